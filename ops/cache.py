"""
The cache, a small object with a clear protocol (as gpt-fast's): GPT.init_cache() makes one, GPT.forward() fills it.

    cache = model.init_cache(batch_size)          # preallocated for block_size tokens; nothing is resized
    logits, _ = model(idx, cache=cache)           # L >= 1 new tokens at positions len(cache)...; logits (B, L, vocab)
    len(cache), cache.nbytes                      # tokens seen; bytes held for them (the filled part)
    cache.reset()                                 # empty again, buffers kept
    cache = model.init_cache(batch_size, static=True)  # fixed shapes: torch.compile, CUDA graphs; under no_grad

Each layer's LayerCache holds K and V, MLA's latent, or a linear layout's fixed state (a hybrid mixes them). With
static=True the position is a device tensor, writes go through index_copy_ and every step attends over the whole
buffer under a mask of the filled blocks (FlexAttention): one compiled graph serves every step, reading the filled.
"""
import torch

from ops.softmax import filled


class LayerCache:
    """One layer's buffers: K and V (B, n_kv, T, hs), MLA's [latent | rope key] (B, 1, T, d_c + d_R), or a state."""

    def __init__(self, shapes, dtype, device, grows=True):
        self.bufs = [torch.zeros(s, dtype=dtype, device=device) for s in shapes]
        self.grows = grows  # along time (dim 2); a state does not

    def update(self, pos, *xs):
        """Write xs (B, heads, L, dim) at [pos, pos + L); return the buffers to attend to and their mask: an int pos
        gives the filled part (mask None: causal), a tensor pos the whole buffers and a BlockMask of the filled part."""
        L = xs[0].size(2)
        if not torch.is_tensor(pos):
            for buf, x in zip(self.bufs, xs):
                buf[:, :, pos:pos + L] = x
            return *[buf[:, :, :pos + L] for buf in self.bufs], None
        for buf, x in zip(self.bufs, xs):
            buf.index_copy_(2, pos + torch.arange(L, device=pos.device), x)
        return *self.bufs, filled(pos, L, self.bufs[0].size(2))

class Cache:
    """Every layer's cache and the position GPT.forward advances: an int, or (static=True) a device tensor."""

    def __init__(self, layers, static=False):
        self.layers = layers
        self.pos = torch.zeros((), dtype=torch.long, device=layers[0].bufs[0].device) if static else 0
        if static:  # CUDA graph replays write into these in place: their addresses must never change
            for t in [self.pos] + [b for layer in layers for b in layer.bufs]:
                torch._dynamo.mark_static_address(t)

    def __len__(self):
        return int(self.pos)

    @property
    def nbytes(self):  # of the filled positions (all of a state)
        n = len(self)
        return sum((b[:, :, :n] if l.grows else b).numel() * b.element_size() for l in self.layers for b in l.bufs)

    def reset(self):
        """Empty again, buffers kept; only a linear layout's state is zeroed (K/V past pos: sliced off or masked)."""
        self.pos = self.pos.zero_() if torch.is_tensor(self.pos) else 0
        for b in (b for layer in self.layers if not layer.grows for b in layer.bufs):
            b.zero_()
