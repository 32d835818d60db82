"""sample.py end to end on a tiny checkpoint trained here: both cache modes, --compare, streaming,
prompt errors, top-k / top-p, a BPE (tiktoken) checkpoint, and the newest ./out*/ checkpoint found
(broken checkpoints: test_checkpoint.py)."""
import os
import re
import shutil
import time
import warnings

import pytest
import torch

from conftest import ROOT, SHAKESPEARE, one_line, run, train
from run.checkpoint import read_checkpoint


@pytest.fixture(scope='module')
def ckpt_dir(tmp_path_factory, char_data):
    out = tmp_path_factory.mktemp('sample_ckpt')
    train(out, char_data, '--attn=mla', '--max_iters=40', '--eval_interval=20')
    return str(out)


def sample(ckpt_dir, *args, env=None):
    r = run('sample.py', f'--out_dir={ckpt_dir}', '--max_new_tokens=60', *args, env=env,
            timeout=300)
    assert r.returncode == 0, r.stderr
    return r.stdout


def table(out):
    """--compare's table: {row: value}."""
    rows = (line.split(' | ', 1) for line in out.splitlines() if ' | ' in line)
    return {k.strip(): v for k, v in rows}


def test_cached_and_uncached_give_the_same_text(ckpt_dir):
    for args in (['--temperature=0'], ['--temperature=1.0', '--top_k=10', '--seed=7']):
        a = sample(ckpt_dir, '--num_samples=3', '--use_cache=True', *args)
        b = sample(ckpt_dir, '--num_samples=3', '--use_cache=False', *args)
        assert a == b and a.count('---------------') == 3
    seeded = [sample(ckpt_dir, '--num_samples=2', f'--seed={seed}') for seed in (1, 2)]
    assert seeded[0] != seeded[1]


def test_a_model_trained_with_dropout_samples_without_it(tmp_path, char_data):
    """Greedy, every sample of one prompt is the same text: dropout left on (train mode) would draw
    another mask for each."""
    train(tmp_path, char_data, '--max_iters=4', '--eval_interval=4', '--dropout=0.5')
    out = sample(str(tmp_path), '--temperature=0', '--num_samples=3')
    texts = out.split('---------------\n')
    assert len(texts) == 4 and texts[0] == texts[1] == texts[2], texts


def test_compare_table(ckpt_dir):
    out = sample(ckpt_dir, '--compare', '--num_samples=2', '--max_new_tokens=80', '--start=ROMEO:')
    rows = table(out)
    assert rows['layout'] == 'mla' and rows['tokens identical'] == 'yes'
    # a warm-up, then 3 rounds taking turns: the median and the spread
    for way in ('with', 'without'):
        m = re.fullmatch(r"([\d,.]+)  \(3 rounds: ([\d,.]+) to ([\d,.]+)\)",
                         rows[f'tokens/s {way} cache'])
        low, median, high = (float(m[i].replace(',', '')) for i in (2, 1, 3))
        assert 0 < low <= median <= high
    assert float(rows['speedup (medians)'].rstrip('x')) > 0
    # why fewer than generated
    assert "the cache holds" in out and "past block_size=32 the window slides" in out
    assert rows['cache bytes / token: measured'] == rows['cache bytes / token: formula']
    # the window policy, replayed: block 32, slides keep the last 16 tokens
    n, start = len('ROMEO:'), 0
    for _ in range(80):
        if n - start > 32:
            start = n - 16
        n += 1
    held = [k for k in rows if k.startswith('cache bytes at the end')]
    # the live cache, not a refill
    assert held == [f'cache bytes at the end ({n - 1 - start} tokens x 2 samples)']


@pytest.mark.parametrize('attn, n_layer', [('gated_deltanet+gqa', 2), ('deltanet*2+gqa', 4)])
def test_compare_on_a_hybrid(tmp_path, char_data, attn, n_layer):
    """A hybrid's cache is per layer (a state and the conv's last inputs for gated_deltanet, K/V for
    gqa): --compare gives the same tokens both ways, and the live cache's bytes are the formula's;
    also for a pattern that does not divide n_layer (deltanet, deltanet, gqa, deltanet)."""
    train(tmp_path, char_data, f'--attn={attn}', f'--n_layer={n_layer}', '--n_kv_head=2',
          '--max_iters=10', '--eval_interval=10')
    rows = table(sample(str(tmp_path), '--compare', '--num_samples=2', '--max_new_tokens=40',
                        '--temperature=0.8'))
    assert rows['layout'] == attn and rows['tokens identical'] == 'yes'
    assert rows['cache bytes / token: formula'] == \
        rows['cache bytes / token: measured'] + '  (incl. the fixed state / tokens)'


def test_dtype_reaches_the_weights_and_the_cache(ckpt_dir):
    """--dtype=bfloat16 runs the model and its cache in 16 bits (on CPU too): half the cache
    bytes."""
    tables = [table(sample(ckpt_dir, '--compare', '--num_samples=1', '--max_new_tokens=20',
                           f'--dtype={dtype}', '--device=cpu'))
              for dtype in ('float32', 'bfloat16')]
    assert [t['device / dtype'] for t in tables] == ['cpu / float32', 'cpu / bfloat16']
    per_token = [float(t['cache bytes / token: measured'].replace(',', '')) for t in tables]
    assert per_token[1] * 2 == per_token[0] and tables[1]['tokens identical'] == 'yes'


def test_defaults_to_cuda_where_available(ckpt_dir):
    """With CUDA reported available, sample.py picks it (bfloat16 where supported) unless told
    otherwise; this machine has no CUDA, so loading then fails in one line, naming it."""
    fake = ("import sys, runpy, torch; torch.cuda.is_available = lambda: True; "
            "torch.cuda.is_bf16_supported = lambda: True; sys.argv = ['sample.py'] + sys.argv[1:]; "
            "runpy.run_path('sample.py', run_name='__main__')")
    args = ['-c', fake, f'--out_dir={ckpt_dir}', '--max_new_tokens=5', '--compare',
            '--num_samples=1']
    r = run(*args, timeout=300)
    assert r.returncode != 0 and 'Traceback' not in r.stderr, r.stderr
    assert 'cuda' in r.stderr.lower(), r.stderr
    r = run(*args, '--device=cpu', '--dtype=float32', timeout=300)
    assert r.returncode == 0 and 'cpu / float32' in r.stdout, r.stderr


def test_streaming_one_sample_and_file_prompt(ckpt_dir, tmp_path):
    prompt = tmp_path / 'p.txt'
    prompt.write_text('KING:\n')
    greedy = sample(ckpt_dir, f'--start=FILE:{prompt}', '--num_samples=1', '--temperature=0')
    assert greedy.startswith('KING:\n') and len(greedy) == len('KING:\n') + 60 + 1
    batch = sample(ckpt_dir, '--start=KING:\n', '--num_samples=2', '--temperature=0')
    # the same text, streamed or not
    assert batch.split('---------------')[0].strip('\n') == greedy.strip('\n')


def test_top_p_tiny_is_greedy_and_top_k_one_is_greedy(ckpt_dir):
    greedy = sample(ckpt_dir, '--temperature=0', '--num_samples=2')
    # (ours: here)
    ours = sample(ckpt_dir, '--temperature=0', '--num_samples=2', '--linear_kernels=torch')
    assert ours == greedy
    assert sample(ckpt_dir, '--temperature=1.0', '--top_p=1e-9', '--num_samples=2') == greedy
    assert sample(ckpt_dir, '--temperature=1.0', '--top_k=1', '--num_samples=2') == greedy


TEMPERATURE = "must be 0 (greedy) or in [1e-6, 1e6]"
SAMPLE_REFUSALS = [  # (sample.py's flags, what it says)
    (['--start=héllo ☃'], "the prompt has characters outside the vocabulary: 'é☃' ('\\xe9', "
                          "'\\u2603')"),
    (['--start='], "the prompt is empty"),
    (['--start=FILE:{tmp}/latin1.txt'], "is not UTF-8 text (byte 10)"),
    (['--start=FILE:/no/such'], "cannot read the prompt file '/no/such'"),
    # not all read
    (['--start=FILE:/dev/zero'], "the prompt file '/dev/zero' holds more than 67,108,864 bytes"),
    (['--max_new_tokens=-1'], "max_new_tokens=-1 must be >= 0"),
    (['--compare', '--max_new_tokens=0'], "max_new_tokens=0 must be >= 1 with --compare"),
    (['--top_k=0'], "top_k=0 must be >= 1"),
    (['--top_p=0'], "top_p=0.0 must be in (0, 1]"),
    (['--top_p=1.5'], "top_p=1.5 must be in (0, 1]"),
    (['--num_samples=0'], "num_samples=0 must be >= 1"),
    (['--num_samples=1000000000'], "num_samples=1000000000: the weights, caches and activations "
                                   "need at least"),
    (['--compare', '--use_cache=False'], "use_cache=False must be True with --compare (it runs "
                                         "both ways)"),
    (['--temperature=-1'], f"temperature=-1.0 {TEMPERATURE}"),
    (['--temperature=1e300'], f"temperature=1e+300 {TEMPERATURE}"),  # logits / it: 0 or nan
    (['--temperature=1e-300'], f"temperature=1e-300 {TEMPERATURE}"),
    (['--seed=99999999999999999999999'], "seed=99999999999999999999999 must be in [0, 2**62)"),
    (['--device=tpu'], "device='tpu' should be cpu, cuda or cuda:N"),
    (['--device=foo'], "device='foo' should be cpu, cuda or cuda:N"),
    (['--device=cuda'], "CUDA is not available here"),
    (['--linear_kernels=triton'], "linear_kernels='triton' must be 'fla' or 'torch'"),
    (['--out_dir={ckpt}/ckpt.pt'], "is a file: give the folder that holds it, --out_dir={ckpt}"),
]


@pytest.mark.parametrize('args,message', SAMPLE_REFUSALS)
def test_bad_input_is_one_line(ckpt_dir, tmp_path, args, message):
    (tmp_path / 'latin1.txt').write_bytes('ROMEO: caf\u00e9'.encode('latin-1'))
    before = open(os.path.join(ckpt_dir, 'ckpt.pt'), 'rb').read()
    paths = lambda s: s.format(tmp=tmp_path, ckpt=ckpt_dir)
    r = run('sample.py', f'--out_dir={ckpt_dir}', *map(paths, args), timeout=300)
    assert paths(message) in one_line(r)
    assert open(os.path.join(ckpt_dir, 'ckpt.pt'), 'rb').read() == before


def test_sample_sizes_a_checkpoint_before_building_it(tmp_path, trained):
    ckpt = torch.load(trained / 'ckpt.pt', weights_only=True)
    # the file stays small; the model it asks for does not fit anywhere
    ckpt['model_args']['n_layer'] = 10 ** 6
    torch.save(ckpt, tmp_path / 'ckpt.pt')
    t0 = time.time()
    err = one_line(run('sample.py', f'--out_dir={tmp_path}', '--num_samples=1', timeout=60))
    assert "model (1000000 layers, n_embd 64) and num_samples=1: the weights, caches and " \
           "activations need at least" in err and time.time() - t0 < 30


# tiktoken finds encodings in its tiktoken_ext namespace: the tests' small encoding, registered
PLUGIN = """
from conftest import small_gpt2_like_encoding
def small_encoding_kwargs():
    e = small_gpt2_like_encoding()
    return dict(name=e.name, pat_str=e._pat_str, mergeable_ranks=e._mergeable_ranks,
                special_tokens={})
ENCODING_CONSTRUCTORS = {'test-bpe': small_encoding_kwargs}
"""


def test_bpe_checkpoint(tmp_path):
    """A tiktoken checkpoint end to end, offline: the test's small encoding is registered with
    tiktoken through its tiktoken_ext plugin namespace, as a real encoding would be."""
    plugin = tmp_path / 'plugin'
    (plugin / 'tiktoken_ext').mkdir(parents=True)
    (plugin / 'tiktoken_ext' / 'test_bpe_plugin.py').write_text(PLUGIN)
    env = {'PYTHONPATH': os.pathsep.join([str(plugin), os.path.join(ROOT, 'tests'), ROOT])}
    data = tmp_path / 'bpe'
    r = run('-c', f"import tiktoken; from data.shakespeare.prepare import prepare; "
                  f"prepare({str(data)!r}, {SHAKESPEARE!r}, enc=tiktoken.get_encoding('test-bpe'))",
            env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    out = tmp_path / 'out'
    train(out, data, '--dataset=shakespeare', '--max_iters=10', '--eval_interval=10', env=env)
    text = sample(str(out), '--start=the king', '--compare', '--num_samples=1',
                  '--max_new_tokens=20', env=env)
    assert 'tokens identical | yes' in ' '.join(text.split())


def sample_here(folder, *args):
    """sample.py as typed in folder: no --out_dir, the newest checkpoint of ./out*/."""
    return run(os.path.join(ROOT, 'sample.py'), *args, cwd=folder, timeout=300)


def test_sample_as_typed_finds_the_newest_checkpoint(tmp_path, ckpt_dir):
    """`python sample.py --use_cache` and `--compare` with no other flag: the newest checkpoint of
    ./out*/."""
    for name in ('out-older', 'out-newer'):
        shutil.copytree(ckpt_dir, tmp_path / name)
    os.utime(tmp_path / 'out-older' / 'ckpt.pt', (1, 1))
    picked = re.escape(f"sampling {os.path.join('out-newer', 'ckpt.pt')}: ") + \
        r"mla, trained on \S+ \(65 tokens\), iteration 40, val loss \d\.\d{4}, " \
        r"saved [\dms.]+( s)? ago"
    rounds = ['warm-up', 'round 1 of 3', 'round 2 of 3', 'round 3 of 3']
    for args in (['--use_cache'], ['--compare']):
        r = sample_here(tmp_path, *args, '--max_new_tokens=12')
        # which checkpoint; --compare: then a line per run, never silent
        said = r.stderr.strip().splitlines()
        assert r.returncode == 0 and re.fullmatch(picked, said[0]), r.stderr  # what was picked
        # each run: how long it took
        lines = [re.sub(r': [\d.]+ s$', '', line) for line in said[1:]]
        if args == ['--use_cache']:
            assert lines == ["generating 10 samples of 12 tokens (printed when all are done)"]
        else:  # each round both ways, in an order of their own (bench.py's take_turns)
            in_turns = [line for i in range(0, len(lines), 2) for line in sorted(lines[i:i + 2])]
            assert in_turns == [f"--compare: {when}, {w} the cache" for when in rounds
                                for w in ('with', 'without')]
    assert 'tokens identical' in r.stdout
    # an interrupted run left only last.pt: sampled too
    os.remove(tmp_path / 'out-newer' / 'ckpt.pt')
    shutil.copy(tmp_path / 'out-older' / 'ckpt.pt', tmp_path / 'out-newer' / 'last.pt')
    said = sample_here(tmp_path, '--max_new_tokens=3').stderr.strip()
    assert said.startswith(f"sampling {os.path.join('out-newer', 'last.pt')}: ")
    shutil.rmtree(tmp_path / 'out-older'), shutil.rmtree(tmp_path / 'out-newer')
    r = sample_here(tmp_path)
    said = 'error: no checkpoint (ckpt.pt or last.pt) in out nor any ./out*/'
    assert r.returncode == 2 and r.stderr.startswith(said)


def test_a_changed_pickle_protocol_is_one_line_without_torchs_warning(tmp_path, ckpt_dir,
                                                                       monkeypatch):
    """A changed pickle protocol byte makes torch.load warn (two lines) before the CRC check fails:
    the user sees our one line only, for the checkpoint asked for and for another ./out*/ one
    looked into. A warning from a load that succeeds is still shown."""
    good = open(os.path.join(ckpt_dir, 'ckpt.pt'), 'rb').read()
    at = good.find(b'\x80\x02')  # the pickle's PROTO opcode and its protocol, 2
    # out-good the newer: picked, out-bad looked into for its data
    for name in ('out-bad', 'out-good'):
        os.mkdir(tmp_path / name)
        changed = name == 'out-bad'
        protocol = good[:at + 1] + bytes([7]) * changed + good[at + 1 + changed:]
        (tmp_path / name / 'ckpt.pt').write_bytes(protocol)
    os.utime(tmp_path / 'out-bad' / 'ckpt.pt', (1, 1))
    with pytest.warns(UserWarning, match='pickle protocol 7'):  # what the check keeps back
        torch.load(tmp_path / 'out-bad' / 'ckpt.pt', weights_only=True)
    r = run('sample.py', f"--out_dir={tmp_path / 'out-bad'}", '--max_new_tokens=2', timeout=300)
    assert r.returncode == 2 and 'corrupted' in r.stderr, r.stderr
    assert len(r.stderr.splitlines()) == 1, r.stderr
    r = sample_here(tmp_path, '--max_new_tokens=2', '--num_samples=1')
    assert r.returncode == 0 and 'out-good' in r.stderr and 'Warning' not in r.stderr, r.stderr
    load = torch.load
    monkeypatch.setattr(torch, 'load',
                        lambda *a, **k: (warnings.warn('a load that succeeds'), load(*a, **k))[1])
    with pytest.warns(UserWarning, match='a load that succeeds'):
        read_checkpoint(os.path.join(ckpt_dir, 'ckpt.pt'))


def test_sample_as_typed_passes_over_out_folders_it_cannot_use(tmp_path, ckpt_dir):
    """sample.py with no --out_dir picks the newest checkpoint of ./out*/: a broken link, a link
    loop or a folder named ckpt.pt in another out*/ folder is passed over (it raised, or hid the
    good one), and a picked checkpoint without meta is still described (its vocabulary's size
    formatted with ',': a traceback)."""
    good = tmp_path / 'out-good' / 'ckpt.pt'
    shutil.copytree(ckpt_dir, tmp_path / 'out-good')
    os.utime(good, (1, 1))  # the oldest of them all
    for name in ('out-broken', 'out-loop', 'out-folder'):
        os.mkdir(tmp_path / name)
    os.symlink(tmp_path / 'nowhere', tmp_path / 'out-broken' / 'ckpt.pt')
    os.symlink(tmp_path / 'out-loop' / 'ckpt.pt', tmp_path / 'out-loop' / 'ckpt.pt')
    os.mkdir(tmp_path / 'out-folder' / 'ckpt.pt')
    r = sample_here(tmp_path, '--max_new_tokens=2', '--num_samples=1')
    said = f"sampling {os.path.join('out-good', 'ckpt.pt')}: mla, "
    assert r.returncode == 0 and r.stderr.startswith(said), r.stderr
    state = torch.load(good, weights_only=True)
    del state['meta']
    torch.save(state, good)
    r = sample_here(tmp_path, '--max_new_tokens=2', '--num_samples=1')
    # said what it picked, then why it cannot sample it
    assert r.returncode == 2 and " (? tokens), iteration 40" in r.stderr.splitlines()[0], r.stderr
    assert r.stderr.splitlines()[1:] == [
        f"error: cannot load checkpoint {os.path.join('out-good', 'ckpt.pt')}: ValueError: meta "
        f"has no vocab_size in [1, 65536] (token ids are uint16)"]
