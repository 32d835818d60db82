"""
The linear-attention family's maths, as plain functions (like fla's ops/*/naive.py): each layout keeps a fixed state
S per head and rewrites it every token,

    S_t = α_t S_{t-1} (I - β_t k_t k_tᵀ) + β_t v_t k_tᵀ,     o_t = S_t q_t,

and the rules differ only in α (forget) and β (correct: the delta rule). model.py's LINEAR_RULES picks them per
layout; here is the update in its two forms, which agree (linear_step: one token, decode; linear_chunked: training
and prefill), and the operators around it: φ, l2norm, the short conv, the unit-lower-triangular solve.
linear_fla runs the same update on flash-linear-attention's Triton kernels (fla, optional: requirements-gpu.txt).
Imports nothing from model.py.
"""
import os
from typing import Optional

import torch
from torch import Tensor

try:  # fla-core, where Triton runs: CUDA (or any device under TRITON_INTERPRET=1, slowly: the tests)
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    from fla.ops.simple_gla import chunk_simple_gla, fused_recurrent_simple_gla
    FLA = {False: (chunk_simple_gla, fused_recurrent_simple_gla),  # delta: (chunked kernel, one-token kernel)
           True: (chunk_gated_delta_rule, fused_recurrent_gated_delta_rule)}
except ImportError:
    FLA = None


# The update, written once. S (B, nh, d_k, d_v) = Σ k vᵀ: transposed, o = q S on rows; g = log α and β (B, nh, L).

def linear_step(q, k, v, g, beta, S, delta):
    """One token (decode), q, k (B, nh, 1, d_k), v (B, nh, 1, d_v): S <- α S (I - β k kᵀ) + β v kᵀ, o = q S."""
    if g is not None:                          # forget: α_t S_{t-1} (g None: α = 1)
        S = S * g.exp()[..., None]
    if delta:                                  # correct: write the error of the memory on k_t, at rate β_t
        v = beta[..., None] * (v - k @ S)
    S = S + k.transpose(-2, -1) @ v            # write: S_t = α_t S_{t-1} (I - β_t k_t k_tᵀ) + β_t k_t v_tᵀ
    return q @ S, S

def linear_chunked(q, k, v, g, beta, S, delta, chunk_size, keep_state=True):
    """Training, prefill: the same update over chunks of C tokens, matrix products inside a chunk and the state
    between chunks. Inside a chunk, with G_i = Σ_{j<=i} g_j (log of the decay since the chunk began) and u_i what
    token i writes (v_i, or for the delta rule the corrected β_i (v_i - S_{i-1} k_i)):
        o_i = e^{G_i} q_i S_0 + Σ_{j<=i} e^{G_i - G_j} (q_i · k_j) u_j,
        S_C = e^{G_C} S_0 + Σ_j e^{G_C - G_j} k_j u_jᵀ.
    The delta rule's u solve one unit-lower-triangular system per chunk (the WY / UT form, Yang et al. 2024):
        (I + A) U = diag(β) (V - diag(e^G) K S_0),   A_ij = β_i e^{G_i - G_j} (k_i · k_j) for j < i.
    S None is a zero state (training: its products skipped); keep_state=False skips the last chunk's write to S."""
    # α = 1: log α = 0; a gate clamped at e^-10⁴, 0 as e^-inf is (a -inf, at exp(A_log) = inf, makes G_i - G_i nan)
    gated = g is not None
    g = torch.zeros_like(beta) if g is None else g.clamp(min=-1e4)
    # chunks of C tokens, the last shorter (one chunk unsplit: split's backward would copy it whole)
    each = [x.split(chunk_size, dim=2) if x.size(2) > chunk_size else [x] for x in (q, k, v, g, beta)]
    out = []
    for n, (q, k, u, g, beta) in enumerate(zip(*each)):                             # (B, nh, C, .) each
        C = q.size(2)
        G = g.cumsum(-1)[..., None]                                                   # (B, nh, C, 1)
        causal = torch.ones(C, C, dtype=q.dtype, device=q.device).tril()
        # e^{G_i - G_j}, 0 above the diagonal: tril before the exp (G_i - G_j > 0 may overflow; -inf: a slow CPU exp)
        decay = (G - G.mT).tril().exp() * causal if gated else causal
        eG = G.exp()
        if delta:  # the errors of the memory on each key, corrected for the writes before it in the chunk
            err = beta[..., None] * (u if S is None else u - eG * (k @ S))
            u = UnitLowerSolve.apply((beta[..., None] * k) @ k.mT * decay, err)  # (I + A)⁻¹ err; reads j < i
        y = (q @ k.mT * decay) @ u                                                    # (B, nh, C, d_v)
        out.append(y if S is None else y + eG * (q @ S))
        if n < len(each[0]) - 1 or keep_state:  # the state carried to the next chunk (None: zero, products skipped)
            write = ((G[:, :, -1:] - G).exp() * k).mT @ u
            S = write if S is None else eG[:, :, -1:] * S + write
    return torch.cat(out, 2) if len(out) > 1 else out[0], S

def fla_runs(x):
    """fla's kernels can run on x: fla is installed and Triton runs there (CUDA, or the interpreter)."""
    return FLA is not None and (x.is_cuda or os.environ.get('TRITON_INTERPRET') == '1')

def linear_fla(q, k, v, g, beta, S, delta, keep_state=True):
    """linear_step / linear_chunked on fla's kernels: a chunked kernel for L tokens, a fused recurrent one for a
    decode token. fla's conventions: (B, L, nh, d); scale=1.0 (our q is scaled); g = log α; β after the sigmoid; the
    state (d_k, d_v) as ours. Katharopoulos is simple_gla with no g on our v + a channel of ones (fla's chunk_linear_attn
    is that call, but keeps z apart and divides with eps 1e-10: this keeps our normalizer). DeltaNet is the gated rule
    with g = 0: fla's chunk_delta_rule refuses float32, where ours runs. Under torch.compile the kernels are one opaque
    op (Dynamo cannot trace fla's launchers), whose backward runs the forward again."""
    if torch.compiler.is_compiling():
        o, S = torch.ops.gpt.linear_fla(q, k, v, g, beta, S, delta, keep_state)
        return o, S if keep_state else None
    chunked, one_token = FLA[delta]
    kernel = one_token if q.size(2) == 1 and S is not None else chunked
    fla = lambda x: x.transpose(1, 2)  # (B, nh, L, .) <-> (B, L, nh, .)
    g = torch.zeros_like(beta) if delta and g is None else g  # α = 1
    knobs = ({'g': fla(g)} if g is not None else {}) | ({'beta': fla(beta)} if delta else {})
    o, S = kernel(fla(q), fla(k), fla(v), **knobs, scale=1.0, initial_state=S, output_final_state=keep_state)
    return fla(o), S

@torch.library.custom_op('gpt::linear_fla', mutates_args=())
def _linear_fla_op(q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor], beta: Tensor, S: Optional[Tensor],
                   delta: bool, keep_state: bool) -> tuple[Tensor, Tensor]:
    o, S = linear_fla(q, k, v, g, beta, S, delta, keep_state)
    return o.contiguous(), S if keep_state else q.new_empty(0)  # an op returns tensors, in the strides of its fake

@_linear_fla_op.register_fake
def _(q, k, v, g, beta, S, delta, keep_state):
    return v.new_empty(v.shape), q.new_empty((*q.shape[:2], q.size(-1), v.size(-1)) if keep_state else 0)

@torch.library.custom_op('gpt::linear_fla_backward', mutates_args=())
def _linear_fla_backward(inputs: list[Optional[Tensor]], do: Tensor, dS: Tensor, delta: bool, keep_state: bool
                         ) -> list[Tensor]:
    """The gradients of each input (an empty tensor for None), by fla's backward after its forward again."""
    inputs = [x if x is None else x.detach().requires_grad_() for x in inputs]
    no_keys_off = torch._C.DispatchKeySet(torch._C.DispatchKey.Undefined)  # an op runs below autograd: back on
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), no_keys_off), torch.enable_grad():
        o, S = linear_fla(*inputs, delta, keep_state)
        given = [x for x in inputs if x is not None]
        grads = iter(torch.autograd.grad([o, S] if keep_state else [o], given, [do, dS] if keep_state else [do],
                                         allow_unused=True))
    return [do.new_empty(0) if x is None else (lambda d: torch.zeros_like(x) if d is None else d.contiguous())(next(grads))
            for x in inputs]

@_linear_fla_backward.register_fake
def _(inputs, do, dS, delta, keep_state):
    return [do.new_empty(0) if x is None else x.new_empty(x.shape) for x in inputs]

def _save(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:6])
    ctx.flags = inputs[6:]

def _backward(ctx, do, dS):
    grads = torch.ops.gpt.linear_fla_backward(list(ctx.saved_tensors), do, dS, *ctx.flags)
    return *[None if x is None else d for x, d in zip(ctx.saved_tensors, grads)], None, None

_linear_fla_op.register_autograd(_backward, setup_context=_save)

class UnitLowerSolve(torch.autograd.Function):
    """u = (I + A)⁻¹ e for the strictly lower part of A (..., C, C), through the inverse, kept for the backward:
    there de = (I + A)⁻ᵀ du is a product, where autograd's would solve again (a small LAPACK call per matrix)."""

    @staticmethod
    def forward(ctx, A, e):
        eye = torch.eye(A.size(-1), dtype=A.dtype, device=A.device).expand_as(A)
        T = torch.linalg.solve_triangular(A, eye, upper=False, unitriangular=True)     # (I + A)⁻¹
        u = T @ e
        ctx.save_for_backward(T, u)
        return u

    @staticmethod
    def backward(ctx, du):
        T, u = ctx.saved_tensors
        de = T.mT @ du
        return (de @ u.mT).neg_().tril_(-1), de  # only j < i of A is read

class ShortConv(torch.autograd.Function):
    """The causal depthwise conv c_t = Σ_s w_{K-1-s} x_{t-s} (s = 0 .. K-1), w (K, C), over x (B, T, C), zeros before
    x_0. Its backward written out: autograd's, through K shifted slices, zero-fills and adds x K times."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        c = x * w[-1]                                                        # (B, T, C): s = 0, the token itself
        for s in range(1, len(w)):                                           # s tokens back (none if s >= T)
            c[:, s:].addcmul_(x[:, :-s], w[-1 - s])
        return c

    @staticmethod
    def backward(ctx, dc):
        x, w = ctx.saved_tensors
        dx = dc * w[-1]
        for s in range(1, len(w)):
            dx[:, :-s].addcmul_(dc[:, s:], w[-1 - s])
        return dx, torch.stack([(dc[:, s:] * x[:, :x.size(1) - s]).sum((0, 1)) for s in reversed(range(len(w)))])

def l2norm(x):  # x / sqrt(|x|² + 1e-6) as in fla and Qwen3-Next (F.normalize's backward: ~5% of a step slower)
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)

def phi(x):
    """elu(x) + 1 > 0, computed in float32 at least: in bf16 elu(x) + 1 rounds to 0 near x = -8."""
    x = x.to(torch.promote_types(x.dtype, torch.float32))
    return torch.where(x >= 0, x + 1, torch.exp(x.clamp(max=0)))
