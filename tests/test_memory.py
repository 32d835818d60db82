"""cache.nbytes per token == the table: 2*n_layer*h_kv*d_k (never h_q), (d_c + d_R)*n_layer for MLA,
and a fixed state for linear attention."""
import pytest
import torch

from conftest import make_model

L, H, DK = 2, 4, 8   # the tiny config: n_layer, n_head, head_dim
H_KV = {'mha': 4, 'gqa': 2, 'mqa': 1}


def table_elements_per_token(attn):
    if attn in H_KV:
        return 2 * L * H_KV[attn] * DK
    if attn == 'mla':
        return (16 + 4) * L  # d_c + d_R
    return None  # linear: no per-token cost


@pytest.mark.parametrize('dtype', [torch.float32, torch.float64, torch.bfloat16])
def test_nbytes_matches_table(attn, dtype):
    model = make_model(attn, dtype=dtype)
    B = 3
    cache = model.init_cache(B)
    elem = torch.empty(0, dtype=dtype).element_size()
    assert len(cache) == 0
    seen = []
    for T in (1, 5, 17, 32):
        model(torch.randint(0, 40, (B, T - len(cache))), cache=cache)
        assert len(cache) == T
        seen.append(cache.nbytes)
        per_token = table_elements_per_token(attn)
        if per_token is not None:
            assert cache.nbytes == per_token * elem * B * T
            assert model.config.cache_elements(T) == per_token * T
    if attn == 'linear':  # constant in T: H * d_k * (d_v + 1) per layer, float32 even in bf16
        state = L * H * DK * (DK + 1) * B * max(elem, 4)
        assert seen == [state] * 4
        assert model.config.cache_elements(1) == model.config.cache_elements(32) == state // B // max(elem, 4)


def test_grouped_heads_cache_counts_h_kv_not_h_q():
    for attn, h_kv in H_KV.items():
        model = make_model(attn)
        cache = model.init_cache(1)
        model(torch.randint(0, 40, (1, 10)), cache=cache)
        assert all(buf.size(1) == h_kv for layer in cache.layers for buf in layer.bufs)
        wrong = 2 * L * H * DK * 10 * 8  # counted with h_q
        assert (cache.nbytes == wrong) == (attn == 'mha')
