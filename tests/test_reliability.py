"""Nothing lost, nothing unsafe: bad input is one line and exit 2 and leaves existing checkpoints
alone; Ctrl-C saves; SIGKILL never leaves a checkpoint that does not load; no pickle anywhere."""
import hashlib
import json
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import ROOT
from test_train import TINY, environ, interrupted, metrics, train


@pytest.fixture(scope='module')
def trained(tmp_path_factory, char_data):
    """A tiny checkpoint (for resume and sample.py) and its fingerprint."""
    out = tmp_path_factory.mktemp('reliability')
    train(out, char_data, '--max_iters=4', '--eval_interval=2', '--always_save_checkpoint=True')
    return out


def digest(path):
    with open(path, 'rb') as f:
        return hashlib.sha256(f.read()).hexdigest()


def broken_data(tmp, char_data, kind):
    d = tmp / f'data-{kind}'
    shutil.copytree(char_data, d)
    meta = json.loads((d / 'meta.json').read_text())
    if kind == 'truncated':
        with open(d / 'val.bin', 'r+b') as f:
            f.truncate(31)
    elif kind == 'nometa':
        os.remove(d / 'meta.json')
    elif kind == 'random':  # random bytes as token ids: most are outside the 65-symbol vocabulary
        (d / 'train.bin').write_bytes(random.Random(0).randbytes(4096))
    else:
        meta = {'{}': {}, '[]': [], 'zero': {**meta, 'vocab_size': 0}, 'huge': {'kind': 'tiktoken', 'encoding': 'gpt2',
                'vocab_size': 10 ** 12}, 'small': {**meta, 'vocab_size': 10,
                'itos': meta['itos'][:10]}}[kind]
        (d / 'meta.json').write_text(json.dumps(meta))
    return d


def broken_checkpoint(tmp, trained, kind):
    """A copy of the trained checkpoint with one thing wrong, in a folder of its own."""
    ckpt = torch.load(trained / 'ckpt.pt', weights_only=True)
    if kind == 'missing':
        ckpt['model'].pop(next(iter(ckpt['model'])))
    elif kind == 'extra':
        ckpt['model']['transformer.extra.weight'] = torch.zeros(3)
    elif kind == 'nooptim':
        del ckpt['optimizer']
    elif kind == 'striter':
        ckpt['iter_num'] = str(ckpt['iter_num'])
    elif kind == 'nokind':
        del ckpt['meta']['kind']
    elif kind == 'shortitos':
        ckpt['meta']['itos'] = ckpt['meta']['itos'][:5]
    elif kind == 'wideitos':  # a token of 2 characters: not a character vocabulary
        ckpt['meta']['itos'] = ['ab'] + ckpt['meta']['itos'][1:]
    d = tmp / f'ckpt-{kind}'
    d.mkdir()
    torch.save(ckpt, d / 'ckpt.pt')
    return d


TRAIN_CASES = [
    (['--learning_rate=0'], "learning_rate=0.0 must be in (0, 1e12]"),
    (['--learning_rate=1e308'], "learning_rate=1e+308 must be in (0, 1e12]"),  # was a traceback from AdamW's step
    (['--batch_size=0'], "batch_size=0 must be >= 1"),
    (['--batch_size=1000000000', '--overwrite=True'], "the weights, optimizer and activations need at least"),
    (['--n_layer=50', '--n_embd=20000', '--n_head=4', '--batch_size=1', '--block_size=8', '--overwrite=True'],
     "M parameters and batch_size=1 x block_size=8: the weights, optimizer and activations need at least"),  # was killed by Linux's OOM
    (['--learning_rate=nan'], "learning_rate=nan should be a finite number"),
    (['--block_size=0'], "GPTConfig.block_size=0 is invalid"),
    (['--n_layer=-2'], "GPTConfig.n_layer=-2 is invalid"),
    (['--n_head=3'], "GPTConfig.n_embd=64 is invalid: must be divisible by n_head=3"),
    (['--max_iters=-1'], "max_iters=-1 must be >= 0"),
    (['--eval_iters=0'], "eval_iters=0 must be >= 1"),
    (['--dropout=1.5'], "GPTConfig.dropout=1.5 is invalid"),
    (['--attn=gqa', '--kv_lora_rank=48'], "GPTConfig.kv_lora_rank=48 is invalid: no layer of attn='gqa' uses it"),  # not ignored
    (['--device=cuda'], "CUDA is not available here"),
    (['--device=foo'], "device='foo' should be cpu, cuda or cuda:N"),
    (['--dataset=nope', '--data_dir='], "dataset='nope' is unknown"),
    (['--data_dir=TRUNCATED'], "val.bin has 31 bytes, an odd number: truncated"),
    (['--data_dir=NOMETA'], "meta.json"),
    (['--data_dir=META{}'], "meta has no vocab_size in [1, 65536]"),
    (['--data_dir=META[]'], "meta has no vocab_size in [1, 65536]"),
    (['--data_dir=METAzero'], "meta has no vocab_size in [1, 65536]"),
    (['--data_dir=METAhuge'], "meta has no vocab_size in [1, 65536] (token ids are uint16)"),
    (['--block_size=2000000'], "train.bin has 1,003,854 tokens, not more than block_size=2000000: lower it"),
    (['--seed=99999999999999999999999'], "seed=99999999999999999999999 must be in [0, 2**62)"),
    (['--learning_rate=1e999'], "learning_rate=inf should be a finite number"),
    (['--eval_only=True'], "eval_only=True would evaluate a new random model, not"),
    (['--init_from=resume', '--out_dir=STRITER'], "no iter_num of the right kind in it"),
    (['--data_dir=RANDOM'], "train.bin holds token id"),  # an IndexError at the first eval before
    (['--data_dir=SMALLVOCAB'], "train.bin holds token id 64, outside meta.json's vocab_size 10"),
    (['--data_dir=AFILE'], "no train.bin in data_dir="),  # a data_dir given is never prepared into: a typo trained
    (['--data_dir=/nonexistent/mien'], "no train.bin in data_dir='/nonexistent/mien': make one (python data/shakespeare_char/prepare.py"),  # on Shakespeare
    (['--attn=mla', '--match_mha_params=True', '--kv_lora_rank=256'], "the MLP would need -"),
    (['--max_iters=2'], "ckpt.pt exists: continue that run with --init_from=resume, replace it with --overwrite=True"),
    (['--overwrite=True', '--wandb_log=True', '--wandb_mode=bogus'], "wandb_mode='bogus' should be online, offline"),
    (['--init_from=resume', '--out_dir=MISSINGKEY'], "Missing key(s) in state_dict"),
    (['--init_from=resume', '--out_dir=EXTRAKEY'], 'Unexpected key(s) in state_dict: "transformer.extra.weight"'),
    (['--init_from=resume', '--out_dir=NOOPTIM'], "no optimizer of the right kind in it: not a checkpoint of train.py"),
    (['--init_from=resume', '--attn=mla'], "is another model (--attn=mha in it); add those settings"),
    (['--init_from=resume', '--attn=gqa'], "is another model (--attn=mha in it); add"),  # not n_kv_head: mha's own
    (['--init_from=resume', '--attn=gqa', '--n_kv_head=1'], "is another model (--attn=mha, --n_kv_head=4 in it)"),
    (['--init_from=resume', '--rope_head_dim=4'], "rope_head_dim=4 is invalid: no layer of attn='mha' uses it"),
    (['--init_from=resume', '--out_dir=CORRUPT'], "ckpt.pt: truncated or corrupted, not a whole torch.save file (5,000 bytes)"),
    (['--init_from=resume', '--learning_rate=1e12', '--grad_clip=0', '--max_iters=200', '--eval_interval=1000'],
     "loss is nan at iteration"),
    (['--out_dir=/proc/forbidden'], "is not writable"),
    (['--init_from=resume', '--max_iters=2'], "is at iteration 4, past max_iters=2: nothing to train"),  # hung before
    (['--init_from=resume', '--out_dir=EMPTY'], "ckpt.pt: truncated or corrupted, not a whole torch.save file (0 bytes)"),
    (['--init_from=resume', '--learning_rate=1e12', '--grad_clip=0', '--max_iters=30', '--eval_interval=1',
      '--always_save_checkpoint=True'], "gave a non-finite loss"),  # a diverged eval is never saved
    (['--init_from=resume', '--learning_rate=1e12', '--grad_clip=0', '--max_iters=30', '--eval_interval=5',
      '--log_interval=1000', '--sample_every_eval=True'], "gave a non-finite loss"),  # stopped before its sample
]


@pytest.mark.parametrize('args,message', TRAIN_CASES, ids=[' '.join(a) for a, _ in TRAIN_CASES])
def test_train_bad_input(tmp_path, char_data, trained, args, message):
    before, log = digest(trained / 'ckpt.pt'), digest(trained / 'metrics.jsonl')
    corrupt = tmp_path / 'corrupt'
    corrupt.mkdir()
    (corrupt / 'ckpt.pt').write_bytes((trained / 'ckpt.pt').read_bytes()[:5000])  # truncated copy
    empty = tmp_path / 'empty'
    empty.mkdir()
    (empty / 'ckpt.pt').write_bytes(b'')
    (tmp_path / 'a-file').write_text('not a folder')
    subst = {'TRUNCATED': lambda: broken_data(tmp_path, char_data, 'truncated'),
             'NOMETA': lambda: broken_data(tmp_path, char_data, 'nometa'), 'CORRUPT': lambda: corrupt,
             'EMPTY': lambda: empty, 'RANDOM': lambda: broken_data(tmp_path, char_data, 'random'),
             'SMALLVOCAB': lambda: broken_data(tmp_path, char_data, 'small'), 'AFILE': lambda: tmp_path / 'a-file',
             **{f'META{k}': lambda k=k: broken_data(tmp_path, char_data, k) for k in ('{}', '[]', 'zero', 'huge')},
             **{f'{k.upper()}KEY': lambda k=k: broken_checkpoint(tmp_path, trained, k) for k in ('missing', 'extra')},
             'NOOPTIM': lambda: broken_checkpoint(tmp_path, trained, 'nooptim'),
             'STRITER': lambda: broken_checkpoint(tmp_path, trained, 'striter')}
    argv = []
    for a in args:
        key, _, value = a.partition('=')
        argv.append(f"{key}={subst[value]()}" if value in subst else a)
    r = subprocess.run([sys.executable, 'train.py', *TINY, f'--out_dir={trained}', f'--data_dir={char_data}', *argv],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert message in r.stderr and 'Traceback' not in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert digest(trained / 'ckpt.pt') == before  # nothing already saved is lost
    if 'loss' not in message:  # (a run that trained and then diverged has logged its rows)
        assert digest(trained / 'metrics.jsonl') == log


def test_an_interrupt_stops_a_long_evaluation_within_seconds(tmp_path, trained, char_data):
    """SIGTERM during a 100000-batch evaluation: dropped at the next batch, nothing written by eval_only."""
    before = digest(trained / 'ckpt.pt')
    p = subprocess.Popen([sys.executable, 'train.py', *TINY, f'--out_dir={trained}', f'--data_dir={char_data}',
                          '--init_from=resume', '--eval_only=True', '--eval_iters=100000'], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    started = ['']  # the start-up's lines up to the evaluation's (start-up is slow on a loaded machine: no fixed sleep)
    while 'evaluating' not in started[-1]:
        started.append(p.stdout.readline())
        assert started[-1], (started, p.stderr.read())
    time.sleep(2)  # well into the evaluation (100000 batches take minutes)
    assert p.poll() is None
    t0 = time.time()
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=60)
    assert time.time() - t0 < 10 and 'step 4:' not in ''.join(started) + out, (out, err)
    assert p.returncode == 130 and err.strip() == "error: interrupted during the evaluation; nothing was written"
    assert digest(trained / 'ckpt.pt') == before


def test_eval_only_resume_evaluates_and_writes_nothing(tmp_path, trained, char_data):
    """--init_from=resume --eval_only=True evaluates the checkpoint and stops: no training, no save."""
    before = digest(trained / 'ckpt.pt')
    r = subprocess.run([sys.executable, 'train.py', *TINY, f'--out_dir={trained}', f'--data_dir={char_data}',
                        '--init_from=resume', '--eval_only=True', '--always_save_checkpoint=True', '--max_iters=2'],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert re.search(r"^step 4: train loss [\d.]+, val loss [\d.]+ \(evaluated in [\d.]+ s\)$", r.stdout, re.M), r.stdout
    assert not re.search(r"^iter \d+/", r.stdout, re.M) and 'saving checkpoint' not in r.stdout
    assert digest(trained / 'ckpt.pt') == before


def test_a_diverged_fresh_run_saves_no_checkpoint(tmp_path, char_data):
    r = subprocess.run([sys.executable, 'train.py', *TINY, f'--out_dir={tmp_path}', f'--data_dir={char_data}',
                        '--learning_rate=1e12', '--grad_clip=0', '--max_iters=30', '--eval_interval=1',
                        '--always_save_checkpoint=True'], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and 'no checkpoint was written' in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / 'ckpt.pt').exists()


SAMPLE_CASES = [  # (prompt and sampling values: tests/test_sample.py)
    (['--compare', '--max_new_tokens=0'], "max_new_tokens=0 must be >= 1 with --compare"),
    (['--device=cuda'], "CUDA is not available here"),
    (['--num_samples=0'], "num_samples=0 must be >= 1"),
    (['--out_dir=CORRUPT'], "cannot load checkpoint"),
    (['--out_dir=EMPTY'], "cannot load checkpoint"),
    (['--out_dir=NOKIND'], "meta's kind None should be 'char' (with itos) or 'tiktoken'"),
    (['--out_dir=SHORTITOS'], "meta's itos should list vocab_size=65 characters"),
    (['--out_dir=WIDEITOS'], "meta's itos should list vocab_size=65 characters (strings of length 1)"),
    (['--start=FILE:LATIN1'], "is not UTF-8 text (byte 10)"),
    (['--device=foo'], "device='foo' should be cpu, cuda or cuda:N"),
    (['--seed=99999999999999999999999'], "seed=99999999999999999999999 must be in [0, 2**62)"),
    (['--temperature=1e-300'], "temperature=1e-300 must be 0 (greedy) or in [1e-6, 1e6]"),
]


@pytest.mark.parametrize('args,message', SAMPLE_CASES, ids=[' '.join(a) for a, _ in SAMPLE_CASES])
def test_sample_bad_input(tmp_path, trained, args, message):
    before = digest(trained / 'ckpt.pt')
    (tmp_path / 'ckpt.pt').write_bytes(b'not a checkpoint at all')
    (tmp_path / 'empty').mkdir()
    (tmp_path / 'empty' / 'ckpt.pt').write_bytes(b'')
    (tmp_path / 'latin1.txt').write_bytes('ROMEO: caf\u00e9'.encode('latin-1'))
    subst = {'CORRUPT': lambda: tmp_path, 'EMPTY': lambda: tmp_path / 'empty', 'LATIN1': lambda: tmp_path / 'latin1.txt',
             'NOKIND': lambda: broken_checkpoint(tmp_path, trained, 'nokind'),
             'SHORTITOS': lambda: broken_checkpoint(tmp_path, trained, 'shortitos'),
             'WIDEITOS': lambda: broken_checkpoint(tmp_path, trained, 'wideitos')}
    argv = [re.sub('|'.join(subst), lambda m: str(subst[m.group(0)]()), a) for a in args]
    r = subprocess.run([sys.executable, 'sample.py', f'--out_dir={trained}', *argv], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and message in r.stderr and 'Traceback' not in r.stderr, r.stderr
    assert digest(trained / 'ckpt.pt') == before


@pytest.mark.parametrize('sig', [signal.SIGINT, signal.SIGTERM], ids=['SIGINT', 'SIGTERM'])
def test_an_interrupt_keeps_the_best_weights_and_resumes_where_it_stopped(tmp_path, char_data, sig):
    """Ctrl-C / SIGTERM: the state goes to last.pt; ckpt.pt keeps the best-val weights, labelled with their own val
    loss; the printed command resumes from last.pt at the interrupted iteration."""
    out, err = interrupted(tmp_path, char_data, '--eval_interval=3', '--eval_iters=2', sig=sig)
    m = re.search(r"^interrupted before iteration (\d+): its state saved to .*last.pt, the best weights kept in .*ckpt.pt; continue with:\n  (.*)$",
                  err, re.M)  # (on stderr, as every stop)
    assert m, err
    best, last = (torch.load(tmp_path / f, weights_only=True) for f in ('ckpt.pt', 'last.pt'))
    assert last['iter_num'] == int(m.group(1)) >= best['iter_num'] and last['val_loss'] is None
    evals = {row['iter']: row['val/loss'] for row in metrics(tmp_path) if 'val/loss' in row}
    assert best['val_loss'] == evals[best['iter_num']] == min(evals.values()) == last['best_val_loss']
    assert (last['iter_num'] > best['iter_num']) == any(not torch.equal(best['model'][k], last['model'][k])
                                                     for k in best['model'])
    if sig == signal.SIGINT:
        return
    before = digest(tmp_path / 'ckpt.pt')
    command = shlex.split(m.group(2))
    assert command[:2] == ['python', 'train.py'] and '--init_from=resume' in command
    it = last['iter_num']
    r = subprocess.run([sys.executable, *command[1:], f'--max_iters={it + 1}', '--log_interval=1'], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    source = 'last.pt' if it > best['iter_num'] else 'ckpt.pt'  # (the interrupt may land on a save: the same state)
    assert r.returncode == 0 and f"resuming from {tmp_path / source} at iteration {it}" in r.stdout, r.stderr
    assert re.search(rf"^iter {it}/{it + 1}: loss", r.stdout, re.M) and not re.search(rf"^iter {it - 1}/", r.stdout, re.M)
    end = {f.name: torch.load(f, weights_only=True) for f in tmp_path.glob('*.pt')}  # the end state is kept: in
    assert max(c['iter_num'] for c in end.values()) == it + 1  # ckpt.pt if its val loss is the best, else last.pt
    ckpt = end['ckpt.pt']  # (an eval at iteration `it` itself may have saved a new best before the end state)
    assert ('last.pt' in end) == (ckpt['iter_num'] != it + 1)
    assert (digest(tmp_path / 'ckpt.pt') != before) == (ckpt['iter_num'] > best['iter_num'])
    evals = {row['iter']: row['val/loss'] for row in metrics(tmp_path) if 'val/loss' in row}
    assert ckpt['val_loss'] == evals[ckpt['iter_num']] == min(evals.values())


@pytest.mark.slow
def test_sigint_at_start_up_is_one_line(tmp_path, char_data):
    """Ctrl-C at moments from start-up into the first iterations: one line, never a traceback; before the
    loop exit 130 and nothing written (an earlier run's log is kept), in it the usual save."""
    before_loop = 0
    for delay in (0.0, 0.5, 1.0, 2.0, 3.5):
        out_dir = tmp_path / str(delay)
        out_dir.mkdir()
        (out_dir / 'metrics.jsonl').write_text('{"iter": 0, "val/loss": 1.5}\n')  # of a run that saved no checkpoint
        p = subprocess.Popen([sys.executable, 'train.py', *TINY, f'--out_dir={out_dir}', f'--data_dir={char_data}',
                              '--max_iters=100000', '--eval_interval=100000'], cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 30  # numpy's library mapped: train.py is past its first lines (the handler)
        while '/numpy/' not in open(f'/proc/{p.pid}/maps').read():
            assert time.time() < deadline and p.poll() is None
            time.sleep(0.01)
        time.sleep(delay)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
        assert 'Traceback' not in err and p.returncode == 130, err
        if 'nothing was written' in err:  # before the loop, or in the first evaluation
            before_loop += 1
            assert re.fullmatch(r"error: interrupted before (training started|the first training step); nothing was "
                                r"written", err.strip()), err
            assert set(os.listdir(out_dir)) == {'metrics.jsonl'}  # (a lock it made is removed again)
            assert (out_dir / 'metrics.jsonl').read_text() == '{"iter": 0, "val/loss": 1.5}\n'
        else:
            assert re.fullmatch(r"interrupted before iteration \d+: its state saved to .*; continue with:\n  .*\n", err), err
    assert before_loop >= 1


@pytest.mark.slow
def test_stress_random_sigkill_and_sigterm(tmp_path, char_data):
    """20+ runs of one training, each stopped at a random moment by SIGKILL or SIGTERM (half each), each resuming the
    last: it saves every iteration, so kills land inside saves. After every stop the newest state loads and never
    goes back; at the end a last resume finishes, and metrics.jsonl is one log: in order, no row twice."""
    rng = random.Random(0)
    args = [sys.executable, 'train.py', *TINY, f'--out_dir={tmp_path}', f'--data_dir={char_data}', '--log_interval=1',
            '--max_iters=100000', '--eval_interval=1', '--eval_iters=1', '--always_save_checkpoint=True']
    log = tmp_path / 'metrics.jsonl'
    resumed_at, mid_save, kinds = [], 0, []
    for attempt in range(40):  # 20 tries, more only until a SIGKILL has landed in a save (4 in 10 do)
        if attempt >= 20 and mid_save:
            break
        resume = ['--init_from=resume'] if list(tmp_path.glob('*.pt')) else []
        rows = len(log.read_text().splitlines()) if resume else 0
        p = subprocess.Popen(args + resume, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=environ(None))
        deadline = time.time() + 60
        while not (log.exists() and len(log.read_text().splitlines()) > rows + 2) and p.poll() is None:
            assert time.time() < deadline
            time.sleep(0.02)  # until it trains; then several saves a second
        time.sleep(rng.uniform(0.0, 0.5))
        sig = rng.choice([signal.SIGKILL, signal.SIGTERM])
        p.send_signal(sig)
        out, err = p.communicate(timeout=60)
        kinds.append(sig)
        if sig == signal.SIGKILL:
            assert p.returncode == -signal.SIGKILL, err  # it was still running: killed, not crashed
            mid_save += bool(list(tmp_path.glob('*.pt.tmp*')))
        else:
            assert p.returncode == 130 and 'Traceback' not in err, err
            assert 'its state saved to' in err or 'nothing was written' in err, (out, err)
        states = [torch.load(f, weights_only=True)['iter_num'] for f in tmp_path.glob('*.pt')]  # every file loads
        resumed_at.append(max(states))
    assert mid_save >= 1 and kinds.count(signal.SIGTERM) >= 5 and kinds.count(signal.SIGKILL) >= 5
    assert len(resumed_at) >= 20 and resumed_at == sorted(resumed_at) and resumed_at[-1] > resumed_at[0]
    end = resumed_at[-1] + 3
    train(tmp_path, char_data, '--init_from=resume', f'--max_iters={end}', '--eval_interval=1', '--eval_iters=1',
          '--log_interval=1', '--always_save_checkpoint=True')
    rows = metrics(tmp_path)  # every line parses
    key = lambda row: (row['iter'], 'val/loss' in row)
    assert [row['iter'] for row in rows] == sorted(row['iter'] for row in rows)  # never going back
    assert len(set(map(key, rows))) == len(rows)  # no row twice
    assert {key(row) for row in rows} == {(i, e) for i in range(end + 1) for e in (True, False)} - {(end, False)}
    assert torch.load(tmp_path / 'ckpt.pt', weights_only=True)['iter_num'] == end


def test_a_second_run_into_a_live_out_dir_is_refused(tmp_path, char_data):
    """Two runs writing one out_dir would race on its files: the second is refused in one line while the first
    lives, and the lock dies with the first (a killed run leaves nothing stuck, nor its temp files)."""
    args = [sys.executable, 'train.py', *TINY, f'--out_dir={tmp_path}', f'--data_dir={char_data}', '--max_iters=100000',
            '--eval_interval=100000']
    first = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while not (tmp_path / 'metrics.jsonl').exists() or (tmp_path / 'metrics.jsonl').stat().st_size < 200:
        assert time.time() < deadline and first.poll() is None
        time.sleep(0.1)
    second = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert second.returncode == 2 and 'is in use by another train.py run' in second.stderr, second.stderr
    assert len(second.stderr.strip().splitlines()) == 1 and first.poll() is None  # the first trains on
    first.kill()
    first.wait()
    (tmp_path / 'ckpt.pt.tmp12345').write_bytes(b'half a checkpoint')  # as a kill inside a save leaves it
    train(tmp_path, char_data, '--max_iters=2')  # the dead run's lock is gone
    assert not list(tmp_path.glob('ckpt.pt.tmp*'))


def test_a_failed_save_is_one_line_and_leaves_the_old_checkpoint(tmp_path, trained, char_data):
    """A write that fails mid-checkpoint (here a 64 KiB file-size limit, as a full disk would): one line,
    exit 2, the previous ckpt.pt intact and no partial temp file left to break the next resume."""
    import resource
    out = tmp_path / 'run'
    shutil.copytree(trained, out)
    before = digest(out / 'ckpt.pt')
    limit = lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))
    r = subprocess.run([sys.executable, 'train.py', *TINY, f'--out_dir={out}', f'--data_dir={char_data}',
                        '--init_from=resume', '--max_iters=8', '--eval_interval=1', '--always_save_checkpoint=True'],
                       cwd=ROOT, capture_output=True, text=True, timeout=120, preexec_fn=limit)
    assert r.returncode == 2 and f"cannot write {out / 'ckpt.pt'}: " in r.stderr, r.stderr
    assert f'ckpt.pt in {out} kept' in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert digest(out / 'ckpt.pt') == before and not list(out.glob('ckpt.pt.tmp*'))


def test_no_pickle_anywhere():
    """Checkpoints are loaded with weights_only=True everywhere; vocabularies are JSON."""
    offenders = []
    for folder, _, files in os.walk(ROOT):
        if any(part.startswith('.') or part in ('results', 'wandb', '__pycache__') for part in
               os.path.relpath(folder, ROOT).split(os.sep)):
            continue
        for name in files:
            if name.endswith('.py') and name != 'test_reliability.py':
                text = open(os.path.join(folder, name), encoding='utf-8').read()
                if re.search(r"^\s*import pickle|pickle\.load|torch\.load\((?![^)]*weights_only=True)", text, re.M):
                    offenders.append(name)
    assert offenders == []


def test_generate_limits(attn):
    from conftest import make_model
    model = make_model(attn)
    with pytest.raises(ValueError, match='empty prompt'):
        model.generate(torch.zeros(1, 0, dtype=torch.long), 5)
    for use_cache in (True, False):  # batch size 0: nothing to do, no error
        assert model.generate(torch.zeros(0, 3, dtype=torch.long), 5, use_cache=use_cache).shape == (0, 8)
    assert model.generate(torch.zeros(2, 3, dtype=torch.long), 0).shape == (2, 3)


def test_overwrite_replaces_a_finished_run(tmp_path, trained, char_data):
    """--overwrite=True: the old checkpoints are removed when the new run starts, and its log starts anew."""
    shutil.copytree(trained, tmp_path / 'run')
    torch.save(torch.load(trained / 'ckpt.pt', weights_only=True), tmp_path / 'run' / 'last.pt')
    r = train(tmp_path / 'run', char_data, '--max_iters=2', '--overwrite=True', '--n_layer=1')
    assert f"removed {tmp_path / 'run' / 'last.pt'} (--overwrite=True)" in r.stdout
    assert sorted(os.listdir(tmp_path / 'run')) == ['ckpt.pt', 'metrics.jsonl', 'train.lock']
    ckpt = torch.load(tmp_path / 'run' / 'ckpt.pt', weights_only=True)
    assert ckpt['iter_num'] == 2 and ckpt['model_args']['n_layer'] == 1
    assert [row['iter'] for row in metrics(tmp_path / 'run') if 'val/loss' in row] == [0, 2]


def test_a_resume_from_last_pt_saves_its_first_evaluation(tmp_path, trained, char_data):
    """An interrupt just before an evaluation leaves last.pt unevaluated: the resumed run's first evaluation is of
    weights ckpt.pt does not hold, so it is saved when it is the best (here always_save_checkpoint)."""
    shutil.copytree(trained, tmp_path / 'run')
    state = torch.load(trained / 'ckpt.pt', weights_only=True)
    torch.save({**state, 'iter_num': 6, 'val_loss': None}, tmp_path / 'run' / 'last.pt')  # as an interrupt at 6 leaves it
    r = train(tmp_path / 'run', char_data, '--init_from=resume', '--max_iters=6', '--always_save_checkpoint=True')
    assert f"resuming from {tmp_path / 'run' / 'last.pt'} at iteration 6" in r.stdout
    assert torch.load(tmp_path / 'run' / 'ckpt.pt', weights_only=True)['iter_num'] == 6, r.stdout
    assert not (tmp_path / 'run' / 'last.pt').exists()  # older than ckpt.pt now


def test_non_finite_weights_are_never_saved_by_an_interrupt(tmp_path, char_data):
    """A step that leaves a weight infinite, then SIGTERM (patched in: AdamW.step): one line, nothing saved."""
    hook = ("import os, runpy, signal, sys, torch\n"
            "step = torch.optim.AdamW.step\n"
            "def broken(self, *a, **k):\n"
            "    out = step(self, *a, **k)\n"
            "    self.param_groups[0]['params'][0].data.fill_(float('inf'))\n"
            "    os.kill(os.getpid(), signal.SIGTERM)\n"
            "    return out\n"
            "torch.optim.AdamW.step = broken\n"
            "sys.argv = ['train.py'] + sys.argv[1:]\n"
            "runpy.run_path('train.py', run_name='__main__')\n")
    r = subprocess.run([sys.executable, '-c', hook, *TINY, f'--out_dir={tmp_path}', f'--data_dir={char_data}',
                        '--max_iters=20'], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip() == ("error: the weights at iteration 1 are not finite: not saved, no "
                                                      "checkpoint was written (try a lower learning_rate)"), r.stderr
    assert not list(tmp_path.glob('*.pt'))
