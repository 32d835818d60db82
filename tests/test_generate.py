"""generate(): with the cache == without it, greedy and sampled, inside and past block_size."""
import pytest
import torch

from conftest import make_model, full_logits
from ops.sampling import sample, stream


@pytest.mark.parametrize('new_tokens', [20, 90])  # 4 + 90 runs far past block_size = 32
def test_greedy_with_and_without_cache_identical(attn, new_tokens):
    model = make_model(attn)
    prompt = torch.randint(0, 40, (2, 4))
    a = model.generate(prompt, new_tokens, temperature=0, use_cache=True)
    b = model.generate(prompt, new_tokens, temperature=0, use_cache=False)
    cache = model.init_cache(2, static=True)
    static = torch.cat([prompt, *stream(model, prompt, new_tokens, temperature=0, cache=cache)], 1)
    assert a.shape == (2, 4 + new_tokens)
    assert torch.equal(a, b) and torch.equal(static, b)


def test_sampling_same_seed_same_tokens(attn):
    model = make_model(attn)
    prompt = torch.randint(0, 40, (3, 5))
    hot = dict(temperature=4.0, top_k=20, top_p=0.95)
    runs = []
    for use_cache in (True, False):
        torch.manual_seed(123)
        runs.append(model.generate(prompt, 60, **hot, use_cache=use_cache))
    assert torch.equal(*runs)
    torch.manual_seed(124)
    assert not torch.equal(runs[0], model.generate(prompt, 60, **hot))


@pytest.mark.parametrize('pos_emb', ['rope', 'learned'])
def test_window_policy_past_block_size(attn, pos_emb):
    """The documented policy, written out independently: the model conditions on a window that
    starts at max(0, prompt - block_size); when the window would exceed block_size it jumps so
    that its last block_size // 2 tokens remain, and positions restart at 0."""
    model = make_model(attn, pos_emb=pos_emb)
    bs = model.config.block_size
    idx = torch.randint(0, 40, (1, 40))  # a prompt longer than block_size is cropped
    out = model.generate(idx, 70, temperature=0)
    seq, start = idx, idx.size(1) - bs
    for _ in range(70):
        if seq.size(1) - start > bs:
            start = seq.size(1) - bs // 2
        nxt = full_logits(model, seq[:, start:])[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], 1)
    assert torch.equal(out, seq)


def test_sample_top_k_top_p():
    torch.manual_seed(0)
    logits = torch.randn(8, 50)
    greedy = logits.argmax(-1, keepdim=True)
    assert torch.equal(sample(logits, temperature=0), greedy)
    assert torch.equal(sample(logits, top_k=1), greedy)
    assert torch.equal(sample(logits, top_p=1e-6), greedy)
    # 0 in float32: the top token is still kept
    assert torch.equal(sample(logits, top_p=1e-300), greedy)
    draws = torch.cat([sample(logits, top_k=3) for _ in range(200)], 1)
    top3 = logits.topk(3).indices
    assert all(set(draws[i].tolist()) <= set(top3[i].tolist()) for i in range(8))
    assert any(len(set(draws[i].tolist())) > 1 for i in range(8))  # it does sample
    # nucleus: the kept set is the smallest prefix of sorted tokens whose probability reaches top_p
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    draws = {sample(p, top_p=0.79).item() for _ in range(300)}
    assert draws == {0, 1}


def test_generate_refuses_a_sampling_setting_it_would_misread():
    """A temperature below 0 would sample the least likely tokens first, one below 1e-6 or above 1e6
    makes logits / temperature inf or 0 (nan probabilities); top_k 0 or 2.5 and a top_p outside (0,
    1] keep nothing or fail in torch; a negative max_new_tokens returned the prompt; a 1-D prompt
    failed on its size: each refused at once."""
    model = make_model('mha').eval()
    idx = torch.zeros(1, 3, dtype=torch.long)
    said = r"need max_new_tokens >= 0, temperature 0 or in \[1e-6, 1e6\], an integ"
    for bad in (dict(temperature=-1.0), dict(temperature=1e-40), dict(temperature=1e300),
                dict(temperature=float('nan')), dict(top_k=0), dict(top_k=2.5), dict(top_p=0.0),
                dict(top_p=1.5), dict(max_new_tokens=-1)):
        with pytest.raises(ValueError, match=said):
            model.generate(idx, **{'max_new_tokens': 2, **bad})
    for bad in (dict(max_new_tokens=None), dict(max_new_tokens=1e3), dict(temperature=None),
                dict(top_p='0.9'), dict(top_k=True)):  # wrong types: refused, not a TypeError
        with pytest.raises(ValueError, match=said):
            model.generate(idx, **{'max_new_tokens': 2, **bad})
    for prompt in (idx[0], idx[:, :0], [[1, 2]]):
        with pytest.raises(ValueError, match=r"empty prompt, or not a tensor \(B, T\)"):
            model.generate(prompt, 2)
    vocab = model.config.vocab_size
    for ids, said in ((idx.float(), "must hold token ids"), (idx + vocab, rf"in \[0, {vocab}\)"),
                      (idx - 1, rf"in \[0, {vocab}\), .* holds -1 to -1")):
        with pytest.raises(ValueError, match=said):  # (another tokenizer's ids: not an IndexError)
            model.generate(ids, 2)
    # stream() checks at the call, not at the first token; and a cache made for another batch
    with pytest.raises(ValueError, match=r"the cache holds \d+ layers of batch \{2\}"):
        stream(model, idx, 2, cache=model.init_cache(2))
    assert model.generate(idx, 2, temperature=1e-6, top_k=1, top_p=1.0).shape == (1, 5)


def test_generate_limits(attn):
    """An empty prompt is refused; a batch of 0 is nothing to do, with or without the cache; 0 new
    tokens return the prompt."""
    model = make_model(attn)
    with pytest.raises(ValueError, match='empty prompt'):
        model.generate(torch.zeros(1, 0, dtype=torch.long), 5)
    for use_cache in (True, False):
        empty = model.generate(torch.zeros(0, 3, dtype=torch.long), 5, use_cache=use_cache)
        assert empty.shape == (0, 8)
    assert model.generate(torch.zeros(2, 3, dtype=torch.long), 0).shape == (2, 3)


# (the other linear rules share gated_deltanet's code path)
@pytest.mark.parametrize('attn', ['mha', 'gqa', 'mla', 'linear', 'gated_deltanet',
                                  'gated_deltanet+gqa'])
def test_traces_as_one_graph_per_path(attn):
    """torch.compile(fullgraph=True) captures training, prefill, decode and the uncached window
    without a graph break (which would raise) and within the recompile limit: what `bench.py decode
    --compile` and `compile=True` rely on. backend='eager' traces without generating code, so this
    runs in seconds."""
    torch._dynamo.reset()
    model = make_model(attn)
    compiled = torch.compile(model, fullgraph=True, backend='eager')
    idx = torch.randint(0, 40, (2, 12))
    logits, loss = compiled(idx, idx)
    torch.testing.assert_close(loss, model(idx, idx)[1], rtol=0, atol=0)
    model.eval()
    with torch.inference_mode(), torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        cache, ref = model.init_cache(2), model.init_cache(2)
        # prefill, decode, a chunk, decode
        for pos, L in ((0, 5), (5, 1), (6, 1), (7, 1), (8, 3), (11, 1)):
            torch.testing.assert_close(compiled(idx[:, pos:pos + L], cache=cache)[0],
                                       model(idx[:, pos:pos + L], cache=ref)[0], rtol=0, atol=0)
        for T in (4, 7, 9):  # the uncached window at several lengths
            torch.testing.assert_close(compiled(idx[:, :T])[0], model(idx[:, :T])[0], rtol=0,
                                       atol=0)
    torch._dynamo.reset()


def test_in_place_compile_reaches_generation():
    """sample.py --compile: model.compile() in place, since generate() calls self(...) and a
    torch.compile(model) wrapper is never reached from there (nothing would be compiled)."""
    from torch._dynamo.utils import counters
    model = make_model('gqa').eval()
    prompt = torch.randint(0, 40, (1, 4))
    eager = model.generate(prompt, 6, temperature=0)
    torch._dynamo.reset()
    counters.clear()
    wrapped = torch.compile(model, backend='eager')
    assert torch.equal(wrapped.generate(prompt, 6, temperature=0), eager)
    assert not counters['stats']['unique_graphs']
    model.compile(backend='eager', fullgraph=True)
    assert torch.equal(model.generate(prompt, 6, temperature=0), eager)
    assert counters['stats']['unique_graphs'] > 0
    torch._dynamo.reset()
    # a 1-token prompt (sample.py's newline) into a static cache: its prefill is a decode step's
    # graph
    counters.clear()
    list(stream(model, prompt[:, :1], 6, temperature=0, cache=model.init_cache(1, static=True)))
    # (2 when the prompt was not an inference tensor as the tokens are)
    assert counters['stats']['unique_graphs'] == 1
    torch._dynamo.reset()


@pytest.mark.parametrize('backend', ['FLASH_ATTENTION', 'MATH'])
def test_decode_tokens_do_not_depend_on_the_sdpa_backend(attn, backend, monkeypatch):
    """Greedy tokens, cached and not, are the same whether SDPA runs its fused kernel or the math
    one, in prefill (the caller's choice, math where the fused kernel can't: MLA's training path has
    d_k != d_v) and in decode (attend's DECODE_BACKENDS)."""
    from ops import softmax
    from torch.nn.attention import SDPBackend, sdpa_kernel
    m = make_model(attn, dtype=torch.float32)
    prompt = torch.randint(0, 40, (2, 4), generator=torch.Generator().manual_seed(0))
    reference = m.generate(prompt, 40, temperature=0, use_cache=False)  # default backends, no cache
    monkeypatch.setattr(softmax, 'DECODE_BACKENDS', [getattr(SDPBackend, backend)])
    with sdpa_kernel([getattr(SDPBackend, backend), SDPBackend.MATH]):
        assert torch.equal(m.generate(prompt, 40, temperature=0, use_cache=True), reference)
        assert torch.equal(m.generate(prompt, 40, temperature=0, use_cache=False), reference)


def test_a_static_cache_decodes_every_position_with_one_graph(attn):
    """sample.py --compile / bench.py decode --compile: with static=True the position is a tensor
    and the shapes never change, so one compiled graph (on CUDA one CUDA graph) serves every decode
    step, past block_size too; with the default cache each position would be a new graph
    (dynamic=False)."""
    torch._dynamo.reset()
    graphs = []
    # a backend that runs the traced graph as is and notes whether it decodes (idx (1, 1))
    def count(gm, inputs):
        decode = lambda t: torch.is_tensor(t) and t.dtype == torch.long and t.shape == (1, 1)
        graphs.append(any(map(decode, inputs)))
        return gm.forward
    model = make_model(attn).eval()
    prompt = torch.randint(0, 40, (1, 4))
    expected = model.generate(prompt, 50, temperature=0, use_cache=False)
    model.compile(backend=count, fullgraph=True, dynamic=False)
    cache = model.init_cache(1, static=True)
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        out = torch.cat([prompt, *stream(model, prompt, 50, temperature=0, cache=cache)], 1)
    assert torch.equal(out, expected)  # 4 + 50 tokens: the window slid past block_size = 32
    # one decode graph for all ~50 positions (prefills: the prompt, slid windows)
    assert graphs.count(True) == 1
    torch._dynamo.reset()
