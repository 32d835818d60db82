"""Property test: over random small configs of every layout and random token sequences, the cached
forward in random chunks equals the full forward, and greedy generation is identical both ways."""
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from conftest import make_model, full_logits
from model import ATTN_LAYOUTS


@st.composite
def configs(draw):
    attn = draw(st.sampled_from(ATTN_LAYOUTS))
    n_head = draw(st.sampled_from([4, 6] if attn == 'gqa' else [1, 2, 4, 6]))
    head_dim = draw(st.sampled_from([2, 4, 6]))
    cfg = dict(attn=attn, n_head=n_head, n_embd=n_head * head_dim, n_layer=draw(st.integers(1, 2)),
               block_size=draw(st.integers(2, 24)), vocab_size=draw(st.integers(2, 30)),
               pos_emb=draw(st.sampled_from(['rope', 'learned'])), bias=draw(st.booleans()))
    if attn == 'gqa':
        cfg['n_kv_head'] = draw(st.sampled_from([d for d in range(2, n_head) if n_head % d == 0]))
    if attn == 'mla':
        cfg.update(kv_lora_rank=draw(st.integers(1, 12)),
                   rope_head_dim=draw(st.sampled_from([2, 4])),
                   q_lora_rank=draw(st.sampled_from([0, 5])))
    if attn == 'linear':
        cfg['chunk_size'] = draw(st.integers(1, 9))
    return cfg


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=configs(), data=st.data())
def test_cached_chunks_equal_full_forward_and_greedy_agrees(cfg, data):
    attn = cfg.pop('attn')
    model = make_model(attn, seed=data.draw(st.integers(0, 99)), **cfg)
    B = data.draw(st.integers(1, 3))
    T = data.draw(st.integers(1, cfg['block_size']))
    row = st.lists(st.integers(0, cfg['vocab_size'] - 1), min_size=T, max_size=T)
    idx = torch.tensor(data.draw(st.lists(row, min_size=B, max_size=B)))
    cache, out, pos = model.init_cache(B), [], 0
    while pos < T:
        n = data.draw(st.integers(1, T - pos))
        out.append(model(idx[:, pos:pos + n], cache=cache)[0])
        pos += n
    torch.testing.assert_close(torch.cat(out, 1), full_logits(model, idx), atol=1e-9, rtol=0)
    new = data.draw(st.integers(0, 2 * cfg['block_size']))  # past block_size too
    assert torch.equal(model.generate(idx, new, temperature=0, use_cache=True),
                       model.generate(idx, new, temperature=0, use_cache=False))
