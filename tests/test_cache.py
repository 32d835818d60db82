"""The cache is exact: full forward == token by token == uneven chunks, for every layout, windowed
ones too."""
import pytest
import torch

from model import LINEAR_RULES
from conftest import EVERY, make_model, full_logits, tol

VARIANTS = [dict(attn=a) for a in EVERY] + [
    dict(attn='mha', pos_emb='learned'), dict(attn='gqa', pos_emb='learned'),
    dict(attn='mla', pos_emb='learned'), dict(attn='mla', q_lora_rank=12),
    dict(attn='linear', pos_emb='learned'), dict(attn='linear', chunk_size=5),
    dict(attn='gated_deltanet', chunk_size=5), dict(attn='retnet', chunk_size=3, bias=True),
    dict(attn='mamba2+mqa', pos_emb='learned', chunk_size=7),
    dict(attn='mha', bias=True), dict(attn='mla', bias=True),
    dict(attn='mla', n_embd=36, kv_lora_rank=15, rope_head_dim=6),  # odd head_dim and d_c: odd offsets for RoPE
    # windows: rings of n_sink + W slots, which chunks longer than W cross and wrap around
    dict(attn='gqa', window=5), dict(attn='mha', window=4, n_sink=2), dict(attn='mla', window=6, n_sink=1),
    dict(attn='mqa@3+mqa'), dict(attn='gated_deltanet+gqa@5', n_sink=2),
    dict(attn='mha', window=7, pos_emb='learned')]
IDS = ['-'.join(f'{k}={v}' for k, v in d.items()) for d in VARIANTS]


@torch.no_grad()  # generation: a static cache's FlexAttention has no backward on a CPU
def cached_logits(model, idx, chunks, static=False):
    cache = model.init_cache(idx.size(0), static=static)
    out, pos = [], 0
    for n in chunks:
        logits, _ = model(idx[:, pos:pos + n], cache=cache)
        assert logits.shape == (idx.size(0), n, model.config.vocab_size)
        pos += n
        assert len(cache) == pos  # advances by exactly the tokens fed
        out.append(logits)
    return torch.cat(out, dim=1)


@pytest.mark.parametrize('static', [False, True], ids=['cache', 'static_cache'])
@pytest.mark.parametrize('dtype', [torch.float64, torch.float32])
@pytest.mark.parametrize('variant', VARIANTS, ids=IDS)
def test_full_equals_token_by_token_equals_chunks(variant, dtype, static):
    model = make_model(dtype=dtype, **variant)
    idx = torch.randint(0, model.config.vocab_size, (3, 32))
    full = full_logits(model, idx)
    for chunks in ([1] * 32, [5, 1, 3, 7, 16], [32], [2, 30]):
        torch.testing.assert_close(cached_logits(model, idx, chunks, static), full, **tol(dtype))


def test_eager_cache_attends_to_t_keys_static_to_capacity(attn, monkeypatch):
    """The default cache's cost grows with t (attention sees the t filled keys); a static cache always
    attends over block_size keys under a mask, so every step has the same shapes."""
    import model as model_module
    from ops import mla
    seen = []
    attend = model_module.attend
    for module in (model_module, mla):  # MHA's, GQA's, MQA's; MLA's
        monkeypatch.setattr(module, 'attend', lambda q, k, *a, **kw: seen.append(k.size(2)) or attend(q, k, *a, **kw))
    model = make_model(attn)
    idx = torch.randint(0, 40, (1, 8))
    for static in (False, True):
        seen.clear()
        cache = model.init_cache(1, static=static)
        with torch.no_grad():
            for t in range(8):
                model(idx[:, t:t + 1], cache=cache)
        softmax_layers = sum(a not in LINEAR_RULES for a in model.config.layouts)  # linear layers: a state, no attend
        per_layer = [32] * 8 if static else list(range(1, 9))
        assert seen == [s for s in per_layer for _ in range(softmax_layers)]


def test_last_position_shortcut_and_block_size_limit(attn):
    model = make_model(attn)
    idx = torch.randint(0, 40, (2, 32))
    logits, loss = model(idx)
    assert logits.shape == (2, 1, 40) and loss is None
    torch.testing.assert_close(logits[:, 0], full_logits(model, idx)[:, -1], atol=1e-12, rtol=0)
    with pytest.raises(ValueError, match='block_size'):
        model(torch.zeros(1, 33, dtype=torch.long))
    cache = model.init_cache(2)
    model(idx[:, :30], cache=cache)
    with pytest.raises(ValueError, match='block_size'):
        model(idx[:, :3], cache=cache)
    for cache in (None, model.init_cache(2), model.init_cache(2, static=True)):  # no token: one clear error
        with pytest.raises(ValueError, match='cannot feed 0 tokens'):
            model(idx[:, :0], cache=cache)


def test_causality_later_tokens_do_not_change_earlier_logits(attn):
    model = make_model(attn)
    idx = torch.randint(0, 40, (2, 32))
    for t in (0, 7, 20):
        changed = idx.clone()
        changed[:, t + 1:] = torch.randint(0, 40, changed[:, t + 1:].shape)
        assert not torch.equal(changed, idx)
        a, b = full_logits(model, idx), full_logits(model, changed)
        assert torch.equal(a[:, :t + 1], b[:, :t + 1])       # bit-identical up to t
        assert not torch.allclose(a[:, t + 1:], b[:, t + 1:])  # and the check can see a change


def test_batch_rows_are_independent(attn):
    model = make_model(attn)
    idx = torch.randint(0, 40, (4, 24))
    batched = full_logits(model, idx)
    cache = model.init_cache(4)
    cached = torch.cat([model(idx[:, :10], cache=cache)[0], model(idx[:, 10:], cache=cache)[0]], 1)
    for b in range(4):
        torch.testing.assert_close(batched[b], full_logits(model, idx[b:b + 1])[0], atol=1e-12, rtol=0)
        torch.testing.assert_close(cached[b], batched[b], atol=1e-10, rtol=0)


def test_cache_buffers_are_preallocated_not_resized(attn):
    model = make_model(attn)
    cache = model.init_cache(2)
    bufs = lambda: [t for layer in cache.layers for t in layer.buffers.values()]
    ptrs, shapes = [t.data_ptr() for t in bufs()], [t.shape for t in bufs()]
    for _ in range(5):
        model(torch.randint(0, 40, (2, 3)), cache=cache)
    assert [t.data_ptr() for t in bufs()] == ptrs and [t.shape for t in bufs()] == shapes  # a state too: in place
    assert all(t.size(2) == model.config.block_size
               for layer in cache.layers if layer.grows for t in layer.buffers.values())
