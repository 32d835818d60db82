"""Hybrid stacks whose pattern does not divide n_layer, and whose first layer is linear: the layers
each layout gets, the cache they keep, the MLP that matches MHA's parameters, the positions the
softmax layer sees, conversion."""
from collections import Counter

import pytest
import torch

from conftest import make_model, table_layer_elements, tiny
from model import GPT, LINEAR_RULES
from run.convert import pool_kv_heads
from run.settings import num_params
from ops.softmax import rope_table

# (attn, n_layer, each layer's layout written out): Qwen3-Next's 3:1 on 6 layers is the README's
# own hybrid
STACKS = [('gated_deltanet*3+gqa', 6, ['gated_deltanet'] * 3 + ['gqa'] + ['gated_deltanet'] * 2),
          ('deltanet*2+mla', 5, ['deltanet', 'deltanet', 'mla', 'deltanet', 'deltanet']),
          ('gqa+mamba2*2', 4, ['gqa', 'mamba2', 'mamba2', 'gqa']),
          ('retnet+mqa', 3, ['retnet', 'mqa', 'retnet'])]


@pytest.mark.parametrize('attn, n_layer, layers', STACKS)
def test_layer_counts_and_the_built_blocks_are_the_written_out_layers(attn, n_layer, layers):
    """layer_counts() (what the cache accounting and match_mha_params read) and the blocks built:
    the partial period at the end counted from the pattern's start."""
    cfg = tiny(attn, n_layer=n_layer)
    assert cfg.layouts == layers and cfg.layer_counts() == dict(Counter(layers))
    built = [('linear' if block.attn.__class__.__name__ == 'LinearAttention' else 'softmax')
             for block in GPT(cfg).transformer.h]
    assert built == ['linear' if a in LINEAR_RULES else 'softmax' for a in layers]


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
@pytest.mark.parametrize('attn, n_layer, layers', STACKS)
def test_cache_bytes_of_a_stack_that_does_not_divide(attn, n_layer, layers, dtype):
    """The live cache, the formula and the README's table written out per layer agree (a wrong count
    of the partial period would make the formula disagree with the cache actually kept)."""
    model = make_model(attn, dtype=dtype, n_layer=n_layer)
    cache = model.init_cache(2)
    for T in (3, 17):
        model(torch.randint(0, 40, (2, T - len(cache))), cache=cache)
        want = sum(table_layer_elements(a, T) * (4 if a in LINEAR_RULES else dtype.itemsize)
                   for a in layers)
        assert cache.nbytes == 2 * want and model.config.cache_bytes(T, dtype) == want
        assert model.config.cache_elements(T) == sum(table_layer_elements(a, T) for a in layers)


@pytest.mark.parametrize('attn, n_layer, layers', STACKS)
def test_match_mha_params_of_a_stack_that_does_not_divide(attn, n_layer, layers):
    """match_mha_params widens the MLP by the attention weights each layer lacks against MHA's: the
    model's count is MHA's up to the MLP width's rounding (n_layer units of 2 n_embd at most),
    closer than without matching."""
    mha = num_params(tiny('mha', n_layer=n_layer, n_head=4, n_embd=32))
    matched, plain = (num_params(tiny(attn, n_layer=n_layer, match_mha_params=m))
                      for m in (True, False))
    assert abs(matched - mha) <= n_layer * 32 < abs(plain - mha)
    assert num_params(tiny(attn, n_layer=n_layer, match_mha_params=True)) == sum(
        p.numel() for p in GPT(tiny(attn, n_layer=n_layer, match_mha_params=True)).parameters())


class Seen:
    """The rope table and position each block's attention is called with."""

    def __init__(self, model):
        self.calls = []
        for i, block in enumerate(model.transformer.h):
            note = lambda m, args, i=i: self.calls.append((i, args[1], args[2]))
            block.attn.register_forward_pre_hook(note)


@pytest.mark.parametrize('attn, n_layer, layers', STACKS)
def test_the_softmax_layers_get_rope_at_their_positions_whatever_the_first_layer(attn, n_layer,
                                                                                  layers):
    """Whether the first layer is linear or softmax, each softmax layer is given RoPE's table of the
    tokens' true positions: 0..T-1 in a prefill, then T, T+1 at decode (computed here from
    rope_table itself)."""
    model = make_model(attn, n_layer=n_layer)
    seen, cache = Seen(model), model.init_cache(1)
    d = model.config.rope_head_dim if 'mla' in attn else model.config.head_dim
    for start, L in ((0, 7), (7, 1), (8, 1)):
        seen.calls.clear()
        model(torch.randint(0, 40, (1, L)), cache=cache)
        want = rope_table(d, torch.arange(start, start + L), model.config.rope_base)
        for i, rope, pos in seen.calls:
            if layers[i] not in LINEAR_RULES:
                assert pos == start and rope is not None and torch.equal(rope, want), (i, layers[i])
        assert len(seen.calls) == n_layer
    # learned positions: no rotation anywhere
    learned = make_model(attn, n_layer=n_layer, pos_emb='learned')
    seen = Seen(learned)
    learned(torch.randint(0, 40, (1, 5)))
    assert all(rope is None for _, rope, _ in seen.calls)


def test_a_hybrid_is_refused_by_conversion_either_way():
    """Conversion mean-pools an MHA checkpoint's K/V heads: a hybrid source is refused (its linear
    layers have no K/V heads to pool); train.py refuses a hybrid target (convert.py's check, tested
    in test_convert)."""
    model = make_model('gated_deltanet*3+gqa', n_layer=6)
    with pytest.raises(ValueError, match="this one is 'gated_deltanet\\*3\\+gqa'"):
        pool_kv_heads(model.state_dict(), model.config, 1)
