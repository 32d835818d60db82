"""The linear layouts' one update in its two forms: chunkwise-parallel (any chunk size, from any state) == the
one-token recurrence, outputs, states and gradients; the knob (α, β) each rule computes, its shapes and its
initialisation; the state stays float32 under 16-bit inputs."""
import math

import pytest
import torch
import torch.nn.functional as F

from conftest import make_model
from ops.linear import ShortConv, UnitLowerSolve, linear_chunked, linear_step, phi
from model import GPT, GPTConfig, LINEAR_RULES

B, H, T, D = 2, 3, 50, 8


def inputs(dtype=torch.float64, seed=0, forget=True, delta=True):
    """q, k unit rows (as the delta rules see them), v, g = log α <= 0 (or None: α = 1),
    β in (0, 1) (or 1), a state."""
    g = torch.Generator().manual_seed(seed)
    q, k = (F.normalize(torch.randn(B, H, T, D, generator=g, dtype=dtype), dim=-1) for _ in range(2))
    v = torch.randn(B, H, T, D + 1, generator=g, dtype=dtype)  # d_v != d_k: the orientation is checked
    log_alpha = -torch.rand(B, H, T, generator=g, dtype=dtype) * 0.5 if forget else None
    beta = torch.rand(B, H, T, generator=g, dtype=dtype) if delta else torch.ones(B, H, T, dtype=dtype)
    S0 = torch.randn(B, H, D, D + 1, generator=g, dtype=dtype)
    return q, k, v, log_alpha, beta, S0


def recurrent(q, k, v, g, beta, S, delta):
    out = []
    for t in range(q.size(2)):  # the decode step, token by token
        o, S = linear_step(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], g if g is None else g[:, :, t:t + 1],
                           beta[:, :, t:t + 1],
                           S, delta)
        out.append(o)
    return torch.cat(out, 2), S


RULES = [(f, d) for f in (False, True) for d in (False, True)]  # (forgets, corrects): the chapter's four corners


@pytest.mark.parametrize('forget,delta', RULES)
@pytest.mark.parametrize('chunk', [1, 7, 16, T, 64])  # 7 and 16 don't divide T; 64 > T
def test_chunked_equals_recurrent_from_any_state(forget, delta, chunk):
    q, k, v, g, beta, S0 = inputs(forget=forget, delta=delta)
    ref, S_ref = recurrent(q, k, v, g, beta, S0, delta)
    out, S = linear_chunked(q, k, v, g, beta, S0, delta, chunk)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
    torch.testing.assert_close(S, S_ref, atol=1e-12, rtol=0)


@pytest.mark.parametrize('forget,delta', RULES)
def test_chunked_continues_from_its_own_state(forget, delta):
    """Prefill in two uneven pieces with the state carried == one piece: what the cache relies on."""
    q, k, v, g, beta, S0 = inputs(seed=1, forget=forget, delta=delta)
    whole, S = linear_chunked(q, k, v, g, beta, S0, delta, 16)
    cut = lambda x, s: x if x is None else x[:, :, s]
    a, mid = linear_chunked(*(cut(x, slice(0, 21)) for x in (q, k, v, g, beta)), S0, delta, 16)
    b, end = linear_chunked(*(cut(x, slice(21, None)) for x in (q, k, v, g, beta)), mid, delta, 16)
    torch.testing.assert_close(torch.cat([a, b], 2), whole, atol=1e-12, rtol=0)
    torch.testing.assert_close(end, S, atol=1e-12, rtol=0)


@pytest.mark.parametrize('delta', [False, True])
def test_no_gate_is_a_gate_of_one(delta):
    """g None (α = 1: the decay skipped, only the causal mask) == g = log 1 = 0 through the decay, values and grads."""
    runs = []
    for g in (None, torch.zeros(B, H, T, dtype=torch.float64)):
        q, k, v, _, beta, S0 = (t.detach().requires_grad_() for t in inputs(seed=5, forget=True))
        out, S = linear_chunked(q, k, v, g, beta, S0, delta, 16)
        (out.sum() + S.sum()).backward()
        runs.append([out, S, q.grad, k.grad, v.grad, beta.grad, S0.grad])
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


@pytest.mark.parametrize('T', [9, 2])  # 2: fewer tokens than taps
def test_short_conv_backward(T):
    """The conv's hand-written backward against finite differences of its forward; its forward against the taps,
    zeros before the first token."""
    x, w = torch.randn(2, T, 5, dtype=torch.float64), torch.randn(4, 5, dtype=torch.float64)
    padded = F.pad(x, (0, 0, 3, 0))
    expected = sum(w[j] * padded[:, j:j + T] for j in range(4))
    torch.testing.assert_close(ShortConv.apply(x, w), expected, atol=1e-12, rtol=0)
    assert torch.autograd.gradcheck(ShortConv.apply, (x.requires_grad_(), w.requires_grad_()))


@pytest.mark.parametrize('C', [1, 7, 16])
def test_unit_lower_solve_backward(C):
    """u = (I + A)⁻¹ e through the kept inverse: against LAPACK's solve, its backward against finite differences;
    only A's strictly lower part is read (its diagonal and upper part get no gradient)."""
    A, e = torch.randn(2, 3, C, C, dtype=torch.float64) * 0.3, torch.randn(2, 3, C, 4, dtype=torch.float64)
    ref = torch.linalg.solve_triangular(A, e, upper=False, unitriangular=True)
    torch.testing.assert_close(UnitLowerSolve.apply(A, e), ref, atol=1e-12, rtol=0)
    assert torch.autograd.gradcheck(UnitLowerSolve.apply, (A.requires_grad_(), e.requires_grad_()))
    UnitLowerSolve.apply(A, e).sum().backward()
    assert torch.equal(A.grad.triu(), torch.zeros_like(A)) and (C == 1 or A.grad.tril(-1).abs().sum() > 0)


def test_what_each_corner_writes():
    """Independent of both forms: accumulate from zero ends at Σ k vᵀ; the delta rule with β = 1 and one key written
    twice keeps only the second value (it overwrites); a decay α leaves α^T of the start state."""
    q, k, v, g, beta, _ = inputs(seed=2)
    zero = torch.zeros(B, H, D, D + 1, dtype=torch.float64)
    _, S = linear_chunked(q, k, v, torch.zeros_like(g), beta, zero, False, 16)
    torch.testing.assert_close(S, k.transpose(-2, -1) @ v, atol=1e-12, rtol=0)
    kk, vv = k[:, :, :1].repeat(1, 1, 2, 1), v[:, :, :2]
    _, S = linear_chunked(q[:, :, :2], kk, vv, torch.zeros(B, H, 2, dtype=torch.float64),
                          torch.ones(B, H, 2, dtype=torch.float64), zero, True, 16)
    torch.testing.assert_close(k[:, :, :1] @ S, v[:, :, 1:2], atol=1e-12, rtol=0)  # reads back the last value only
    S0 = torch.randn(B, H, D, D + 1, dtype=torch.float64)
    _, S = linear_chunked(q, k * 0, v, torch.full_like(g, math.log(0.9)), beta, S0, True, 16)
    torch.testing.assert_close(S, 0.9 ** T * S0, atol=1e-12, rtol=0)


@pytest.mark.parametrize('forget,delta', RULES)
def test_gradients_of_the_chunked_form_equal_the_recurrence(forget, delta):
    grads = []
    for form in ('recurrent', 'chunked'):
        xs = [t if t is None else t.detach().requires_grad_() for t in inputs(seed=3, forget=forget, delta=delta)]
        q, k, v, g, beta, S0 = xs
        out, S = recurrent(q, k, v, g, beta, S0, delta) if form == 'recurrent' else \
            linear_chunked(q, k, v, g, beta, S0, delta, 7)
        ((out * torch.linspace(-1, 1, D + 1, dtype=out.dtype)).sum() + S.sum()).backward()
        grads.append([x.grad for x in xs if x is not None])
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, atol=1e-10, rtol=0)


def test_gates_in_log_space_never_make_nan():
    """A strong gate makes exp(G_i - G_j) overflow above the diagonal unless it is masked before the exp."""
    q, k, v, g, beta, S0 = inputs(dtype=torch.float32, seed=4)
    out, S = linear_chunked(q, k, v, g * 400, beta, S0, True, 50)  # G spans ~-5000: exp(+5000) = inf if not masked
    assert torch.isfinite(out).all() and torch.isfinite(S).all()
    xs = inputs(dtype=torch.float64, seed=4)  # α = 0 inside a chunk, as when exp(A_log) overflows: the state forgotten
    xs[3][:, :, ::7] = -math.inf
    ref = recurrent(*xs, True)  # a step forgets it: S * e^-inf = 0; in float64, the truth for float32 too
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-5)):  # float32 near its precision (5e-6; without
        for chunk in (4, 50):                                             # a -inf gate 6e-7; a floor at -10⁴: 3e-3)
            out = linear_chunked(*[x.to(dtype) for x in xs], True, chunk)
            assert all(torch.isfinite(x).all() for x in out)
            torch.testing.assert_close(out, tuple(r.to(dtype) for r in ref), atol=tol, rtol=0)


# --- each rule's knob: shapes, values, initialisation --------------------------------------------------------

def layer(layout, **kw):
    config = GPTConfig(**{**dict(n_layer=1, n_head=4, n_embd=32, block_size=16, attn=layout), **kw})
    return GPT(config).transformer.h[0].attn


@pytest.mark.parametrize('layout', list(LINEAR_RULES))
def test_knob_shapes_and_values(layout):
    torch.manual_seed(0)
    attn = layer(layout)
    x = torch.randn(3, 5, 32)
    parts = dict(zip(attn.parts, attn.c_attn(x).split(list(attn.parts.values()), -1)))
    g, beta = attn.knob(parts, 3, 5, torch.float32)
    forget, delta = LINEAR_RULES[layout]
    assert beta.shape == (3, 4, 5)  # (B, nh, L): one β per head and token, and one α, or None (α = 1: no decay)
    assert g is None if forget is None else g.shape == (3, 4, 5)
    if forget == 'decay':  # RetNet: γ_h = 1 - 2^(-5-h), the same at every token and in every row
        torch.testing.assert_close(g.exp(), (1 - 2.0 ** -torch.arange(5.0, 9.0))[:, None].expand(3, 4, 5))
    if forget == 'gate':
        assert (g < 0).all() and g.std(dim=2).min() > 0  # α_t in (0, 1), changing with the token
        W_a = attn.c_attn.weight[-4 - 4 * LINEAR_RULES[layout][1]:][:4]  # the rows after q, k, v, gate: W_a, then W_β
        ref = -attn.A_log.exp()[:, None] * F.softplus(x @ W_a.T + attn.dt_bias).transpose(1, 2)
        torch.testing.assert_close(g, ref)
    if delta:
        torch.testing.assert_close(beta, torch.sigmoid(x @ attn.c_attn.weight[-4:].T).transpose(1, 2))
    else:
        assert torch.equal(beta, torch.ones_like(beta))


@pytest.mark.parametrize('layout', list(LINEAR_RULES))
def test_initialisation(layout):
    """Mamba-2's: A = exp(A_log) ~ U[1, 16], softplus(dt_bias) = dt ~ logU[1e-3, 0.1], per head; GPT-2's 0.02 for the
    one projection (q, k, v, then the output gate, W_a, W_β: only those the rule uses); the output norm starts at 1;
    the short conv's taps as nn.Conv1d's, U[-1/sqrt(K), 1/sqrt(K)] for K = conv_size = 4."""
    torch.manual_seed(0)
    attn = layer(layout, n_head=64, n_embd=256)
    forget, delta = LINEAR_RULES[layout]
    names = {n for n, _ in attn.named_parameters()}
    assert ('A_log' in names) == ('dt_bias' in names) == (forget == 'gate')
    assert ('o_norm.weight' in names) == ('conv' in names) == (layout != 'linear')
    rows = 3 * 256 + 256 * (layout != 'linear') + 64 * (forget == 'gate') + 64 * delta
    widths = (768, 256 * (layout != 'linear'), 64 * (forget == 'gate'), 64 * delta)
    assert list(attn.parts.values()) == [n for n in widths if n]
    assert attn.c_attn.weight.shape == (rows, 256) and abs(attn.c_attn.weight.std().item() - 0.02) < 0.001
    if forget == 'gate':
        A, dt = attn.A_log.exp(), F.softplus(attn.dt_bias)
        assert attn.A_log.shape == attn.dt_bias.shape == (64,)
        assert 1 <= A.min() and A.max() <= 16 and A.max() - A.min() > 8       # spread over [1, 16]
        assert 1e-3 * 0.999 <= dt.min() and dt.max() <= 0.1 * 1.001 and dt.max() / dt.min() > 10  # log-uniform
    if layout != 'linear':
        assert torch.equal(attn.o_norm.weight, torch.ones(4))  # head_dim = 256 / 64
        w = attn.conv  # (K, 3 n_embd): a tap per channel of q, k and v
        assert w.shape == (4, 768) and 0.49 < w.abs().max() <= 0.5 and abs(w.std().item() - 0.5 / math.sqrt(3)) < 0.01


# --- dtypes: the state, the gates and the solves in float32 at least ------------------------------------------

def test_phi_positive_in_bf16():
    x = torch.tensor([-30.0, -8.0, -1.0, 0.0, 2.0], dtype=torch.bfloat16)
    assert phi(x).dtype == torch.float32 and (phi(x) > 0).all()
    assert (torch.nn.functional.elu(x) + 1 == 0).any()  # the naive formula underflows here


def test_phi_gradient_finite_for_large_inputs():
    """torch.where differentiates both branches: exp(x) of float32 x > 88 is inf, and inf times the
    untaken branch's zero a NaN gradient, unless the exp's input is clamped."""
    x = torch.tensor([-30.0, -1.0, 0.0, 50.0, 89.0, 1e4], requires_grad=True)
    phi(x).sum().backward()
    assert torch.isfinite(x.grad).all(), x.grad
    assert torch.equal(x.grad[x >= 0], torch.ones(4))  # d(x + 1)/dx


@pytest.mark.parametrize('layout', list(LINEAR_RULES))
def test_float32_state_in_a_bf16_model_and_under_autocast(layout):
    model = make_model(layout, dtype=torch.bfloat16)
    cache = model.init_cache(2)
    logits, _ = model(torch.randint(0, 40, (2, 9)), cache=cache)
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()
    assert all(b.dtype == torch.float32 for layer in cache.layers for b in layer.buffers.values())
    model = make_model(layout, dtype=torch.float32)
    idx = torch.randint(0, 40, (2, 20))
    cache = model.init_cache(2)
    with torch.autocast('cpu', dtype=torch.bfloat16):
        logits, _ = model(idx, cache=cache)
        step, _ = model(idx[:, :1], cache=cache)  # one recurrent step under autocast too
    assert all(b.dtype == torch.float32 for layer in cache.layers for b in layer.buffers.values())
    full = model(idx, targets=idx)[0]
    assert ((logits.float() - full).norm() / full.norm()).item() < 0.05  # bf16 projections only


def test_a_chunk_longer_than_the_sequence_is_the_sequence():
    """chunk_size > T works in one chunk of T (no padding up to chunk_size: a huge chunk_size must not allocate it)."""
    q, k, v, g, beta, S0 = inputs(seed=5)
    ref, S_ref = linear_chunked(q, k, v, g, beta, S0, True, T)
    out, S = linear_chunked(q, k, v, g, beta, S0, True, 10 ** 9)
    torch.testing.assert_close(out, ref, atol=0, rtol=0)
    torch.testing.assert_close(S, S_ref, atol=0, rtol=0)
