"""
Softmax attention's maths, as plain functions: RoPE, and the one causal attention call with its
masks. Training and prefill feed L = S = T tokens; decode feeds L = 1 token that attends to
S = T + 1 keys. A mask for L != S is right-aligned (query i sees keys <= S - L + i): SDPA's
is_causal=True aligns top-left, so it is used only when L == S. A static cache (fixed shapes:
torch.compile, CUDA graphs) attends through FlexAttention, which reads only the filled blocks of
keys and splits them across the GPU (flash-decoding).
"""
import torch
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask, flex_attention


def rope_table(dim, positions, base):
    """(L, 2, dim): cos and signed sin (-sin, +sin) of pos * base^(-2i/dim) for each pair
    (x[2i], x[2i+1]). The angles in float64: in float32 their error grows with the position
    (~1e-4 rad at 2048)."""
    exponents = torch.arange(0, dim, 2, dtype=torch.float64, device=positions.device) / dim
    inv_freq = 1.0 / (base ** exponents)
    angles = torch.outer(positions.double(), inv_freq).repeat_interleave(2, dim=1)
    sign = 1.0 - 2.0 * (torch.arange(dim, device=positions.device) % 2 == 0)  # -1, +1, -1, ...
    return torch.stack([angles.cos(), angles.sin() * sign], dim=1).float()

def apply_rope(x, rope):
    """(x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) for each pair of x (..., L, d), in float32 at
    least."""
    if rope is None:
        return x
    # real arithmetic, not a complex product: torch.compile cannot fuse complex ops
    cos, sin = rope.unbind(-2)
    x32 = x.to(torch.promote_types(x.dtype, torch.float32))
    return (x32 * cos + x32.unflatten(-1, (-1, 2)).flip(-1).flatten(-2) * sin).type_as(x)

# decode: never cuDNN attention, which plans per key length (a cached H200 step 10x slower than no
# cache)
DECODE_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

def filled(pos, L, S, block=128):
    """A static cache's mask: L queries at positions pos, pos + 1, ... (a tensor) over its S-long
    buffers, query i seeing keys <= pos + i. Only the blocks of keys up to the last query's are
    listed: the others are never read."""
    q_blocks = torch.arange(-(-L // block), device=pos.device)
    # each block of queries' last key, and the blocks of keys it reads: (1, 1, q blocks)
    last_key = pos + ((q_blocks + 1) * block).clamp(max=L) - 1
    listed = (last_key // block + 1).to(torch.int32)[None, None]
    blocks = torch.arange(-(-S // block), dtype=torch.int32, device=pos.device)
    blocks = blocks.expand(1, 1, len(q_blocks), -1)                  # (1, 1, q blocks, kv blocks)
    seen = lambda b, h, i, j: j <= pos + i
    return BlockMask.from_kv_blocks(listed, blocks, BLOCK_SIZE=block, mask_mod=seen,
                                    seq_lengths=(L, S), compute_q_blocks=False)

def attend(q, k, v, scale=None, dropout_p=0.0, mask=None):
    """softmax(q kᵀ * scale + mask) v. q (B, nh, L, d), k (B, n_kv, S, d), v (B, n_kv, S, dv);
    n_kv divides nh (groups share a K/V head). mask (L, S), True = seen (a window's band:
    ops/window.py); None = causal with the L queries the LAST L of the S keys; or a static cache's
    BlockMask."""
    (B, H, L, D), (H_kv, S) = q.shape, k.shape[1:3]
    gqa = H != H_kv
    # split-KV over the filled blocks; compiled, one fused kernel (eager: a reference)
    if isinstance(mask, BlockMask):
        return flex_attention(q, k, v, scale=scale, block_mask=mask, enable_gqa=gqa)
    # training, or a prefill into an empty cache: is_causal's top-left mask is right here
    if mask is None and L == S:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True,
                                              scale=scale, enable_gqa=gqa)
    if mask is None and L > 1:  # query i sees keys <= S - L + i
        mask = torch.ones(L, S, dtype=torch.bool, device=q.device).tril(S - L)
    # a chunk, or a mask given; decode: a group's G query heads become G queries of its K/V head
    G = H // H_kv if L == 1 else 1
    with sdpa_kernel(DECODE_BACKENDS):
        y = F.scaled_dot_product_attention(q.reshape(B, H // G, G * L, D), k, v, attn_mask=mask,
                                           dropout_p=dropout_p, scale=scale,
                                           enable_gqa=G == 1 and gqa)
    # reshape, not view: the output's strides depend on the backend
    return y.reshape(B, H, L, v.size(-1))
