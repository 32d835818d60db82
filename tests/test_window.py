"""Sliding windows (ops/window.py): the band against its convention written out, told apart from
the field's off-by-one bugs; the ring's slots; decode past block_size across many wraps, equal to
the full forward; a cache that stops growing; local/global stacks; and the refusals of train.py
and sample.py. (Each windowed layer against the paper's attention: test_reference.py; the cache's
chunk schedules: test_cache.py; GPTConfig's refusals: test_config.py.)"""
from pathlib import Path

import pytest
import torch

from conftest import full_logits, make_model, one_line, refused, run, table_layer_elements, train
from model import GPTConfig
from ops.cache import Cache
from ops.sampling import stream
from ops.window import band, held, slot


def written_out(q_pos, k_pos, window, n_sink):
    """The convention by loops: query i sees key j iff j is filled (>= 0), j <= i, and j is one of
    the W most recent (i - W < j) or a sink (j < n_sink)."""
    return torch.tensor([[j >= 0 and j <= i and (i - window < j or j < n_sink) for j in k_pos]
                         for i in q_pos])


BUGS = {  # each a `sees` with one of the field's window bugs
    "W + 1 keys (FlashAttention's window_size=(W, 0), attention-gym)":
        lambda i, j, W, s: (j >= 0) & (j <= i) & ((i - j <= W) | (j < s)),
    'W - 1 keys': lambda i, j, W, s: (j >= 0) & (j <= i) & ((i - j < W - 1) | (j < s)),
    'sinks seen before they come': lambda i, j, W, s: (j >= 0) & ((j <= i) & (i - j < W) | (j < s)),
    'an empty slot seen': lambda i, j, W, s: (j <= i) & ((i - j < W) | (j < s)),
}
CASES = [(torch.arange(12), torch.arange(12), 4, 0), (torch.arange(12), torch.arange(12), 3, 2),
         (torch.tensor([9]), torch.tensor([0, 1, 6, 7, 8, 9, -1]), 4, 2),  # a ring, one empty
         (torch.arange(5, 8), torch.arange(8), 1, 1)]


def as_written(mask_fn):
    return all(torch.equal(mask_fn(q, k, W, s), written_out(q.tolist(), k.tolist(), W, s))
               for q, k, W, s in CASES)


def test_the_band_is_the_convention_written_out():
    assert as_written(band)
    # W keys, the query's own included: at W = 1 a query sees itself (and the sinks) alone
    assert band(torch.arange(3), torch.arange(3), 1).int().tolist() == [[1, 0, 0], [0, 1, 0],
                                                                          [0, 0, 1]]


@pytest.mark.parametrize('bug', list(BUGS))
def test_the_check_rejects_each_window_bug(bug):
    wrong = BUGS[bug]
    assert not as_written(lambda q, k, W, s: wrong(q[:, None], k[None, :], W, s))


def test_a_slot_holds_the_latest_position_written_to_it():
    """held() against positions 0, 1, ... written into slot() in order (later over earlier)."""
    for window in (1, 2, 5):
        for n_sink in (0, 1, 3):
            slots = [-1] * (n_sink + window)
            for seen in range(1, 30):
                slots[slot(torch.tensor(seen - 1), window, n_sink)] = seen - 1
                assert held(seen, torch.arange(n_sink + window), window, n_sink).tolist() == slots


ENDLESS = [dict(attn='gqa', window=5, n_sink=2), dict(attn='mla@6'),
           dict(attn='gated_deltanet+mqa@4', n_sink=3)]


@pytest.mark.parametrize('static', [False, True], ids=['cache', 'static_cache'])
@pytest.mark.parametrize('variant', ENDLESS, ids=lambda v: '-'.join(f'{k}={x}' for k, x in v.items()))
@torch.no_grad()
def test_decode_past_block_size_across_many_wraps_is_the_full_forward(variant, static):
    """100 tokens, one at a time, through a ring of a few slots (block_size 32: past it, ~20 wraps),
    in float64: the logits of the full forward over the 100 tokens under the same band (positions
    absolute, keys never rotated again). The cache's bytes stop at the window's."""
    model = make_model(**variant)
    assert model.config.endless
    idx = torch.randint(0, 40, (2, 100))
    full = full_logits(model, idx)
    cache = model.init_cache(2, static=static)
    nbytes = []
    for t in range(100):
        torch.testing.assert_close(model(idx[:, t:t + 1], cache=cache)[0][:, 0], full[:, t],
                                   atol=1e-10, rtol=0)
        nbytes.append(cache.nbytes)
    assert nbytes == [2 * model.config.cache_bytes(t, torch.float64) for t in range(1, 101)]
    assert nbytes[20:] == nbytes[-1:] * 80 and nbytes[0] < nbytes[-1]


def test_a_window_changes_no_weight():
    """A window says which pairs are computed, not what is learned: the same parameters with and
    without it, match_mha_params' MLP too (its MHA reference once kept the sinks and lost the
    windows, and refused config/local_global.py --n_sink=4)."""
    from run.settings import num_params
    for windowed, full in ((dict(attn='gqa@16+gqa', n_sink=4), dict(attn='gqa')),
                           (dict(attn='mla', window=16, n_sink=4), dict(attn='mla')),
                           (dict(attn='gated_deltanet+gqa@8', n_sink=2), dict(attn='gated_deltanet+gqa'))):
        assert num_params(GPTConfig(**windowed, match_mha_params=True)) == \
            num_params(GPTConfig(**full, match_mha_params=True))


def test_a_windowed_cache_keeps_n_sink_plus_w_slots_whatever_the_length():
    """The formula (K and V of the n_kv_head heads, for n_sink + W tokens at most) written out, the
    cache's buffers (static ones too) and GPTConfig's accounting."""
    for static in (False, True):
        model = make_model('gqa', window=5, n_sink=2)
        cache = model.init_cache(3, static=static)
        assert {b.size(2) for layer in cache.layers for b in layer.buffers.values()} == {7}
    cfg = make_model('gqa@5+gqa', n_sink=2).config
    for T in (1, 7, 30):  # a windowed layer and a global one
        want = table_layer_elements('gqa', min(T, 7)) + table_layer_elements('gqa', T)
        assert cfg.cache_elements(T) == want


@pytest.mark.parametrize('variant', ENDLESS + [dict(attn='gqa@4+gqa'), dict(attn='mha', window=4, pos_emb='learned')],
                         ids=lambda v: '-'.join(f'{k}={x}' for k, x in v.items()))
def test_generation_past_block_size(variant, monkeypatch):
    """A stack whose softmax layers are all windowed (RoPE) generates past block_size with no
    re-prefill; one with a global layer, or learned positions, slides its window as before. The
    tokens are the same with the cache, without it and with a static cache."""
    model = make_model(**variant)
    resets = []
    reset = Cache.reset
    monkeypatch.setattr(Cache, 'reset', lambda self: resets.append(len(self)) or reset(self))
    prompt = torch.randint(0, 40, (2, 40))  # longer than block_size: an endless model keeps it all
    cached = model.generate(prompt, 60, temperature=0)
    assert (resets == [0]) == model.config.endless  # the prompt's prefill, then none
    static = torch.cat([prompt, *stream(model, prompt, 60, temperature=0,
                                        cache=model.init_cache(2, static=True))], 1)
    assert torch.equal(cached, model.generate(prompt, 60, temperature=0, use_cache=False))
    assert torch.equal(cached, static)


def test_the_retrofits_teacher_forced_logits_are_what_generation_computes():
    """bench.py train's retrofit reads a text with teacher forcing: its logits at every position
    pick the tokens greedy generation picks, for sample.py's jump-and-re-prefill past block_size
    and for a window."""
    from benchmarks.windows import jumping, windowed
    prompt = torch.randint(0, 40, (3, 5))
    for model, logits in ((make_model('mha'), jumping), (make_model('mha', window=12, n_sink=2), windowed)):
        tokens = model.generate(prompt, 80, temperature=0)  # block_size 32: past it
        with torch.no_grad():
            picked = logits(model, tokens[:, :-1]).argmax(-1)
        assert torch.equal(picked[:, 4:], tokens[:, 5:])


@pytest.mark.slow
def test_a_compiled_static_cache_decodes_a_window_past_block_size():
    """sample.py --compile, bench.py decode --compile: the ring's FlexAttention mask, compiled by
    inductor on a CPU (which cannot read a tensor the graph computed: the positions are computed
    inside the mask), gives the tokens of the uncached model, past block_size, in one decode graph."""
    torch._dynamo.reset()
    model = make_model('gqa', window=5, n_sink=2, dtype=torch.float32)
    prompt = torch.randint(0, 40, (1, 4))
    expected = model.generate(prompt, 50, temperature=0, use_cache=False)
    model.compile(fullgraph=True, dynamic=False)
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        tokens = stream(model, prompt, 50, temperature=0, cache=model.init_cache(1, static=True))
        assert torch.equal(torch.cat([prompt, *tokens], 1), expected)
    torch._dynamo.reset()


@pytest.mark.slow
def test_the_bands_cost_compares_one_band_computed_two_ways():
    """bench.py train's table of the band's cost: SDPA's boolean band and FlexAttention's
    compiled one give the same attention (their largest difference is in the table)."""
    from benchmarks.windows import band_cost
    text = band_cost(lengths=(256,), window=64, batch=1, heads=2, d=16, rounds=1)
    cells = [c.strip() for c in text.strip().splitlines()[-1].strip('|').split('|')]
    assert cells[0] == '256' and float(cells[-1]) < 1e-5, text


# --- train.py and sample.py ------------------------------------------------------------------------

@pytest.fixture(scope='module')
def windowed(tmp_path_factory, char_data):
    """A tiny GQA run whose every layer sees 8 keys and 2 sinks (block_size 32)."""
    out = tmp_path_factory.mktemp('windowed')
    train(out, char_data, '--attn=gqa', '--n_kv_head=2', '--window=8', '--n_sink=2',
          '--max_iters=6', '--eval_interval=6')
    return str(out)


def test_sample_compare_runs_past_block_size_with_the_same_tokens(windowed):
    r = run('sample.py', f'--out_dir={windowed}', '--compare', '--num_samples=2',
            '--max_new_tokens=60', '--start=ROMEO:', timeout=300)
    assert r.returncode == 0, r.stderr
    rows = dict(line.split(' | ', 1) for line in r.stdout.splitlines() if ' | ' in line)
    rows = {k.strip(): v for k, v in rows.items()}
    assert rows['tokens identical'] == 'yes' and rows['layout'] == 'gqa, window 8 + 2 sinks'
    assert rows['cache bytes at the end (65 tokens x 2 samples)']  # every token, never refilled
    assert rows['cache bytes / token: measured'] == rows['cache bytes / token: formula']
    assert 'no re-prefill' in r.stdout and 'the window slides' not in r.stdout


def test_a_resume_or_conversion_that_changes_the_window_is_one_line(windowed, trained, char_data):
    """A resume must train the model it saved (its window and sinks); a conversion keeps its
    source's windows: each refused in one line, nothing written."""
    before = sorted((p.name, p.stat().st_mtime_ns) for p in Path(windowed).iterdir())
    for flags, said in ((['--window=4'], "--window=8"), (['--n_sink=0'], "--n_sink=2"),
                        (["--attn=gqa@8+gqa", '--window=0'], "another model")):
        err = refused(windowed, char_data, '--attn=gqa', '--n_kv_head=2', '--window=8', '--n_sink=2',
                      '--init_from=resume', '--max_iters=8', *flags)
        assert said in err, err
    after = sorted((p.name, p.stat().st_mtime_ns) for p in Path(windowed).iterdir())
    assert before == after
    err = refused(str(trained) + '-gqa', char_data, f'--init_from={trained}', '--attn=gqa',
                  '--window=8')
    assert "keeps its shape: drop --window=8 (the checkpoint has 0)" in err, err
    err = refused(str(trained) + '-gqa', char_data, f'--init_from={trained}', "--attn=gqa@8+gqa")
    assert "keeps its windows" in err, err


def test_a_conversion_keeps_the_windows_however_they_are_spelled(tmp_path, char_data):
    """An MHA run with local and global layers converts to each softmax layout spelled per layer
    (MLA too), and one windowed with window= to the same windows spelled with '@'."""
    local_global, every = tmp_path / 'local_global', tmp_path / 'every'
    train(local_global, char_data, '--attn=mha@8+mha', '--max_iters=2', '--eval_interval=2')
    train(every, char_data, '--window=8', '--n_sink=2', '--max_iters=2', '--eval_interval=2')
    for source, attn, windows in [(local_global, 'mla@8+mla', [8, 0]),
                                  (local_global, 'gqa@8+gqa', [8, 0]), (every, 'mqa@8', [8, 8])]:
        out = tmp_path / f"{source.name}-{attn.replace('@', '-').replace('+', '-')}"
        train(out, char_data, f'--init_from={source}', f'--attn={attn}', '--max_iters=2',
              '--eval_interval=2')
        args = torch.load(out / 'ckpt.pt', weights_only=True)['model_args']
        config = GPTConfig(**args)
        assert config.windows[:2] == windows and config.pattern()[0] == attn[:3]
        assert config.n_sink == (2 if source == every else 0)
