"""nanoGPT parts: tied embeddings, GPT-2 init, and that every layout learns (train.py's optimizer:
test_train)."""
import math

import pytest
import torch

from model import GPT, GPTConfig
from conftest import tiny


def test_tied_embeddings_and_gpt2_init(attn):
    torch.manual_seed(0)
    model = GPT(tiny(attn, n_layer=4, n_embd=64))
    assert model.transformer.wte.weight is model.lm_head.weight
    weights = lambda end: torch.cat([p.flatten() for n, p in model.named_parameters()
                                     if n.endswith(end)])
    proj, other = weights('c_proj.weight'), weights('c_fc.weight')
    assert abs(proj.std().item() - 0.02 / math.sqrt(2 * 4)) < 0.001  # scaled residual projections
    assert abs(other.std().item() - 0.02) < 0.001


def test_every_layout_learns_a_batch(attn):
    torch.manual_seed(0)
    model = GPT(tiny(attn))
    x = torch.randint(0, 40, (4, 32))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    losses = []
    for _ in range(60):
        _, loss = model(x[:, :-1], x[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(math.log(40), rel=0.05)  # starts near uniform
    assert losses[-1] < 0.5 * losses[0]
    assert all(p.grad is not None for n, p in model.named_parameters())


@pytest.mark.parametrize('sizes', [dict(), dict(n_layer=4, n_head=4, n_embd=128, block_size=64,
                                                 kv_lora_rank=128, rope_head_dim=16)])
def test_match_mha_params(attn, sizes):
    count = lambda **kw: GPT(GPTConfig(**sizes, **kw)).get_num_params()
    mha = count(attn='mha')
    matched = count(attn=attn, match_mha_params=True)
    assert abs(matched - mha) / mha < 0.005
    # fewer K/V heads, fewer parameters: the MLP must have grown to match
    if attn in ('gqa', 'mqa'):
        assert count(attn=attn) < 0.95 * mha


def test_learned_positions_get_gpt2_init():
    """wpe ~ N(0, 0.02) like every embedding (nn.Embedding's own default is N(0, 1), which would
    swamp the tokens); tied wte is lm_head's N(0, 0.02)."""
    torch.manual_seed(0)
    model = GPT(tiny(pos_emb='learned', block_size=256, n_embd=64))
    wpe = model.transformer.wpe.weight
    assert wpe.shape == (256, 64)
    assert abs(wpe.std().item() - 0.02) < 0.001 and abs(wpe.mean().item()) < 0.001
    assert 'wpe' not in dict(GPT(tiny()).transformer.named_children())  # RoPE: no learned table


def test_dropout_is_off_in_eval(attn):
    """A model with dropout > 0 in eval() computes exactly what the same weights with dropout 0
    compute, with and without the cache; in train() it does not (the check can fail)."""
    torch.manual_seed(0)
    idx = torch.randint(0, 40, (2, 20))
    drop = GPT(tiny(attn, dropout=0.5)).double().eval()
    plain = GPT(tiny(attn)).double().eval()
    plain.load_state_dict(drop.state_dict())
    want = plain(idx, idx)[0]
    assert torch.equal(drop(idx, idx)[0], want)
    cache = drop.init_cache(2)
    cached = torch.cat([drop(idx[:, :7], cache=cache)[0], drop(idx[:, 7:], cache=cache)[0]], 1)
    torch.testing.assert_close(cached, want, atol=1e-12, rtol=0)
    assert not torch.equal(drop.train()(idx, idx)[0], want)


@pytest.mark.parametrize('attn', ['mha', 'gqa', 'mla', 'linear', 'gated_deltanet',
                                  'gated_deltanet*3+gqa', 'deltanet+mla'])
def test_num_params_counts_what_gpt_builds(attn):
    """run.settings.num_params, which sizes a model before it is built (one block per layout), equals the
    built model's count, learned positions, biases and a matched MLP included."""
    from run.settings import num_params
    for extra in ({}, dict(pos_emb='learned', bias=True, match_mha_params=True)):
        cfg = tiny(attn, n_layer=5, **extra)
        assert num_params(cfg) == sum(p.numel() for p in GPT(cfg).parameters()), extra
