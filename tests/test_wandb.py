"""W&B: offline without credentials, read back the same as metrics.jsonl; a resumed run is one W&B
run; an early stop leaves none; W&B failing is one line at the start or one warning later."""
import os
import re
import signal
import time

import torch

from conftest import (ROOT, TINY_TRAIN, environ, metrics, refused, run, start, train,
                      wandb_records)

# no credentials (no key, no ~/.netrc) and no mode given: train.py must pick offline by itself
OFFLINE = {'WANDB_MODE': None, 'WANDB_API_KEY': None, 'WANDB_SILENT': 'true'}


def offline(home):
    return {**OFFLINE, 'HOME': str(home), 'WANDB_DIR': str(home)}


def test_wandb_offline_run_read_back(tmp_path, char_data):
    """An offline run where W&B looks (./wandb, here $WANDB_DIR), read back: history ==
    metrics.jsonl, the resolved model and parameter count in the config, constants in the summary,
    a table of samples, the checkpoint as an artifact."""
    out = tmp_path / 'out'
    r = train(out, char_data, '--attn=mqa', '--eval_interval=5', '--wandb_log=True',
              '--wandb_run_name=smoke', '--max_iters=10', '--wandb_log_checkpoint=True',
              env=offline(tmp_path))
    runs = [d for d in os.listdir(tmp_path / 'wandb') if d.startswith('offline-run-')]
    folder = os.path.relpath(tmp_path / 'wandb' / runs[0], ROOT)
    said = f"W&B run mqa-smoke (offline) in {folder}; upload it later with: wandb sync"
    assert len(runs) == 1 and said in r.stdout, r.stdout  # offline, not online
    records = wandb_records(tmp_path / 'wandb' / runs[0])
    history = [row['history']['item'] for row in records if row.get('type') == 'history']
    for key in ('iter', 'train/loss', 'val/loss', 'lr', 'tokens_per_sec', 'train/batch_loss',
                'ms_per_iter'):
        assert key in set().union(*history), key
    evals = [m for m in metrics(out) if 'val/loss' in m]
    assert [h['iter'] for h in history if 'val/loss' in h] == [0, 5, 10]
    # no MFU on a CPU: an A100's peak means nothing there
    steps = [m for m in metrics(out) if 'train/batch_loss' in m]
    assert steps and not any('mfu' in m for m in steps) and not any('mfu' in h for h in history)
    # the same rows as metrics.jsonl
    assert [h['val/loss'] for h in history if 'val/loss' in h] == [m['val/loss'] for m in evals]
    assert not any('cache_bytes_per_token' in h for h in history)  # a constant: in the summary
    # a table of samples at each eval
    assert [h['iter'] for h in history if 'samples._type' in h] == [0, 5, 10]
    artifacts = [row['artifact'] for row in records if row.get('type') == 'artifact']
    assert [c['path'] for a in artifacts for c in a['manifest']['contents']][-1] == 'ckpt.pt'
    summary = wandb_records(tmp_path / 'wandb' / runs[0], '--summary')[0]
    config, constants = summary['config'], summary['summary']
    ckpt = torch.load(out / 'ckpt.pt', weights_only=True)
    assert summary['name'] == 'mqa-smoke' and config['attn'] == 'mqa'
    # resolved, once
    assert config['model']['n_kv_head'] == 1 and 'n_kv_head' not in config
    assert config['params'] == constants['params'] > 0 and config['tokens_per_iter'] == 256
    assert constants['best_val_loss'] == ckpt['best_val_loss'] == min(m['val/loss'] for m in evals)
    assert constants['cache_bytes_per_token'] == 2 * 2 * 1 * 16 * 4


def test_a_resumed_wandb_run_is_one_run(tmp_path, char_data):
    """The same W&B run continued: the id the checkpoint keeps, the same name, the config kept (the
    resume an added key), no step sent twice, the samples table whole; the config holds the model's
    fields that apply to its layout, resolved, once."""
    out, args = tmp_path / 'out', ['--attn=gqa', '--eval_interval=2', '--wandb_log=True']
    train(out, char_data, *args, '--max_iters=4', env=offline(tmp_path))
    time.sleep(1.1)  # a new run name would differ by its time
    for more in (6, 8):  # resumed twice
        train(out, char_data, *args, f'--max_iters={more}', '--init_from=resume',
              env=offline(tmp_path))
    folders = sorted(d for d in os.listdir(tmp_path / 'wandb') if d.startswith('offline-run-'))
    wandb_id = torch.load(out / 'ckpt.pt', weights_only=True)['wandb_id']
    assert len(folders) == 3 and {d.rsplit('-', 1)[1] for d in folders} == {wandb_id}
    first, second, third = [wandb_records(tmp_path / 'wandb' / d, '--summary')[0] for d in folders]
    assert first['name'] == second['name'] == third['name'] and first['name'].startswith('gqa-')
    config = third['config']
    assert {k: v for k, v in config.items() if not k.startswith('resumed_at_')} == first['config']
    assert config['resumed_at_4'] == {'max_iters': 6} and config['resumed_at_6'] == {'max_iters': 8}
    assert config['init_from'] == 'scratch'
    assert config['model']['n_kv_head'] == 2 and 'n_kv_head' not in config  # resolved, once
    other_layouts = {'kv_lora_rank', 'rope_head_dim', 'q_lora_rank', 'conv_size', 'chunk_size'}
    assert not other_layouts & set(config['model'])
    steps = [[row['history']['item'] for row in wandb_records(tmp_path / 'wandb' / d)
              if row.get('type') == 'history'] for d in folders]
    # iterations 4 and 6, evaluated again by the resumes, are sent once
    assert [h['iter'] for rows in steps for h in rows if 'val/loss' in h] == [0, 2, 4, 6, 8]
    sent = [sorted({h['iter'] for h in rows}) for rows in steps]
    # no step in two folders: W&B drops them
    assert sent[0][-1] < sent[1][0] and sent[1][-1] < sent[2][0], sent
    tables = [h['samples.nrows'] for rows in steps for h in rows if 'samples.nrows' in h]
    assert tables == [1, 2, 3, 4, 5]  # the resumed table keeps the earlier rows


def test_an_interrupt_before_the_first_step_leaves_no_wandb_run_and_no_out_dir(tmp_path, char_data):
    out = tmp_path / 'out'
    p = start('train.py', *TINY_TRAIN, f'--out_dir={out}', f'--data_dir={char_data}',
              '--wandb_log=True', '--eval_iters=100000', env=environ(offline(tmp_path)))
    said = []
    # W&B started, the first evaluation under way
    while not said or not said[-1].startswith('step 0/'):
        said.append(p.stdout.readline())
        assert said[-1], p.stderr.read()
    assert any(line.startswith('W&B run ') for line in said) and os.listdir(tmp_path / 'wandb')
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130, err
    assert err.strip().endswith("error: interrupted before the first training step; nothing was "
                                "written"), err
    assert not os.path.exists(out) and not os.path.exists(tmp_path / 'wandb'), os.listdir(tmp_path)


FAKE_WANDB = """
import os
class Run:
    dir = os.getcwd()
    summary = {}
def init(**kwargs):
    if os.environ.get('FAKE_WANDB') == 'init':
        raise RuntimeError('wandb.errors.UsageError: api_key not configured (no-tty)')
    return Run()
def log(*args, **kwargs):
    if os.environ.get('FAKE_WANDB') == 'log':
        raise PermissionError(13, 'Permission denied', '/home/ro/.cache/wandb/artifacts')
class Table:
    def __init__(self, **kwargs): pass
def finish(): pass
"""


def test_wandb_failures_are_one_line_at_start_or_one_warning_later(tmp_path, char_data):
    """W&B failing to start: one line before training (nothing written). Failing later (a read-only
    HOME made the samples table raise): one warning, and training, checkpoints and metrics.jsonl
    go on."""
    fake = tmp_path / 'fake'
    fake.mkdir()
    (fake / 'wandb.py').write_text(FAKE_WANDB)
    env = {'PYTHONPATH': str(fake), 'HOME': str(tmp_path), 'WANDB_API_KEY': None}
    args = ['--wandb_log=True', '--max_iters=4', '--eval_interval=2']
    err = refused(tmp_path / 'online', char_data, *args, '--wandb_mode=online', env=env)
    assert "wandb_mode=online needs W&B credentials" in err
    err = refused(tmp_path / 'init', char_data, *args, env={**env, 'FAKE_WANDB': 'init'})
    assert "W&B could not start (RuntimeError: wandb.errors.UsageError" in err
    assert not os.path.exists(tmp_path / 'init' / 'ckpt.pt')
    r = run('train.py', *TINY_TRAIN, f'--data_dir={char_data}', *args,
            f'--out_dir={tmp_path / "log"}', env={**env, 'FAKE_WANDB': 'log'})
    assert r.returncode == 0 and 'Traceback' not in r.stderr, r.stderr
    assert r.stderr.count('warning: W&B logging stopped (PermissionError') == 1, r.stderr
    assert os.path.isfile(tmp_path / 'log' / 'ckpt.pt')
    assert max(m['iter'] for m in metrics(tmp_path / 'log')) == 4


def test_a_wandb_entry_of_the_wrong_kinds_is_dropped(tmp_path, char_data, saved):
    """A checkpoint's 'wandb' entry of the wrong kinds (samples None, a name that is a number) is
    dropped on a resume, not a traceback."""
    wrong = {'samples': None, 'name': 5, 'id': 'abcd1234', 'step': True}
    torch.save({**saved[1], 'wandb': wrong}, tmp_path / 'ckpt.pt')
    r = train(tmp_path, char_data, '--init_from=resume', '--max_iters=6', '--eval_interval=2',
              '--wandb_log=True', env={**offline(tmp_path), 'WANDB_MODE': 'offline'})
    assert re.search(r"^W&B run \S+ \(offline\)", r.stdout, re.M), r.stdout
    assert 'Traceback' not in r.stderr
    assert torch.load(tmp_path / 'ckpt.pt', weights_only=True)['wandb']['id'] == 'abcd1234'
