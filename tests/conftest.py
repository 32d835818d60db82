"""What the tests share: tiny models, the tiny Shakespeare data, the scripts run as a user runs
them, and the trained runs that tests copy or refuse into. Test modules import from here, never from
each other."""
import hashlib
import json
import os
import resource
import signal
import subprocess
import sys
import time

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from model import GPT, GPTConfig, ATTN_LAYOUTS, LINEAR_RULES  # noqa: E402

# pytest -n 2 on 2 cores: one thread per worker and per subprocess, else OpenMP threads
# oversubscribe the cores and spin (5-30x slower)
if os.environ.get('PYTEST_XDIST_WORKER'):
    os.environ['OMP_NUM_THREADS'] = '1'
    torch.set_num_threads(1)
else:
    torch.set_num_threads(2)

# ---- tiny models ----

# Tiny but complete: 2 layers, 4 query heads (GQA: 2 K/V heads), head dim 8, MLA d_c 16 / d_R 4.
TINY_MODEL = dict(block_size=32, vocab_size=40, n_layer=2, n_head=4, n_embd=32, chunk_size=8)


def tiny(attn='mha', **overrides):
    """TINY_MODEL's GPTConfig for attn; a stack with an MLA layer gets d_c 16 and d_R 4 (the others
    refuse them)."""
    mla = dict(kv_lora_rank=16, rope_head_dim=4) if 'mla' in str(attn) else {}
    return GPTConfig(**{**TINY_MODEL, 'attn': attn, **mla, **overrides})


def make_model(attn, dtype=torch.float64, seed=0, **overrides):
    """A tiny model with fan-in-scaled random weights: GPT-2's 0.02 init makes attention almost
    uniform, which would let a wrong mask or scale slip through the checks."""
    torch.manual_seed(seed)
    model = GPT(tiny(attn, **overrides))
    with torch.no_grad():
        for name, p in model.named_parameters():
            embedding = 'wte' in name or 'wpe' in name
            if p.dim() == 2:
                p.normal_(0.0, 1.0 if embedding else 1.0 / p.size(1) ** 0.5)
            else:
                p.normal_(1.0 if name.endswith('weight') else 0.0, 0.1)
    return model.to(dtype).eval()


def full_logits(model, idx):
    """Logits at every position, computed without a cache (the training path)."""
    return model(idx, targets=idx)[0]


def tol(dtype):
    return dict(atol=1e-10, rtol=0) if dtype == torch.float64 else dict(atol=1e-4, rtol=0)


# per layer: TINY_MODEL's 2 layers, one linear and one softmax
HYBRIDS = ('gated_deltanet+gqa', 'deltanet+mla')
EVERY = (*ATTN_LAYOUTS, *HYBRIDS)


def is_linear(attn):
    """Every layer a fixed-size state, no K/V cache."""
    return all(a in LINEAR_RULES for a in attn.split('+'))


@pytest.fixture(params=EVERY)
def attn(request):
    return request.param


def table_layer_elements(layout, T):
    """One layer of the README's table for TINY_MODEL, written out: K and V of h_kv heads per
    token, MLA's d_c + d_R per token, or a linear layout's fixed state: d_k x d_v per head
    (Katharopoulos one column more, its normalizer z; the others the short conv's last
    conv_size - 1 = 3 inputs of q, k and v, 3 * n_embd each)."""
    heads, dk = TINY_MODEL['n_head'], TINY_MODEL['n_embd'] // TINY_MODEL['n_head']
    h_kv = {'mha': heads, 'gqa': 2, 'mqa': 1}
    if layout in h_kv:
        return 2 * h_kv[layout] * dk * T
    if layout == 'mla':
        return (16 + 4) * T  # d_c + d_R
    if layout == 'linear':
        return heads * dk * (dk + 1)
    return heads * dk * dk + 3 * (3 * heads * dk)


# ---- the data ----

def find_text(root=ROOT):
    """The tiny Shakespeare text wherever a user has it: $SHAKESPEARE_PATH, else where the README's
    first command left it (data/*/input.txt), else ../shared/data/tinyshakespeare/input.txt, else
    downloaded as prepare does."""
    from data.common import ENV, PrepareError, read_text
    candidates = [os.environ.get(ENV), os.path.join(root, 'data', 'shakespeare_char', 'input.txt'),
                  os.path.join(root, 'data', 'shakespeare', 'input.txt'),
                  os.path.join(root, '..', 'shared', 'data', 'tinyshakespeare', 'input.txt')]
    found = next((p for p in candidates if p and os.path.isfile(p)), None)
    if found:
        return found
    try:
        read_text(None, download_to=candidates[1])
    except PrepareError as e:
        return f"(not found: {e})"
    return candidates[1]


SHAKESPEARE = find_text()


@pytest.fixture(scope='session')
def char_data(tmp_path_factory):
    """tiny Shakespeare prepared at the char level once per test session, in a temp folder."""
    assert os.path.isfile(SHAKESPEARE), f"tests need the tiny Shakespeare text {SHAKESPEARE}"
    from data.shakespeare_char.prepare import prepare
    out = tmp_path_factory.mktemp('shakespeare_char')
    prepare(str(out), SHAKESPEARE)
    return str(out)


def small_gpt2_like_encoding():
    """Byte-level BPE with GPT-2's split pattern and three merges: enough to test the pipeline
    offline."""
    import tiktoken
    ranks = {bytes([i]): i for i in range(256)}
    for merge in (b'th', b'the', b' the'):
        ranks[merge] = len(ranks)
    pat = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
    return tiktoken.Encoding(name='test-bpe', pat_str=pat, mergeable_ranks=ranks, special_tokens={})


# ---- the scripts, run as a user runs them ----

# train.py's flags for a tiny CPU run: 2 layers, 64 wide, a few iterations a second
TINY_TRAIN = ['config/cpu.py', '--n_layer=2', '--n_head=4', '--n_embd=64', '--block_size=32',
              '--batch_size=8', '--eval_iters=5', '--log_interval=5', '--learning_rate=3e-3',
              '--warmup_iters=5']
DDP = ('-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2')  # 2 CPU processes


def environ(changes):
    """os.environ with changes; a change to None removes that variable."""
    env = {**os.environ, **(changes or {})}
    return {k: v for k, v in env.items() if v is not None}


def run(*args, cwd=ROOT, limit=None, env=None, timeout=120):
    """python with args, its files size-limited to limit bytes (as a full disk would)."""
    size = (lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))) if limit else None
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, preexec_fn=size, env=environ(env))


def one_line(r, code=2):
    """r's stderr, checked to be one line and no traceback, with exit code code."""
    lines = r.stderr.strip().splitlines()
    assert r.returncode == code and 'Traceback' not in r.stderr and len(lines) == 1, r.stderr
    return r.stderr


def train(out_dir, data_dir, *args, env=None, launcher=(), base=TINY_TRAIN):
    """A train.py run that must succeed (launcher=DDP: under torchrun)."""
    r = run(*launcher, 'train.py', *base, f'--out_dir={out_dir}', f'--data_dir={data_dir}', *args,
            env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def refused(out_dir, data_dir, *args, **kwargs):
    """A TINY_TRAIN run that must be refused in one line, exit 2: that line."""
    return one_line(run('train.py', *TINY_TRAIN, f'--out_dir={out_dir}', f'--data_dir={data_dir}',
                        *args, **kwargs))


def start(*args, **kwargs):
    """python with args, started (stdout and stderr piped, as text unless told otherwise)."""
    pipes = dict(cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.Popen([sys.executable, *args], **{**pipes, **kwargs})


def live_run(out_dir, data_dir, *args):
    """A long TINY_TRAIN run logging every iteration, once it has logged a few."""
    p = start('train.py', *TINY_TRAIN, f'--out_dir={out_dir}', f'--data_dir={data_dir}',
              '--max_iters=100000', '--eval_interval=100000', '--log_interval=1', *args)
    logged = 0
    while logged < 3:
        line = p.stdout.readline()
        assert line, p.stderr.read()
        logged += line.startswith('iter ')
    return p


def interrupted(out_dir, data_dir, *args, sig=signal.SIGINT, base=TINY_TRAIN):
    """train.py started, signalled once it has logged a few training rows, and waited for;
    (stdout, stderr)."""
    p = start('train.py', *base, f'--out_dir={out_dir}', f'--data_dir={data_dir}',
              '--max_iters=100000', *args)
    log, deadline = os.path.join(out_dir, 'metrics.jsonl'), time.time() + 60
    while not os.path.exists(log) or sum(1 for line in open(log) if 'batch_loss' in line) < 3:
        ended = p.poll() is not None
        assert time.time() < deadline and not ended, p.stderr.read() if ended else 'slow'
        time.sleep(0.1)
    p.send_signal(sig)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130, err  # interrupted: saved, but not a finished run
    return out, err


def metrics(out_dir):
    """The rows of out_dir's metrics.jsonl."""
    with open(os.path.join(out_dir, 'metrics.jsonl')) as f:
        return [json.loads(line) for line in f]


def losses(out_dir):
    """Each logged row's (iteration, batch loss, val loss): what a resume logs as if never
    stopped."""
    return [(m['iter'], m.get('train/batch_loss'), m.get('val/loss')) for m in metrics(out_dir)]


def same_weights(a, b):
    """Two checkpoints at the same iteration with the same weights, to the bit."""
    return a['iter_num'] == b['iter_num'] and a['model'].keys() == b['model'].keys() and all(
        torch.equal(a['model'][k], b['model'][k]) for k in a['model'])


def digest(path):
    with open(path, 'rb') as f:
        return hashlib.sha256(f.read()).hexdigest()


def wandb_records(run_dir, *flags):
    """An offline W&B run's records, read back by `wandb leet inspect` (--summary: one object)."""
    r = subprocess.run([sys.executable, '-m', 'wandb', 'leet', 'inspect', '--json', *flags,
                        str(run_dir)], capture_output=True, text=True, timeout=120)
    if flags:
        return [json.loads(r.stdout)]
    return [json.loads(line) for line in r.stdout.splitlines() if line.startswith('{')]


@pytest.fixture(scope='session')
def trained(tmp_path_factory, char_data):
    """A 4-iteration TINY_TRAIN run, saved at every evaluation (2 and 4). The refusal tests run
    into it and check that it stays as it was; the others copy it."""
    out = tmp_path_factory.mktemp('trained')
    train(out, char_data, '--max_iters=4', '--eval_interval=2', '--always_save_checkpoint=True')
    return out


@pytest.fixture(scope='session')
def saved(tmp_path_factory, char_data):
    """A 4-iteration TINY_TRAIN run evaluated once, at 4, and its checkpoint: resume() goes on."""
    out = tmp_path_factory.mktemp('saved')
    train(out, char_data, '--max_iters=4', '--eval_interval=4', '--dropout=0')
    return out, torch.load(out / 'ckpt.pt', weights_only=True)


def resume(out_dir, data_dir, *args):
    """saved's run continued from out_dir's checkpoint to iteration 6."""
    return train(out_dir, data_dir, '--max_iters=6', '--eval_interval=6', '--dropout=0',
                 '--init_from=resume', *args)


def pytest_configure(config):
    config.addinivalue_line('markers', "slow: a long stress test, run by `pytest -m slow tests` "
                                       "(CI runs it too)")


def pytest_collection_modifyitems(config, items):
    if 'slow' not in (config.getoption('markexpr') or ''):  # the default run leaves them out
        for item in items:
            if 'slow' in item.keywords:
                item.add_marker(pytest.mark.skip(reason="slow: run with pytest -m slow tests"))
