"""train.py end to end on tiny models: every layout learns, resume continues, W&B offline read-back,
metrics.jsonl, and DDP with 2 CPU processes."""
import json
import math
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import ROOT

TINY = ['config/cpu.py', '--n_layer=2', '--n_head=4', '--n_embd=64', '--block_size=32', '--batch_size=8',
        '--eval_iters=5', '--log_interval=5', '--learning_rate=3e-3', '--warmup_iters=5']


def train(tmp_path, data_dir, *args, env=None, launcher=(sys.executable,), base=TINY):
    r = subprocess.run([*launcher, 'train.py', *base, f'--out_dir={tmp_path}', f'--data_dir={data_dir}', *args],
                       cwd=ROOT, capture_output=True, text=True, timeout=300, env=environ(env))
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def interrupted(out_dir, data_dir, *args, sig=signal.SIGINT, launcher=(sys.executable,), base=TINY):
    """train.py started, signalled once it has logged a few training rows, and waited for; (stdout, stderr)."""
    p = subprocess.Popen([*launcher, 'train.py', *base, f'--out_dir={out_dir}', f'--data_dir={data_dir}',
                          '--max_iters=100000', *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log, deadline = os.path.join(out_dir, 'metrics.jsonl'), time.time() + 60
    while not os.path.exists(log) or sum(1 for line in open(log) if 'batch_loss' in line) < 3:
        assert time.time() < deadline and p.poll() is None, p.stderr.read() if p.poll() is not None else 'slow'
        time.sleep(0.1)
    p.send_signal(sig)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130, err  # interrupted: saved, but not a finished run
    return out, err


def environ(changes):
    env = {**os.environ, **(changes or {})}
    return {k: v for k, v in env.items() if v is not None}  # None removes a variable


def metrics(out_dir):
    with open(os.path.join(out_dir, 'metrics.jsonl')) as f:
        return [json.loads(line) for line in f]


@pytest.mark.parametrize('attn', ['mha', 'gqa', 'mqa', 'mla', 'linear'])
def test_30_iterations_per_layout_loss_falls(tmp_path, char_data, attn):
    r = train(tmp_path, char_data, f'--attn={attn}', '--max_iters=30', '--eval_interval=15', '--sample_every_eval=True')
    samples = re.findall(r"^sample:\n(.*?)\n---$", r.stdout, re.M | re.S)  # sampled, cached, 200 characters each
    assert len(samples) == 3 and all(len(s) == 200 for s in samples), r.stdout
    if attn == 'gqa':  # the last one is what sample.py samples from the saved weights with seed + iteration
        s = subprocess.run([sys.executable, 'sample.py', f'--out_dir={tmp_path}', f'--seed={1337 + 30}', '--num_samples=1',
                            '--max_new_tokens=200', '--device=cpu', '--dtype=float32'], cwd=ROOT, capture_output=True,
                           text=True, timeout=120)
        assert s.stdout == '\n' + samples[-1] + '\n', (s.stdout, s.stderr)
    evals = [m for m in metrics(tmp_path) if 'val/loss' in m]
    assert [m['iter'] for m in evals] == [0, 15, 30]
    assert evals[-1]['val/loss'] < evals[0]['val/loss'] - 0.5
    assert evals[-1]['train/loss'] < evals[0]['train/loss'] - 0.5
    ckpt = torch.load(tmp_path / 'ckpt.pt', weights_only=True)
    assert ckpt['model_args']['attn'] == attn and ckpt['iter_num'] == 30
    opt = ckpt['optimizer']  # nanoGPT's AdamW groups: weights of 2 dims or more decay, biases and norms do not
    decay, nodecay = opt['param_groups']
    assert (decay['weight_decay'], nodecay['weight_decay']) == (0.1, 0.0) and decay['params'] and nodecay['params']
    assert all(opt['state'][i]['exp_avg'].dim() >= 2 for i in decay['params'])
    assert all(opt['state'][i]['exp_avg'].dim() < 2 for i in nodecay['params'])
    cfg = ckpt['model_args']
    expected = {'mha': 2 * 2 * 4 * 16, 'gqa': 2 * 2 * 2 * 16, 'mqa': 2 * 2 * 1 * 16, 'mla': (64 + 8) * 2}  # MLA at d_c = 4 head_dim, d_R = head_dim / 2
    if attn in expected:  # bytes per token at fp32, from the table
        assert evals[0]['cache_bytes_per_token'] == expected[attn] * 4
    else:
        assert evals[0]['cache_bytes_per_token'] == 2 * 4 * 16 * 17 * 4 / cfg['block_size']


def test_bfloat16_on_cpu_trains_in_bfloat16(tmp_path, char_data):
    """--dtype=bfloat16 on CPU runs under autocast (it silently trained float32 while logging a 16-bit cache)."""
    runs = {d: train(tmp_path / d, char_data, '--max_iters=3', '--eval_interval=3', f'--dtype={d}')
            for d in ('float32', 'bfloat16')}
    cache = {d: int(re.search(r"cache ([\d,]+) bytes/token", r.stdout).group(1).replace(',', '')) for d, r in runs.items()}
    assert cache['float32'] == 2 * cache['bfloat16'] > 0
    losses = {d: [m['val/loss'] for m in metrics(tmp_path / d) if 'val/loss' in m] for d in runs}
    assert all(map(math.isfinite, losses['bfloat16'])) and losses['bfloat16'] != losses['float32']


def test_resume_continues_from_the_saved_iteration(tmp_path, char_data):
    """40 iterations in one go == 20, stop, resume, 20 more: same weights, same logged losses (CPU)."""
    common = ['--eval_interval=10', '--always_save_checkpoint=True', '--dropout=0.1']  # dropout draws RNG
    straight, split = tmp_path / 'straight', tmp_path / 'split'
    train(straight, char_data, '--max_iters=40', *common)
    train(split, char_data, '--max_iters=20', *common)
    assert torch.load(split / 'ckpt.pt', weights_only=True)['iter_num'] == 20
    first = metrics(split)
    r = train(split, char_data, '--max_iters=40', '--init_from=resume', *common)
    assert 'step 20:' in r.stdout and 'step 0:' not in r.stdout
    assert f"resuming from {split / 'ckpt.pt'} at iteration 20; changed: max_iters 20 -> 40\n" in r.stdout  # said
    resumed = metrics(split)[len(first) - 1:]  # the iter-20 eval row is dropped on resume, then logged again
    assert resumed[0]['iter'] == 20 and resumed[-1]['iter'] == 40
    losses = lambda rows: [(m['iter'], m.get('train/batch_loss'), m.get('val/loss')) for m in rows]
    assert losses(metrics(split)) == losses(metrics(straight))  # one log, as if never stopped: no row twice
    a, b = (torch.load(d / 'ckpt.pt', weights_only=True) for d in (straight, split))
    assert a['iter_num'] == b['iter_num'] == 40
    assert all(torch.equal(a['model'][k], b['model'][k]) for k in a['model'])


def test_resume_may_change_the_chunk_size(tmp_path, char_data):
    """chunk_size and linear_kernels are how a linear layout computes, not what it learns: a resume may change them, and
    the spelling of the stack ('gated_deltanet*1' is 'gated_deltanet'), not the stack."""
    train(tmp_path, char_data, '--attn=gated_deltanet', '--max_iters=4', '--eval_interval=2', '--chunk_size=4')
    r = train(tmp_path, char_data, '--attn=gated_deltanet', '--max_iters=6', '--eval_interval=2', '--chunk_size=3',
              '--linear_kernels=torch', '--init_from=resume')  # nor which kernels run it
    assert 'resuming from' in r.stdout and metrics(tmp_path)[-1]['iter'] == 6
    assert "changed: chunk_size 4 -> 3, linear_kernels 'fla' -> 'torch', max_iters 4 -> 6\n" in r.stdout  # all said
    r = subprocess.run([sys.executable, 'train.py', *TINY, f'--out_dir={tmp_path}', f'--data_dir={char_data}',
                        '--attn=gated_deltanet', '--max_iters=8', '--conv_size=2', '--init_from=resume'],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "is another model (--conv_size=4 in it)" in r.stderr  # the conv's width is a weight
    r = train(tmp_path, char_data, '--attn=gated_deltanet*1', '--max_iters=8', '--eval_interval=2', '--init_from=resume')
    assert 'resuming from' in r.stdout and metrics(tmp_path)[-1]['iter'] == 8  # the same stack, spelled otherwise
    r = subprocess.run([sys.executable, 'train.py', *TINY, f'--out_dir={tmp_path}', f'--data_dir={char_data}',
                        '--attn=gated_deltanet+mha', '--max_iters=10', '--init_from=resume'],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "is another model (--attn=gated_deltanet*1 in it)" in r.stderr  # as last saved
    r = subprocess.run([sys.executable, 'train.py', *TINY, f'--out_dir={tmp_path}', f'--data_dir={char_data}',
                        '--conv_size=2', '--max_iters=10', '--init_from=resume'],  # no --attn: mha's has no conv
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and r.stderr.count('\n') == 1 and r.stderr.startswith("error: GPTConfig.conv_size=2 is inv")
    assert "ckpt.pt is another model (--attn=gated_deltanet*1, --conv_size=4 in it): add those" in r.stderr, r.stderr


def wandb_records(run_dir, *flags):
    r = subprocess.run([sys.executable, '-m', 'wandb', 'leet', 'inspect', '--json', *flags, str(run_dir)],
                       capture_output=True, text=True, timeout=120)
    if flags:  # --summary: one indented object
        return [json.loads(r.stdout)]
    return [json.loads(line) for line in r.stdout.splitlines() if line.startswith('{')]


def test_wandb_offline_run_read_back(tmp_path, char_data):
    """An offline run where W&B looks (./wandb, here $WANDB_DIR), read back: history == metrics.jsonl, the resolved
    model and parameter count in the config, constants in the summary, a table of samples, the checkpoint as an
    artifact; a resume continues the same W&B run."""
    # no credentials (no key, no ~/.netrc) and no mode given: train.py must pick offline by itself
    env = {'WANDB_MODE': None, 'WANDB_API_KEY': None, 'HOME': str(tmp_path), 'WANDB_SILENT': 'true',
           'WANDB_DIR': str(tmp_path)}
    out = tmp_path / 'out'
    r = train(out, char_data, '--attn=mqa', '--max_iters=10', '--eval_interval=5', '--wandb_log=True',
              '--wandb_run_name=smoke', '--wandb_log_checkpoint=True', env=env)
    runs = [d for d in os.listdir(tmp_path / 'wandb') if d.startswith('offline-run-')]  # offline, not online
    assert len(runs) == 1 and f"W&B run mqa-smoke (offline) in {os.path.relpath(tmp_path / 'wandb' / runs[0], ROOT)}; " \
        f"upload it later with: wandb sync" in r.stdout, r.stdout
    records = wandb_records(tmp_path / 'wandb' / runs[0])
    history = [row['history']['item'] for row in records if row.get('type') == 'history']
    for key in ('iter', 'train/loss', 'val/loss', 'lr', 'tokens_per_sec', 'train/batch_loss', 'ms_per_iter'):
        assert key in set().union(*history), key
    assert [h['iter'] for h in history if 'val/loss' in h] == [0, 5, 10]
    steps = [m for m in metrics(out) if 'train/batch_loss' in m]  # no MFU on a CPU: an A100's peak means nothing there
    assert steps and not any('mfu' in m for m in steps) and not any('mfu' in h for h in history)
    assert [h['val/loss'] for h in history if 'val/loss' in h] == \
        [m['val/loss'] for m in metrics(out) if 'val/loss' in m]  # the same rows as metrics.jsonl
    assert not any('cache_bytes_per_token' in h for h in history)  # a constant: in the summary
    assert [h['iter'] for h in history if 'samples._type' in h] == [0, 5, 10]  # a table of samples at each eval
    artifacts = [row['artifact'] for row in records if row.get('type') == 'artifact']
    assert [c['path'] for a in artifacts for c in a['manifest']['contents']][-1] == 'ckpt.pt'
    summary = wandb_records(tmp_path / 'wandb' / runs[0], '--summary')[0]
    ckpt = torch.load(out / 'ckpt.pt', weights_only=True)
    assert summary['name'] == 'mqa-smoke' and summary['config']['attn'] == 'mqa'
    assert summary['config']['model']['n_kv_head'] == 1 and 'n_kv_head' not in summary['config']  # resolved, once
    assert summary['config']['params'] == summary['summary']['params'] > 0 and summary['config']['tokens_per_iter'] == 256
    assert summary['summary']['best_val_loss'] == ckpt['best_val_loss'] == min(m['val/loss'] for m in metrics(out) if 'val/loss' in m)
    assert summary['summary']['cache_bytes_per_token'] == 2 * 2 * 1 * 16 * 4
    train(out, char_data, '--attn=mqa', '--max_iters=12', '--eval_interval=5', '--wandb_log=True',
          '--wandb_run_name=smoke', '--init_from=resume', env=env)  # the same W&B run, continued
    again = sorted(d for d in os.listdir(tmp_path / 'wandb') if d.startswith('offline-run-'))
    assert len(again) == 2 and {d.rsplit('-', 1)[1] for d in again} == {ckpt['wandb_id']}


def test_ddp_two_cpu_processes(tmp_path, char_data):
    r = train(tmp_path, char_data, '--attn=gqa', '--max_iters=6', '--eval_interval=3', '--gradient_accumulation_steps=2',
              '--always_save_checkpoint=True',
              launcher=(sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2'))
    digests = dict(re.findall(r"rank (\d): weights sha256 ([0-9a-f]{16})", r.stdout))
    assert set(digests) == {'0', '1'} and digests['0'] == digests['1'], r.stdout + r.stderr
    assert r.stdout.count('step 3:') == 1, r.stdout  # only rank 0 evaluates and logs
    assert 'Warning' not in r.stderr, r.stderr  # (DDP's broadcast_buffers is deprecated)
    evals = [m['iter'] for m in metrics(tmp_path) if 'val/loss' in m]
    assert evals == [0, 3, 6]
    assert sorted(os.listdir(tmp_path)) == ['ckpt.pt', 'metrics.jsonl', 'train.lock'], r.stdout + r.stderr
    ckpt = torch.load(tmp_path / 'ckpt.pt', weights_only=True)
    assert ckpt['iter_num'] == 6


@pytest.mark.slow
def test_ddp_refusal_by_rank_0_is_one_line_on_every_rank(tmp_path, char_data):
    """Rank 0 alone locks out_dir: when it refuses, rank 1's barrier fails, and says so in one line too."""
    import fcntl
    with open(tmp_path / 'train.lock', 'a') as lock:  # another run holds out_dir
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        r = subprocess.run([sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2',
                            'train.py', *TINY, f'--out_dir={tmp_path}', f'--data_dir={char_data}',
                            '--gradient_accumulation_steps=2'], cwd=ROOT, capture_output=True, text=True, timeout=300,
                           env=environ(None))
    assert r.returncode != 0 and 'is in use by another train.py run' in r.stderr, r.stderr
    assert re.search(r"^error: rank 1: \w+Error: .*its own error says why\)$", r.stderr, re.M), r.stderr
    assert '[rank1]' not in r.stderr, r.stderr  # (torchrun's launcher still prints its own report)


@pytest.mark.slow
def test_ddp_resume_is_bit_exact(tmp_path, char_data):
    """2 CPU processes: 8 iterations in one go == 4, stop, resume, 4 more (weights and logged losses)."""
    ddp = (sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2')
    common = ['--attn=gqa', '--eval_interval=4', '--always_save_checkpoint=True', '--dropout=0.1',
              '--gradient_accumulation_steps=2', '--log_interval=1']
    straight, split = tmp_path / 'straight', tmp_path / 'split'
    train(straight, char_data, '--max_iters=8', *common, launcher=ddp)
    train(split, char_data, '--max_iters=4', *common, launcher=ddp)
    r = train(split, char_data, '--max_iters=8', '--init_from=resume', *common, launcher=ddp)
    digests = dict(re.findall(r"rank (\d): weights sha256 ([0-9a-f]{16})", r.stdout))
    assert set(digests) == {'0', '1'} and digests['0'] == digests['1'], r.stdout  # both ranks end equal
    losses = lambda d: [(m['iter'], m.get('train/batch_loss'), m.get('val/loss')) for m in metrics(d)]
    assert losses(split) == losses(straight)  # every logged loss, equal to the bit, once, in order
    a, b = (torch.load(d / 'ckpt.pt', weights_only=True) for d in (straight, split))
    assert a['iter_num'] == b['iter_num'] == 8
    assert all(torch.equal(a['model'][k], b['model'][k]) for k in a['model'])


def test_unknown_dataset(tmp_path):
    r = subprocess.run([sys.executable, 'train.py', 'config/cpu.py', '--dataset=nope', f'--out_dir={tmp_path}'],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 2 and "dataset='nope' is unknown" in r.stderr and 'Traceback' not in r.stderr
