"""
Sliding windows: which keys a windowed layer's query sees, and the ring of slots that keeps only
those. A query at position i sees the W most recent keys, itself included (the convention of
Hugging Face, Mistral and gpt-oss; FlashAttention's window_size=(W, 0) means W + 1 keys), and the
first n_sink keys (StreamingLLM's attention sinks):

    query i sees key j  <=>  j <= i  and  (i - j < W  or  j < n_sink)

Positions are absolute: keys are cached after RoPE and never rotated again, so a cached step
computes exactly what the full forward computes under this mask.

The cache of a windowed layer has n_sink + W slots. A sink keeps its slot; every later position p
goes to slot n_sink + (p - n_sink) % W, over the key W positions older, which no query from p on
sees. n_sink = 2, W = 4, after positions 0..8:

    slot         0   1 | 2   3   4   5
    position     0   1 | 6   7   8   5     <- position 9 goes to slot 5, over 5 (9 - 5 = W)
                 sinks | the last W positions, wrapping around

A cache is filled in order from position 0, so which position a slot holds follows from how many
tokens it has seen (held()), and the mask from those positions: the slots' order never matters
(softmax attention does not care about its keys' order). A chunk of L > 1 new keys would
overwrite keys its own first queries still need (query p sees p - W + 1): it attends over the
slots and its own keys side by side, and is written after.
"""
import torch
from torch.nn.attention.flex_attention import BlockMask


def sees(i, j, window, n_sink=0):
    """Whether a query at position i sees the key at position j (tensors, broadcast); j = -1 marks
    an empty slot. Also FlexAttention's mask_mod, once i and j are positions."""
    return (j >= 0) & (j <= i) & ((i - j < window) | (j < n_sink))


def kept(T, window, n_sink=0):
    """How many of T tokens a layer keeps: all (window 0), or its W latest and its first n_sink."""
    return min(T, n_sink + window) if window else T


def band(q_pos, k_pos, window, n_sink=0):
    """The (L, S) mask, True = seen, of queries at positions q_pos (L,) over keys at k_pos (S,)."""
    return sees(q_pos[:, None], k_pos[None, :], window, n_sink)


def slot(p, window, n_sink=0):
    """Where the key of position p (a tensor) lives in a ring of n_sink + window slots."""
    return torch.where(p < n_sink, p, n_sink + (p - n_sink) % window)


def held(seen, j, window, n_sink=0):
    """The position slot j (a tensor) holds once positions 0 .. seen - 1 were written: the latest
    that maps to it, or -1 (empty)."""
    last = seen - 1
    p = last - (last - j) % window  # the latest p <= last with p = j mod W: slot j's, j >= n_sink
    return torch.where(j < n_sink, torch.where(j < seen, j, -1), torch.where(p >= n_sink, p, -1))


def survivors(pos, L, window, n_sink=0):
    """Which of a chunk's L keys (at positions pos, pos + 1, ...) stay in the ring once it is
    written: its sinks and its last W, each to its own slot. None where pos is a device tensor
    (a static cache): there each key is written in order, a later one over an older one."""
    if torch.is_tensor(pos):
        return None
    return [i for i in range(L) if pos + i < n_sink or i >= L - window]


def ring_block_mask(pos, L, slots, S, window, n_sink, block=128):
    """A static cache's FlexAttention mask over its ring, for L queries at pos, pos + 1, ... (pos a
    device tensor): the keys are the slots (a chunk: as they were before it), then, for a chunk
    (S > slots), its own L keys. Every block of keys is listed: within a window the slots all
    fill. The positions are computed inside the mask: compiled on a CPU, FlexAttention cannot
    read a tensor the graph computed."""
    device = pos.device
    q_blocks, kv_blocks = -(-L // block), -(-S // block)
    listed = torch.full((1, 1, q_blocks), kv_blocks, dtype=torch.int32, device=device)
    blocks = torch.arange(kv_blocks, dtype=torch.int32, device=device).expand(1, 1, q_blocks, -1)
    # the slots have seen pos + 1 tokens (one token is written before it attends), or pos (a chunk)
    key = lambda j: torch.where(j < slots, held(pos + (L == 1), j, window, n_sink), pos + j - slots)
    mask_mod = lambda b, h, i, j: sees(pos + i, key(j), window, n_sink)
    return BlockMask.from_kv_blocks(listed, blocks, BLOCK_SIZE=block, mask_mod=mask_mod,
                                    seq_lengths=(L, S), compute_q_blocks=False)
