"""Linear attention: parallel == chunked (any chunk size) == recurrent; the final state is
phi(K)ᵀV and sum phi(K); gradients agree; the state stays float32 under 16-bit inputs."""
import pytest
import torch

from conftest import make_model
from model import phi, linear_chunked, linear_recurrent

B, H, T, D = 2, 3, 100, 8


def linear_parallel(q, k, v, eps=1e-6):
    """The reference, quadratic form (Katharopoulos et al. eq. 6): O = (A V) / (A 1), A = tril(phi(Q) phi(K)ᵀ)."""
    A = (q @ k.transpose(-2, -1)).tril()  # (B, nh, T, T), diagonal included
    return (A @ v) / (A.sum(-1, keepdim=True) + eps)


def qkv(dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, T, D, generator=g, dtype=dtype) for _ in range(3))
    return phi(q), phi(k), v


def zero_state(dtype=torch.float64):
    return torch.zeros(B, H, D, D, dtype=dtype), torch.zeros(B, H, D, dtype=dtype)


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize('chunk', [1, 16, 64, T, 7, 128])  # 16 and 7 don't divide T; 128 > T
def test_chunked_equals_parallel_and_recurrent(chunk):
    q, k, v = qkv()
    ref = linear_parallel(q, k, v)
    out, (S, z) = linear_chunked(q, k, v, chunk, zero_state())
    rec, (S_r, z_r) = [], zero_state()
    for t in range(T):  # the RNN, one step at a time, as decode runs it
        o, (S_r, z_r) = linear_recurrent(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1], (S_r, z_r))
        rec.append(o)
    rec = torch.cat(rec, dim=2)
    assert rel_err(out, ref) < 1e-12 and rel_err(rec, ref) < 1e-12
    torch.testing.assert_close(S, k.transpose(-2, -1) @ v, atol=1e-10, rtol=0)  # phi(K)ᵀ V
    torch.testing.assert_close(z, k.sum(2), atol=1e-10, rtol=0)                 # sum phi(K)
    torch.testing.assert_close(S_r, S, atol=1e-10, rtol=0)
    torch.testing.assert_close(z_r, z, atol=1e-10, rtol=0)


def test_chunked_continues_from_a_state():
    """Prefill in two pieces with the state carried == one piece: what the cache relies on."""
    q, k, v = qkv()
    whole, state = linear_chunked(q, k, v, 16, zero_state())
    a, mid = linear_chunked(q[:, :, :37], k[:, :, :37], v[:, :, :37], 16, zero_state())
    b, end = linear_chunked(q[:, :, 37:], k[:, :, 37:], v[:, :, 37:], 16, mid)
    assert rel_err(torch.cat([a, b], 2), whole) < 1e-12
    torch.testing.assert_close(end[0], state[0], atol=1e-10, rtol=0)


def test_sums_include_step_t_and_no_softmax():
    """o_1 = v_1 exactly (the only key it sees is its own): the sums include step t."""
    q, k, v = qkv()
    out, _ = linear_chunked(q, k, v, 16, zero_state())
    torch.testing.assert_close(out[:, :, 0], v[:, :, 0], atol=1e-5, rtol=0)  # eps = 1e-6 in the denominator


@pytest.mark.parametrize('chunk', [1, 7, 64])
def test_gradients_chunked_equal_parallel(chunk):
    grads = []
    for form in ('parallel', 'chunked'):
        q, k, v = (t.detach().requires_grad_() for t in qkv(seed=3))
        out = linear_parallel(q, k, v) if form == 'parallel' else linear_chunked(q, k, v, chunk, zero_state())[0]
        (out * torch.linspace(-1, 1, D, dtype=out.dtype)).sum().backward()
        grads.append([q.grad, k.grad, v.grad])
    for a, b in zip(*grads):
        assert rel_err(b, a) < 1e-11


def test_phi_positive_in_bf16_and_float32_state():
    x = torch.tensor([-30.0, -8.0, -1.0, 0.0, 2.0], dtype=torch.bfloat16)
    assert phi(x).dtype == torch.float32 and (phi(x) > 0).all()
    assert (torch.nn.functional.elu(x) + 1 == 0).any()  # the naive formula underflows here
    model = make_model('linear', dtype=torch.bfloat16)
    cache = model.init_cache(2)
    logits, _ = model(torch.randint(0, 40, (2, 9)), cache=cache)
    assert logits.dtype == torch.bfloat16
    assert all(all(b.dtype == torch.float32 for b in layer.bufs) for layer in cache.layers)


def test_model_linear_layer_uses_chunked_and_recurrent_consistently():
    model = make_model('linear', chunk_size=5)
    attn = model.transformer.h[0].attn
    x = torch.randn(2, 13, 32, dtype=torch.float64)
    full = attn(x, None, 0)
    cache = attn.init_cache(2, 32, torch.float64, x.device)
    steps = torch.cat([attn(x[:, :6], None, 0, cache)] + [attn(x[:, t:t + 1], None, t, cache) for t in range(6, 13)], 1)
    torch.testing.assert_close(steps, full, atol=1e-10, rtol=0)


def test_state_stays_float32_under_autocast():
    """Under bf16 autocast the projections run in bf16, but the linear-attention forms must not:
    the same float32 q, k, v give the same output inside autocast as outside it."""
    model = make_model('linear', dtype=torch.float32)
    attn = model.transformer.h[0].attn
    q, k, v = (torch.randn(2, 4, 40, 8) for _ in range(3))
    outs, states = [], []
    for enabled in (False, True):
        with torch.autocast('cpu', dtype=torch.bfloat16, enabled=enabled):
            state = attn.init_cache(2, 0, torch.float32, q.device)
            outs.append(attn.mix(q, k, v, 0, state))
            outs.append(attn.mix(q[:, :, :1], k[:, :, :1], v[:, :, :1], 40, state))  # one recurrent step
            states.append(state)
    assert all(b.dtype == torch.float32 for b in states[1].bufs)
    for a, b in zip(outs[:2], outs[2:]):
        assert rel_err(b, a) < 1e-6
    idx = torch.randint(0, 40, (2, 20))
    cache = model.init_cache(2)
    with torch.autocast('cpu', dtype=torch.bfloat16):
        logits, _ = model(idx, cache=cache)
    assert all(layer.bufs[0].dtype == torch.float32 for layer in cache.layers)
    assert rel_err(logits.float(), model(idx, targets=idx)[0]) < 0.05  # bf16 projections only
