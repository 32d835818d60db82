"""The classic silent bugs of attention. Each property below is checked on the repo's `attend`, and
on a copy with the bug made, which the same check must reject (so the check can fail)."""
import math

import pytest
import torch

from conftest import is_linear, make_model
from ops.softmax import attend, filled

B, H, H_KV, D = 2, 4, 2, 8
SHAPES = [(6, 6), (1, 9), (3, 7)]  # (L, S): prefill, decode, a chunk after a prefill


def right_aligned(L, S):
    return torch.ones(L, S, dtype=torch.bool).tril(S - L)  # query i sees keys <= S - L + i


def reference(q, k, v, mask_fn=right_aligned, scale=True, softmax_dim=-1, mask_after=False,
              weights=False):
    """Naive attention; the keyword arguments make the classic bugs."""
    k, v = (t.repeat_interleave(q.size(1) // k.size(1), dim=1) for t in (k, v))
    L, S = q.size(-2), k.size(-2)
    scores = q @ k.transpose(-2, -1) / (math.sqrt(q.size(-1)) if scale else 1.0)
    mask = mask_fn(L, S)
    if not mask_after:
        scores = scores.masked_fill(~mask, float('-inf'))
    A = torch.softmax(scores, dim=softmax_dim)
    if mask_after:
        A = A.masked_fill(~mask, 0.0)
    return A if weights else A @ v


BUGS = {
    'softmax over queries': lambda q, k, v: reference(q, k, v, softmax_dim=-2),
    'no 1/sqrt(d) scale': lambda q, k, v: reference(q, k, v, scale=False),
    'mask after softmax': lambda q, k, v: reference(q, k, v, mask_after=True),
    'square/top-left mask with L != S': lambda q, k, v: reference(
        q, k, v, mask_fn=lambda L, S: torch.ones(L, S, dtype=torch.bool).tril()),
    'returns the weights': lambda q, k, v: reference(q, k, v, weights=True),
}


def inputs(L, S, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, L, D, generator=g, dtype=torch.float64) * 2
    k = torch.randn(B, H_KV, S, D, generator=g, dtype=torch.float64) * 2
    v = torch.randn(B, H_KV, S, D + 3, generator=g, dtype=torch.float64)  # d_v != d_k on purpose
    return q, k, v


def weights_of(fn, q, k):
    """With V = identity, attention returns its weight matrix A (B, H, L, S)."""
    S = k.size(-2)
    return fn(q, k, torch.eye(S, dtype=q.dtype).expand(B, k.size(1), S, S))


def rows_sum_to_one(fn, L, S):
    q, k, _ = inputs(L, S)
    A = weights_of(fn, q, k)
    return torch.allclose(A.sum(-1), torch.ones((), dtype=A.dtype), atol=1e-12)


def masked_exactly_where_right_aligned(fn, L, S):
    q, k, _ = inputs(L, S)
    A = weights_of(fn, q, k)
    return bool(((A == 0) == ~right_aligned(L, S)).all())


def scaled_by_sqrt_d(fn, L, S):
    q, k, _ = inputs(L, S)
    s = q @ k.repeat_interleave(H // H_KV, 1).transpose(-2, -1)
    s = s.masked_fill(~right_aligned(L, S), float('-inf'))
    return torch.allclose(weights_of(fn, q, k), torch.softmax(s / math.sqrt(D), -1), atol=1e-12)


def returns_a_times_v(fn, L, S):
    q, k, v = inputs(L, S)
    out = fn(q, k, v)
    return out.shape == (B, H, L, D + 3) and torch.allclose(
        out, weights_of(fn, q, k) @ v.repeat_interleave(H // H_KV, 1), atol=1e-12)


CHECKS = {
    'softmax over queries': rows_sum_to_one,
    'no 1/sqrt(d) scale': scaled_by_sqrt_d,
    'mask after softmax': rows_sum_to_one,
    'square/top-left mask with L != S': masked_exactly_where_right_aligned,
    'returns the weights': returns_a_times_v,
}


def static_attend(q, k, v, scale=None):
    """attend as a static cache calls it: the L queries the last of S filled positions,
    FlexAttention's BlockMask."""
    L, S = q.size(2), k.size(2)
    return attend(q, k, v, scale, mask=filled(torch.tensor(S - L), L, S))


@pytest.mark.parametrize('L,S', SHAPES)
@pytest.mark.parametrize('check', [rows_sum_to_one, masked_exactly_where_right_aligned,
                                   scaled_by_sqrt_d, returns_a_times_v], ids=lambda f: f.__name__)
@pytest.mark.parametrize('fn', [attend, static_attend], ids=['attend', 'static'])
def test_attend_has_the_property(fn, check, L, S):
    assert check(fn, L, S)


@pytest.mark.parametrize('bug', list(BUGS))
def test_check_rejects_the_bug(bug):
    L, S = 3, 7  # a chunk after a prefill: every bug shows here (a top-left mask needs L != S)
    assert CHECKS[bug](reference, L, S)        # the correct reference passes,
    assert not CHECKS[bug](BUGS[bug], L, S)    # the bugged one does not


@pytest.mark.parametrize('L,S', SHAPES)
@pytest.mark.parametrize('fn', [attend, static_attend], ids=['attend', 'static'])
def test_attend_equals_naive_reference(fn, L, S):
    q, k, v = inputs(L, S, seed=1)
    torch.testing.assert_close(fn(q, k, v), reference(q, k, v), atol=1e-12, rtol=0)
    torch.testing.assert_close(fn(q, k, v, scale=0.3), reference(q * 0.3 * math.sqrt(D), k, v),
                               atol=1e-12, rtol=0)


@pytest.mark.parametrize('L', [1, 130])
@pytest.mark.parametrize('last', [255, 256, 269])  # a block's last key, the next's first, inside
def test_static_cache_never_reads_the_blocks_past_its_last_query(L, last):
    """Compiled, a static cache's attention reads only its filled part: with NaN in every block of
    keys and values past the one holding the last query's position, the output is still the
    attention over the filled keys. At a block's last key too: one key past it is the next
    block's, which must stay unread."""
    pos, S = last - L + 1, 600  # the blocks after the one holding last must stay unread
    q, k, v = (x.float() for x in inputs(L, S, seed=3))  # (compiled flex on a CPU: float32 at most)
    first_unread = last // 128 * 128 + 128
    k[:, :, first_unread:], v[:, :, first_unread:] = float('nan'), float('nan')
    # (eager: dense)
    out = torch.compile(attend, fullgraph=True)(q, k, v, mask=filled(torch.tensor(pos), L, S))
    filled_keys = pos + L
    want = reference(q, k[:, :, :filled_keys], v[:, :, :filled_keys])
    torch.testing.assert_close(out, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize('L,S', SHAPES)
def test_attend_whatever_strides_sdpa_returns_and_takes(L, S, monkeypatch):
    """CUDA's efficient-attention kernel returns non-contiguous outputs (a grouped decode once
    crashed in .view there), and the cache hands attend strided slices. Same values, any strides:
    same answer."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    strided = lambda *a, **kw: sdpa(*a, **kw).transpose(1, 2).contiguous().transpose(1, 2)
    monkeypatch.setattr(torch.nn.functional, 'scaled_dot_product_attention', strided)
    q, k, v = inputs(L, S, seed=2)
    q_strided = q.transpose(1, 2).contiguous().transpose(1, 2)  # (B, H, L, D) laid out (B, L, H, D)
    k_strided = torch.cat([k, k], dim=-2)[:, :, :S]             # a slice of a longer buffer
    out = attend(q_strided, k_strided, v)
    torch.testing.assert_close(out, reference(q, k, v), atol=1e-12, rtol=0)


def test_decode_never_runs_cudnn(attn, monkeypatch):
    """A decode step has a new key length each time: cuDNN attention would build a plan per length
    (10x slower than no cache on an H200). Every SDPA call with L != S runs with cuDNN disabled."""
    sdpa, seen = torch.nn.functional.scaled_dot_product_attention, []

    def spy(q, k, *a, **kw):
        seen.append((q.size(-2), k.size(-2), torch.backends.cuda.cudnn_sdp_enabled()))
        return sdpa(q, k, *a, **kw)
    monkeypatch.setattr(torch.nn.functional, 'scaled_dot_product_attention', spy)
    make_model(attn, dtype=torch.float32).generate(torch.randint(0, 40, (2, 4)), 10, temperature=0)
    decode = [cudnn for L, S, cudnn in seen if L != S]
    assert is_linear(attn) or (len(decode) >= 9 and not any(decode))
    # training / prefill keep every backend
    assert not seen or any(cudnn for L, S, cudnn in seen if L == S)
