"""
The linear-attention family's maths, as plain functions (like fla's ops/*/naive.py): each layout
keeps a fixed state S per head and rewrites it every token,

    S_t = α_t S_{t-1} (I - β_t k_t k_tᵀ) + β_t v_t k_tᵀ,     o_t = S_t q_t,

and the rules differ only in α (forget) and β (correct: the delta rule). model.py's LINEAR_RULES
picks them per layout; here is the update in its two forms, which agree (linear_step: one token,
decode; linear_chunked: training and prefill), and the operators around it: the gates, φ, l2norm,
the short conv, the unit-lower-triangular solve. Imports nothing from model.py; linear_fla.py runs
the same update on fla's Triton kernels.
"""
import math

import torch
from torch.nn import functional as F


# The update, written once. S (B, nh, d_k, d_v) = Σ k vᵀ: transposed, o = q S on rows;
# g = log α and β (B, nh, L).

def linear_step(q, k, v, g, beta, S, delta):
    """One token (decode), q, k (B, nh, 1, d_k), v (B, nh, 1, d_v):
    S <- α S (I - β k kᵀ) + β v kᵀ, o = q S."""
    if g is not None:                          # forget: α_t S_{t-1} (g None: α = 1)
        S = S * g.exp()[..., None]
    if delta:                                  # correct: write the error on k_t, at rate β_t
        v = beta[..., None] * (v - k @ S)
    # write: S_t = α_t S_{t-1} (I - β_t k_t k_tᵀ) + β_t k_t v_tᵀ
    S = S + k.transpose(-2, -1) @ v
    return q @ S, S

def linear_chunked(q, k, v, g, beta, S, delta, chunk_size, keep_state=True):
    """Training, prefill: the same update over chunks of C tokens, matrix products inside a chunk
    and the state between chunks. Inside a chunk, with G_i = Σ_{j<=i} g_j (log of the decay since
    the chunk began) and u_i what token i writes (v_i, or for the delta rule the corrected
    β_i (v_i - S_{i-1} k_i)):
        o_i = e^{G_i} q_i S_0 + Σ_{j<=i} e^{G_i - G_j} (q_i · k_j) u_j,
        S_C = e^{G_C} S_0 + Σ_j e^{G_C - G_j} k_j u_jᵀ.
    The delta rule's u solve one unit-lower-triangular system per chunk (the WY / UT form, Yang et
    al. 2024):
        (I + A) U = diag(β) (V - diag(e^G) K S_0),
        A_ij = β_i e^{G_i - G_j} (k_i · k_j) for j < i.
    S None is a zero state (training: its products skipped); keep_state=False skips the last
    chunk's write to S."""
    # α = 1: log α = 0. A gate is floored at eps, 0 to the dtype's precision as e^-inf is (a -inf,
    # at exp(A_log) = inf, makes G_i - G_i nan), and no lower: G's sums after it keep |G| eps's
    # digits (float32 at -10⁴: an error of 3e-3)
    gated = g is not None
    g = torch.zeros_like(beta) if g is None else g.clamp(min=math.log(torch.finfo(g.dtype).eps))
    # chunks of C tokens, the last shorter (one chunk unsplit: split's backward would copy it whole)
    split = lambda x: x.split(chunk_size, dim=2) if x.size(2) > chunk_size else [x]
    each = [split(x) for x in (q, k, v, g, beta)]
    out = []
    for n, (q, k, u, g, beta) in enumerate(zip(*each)):                     # (B, nh, C, .) each
        C = q.size(2)
        G = g.cumsum(-1)[..., None]                                           # (B, nh, C, 1)
        causal = torch.ones(C, C, dtype=q.dtype, device=q.device).tril()
        # e^{G_i - G_j}, 0 above the diagonal: tril before the exp (G_i - G_j > 0 may overflow;
        # -inf: a slow CPU exp)
        decay = (G - G.mT).tril().exp() * causal if gated else causal
        eG = G.exp()
        if delta:  # the memory's errors on each key, corrected for the chunk's writes before it
            err = beta[..., None] * (u if S is None else u - eG * (k @ S))
            # (I + A)⁻¹ err; reads j < i
            u = UnitLowerSolve.apply((beta[..., None] * k) @ k.mT * decay, err)
        y = (q @ k.mT * decay) @ u                                            # (B, nh, C, d_v)
        out.append(y if S is None else y + eG * (q @ S))
        # the state carried to the next chunk (None: zero, products skipped)
        if n < len(each[0]) - 1 or keep_state:
            write = ((G[:, :, -1:] - G).exp() * k).mT @ u
            S = write if S is None else eG[:, :, -1:] * S + write
    return torch.cat(out, 2) if len(out) > 1 else out[0], S

class UnitLowerSolve(torch.autograd.Function):
    """u = (I + A)⁻¹ e for the strictly lower part of A (..., C, C), through the inverse, kept
    for the backward: there de = (I + A)⁻ᵀ du is a product, where autograd's would solve again
    (a small LAPACK call per matrix)."""

    @staticmethod
    def forward(ctx, A, e):
        eye = torch.eye(A.size(-1), dtype=A.dtype, device=A.device).expand_as(A)
        T = torch.linalg.solve_triangular(A, eye, upper=False, unitriangular=True)  # (I + A)⁻¹
        u = T @ e
        ctx.save_for_backward(T, u)
        return u

    @staticmethod
    def backward(ctx, du):
        T, u = ctx.saved_tensors
        de = T.mT @ du
        return (de @ u.mT).neg_().tril_(-1), de  # only j < i of A is read

# The gates: g = log α, (B, nh, L).

def retnet_decay(n_head, B, L, dtype, device):
    """RetNet's decay, fixed per head: log γ_h = log(1 - 2^(-5-h))."""
    heads = torch.arange(n_head, dtype=dtype, device=device)
    return torch.log1p(-2.0 ** (-5.0 - heads))[:, None].expand(B, -1, L)

def mamba2_gate(a, A_log, dt_bias):
    """Mamba-2's gate, log α_t = -exp(A_log) softplus(W_a x + dt_bias), a = W_a x (B, L, nh); as
    Gated DeltaNet's "Mamba2" rule, on v kᵀ (no Δ_t on the input, no D skip)."""
    return -A_log.exp()[:, None] * F.softplus(a + dt_bias).transpose(1, 2)

# The operators on q, k, v.

def features(qkv, n_head, head_dim, normalizer):
    """q, k, v (B, nh, L, d) from qkv (B, L, 3 nh d), made contiguous once here (else every matmul
    after would copy its transposed view). normalizer ('linear'): phi(q), phi(k), and v with a last
    channel of ones, which sums z = Σ phi(k); the others: l2norm(q) / sqrt(d_k), l2norm(k), v."""
    B, L, _ = qkv.shape
    q, k, v = qkv.view(B, L, 3, n_head, head_dim).permute(2, 0, 3, 1, 4).contiguous()
    if normalizer:
        return phi(q), phi(k), F.pad(v, (0, 1), value=1.0)
    return l2norm(q) * head_dim ** -0.5, l2norm(k), v

def conv_silu(x, before, w):
    """SiLU(the causal short conv with taps w (K, C)) over x (B, L, C), after the K - 1 inputs a
    cache kept, before (B, K - 1, C) (None: zeros). Returns it and the inputs it read, whose last
    K - 1 are the next call's before."""
    if before is None:  # (no slice: its backward would zero-fill)
        return F.silu(ShortConv.apply(x, w)), x
    seen = torch.cat([before, x], 1)                                          # (B, K - 1 + L, C)
    return F.silu(ShortConv.apply(seen, w))[:, -x.size(1):], seen

class ShortConv(torch.autograd.Function):
    """The causal depthwise conv c_t = Σ_s w_{K-1-s} x_{t-s} (s = 0 .. K-1), w (K, C), over
    x (B, T, C), zeros before x_0. Its backward written out: autograd's, through K shifted slices,
    zero-fills and adds x K times."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        c = x * w[-1]                                          # (B, T, C): s = 0, the token itself
        for s in range(1, len(w)):                             # s tokens back (none if s >= T)
            c[:, s:].addcmul_(x[:, :-s], w[-1 - s])
        return c

    @staticmethod
    def backward(ctx, dc):
        x, w = ctx.saved_tensors
        dx = dc * w[-1]
        for s in range(1, len(w)):
            dx[:, :-s].addcmul_(dc[:, s:], w[-1 - s])
        dw = [(dc[:, s:] * x[:, :x.size(1) - s]).sum((0, 1)) for s in reversed(range(len(w)))]
        return dx, torch.stack(dw)

def l2norm(x):
    """x / sqrt(|x|² + 1e-6), as in fla and Qwen3-Next (F.normalize's backward: a step ~5%
    slower)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)

def phi(x):
    """elu(x) + 1 > 0, computed in float32 at least: in bf16 elu(x) + 1 rounds to 0 near x = -8."""
    x = x.to(torch.promote_types(x.dtype, torch.float32))
    return torch.where(x >= 0, x + 1, torch.exp(x.clamp(max=0)))
