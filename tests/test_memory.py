"""cache.nbytes per token == the table: 2*n_layer*h_kv*d_k (never h_q), (d_c + d_R)*n_layer for MLA,
and a fixed state for linear attention."""
import pytest
import torch

from conftest import make_model, table_layer_elements
from model import LINEAR_RULES

L, H, DK = 2, 4, 8   # the tiny config: n_layer, n_head, head_dim
H_KV = {'mha': 4, 'gqa': 2, 'mqa': 1}


@pytest.mark.parametrize('dtype', [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_nbytes_matches_table(attn, dtype):
    model = make_model(attn, dtype=dtype)
    B = 3
    cache = model.init_cache(B)
    elem = torch.empty(0, dtype=dtype).element_size()
    state_elem = max(elem, 4)  # a linear layout's state is float32 even in a 16-bit model
    assert len(cache) == 0
    for T in (1, 5, 17, 32):
        model(torch.randint(0, 40, (B, T - len(cache))), cache=cache)
        assert len(cache) == T
        layers = attn.split('+') * (L // len(attn.split('+')))
        want = sum(table_layer_elements(a, T) * (state_elem if a in LINEAR_RULES else elem) for a in layers)
        assert cache.nbytes == want * B                      # a real cache
        assert model.config.cache_bytes(T, dtype) == want    # the formula the README's tables use, in this dtype
        assert model.config.cache_elements(T) == sum(table_layer_elements(a, T) for a in layers)


def test_a_state_does_not_grow_with_t():
    for layout in LINEAR_RULES:
        cfg = make_model(layout).config
        assert cfg.cache_bytes(1) == cfg.cache_bytes(10_000) == cfg.cache_bytes(1, torch.bfloat16) > 0
    hybrid = make_model('gated_deltanet+gqa').config  # grows by its softmax layer's K/V only
    assert hybrid.cache_elements(11) - hybrid.cache_elements(10) == 2 * H_KV['gqa'] * DK


def test_grouped_heads_cache_counts_h_kv_not_h_q():
    for attn, h_kv in H_KV.items():
        model = make_model(attn)
        cache = model.init_cache(1)
        model(torch.randint(0, 40, (1, 10)), cache=cache)
        assert all(buf.size(1) == h_kv for layer in cache.layers for buf in layer.buffers.values())
        wrong = 2 * L * H * DK * 10 * 8  # counted with h_q
        assert (cache.nbytes == wrong) == (attn == 'mha')
