"""train.py end to end on tiny models: every layout learns, bfloat16 on a CPU, metrics.jsonl, and
DDP with 2 CPU processes (resume: test_resume.py; W&B: test_wandb.py)."""
import fcntl
import math
import os
import re

import pytest
import torch

from conftest import DDP, TINY_TRAIN, metrics, run, train
from run.optim import cosine_lr

# bytes per token at fp32, from the table: K and V per layer and head, or MLA's d_c 4 * head_dim
# and d_R head_dim / 2
CACHE_BYTES = {'mha': 2 * 2 * 4 * 16 * 4, 'gqa': 2 * 2 * 2 * 16 * 4, 'mqa': 2 * 2 * 1 * 16 * 4,
               'mla': (64 + 8) * 2 * 4}


@pytest.mark.parametrize('attn', ['mha', 'gqa', 'mqa', 'mla', 'linear'])
def test_30_iterations_per_layout_loss_falls(tmp_path, char_data, attn):
    r = train(tmp_path, char_data, f'--attn={attn}', '--max_iters=30', '--eval_interval=15',
              '--sample_every_eval=True')
    # sampled at each evaluation, cached, 200 characters each
    samples = re.findall(r"^sample:\n(.*?)\n---$", r.stdout, re.M | re.S)
    assert len(samples) == 3 and all(len(s) == 200 for s in samples), r.stdout
    if attn == 'gqa':  # the last one is what sample.py samples from the saved weights
        s = run('sample.py', f'--out_dir={tmp_path}', f'--seed={1337 + 30}', '--num_samples=1',
                '--max_new_tokens=200', '--device=cpu', '--dtype=float32')
        assert s.stdout == '\n' + samples[-1] + '\n', (s.stdout, s.stderr)
    evals = [m for m in metrics(tmp_path) if 'val/loss' in m]
    assert [m['iter'] for m in evals] == [0, 15, 30]
    assert evals[-1]['val/loss'] < evals[0]['val/loss'] - 0.5
    assert evals[-1]['train/loss'] < evals[0]['train/loss'] - 0.5
    ckpt = torch.load(tmp_path / 'ckpt.pt', weights_only=True)
    assert ckpt['model_args']['attn'] == attn and ckpt['iter_num'] == 30
    # nanoGPT's AdamW groups: weights of 2 dims or more decay, biases and norms do not
    opt = ckpt['optimizer']
    decay, nodecay = opt['param_groups']
    assert (decay['weight_decay'], nodecay['weight_decay']) == (0.1, 0.0)
    assert decay['params'] and nodecay['params']
    assert all(opt['state'][i]['exp_avg'].dim() >= 2 for i in decay['params'])
    assert all(opt['state'][i]['exp_avg'].dim() < 2 for i in nodecay['params'])
    block_size = ckpt['model_args']['block_size']
    linear_state = 2 * 4 * 16 * 17 * 4 / block_size  # per token, over a full block
    assert evals[0]['cache_bytes_per_token'] == CACHE_BYTES.get(attn, linear_state)


def test_bfloat16_on_cpu_trains_in_bfloat16(tmp_path, char_data):
    """--dtype=bfloat16 on CPU runs under autocast (it silently trained float32 while logging a
    16-bit cache)."""
    runs = {d: train(tmp_path / d, char_data, '--max_iters=3', '--eval_interval=3', f'--dtype={d}')
            for d in ('float32', 'bfloat16')}
    cache = {d: int(re.search(r"cache ([\d,]+) bytes/token", r.stdout)[1].replace(',', ''))
             for d, r in runs.items()}
    assert cache['float32'] == 2 * cache['bfloat16'] > 0
    val = {d: [m['val/loss'] for m in metrics(tmp_path / d) if 'val/loss' in m] for d in runs}
    assert all(map(math.isfinite, val['bfloat16'])) and val['bfloat16'] != val['float32']


def test_the_logged_loss_is_a_micro_batchs_whatever_the_accumulation(tmp_path, char_data):
    """With gradient_accumulation_steps=4 in one process, the logged batch loss is a micro-batch's
    loss, not the quarter of it that is backpropagated: at iteration 0, close to the evaluated
    train loss of the same (initial) weights."""
    train(tmp_path, char_data, '--max_iters=1', '--eval_interval=1', '--log_interval=1',
          '--gradient_accumulation_steps=4')
    at_0 = {k: v for m in metrics(tmp_path) if m['iter'] == 0 for k, v in m.items()}
    assert abs(at_0['train/batch_loss'] / at_0['train/loss'] - 1) < 0.2, at_0


def test_the_learning_rate_decays_to_min_lr_and_stays_there():
    """After its warmup the rate never rises: down to min_lr at lr_decay_iters, then min_lr (the
    cosine, read past its end, climbs back to the peak)."""
    peak, min_lr, warmup, decay = 1e-3, 1e-4, 10, 100
    lrs = [cosine_lr(it, peak, warmup, decay, min_lr) for it in range(3 * decay)]
    assert all(a >= b for a, b in zip(lrs[warmup:], lrs[warmup + 1:]))
    assert lrs[decay:] == [min_lr] * (2 * decay) and lrs[decay - 1] > min_lr


def test_ddp_two_cpu_processes(tmp_path, char_data):
    r = train(tmp_path, char_data, '--attn=gqa', '--max_iters=6', '--eval_interval=3',
              '--gradient_accumulation_steps=2', '--always_save_checkpoint=True', launcher=DDP)
    digests = dict(re.findall(r"rank (\d): weights sha256 ([0-9a-f]{16})", r.stdout))
    assert set(digests) == {'0', '1'} and digests['0'] == digests['1'], r.stdout + r.stderr
    assert r.stdout.count('step 3:') == 1, r.stdout  # only rank 0 evaluates and logs
    assert 'Warning' not in r.stderr, r.stderr  # (DDP's broadcast_buffers is deprecated)
    assert [m['iter'] for m in metrics(tmp_path) if 'val/loss' in m] == [0, 3, 6]
    files = sorted(os.listdir(tmp_path))
    assert files == ['ckpt.pt', 'metrics.jsonl', 'train.lock'], r.stdout + r.stderr
    assert torch.load(tmp_path / 'ckpt.pt', weights_only=True)['iter_num'] == 6


@pytest.mark.slow
def test_ddp_refusal_by_rank_0_is_one_line_on_every_rank(tmp_path, char_data):
    """Rank 0 alone locks out_dir: when it refuses, rank 1's barrier fails, and says so in one
    line too."""
    with open(tmp_path / 'train.lock', 'a') as lock:  # another run holds out_dir
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        r = run(*DDP, 'train.py', *TINY_TRAIN, f'--out_dir={tmp_path}', f'--data_dir={char_data}',
                '--gradient_accumulation_steps=2', timeout=300)
    assert r.returncode != 0 and 'is in use by another train.py run' in r.stderr, r.stderr
    said = r"^error: rank 1: \w+Error: .*its own error says why\)$"
    assert re.search(said, r.stderr, re.M), r.stderr
    assert '[rank1]' not in r.stderr, r.stderr  # (torchrun's launcher still prints its own report)
