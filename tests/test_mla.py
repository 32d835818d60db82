"""MLA: the absorbed decode path equals the explicit one, and the cache holds exactly
[norm(W_DKV x), RoPE(W_KR x, pos)]. Negative controls show each check can fail."""
import pytest
import torch

from conftest import make_model, full_logits, tol
from ops.softmax import apply_rope


def layer0_inputs(model, idx):
    """What the first MLA block sees: ln_1 of the token embeddings (RoPE positions)."""
    block = model.transformer.h[0]
    return block.attn, block.ln_1(model.transformer.wte(idx))


def explicit_and_absorbed_scores(attn, h, rope, scale_nope=True):
    H, dh, dR, dc = attn.n_head, attn.dh, attn.dR, attn.dc
    B, T, _ = h.shape
    q = attn.c_q(h).view(B, T, H, dh + dR).transpose(1, 2)
    q_nope, q_rope = q[..., :dh], apply_rope(q[..., dh:], rope)
    c, k_rope = attn.kv_down(h).split([dc, dR], -1)
    c, k_rope = attn.kv_norm(c), apply_rope(k_rope, rope)                     # (B, T, dc), (B, T, dR)
    k_nope = attn.k_up(c).view(B, T, H, dh).transpose(1, 2)                    # materialized K
    explicit = (q_nope @ k_nope.transpose(-2, -1) + q_rope @ k_rope.unsqueeze(1).transpose(-2, -1)) * attn.scale
    q_lat = torch.einsum('bhld,hdc->bhlc', q_nope, attn.k_up.weight.view(H, dh, dc))  # W_UK absorbed
    nope = q_lat @ c.unsqueeze(1).transpose(-2, -1)
    rope_term = q_rope @ k_rope.unsqueeze(1).transpose(-2, -1)
    absorbed = (nope * attn.scale if scale_nope else nope) + rope_term * attn.scale
    return explicit, absorbed


@pytest.mark.parametrize('q_lora_rank', [0, 12])
def test_absorbed_scores_equal_explicit(q_lora_rank):
    model = make_model('mla', q_lora_rank=q_lora_rank)
    attn, h = layer0_inputs(model, torch.randint(0, 40, (2, 20)))
    explicit, absorbed = explicit_and_absorbed_scores(attn, h, model.rope(torch.arange(20)))
    torch.testing.assert_close(absorbed, explicit, atol=1e-10, rtol=0)
    # negative control: the 1/sqrt(d_h + d_R) scale on the rope term only
    _, bug = explicit_and_absorbed_scores(attn, h, model.rope(torch.arange(20)), scale_nope=False)
    assert not torch.allclose(bug, explicit, atol=1e-3)


@pytest.mark.parametrize('dtype', [torch.float64, torch.float32])
def test_absorbed_layer_output_equals_explicit(dtype):
    """One MLA layer: explicit (K, V materialized) == absorbed over cached latents, chunk by chunk."""
    model = make_model('mla', dtype=dtype)
    attn, h = layer0_inputs(model, torch.randint(0, 40, (2, 24)))
    explicit = attn(h, model.rope(torch.arange(24)), 0)
    cache = attn.init_cache(2, 32, dtype, h.device)
    out, pos = [], 0
    for n in (7, 1, 1, 9, 6):
        out.append(attn(h[:, pos:pos + n], model.rope(torch.arange(pos, pos + n)), pos, cache))
        pos += n
    torch.testing.assert_close(torch.cat(out, 1), explicit, **tol(dtype))


def test_decode_never_materializes_k_or_v(monkeypatch):
    """In decode, W_UK and W_UV are only used as absorbed weights: the Linear modules are not called."""
    model = make_model('mla')
    calls = []
    for block in model.transformer.h:
        for lin in (block.attn.k_up, block.attn.v_up):
            monkeypatch.setattr(lin, 'forward', lambda x, _f=lin.forward: calls.append(x.shape) or _f(x))
    cache = model.init_cache(1)
    model(torch.randint(0, 40, (1, 5)), cache=cache)
    model(torch.randint(0, 40, (1, 1)), cache=cache)
    assert calls == []
    full_logits(model, torch.randint(0, 40, (1, 5)))
    assert len(calls) == 2 * model.config.n_layer  # and the explicit path does use them


def test_cache_holds_normed_latent_and_rotated_rope_key():
    model = make_model('mla')
    idx = torch.randint(0, 40, (2, 11))
    cache = model.init_cache(2)
    model(idx[:, :4], cache=cache)
    model(idx[:, 4:], cache=cache)
    attn, h = layer0_inputs(model, idx)
    held = cache.layers[0].latent[:, 0, :11]                         # (B, T, d_c + d_R)
    assert cache.layers[0].latent.shape == (2, 1, model.config.block_size, 16 + 4)
    c, k_r = attn.kv_down(h).split([attn.dc, attn.dR], -1)            # W_DKV x, W_KR x
    torch.testing.assert_close(held[..., :attn.dc], attn.kv_norm(c), atol=1e-12, rtol=0)
    torch.testing.assert_close(held[..., attn.dc:], apply_rope(k_r, model.rope(torch.arange(11))), atol=1e-12, rtol=0)
    # negative controls: the latent before the norm, and the rope key unrotated, are not what is held
    assert not torch.allclose(held[..., :attn.dc], c, atol=1e-3)
    assert not torch.allclose(held[..., attn.dc:], k_r, atol=1e-3)


def test_decoding_at_position_zero_is_caught(monkeypatch):
    """Negative control: rotate every decoded token as if at position 0 and the cached logits
    no longer match the full forward (the same comparison passes without the bug)."""
    model = make_model('mla')
    idx = torch.randint(0, 40, (1, 16))
    full = full_logits(model, idx)

    def decode(m):
        cache = m.init_cache(1)
        return torch.cat([m(idx[:, t:t + 1], cache=cache)[0] for t in range(16)], 1)

    torch.testing.assert_close(decode(model), full, atol=1e-10, rtol=0)
    rope = model.rope
    monkeypatch.setattr(model, 'rope', lambda positions: rope(positions - positions[0]))
    assert not torch.allclose(decode(model), full, atol=1e-3)


def test_query_bottleneck_has_q_lora_rank_width():
    """q_lora_rank = r: W_DQ (n_embd -> r), an RMSNorm over r, W_UQ (r -> n_head (d_h + d_R)); 0: one Linear."""
    for r in (12, 5):
        attn = make_model('mla', q_lora_rank=r).transformer.h[0].attn
        down, norm, up = attn.c_q
        assert (down.in_features, down.out_features) == (32, r)
        assert norm.normalized_shape == (r,)
        assert (up.in_features, up.out_features) == (r, 4 * (8 + 4))
    straight = make_model('mla').transformer.h[0].attn.c_q
    assert isinstance(straight, torch.nn.Linear) and straight.out_features == 4 * (8 + 4)
