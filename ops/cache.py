"""
The cache, a small object with a clear protocol (as gpt-fast's): GPT.init_cache() makes one,
GPT.forward() fills it.

    cache = model.init_cache(batch_size)   # preallocated for block_size tokens, never resized
    logits, _ = model(idx, cache=cache)    # L >= 1 new tokens at len(cache)...: (B, L, vocab)
    len(cache), cache.nbytes               # tokens seen; bytes held for them (the filled part)
    cache.reset()                          # empty again, buffers kept
    # fixed shapes, for torch.compile and CUDA graphs; under no_grad
    cache = model.init_cache(batch_size, static=True)

Each layer's LayerCache holds its buffers by name: k and v, MLA's latent, or a linear layout's state
(and conv, its short conv's last inputs); a hybrid mixes them. A windowed layer's k and v (or
latent) are a ring of n_sink + W slots (ops/window.py draws it): its cache stops growing at the
window, and generation may run past block_size. With static=True the position is a device tensor,
writes go through index_copy_ and every step attends over the whole buffer under a mask of the
filled blocks (FlexAttention): one compiled graph serves every step, reading the filled.
"""
import torch

from ops.softmax import filled
from ops.window import band, held, ring_block_mask, slot, survivors


class LayerCache:
    """One layer's buffers, by name (layer.k, or layer.buffers['k']): k and v (B, n_kv, T, hs);
    MLA's latent [c | k_R] (B, 1, T, d_c + d_R); or a linear layout's state (B, nh, d_k, d_v) and
    conv (B, K - 1, 3 n_embd). Buffers that grow along time (dim 2) are written by update(); a
    state is rewritten by its layer. window > 0: the time buffers are a ring of n_sink + window
    slots (ops/window.py)."""

    def __init__(self, dtype, device, grows=True, window=0, n_sink=0, **shapes):
        self.buffers = {name: torch.zeros(shape, dtype=dtype, device=device)
                        for name, shape in shapes.items()}
        self.__dict__.update(self.buffers)  # each by its name too
        self.grows, self.device, self.window, self.n_sink = grows, device, window, n_sink

    def update(self, pos, *xs):
        """Write xs (B, heads, L, dim), one per buffer in order, at [pos, pos + L); return the
        buffers to attend to and their mask: an int pos gives the filled part (mask None: causal),
        a tensor pos the whole buffers and a BlockMask of the filled part. A ring: ring()."""
        L, bufs = xs[0].size(2), list(self.buffers.values())
        if self.window:
            return self.ring(pos, xs)
        if not torch.is_tensor(pos):
            for buf, x in zip(bufs, xs):
                buf[:, :, pos:pos + L] = x
            return *[buf[:, :, :pos + L] for buf in bufs], None
        positions = pos + torch.arange(L, device=pos.device)
        for buf, x in zip(bufs, xs):
            buf.index_copy_(2, positions, x)
        return *bufs, filled(pos, L, bufs[0].size(2))

    def ring(self, pos, xs):
        """A windowed layer's update: the keys to attend to and their mask (pos a tensor: a
        BlockMask), from the positions the slots hold. One new key is written first (the key it
        replaces is W positions back: no query from here on sees it); a chunk attends over the
        slots and its own keys side by side, and is written after."""
        L, keys = xs[0].size(2), list(self.buffers.values())
        R, W, n_sink = keys[0].size(2), self.window, self.n_sink
        if L > 1:
            keys = [torch.cat([buf, x], dim=2) for buf, x in zip(keys, xs)]  # (copies)
        self.write(pos, xs)
        if torch.is_tensor(pos):
            return *keys, ring_block_mask(pos, L, R, keys[0].size(2), W, n_sink)
        q_pos = torch.arange(pos, pos + L, device=self.device)
        slots = torch.arange(R, device=self.device)
        if L == 1:  # the slots after this token's write
            k_pos = held(pos + 1, slots, W, n_sink)
        else:  # the slots before the chunk's write, then the chunk
            k_pos = torch.cat([held(pos, slots, W, n_sink), q_pos])
        return *keys, band(q_pos, k_pos, W, n_sink)

    def write(self, pos, xs):
        """xs's keys (B, heads, L, dim) into their slots: those that survive the chunk at once,
        each to its own slot, or, where which survive is known only on the device, one by one."""
        L = xs[0].size(2)
        keep = survivors(pos, L, self.window, self.n_sink)
        for idx in [keep] if keep is not None else [[i] for i in range(L)]:
            slots = slot(pos + torch.tensor(idx, device=self.device), self.window, self.n_sink)
            for buf, x in zip(self.buffers.values(), xs):
                buf.index_copy_(2, slots, x[:, :, idx])

    def nbytes(self, n):
        """The bytes of the first n positions (all of a state; a ring's filled slots)."""
        return sum((b[:, :, :n] if self.grows else b).nbytes for b in self.buffers.values())

    def reset(self):
        """Only a state is zeroed: K/V past the position are sliced off or masked (a ring's, by
        the positions its slots hold after len(cache) tokens)."""
        if not self.grows:
            for b in self.buffers.values():
                b.zero_()

class Cache:
    """Every layer's cache, and the position GPT.forward advances: an int, or (static=True) a
    device tensor."""

    def __init__(self, layers, static=False):
        self.layers = layers
        self.pos = torch.zeros((), dtype=torch.long, device=layers[0].device) if static else 0
        # CUDA graph replays write into these in place: their addresses must never change
        if static:
            for t in [self.pos] + [b for layer in layers for b in layer.buffers.values()]:
                torch._dynamo.mark_static_address(t)

    def __len__(self):
        return int(self.pos)

    @property
    def nbytes(self):  # of the filled positions (all of a state)
        return sum(layer.nbytes(len(self)) for layer in self.layers)

    def reset(self):
        """Empty again, buffers kept."""
        self.pos = self.pos.zero_() if torch.is_tensor(self.pos) else 0
        for layer in self.layers:
            layer.reset()
