"""Each layout against its paper's equations, not only against itself. The references below are
written from the modules' weights with plain loops and use nothing from model.py but the modules
(no apply_rope, attend, phi): RoPE (Su et al. 2021), GQA's contiguous groups (Ainslie et al. 2023),
MLA (DeepSeek-V2, eqs. 9-19), linear attention (Katharopoulos et al. 2020, eqs. 4-6) and the
state-update rules (RetNet, Mamba-2, DeltaNet, Gated DeltaNet). Each layer is checked on the
training path and on the cached path (a prefill, a chunk after it, then one token at a time), and
each check is shown to reject a broken copy. A windowed layer's band is written out too, and told
apart from one key wider or narrower."""
import math

import pytest
import torch
import torch.nn.functional as F

from conftest import make_model
from ops.softmax import apply_rope, rope_table

T = 12
# float64 models, but the model's RoPE table holds float32 cos/sin (~6e-8); the bugs are O(1e-2)
ATOL = 1e-6
SCHEDULE = (5, 3, 1, 1, 1, 1)  # the cached path: a prefill, a chunk after it (L != S), then decode


# ------------------------------------------------------------------------------------------ RoPE

def rope_ref(x, positions, base, theta_exp=1.0, sign=1.0):
    """RoPE as written in the paper: the pair (x[2i], x[2i+1]) is the complex number
    x[2i] + i x[2i+1], multiplied by e^(i m theta_i), theta_i = base^(-2i/d), at position m.
    x (..., T, d)."""
    d = x.size(-1)
    theta = base ** (-theta_exp * torch.arange(0, d, 2, dtype=torch.float64) / d)
    angle = sign * positions.double()[:, None] * theta                          # (T, d/2)
    z = torch.complex(x[..., 0::2].double(), x[..., 1::2].double())
    z = z * torch.polar(torch.ones_like(angle), angle)
    return torch.stack([z.real, z.imag], -1).flatten(-2).to(x.dtype)


def model_rope(x, positions, base=10000.0):
    """The model's RoPE: its table rows at the given positions, applied by its apply_rope."""
    return apply_rope(x, rope_table(x.size(-1), positions, base))


ROPE_BUGS = {  # broken copies of RoPE that keep it self-consistent (cached == uncached still holds)
    'theta_i = base^(-i/d)': lambda x, p, base=10000.0: rope_ref(x, p, base, theta_exp=0.5),
    'rotates the other way': lambda x, p, base=10000.0: rope_ref(x, p, base, sign=-1.0),
    'half-split pairs (x[i], x[i + d/2])': lambda x, p, base=10000.0: torch.cat(
        rope_ref(torch.stack([x[..., :x.size(-1) // 2], x[..., x.size(-1) // 2:]], -1).flatten(-2),
                 p, base).unflatten(-1, (-1, 2)).unbind(-1), -1),
    'angle m^2 theta (not a function of m - n)':
        lambda x, p, base=10000.0: rope_ref(x, p * p, base),
    'cos only, no sin': lambda x, p, base=10000.0: x * torch.cos(p.double()[:, None] * base ** (
        -torch.arange(0, x.size(-1), 2, dtype=torch.float64) / x.size(-1))
    ).repeat_interleave(2, -1).to(x.dtype),
}


def hand_values(fn):
    """d = 4, base 10000: theta = (1, 0.01). x = (1, 0, 0, 1) at position m is
    (cos m, sin m, -sin 0.01m, cos 0.01m); at position 0 nothing moves."""
    x = torch.tensor([[1.0, 0.0, 0.0, 1.0]] * 3, dtype=torch.float64)
    want = torch.tensor([[1.0, 0.0, 0.0, 1.0],
                         [math.cos(1), math.sin(1), -math.sin(0.01), math.cos(0.01)],
                         [math.cos(7), math.sin(7), -math.sin(0.07), math.cos(0.07)]],
                        dtype=torch.float64)
    return torch.allclose(fn(x, torch.tensor([0, 1, 7])), want, atol=ATOL, rtol=0)


def preserves_norms(fn):
    x = torch.randn(50, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    return torch.allclose(fn(x, torch.arange(50)).norm(dim=-1), x.norm(dim=-1), atol=ATOL, rtol=0)


def depends_on_m_minus_n_only(fn):
    """q_m . k_n is the same for (m, n) and (m + s, n + s), and changes with m - n."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 16, dtype=torch.float64, generator=g)
    k = torch.randn(1, 16, dtype=torch.float64, generator=g)

    def dot(m, n):
        return (fn(q, torch.tensor([m])) * fn(k, torch.tensor([n]))).sum().item()
    same = all(math.isclose(dot(m, n), dot(m + s, n + s), abs_tol=ATOL)
               for m, n in ((3, 1), (0, 5), (7, 7)) for s in (1, 4, 20))
    return same and not math.isclose(dot(3, 1), dot(5, 1), abs_tol=1e-6)


def equals_reference(fn):
    x = torch.randn(2, 3, 40, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    p = torch.arange(5, 45)
    return all(torch.allclose(fn(x, p, base), rope_ref(x, p, base), atol=ATOL, rtol=0)
               for base in (10000.0, 500.0))


ROPE_CHECKS = [hand_values, preserves_norms, depends_on_m_minus_n_only, equals_reference]


@pytest.mark.parametrize('check', ROPE_CHECKS, ids=lambda f: f.__name__)
def test_model_rope_is_the_paper_rope(check):
    assert check(model_rope)
    assert check(lambda x, p, base=10000.0: rope_ref(x, p, base))  # the reference itself passes too


@pytest.mark.parametrize('bug', list(ROPE_BUGS))
def test_rope_checks_reject_the_bug(bug):
    assert not all(check(ROPE_BUGS[bug]) for check in ROPE_CHECKS)


def test_model_rope_slices_its_table_at_the_position():
    """GPT.rope(positions) is the rotation of positions pos .. pos + L - 1 (the offset the cache
    relies on)."""
    model = make_model('mha', rope_base=500.0)
    x = torch.randn(2, 4, 6, 8, dtype=torch.float64)
    for pos in (0, 3, 20):
        positions = torch.arange(pos, pos + 6)
        torch.testing.assert_close(apply_rope(x, model.rope(positions)),
                                   rope_ref(x, positions, 500.0), atol=ATOL, rtol=0)


# ---------------------------------------------------------------------------------------- layers

def linear(x, layer):
    return x @ layer.weight.T + (layer.bias if layer.bias is not None else 0)


def rms_norm(x, norm):
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight


def causal_softmax_rows(scores, window=0, n_sink=0):
    """scores (T, T): row t attends to keys 0..t; with a window of W, to its W most recent keys,
    itself included (t - W < j <= t), and to the first n_sink (the sinks)."""
    T = scores.size(0)
    seen = torch.zeros(T, T, dtype=torch.bool)
    for t in range(T):
        for j in range(t + 1):
            seen[t, j] = not window or t - window < j or j < n_sink
    return scores.masked_fill(~seen, float('-inf')).softmax(-1)


def softmax_attention_ref(attn, x, base, group=lambda h, H, H_kv: h // (H // H_kv), window=0,
                          n_sink=0):
    """MHA / GQA / MQA (Ainslie et al. 2023): query head h reads K/V head
    h // (n_head / n_kv_head), so each group is a run of consecutive query heads. x (B, T, C),
    positions 0 .. T-1; a window and sinks as causal_softmax_rows'."""
    B, T, _ = x.shape
    H, H_kv, d = attn.n_head, attn.n_kv_head, attn.head_dim
    q, k, v = linear(x, attn.c_attn).split([H * d, H_kv * d, H_kv * d], -1)
    pos = torch.arange(T)
    q = rope_ref(q.view(B, T, H, d).transpose(1, 2), pos, base)       # (B, H, T, d)
    k = rope_ref(k.view(B, T, H_kv, d).transpose(1, 2), pos, base)    # (B, H_kv, T, d)
    v = v.view(B, T, H_kv, d).transpose(1, 2)
    out = torch.zeros(B, T, H, d, dtype=x.dtype)
    for b in range(B):
        for h in range(H):
            g = group(h, H, H_kv)
            scores = q[b, h] @ k[b, g].T / math.sqrt(d)
            out[b, :, h] = causal_softmax_rows(scores, window, n_sink) @ v[b, g]
    return linear(out.reshape(B, T, H * d), attn.c_proj)


def mla_ref(attn, x, base, scale=None, rotate_keys=True, window=0, n_sink=0):
    """DeepSeek-V2 MLA, eqs. 9-19, per head i: c = W_DKV h, RMS-normed (as in the released code);
    k^C_i = W_UK_i c; v_i = W_UV_i c;
    k^R = RoPE(W_KR h), one for all heads; q_i = [q^C_i; RoPE(q^R_i)];
    o_i = sum_j softmax_j((q^C_i . k^C_ij + q^R_i . k^R_j) / sqrt(d_h + d_R)) v_ij;
    out = W_O [o_1; ...; o_H]."""
    B, T, _ = x.shape
    H, dh, dR, dc = attn.n_head, attn.dh, attn.dR, attn.dc
    scale = 1 / math.sqrt(dh + dR) if scale is None else scale
    pos = torch.arange(T)
    if isinstance(attn.c_q, torch.nn.Sequential):  # query compression: W_UQ RMSNorm(W_DQ h)
        down, norm, up = attn.c_q
        q = linear(rms_norm(linear(x, down), norm), up)
    else:
        q = linear(x, attn.c_q)
    q = q.view(B, T, H, dh + dR)                                    # per head [nope | rope]
    q_c, q_r = q[..., :dh], rope_ref(q[..., dh:].transpose(1, 2), pos, base).transpose(1, 2)
    c, k_r = linear(x, attn.kv_down).split([dc, dR], -1)            # W_DKV h, W_KR h
    c = rms_norm(c, attn.kv_norm)                                   # (B, T, dc)
    k_r = rope_ref(k_r, pos, base) if rotate_keys else k_r          # (B, T, dR)
    W_UK, W_UV = attn.k_up.weight.view(H, dh, dc), attn.v_up.weight.view(H, dh, dc)
    out = torch.zeros(B, T, H, dh, dtype=x.dtype)
    for b in range(B):
        for i in range(H):
            k_c, v = c[b] @ W_UK[i].T, c[b] @ W_UV[i].T  # (T, dh): K and V, materialized
            scores = (q_c[b, :, i] @ k_c.T + q_r[b, :, i] @ k_r[b].T) * scale
            out[b, :, i] = causal_softmax_rows(scores, window, n_sink) @ v
    return linear(out.reshape(B, T, H * dh), attn.c_proj)


def linear_attention_ref(attn, x, strict=False):
    """Katharopoulos et al. 2020, eq. 6, causal: phi(x) = elu(x) + 1 and
    o_t = sum_{j<=t} (phi(q_t) . phi(k_j)) v_j / sum_{j<=t} phi(q_t) . phi(k_j)."""
    B, T, _ = x.shape
    H, d = attn.n_head, attn.head_dim
    q, k, v = (t.view(B, T, H, d) for t in linear(x, attn.c_attn).split(H * d, -1))
    q, k = F.elu(q) + 1, F.elu(k) + 1
    out = torch.zeros(B, T, H, d, dtype=x.dtype)
    for t in range(T):
        j = slice(0, t if strict else t + 1)
        w = torch.einsum('bhd,bjhd->bhj', q[:, t], k[:, j])         # phi(q_t) . phi(k_j)
        out[:, t] = torch.einsum('bhj,bjhd->bhd', w, v[:, j]) / w.sum(-1, keepdim=True)
    return linear(out.reshape(B, T, H * d), attn.c_proj)


def layer_paths(model, x, layer=0):
    """A block's attention on x: the training path, and the cached path in SCHEDULE's pieces."""
    attn = model.transformer.h[layer].attn
    full = attn(x, model.rope(torch.arange(x.size(1))), 0)
    cache = attn.init_cache(x.size(0), model.config.block_size, x.dtype, x.device)
    out, pos = [], 0
    for n in SCHEDULE:
        out.append(attn(x[:, pos:pos + n], model.rope(torch.arange(pos, pos + n)), pos, cache))
        pos += n
    return attn, full, torch.cat(out, 1)


def inputs(model, seed=0):
    seeded = torch.Generator().manual_seed(seed)
    return torch.randn(2, T, model.config.n_embd, dtype=torch.float64, generator=seeded)


@pytest.mark.parametrize('attn_name,kw', [('mha', {}), ('gqa', {}), ('mqa', {}),
                                          ('gqa', dict(n_head=8, n_kv_head=2)),
                                          ('gqa', dict(bias=True, rope_base=500.0))])
def test_softmax_layouts_equal_the_reference(attn_name, kw):
    model = make_model(attn_name, **kw)
    x = inputs(model)
    attn, full, cached = layer_paths(model, x)
    ref = softmax_attention_ref(attn, x, model.config.rope_base)
    torch.testing.assert_close(full, ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(cached, ref, atol=ATOL, rtol=0)
    # negative control: interleaved groups (h % n_kv_head) differ
    if attn.n_kv_head not in (1, attn.n_head):
        interleaved = lambda h, H, H_kv: h % H_kv
        bad = softmax_attention_ref(attn, x, model.config.rope_base, group=interleaved)
        assert not torch.allclose(bad, ref, atol=1e-3)


@pytest.mark.parametrize('kw', [{}, dict(q_lora_rank=12),
                                dict(bias=True, rope_base=500.0, rope_head_dim=6)])
def test_mla_equals_the_deepseek_equations(kw):
    model = make_model('mla', **kw)
    x = inputs(model, seed=1)
    attn, full, cached = layer_paths(model, x)
    ref = mla_ref(attn, x, model.config.rope_base)
    torch.testing.assert_close(full, ref, atol=ATOL, rtol=0)
    # absorbed decode, K and V never formed
    torch.testing.assert_close(cached, ref, atol=ATOL, rtol=0)
    # negative controls: the scale of the nope head dim alone, and rope keys left unrotated, differ
    base = model.config.rope_base
    assert not torch.allclose(mla_ref(attn, x, base, scale=1 / math.sqrt(attn.dh)), ref, atol=1e-3)
    assert not torch.allclose(mla_ref(attn, x, base, rotate_keys=False), ref, atol=1e-3)


@pytest.mark.parametrize('window,n_sink', [(4, 0), (3, 2)])
@pytest.mark.parametrize('attn_name', ['mha', 'gqa', 'mqa', 'mla'])
def test_windowed_layers_equal_the_reference(attn_name, window, n_sink, monkeypatch):
    """A query sees its W most recent keys, itself included, and the first n_sink keys: the
    training path and the cached path (a prefill longer than W, a chunk across the ring's wrap,
    then one token at a time) equal the band written out, which differs from one a key wider
    (FlashAttention's window_size=(W, 0)) or narrower; so does the model with either made."""
    model = make_model(attn_name, window=window, n_sink=n_sink)
    x = inputs(model, seed=4)
    attn, full, cached = layer_paths(model, x)
    reference = mla_ref if attn_name == 'mla' else softmax_attention_ref
    ref = lambda w: reference(attn, x, model.config.rope_base, window=w, n_sink=n_sink)
    torch.testing.assert_close(full, ref(window), atol=ATOL, rtol=0)
    torch.testing.assert_close(cached, ref(window), atol=ATOL, rtol=0)
    import ops.window
    sees = ops.window.sees
    for wrong in (window - 1, window + 1):
        assert not torch.allclose(ref(wrong), ref(window), atol=1e-3)
        # the model's own band one key off: the same check catches it
        monkeypatch.setattr(ops.window, 'sees', lambda i, j, w, s=0: sees(i, j, w - window + wrong, s))
        _, full, cached = layer_paths(model, x)
        assert not torch.allclose(full, ref(window), atol=1e-3)
        assert not torch.allclose(cached, ref(window), atol=1e-3)
        monkeypatch.undo()


def test_a_local_global_stack_windows_only_its_local_layers():
    """'mha@4+mha': the first layer sees 4 keys, the second all of them (a window applied to the
    global layers, or dropped from the local ones, fails)."""
    model = make_model('mha@4+mha')
    x = inputs(model, seed=5)
    for layer, window in enumerate((4, 0)):
        attn, full, cached = layer_paths(model, x, layer)
        ref = softmax_attention_ref(attn, x, model.config.rope_base, window=window)
        torch.testing.assert_close(full, ref, atol=ATOL, rtol=0)
        torch.testing.assert_close(cached, ref, atol=ATOL, rtol=0)
        other = softmax_attention_ref(attn, x, model.config.rope_base, window=4 - window)
        assert not torch.allclose(other, ref, atol=1e-3)


def delta_family_ref(attn, x, layout, erase=True, forget=True, gamma_sign=1.0, flip=False):
    """The state-update papers, token by token, in their orientation (S is d_v x d_k,
    o_t = S_t q_t):
    RetNet (Sun et al. 2023)       S_t = γ_h S_{t-1} + v_t k_tᵀ,  γ_h = 1 - 2^(-5-h);
    Mamba-2 (Dao & Gu 2024)        S_t = α_t S_{t-1} + v_t k_tᵀ,
                                   α_t = exp(-exp(A_log) softplus(W_a x_t + dt_bias));
    DeltaNet (Yang et al. 2024)    S_t = S_{t-1} (I - β_t k_t k_tᵀ) + β_t v_t k_tᵀ,
                                   β_t = σ(W_β x_t);
    Gated DeltaNet (Yang et al.)   S_t = α_t S_{t-1} (I - β_t k_t k_tᵀ) + β_t v_t k_tᵀ;
    with Gated DeltaNet's layer around it: a causal depthwise conv of width K,
    c_t = Σ_j w_j ⊙ (W x)_{t-K+1+j} (zeros before the first token), then
    q, k = L2norm(SiLU(c)) (x / sqrt(|x|² + 1e-6)), q / sqrt(d_k), v = SiLU(c),
    o = RMSNorm(o) * SiLU(W_g x)."""
    B, T, C = x.shape
    H, d = attn.n_head, attn.head_dim
    silu = lambda t: t * torch.sigmoid(t)
    # L2 norm with the eps of Qwen3-Next's code
    unit = lambda t: t / (t.norm(dim=-1, keepdim=True) ** 2 + 1e-6).sqrt()
    # knobs: W_a x, W_β x
    qkv, gate, *knobs = linear(x, attn.c_attn).split([3 * C, C, H, H][:len(attn.parts)], -1)
    w = attn.conv.flip(0) if flip else attn.conv  # (K, 3C)
    K = w.size(0)
    conv = torch.zeros_like(qkv)
    for t in range(T):
        for j in range(K):
            if t - K + 1 + j >= 0:
                conv[:, t] += w[j] * qkv[:, t - K + 1 + j]
    q, k, v = (silu(t).view(B, T, H, d) for t in conv.split(C, -1))
    q, k = unit(q) / math.sqrt(d), unit(k)
    alpha = torch.ones(B, T, H, dtype=x.dtype)
    if layout == 'retnet' and forget:
        alpha = alpha * (1 - 2.0 ** (-5.0 - gamma_sign * torch.arange(H, dtype=x.dtype)))
    if layout in ('mamba2', 'gated_deltanet') and forget:
        alpha = torch.exp(-attn.A_log.exp() * F.softplus(knobs[0] + attn.dt_bias))
    delta = layout in ('deltanet', 'gated_deltanet')
    beta = torch.sigmoid(knobs[-1]) if delta else torch.ones(B, T, H, dtype=x.dtype)
    S, eye = torch.zeros(B, H, d, d, dtype=x.dtype), torch.eye(d, dtype=x.dtype)
    out = torch.zeros(B, T, H, d, dtype=x.dtype)
    for t in range(T):
        kt, vt, a, b = k[:, t], v[:, t], alpha[:, t, :, None, None], beta[:, t, :, None, None]
        # (B, H, d, d)
        kkT, vkT = kt[..., :, None] * kt[..., None, :], vt[..., :, None] * kt[..., None, :]
        S = a * S @ (eye - b * kkT) + b * vkT if delta and erase else a * S + b * vkT
        out[:, t] = (S @ q[:, t, :, :, None]).squeeze(-1)
    gated = rms_norm(out, attn.o_norm) * silu(gate).view(B, T, H, d)
    return linear(gated.reshape(B, T, C), attn.c_proj)


@pytest.mark.parametrize('kw', [{}, dict(bias=True, chunk_size=5)])
def test_linear_attention_equals_katharopoulos(kw):
    model = make_model('linear', **kw)
    x = inputs(model, seed=2)
    attn, full, cached = layer_paths(model, x)
    ref = linear_attention_ref(attn, x)
    rel = lambda a: ((a - ref)[:, 1:].norm() / ref[:, 1:].norm()).item()
    assert rel(full) < 1e-6 and rel(cached) < 1e-6  # the model adds eps = 1e-6 to the denominator
    # negative control: sums without step t
    assert rel(linear_attention_ref(attn, x, strict=True)) > 1e-3


BROKEN = {  # per rule, copies of the paper with one thing wrong: each must differ from the model
    # no decay; γ_h for the heads in reverse order
    'retnet': [dict(forget=False), dict(gamma_sign=-1.0)],
    'mamba2': [dict(forget=False)],
    # β v kᵀ added, the old value on k never erased; the conv's taps in reverse order
    'deltanet': [dict(erase=False), dict(flip=True)],
    'gated_deltanet': [dict(erase=False), dict(forget=False)],
}


@pytest.mark.parametrize('kw', [{}, dict(bias=True, chunk_size=5), dict(chunk_size=3, n_head=2)])
@pytest.mark.parametrize('layout', list(BROKEN))
def test_linear_rules_equal_their_papers(layout, kw):
    """Training path (chunkwise, with the WY solve for the delta rules) and cached path (prefill, a
    chunk after it, then the one-token recurrence) == the paper's per-token recurrence, in
    float64."""
    model = make_model(layout, **kw)
    x = inputs(model, seed=3)
    attn, full, cached = layer_paths(model, x)
    ref = delta_family_ref(attn, x, layout)
    torch.testing.assert_close(full, ref, atol=1e-12, rtol=0)
    torch.testing.assert_close(cached, ref, atol=1e-12, rtol=0)
    for bug in BROKEN[layout]:
        assert not torch.allclose(delta_family_ref(attn, x, layout, **bug), ref, atol=1e-4), bug
