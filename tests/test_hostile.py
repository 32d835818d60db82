"""Nothing lost, round 3 (what a hostile tester found): files we don't own, a flag that runs code, limits checked
before the work, output that goes away, write failures outside checkpoints, W&B failures, strict JSON logs."""
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time

import torch

from conftest import ROOT
from test_reliability import digest
from test_train import TINY, environ, metrics, train


def run(*args, cwd=ROOT, limit=None, env=None, timeout=120):
    """A script, its files size-limited to limit bytes (as a full disk would); CompletedProcess."""
    pre = (lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))) if limit else None
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          preexec_fn=pre, env=environ(env))


def one_line(r, code=2):
    assert r.returncode == code and 'Traceback' not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    return r.stderr


def test_only_train_pys_own_temp_files_are_cleaned(tmp_path, char_data):
    """Stale NAME.tmpPID files of train.py's own NAMEs go when a run starts writing; a user's files never, nor in a
    run that is refused."""
    out = tmp_path / 'run'
    train(out, char_data, '--max_iters=2', '--eval_interval=2')
    mine = {'notes.tmp1': 'precious', 'thesis.tmp2024.tex': 'x', 'ckpt.pt.tmp12x': 'not a pid', 'a.tmp5': 'y'}
    for name, text in mine.items():
        (out / name).write_text(text)
    (out / 'dir.tmp5').mkdir()
    (out / 'ckpt.pt.tmp777').write_bytes(b'half a checkpoint')  # a killed run's
    (out / 'metrics.jsonl.tmp778').write_text('{"iter"')
    refused = run('train.py', *TINY, f'--out_dir={out}', f'--data_dir={char_data}', '--max_iters=2')
    assert 'ckpt.pt exists' in one_line(refused)
    assert (out / 'ckpt.pt.tmp777').exists() and all((out / n).read_text() == t for n, t in mine.items())
    train(out, char_data, '--max_iters=2', '--eval_interval=2', '--overwrite=True')
    assert all((out / n).read_text() == t for n, t in mine.items()) and (out / 'dir.tmp5').is_dir()
    assert not (out / 'ckpt.pt.tmp777').exists() and not (out / 'metrics.jsonl.tmp778').exists()


def test_dataset_names_a_folder_of_data_and_never_runs_another_script(tmp_path, char_data):
    evil = tmp_path / 'evil'
    evil.mkdir()
    (evil / 'prepare.py').write_text(f"open({str(tmp_path / 'ran')!r}, 'w').write('ran')\n")
    for name in (str(evil), os.path.relpath(evil, os.path.join(ROOT, 'data')), 'no such'):
        r = run('train.py', *TINY, f'--out_dir={tmp_path / "out"}', f'--dataset={name}')
        assert f"dataset={name!r} is unknown: give one of [" in one_line(r)
        assert not (tmp_path / 'ran').exists() and not (tmp_path / 'out' / 'ckpt.pt').exists()


def test_huge_sizes_are_refused_before_anything_is_built(tmp_path, char_data):
    """A billion layers, or a width whose byte count overflows: one line in seconds (it built for 600 s, then a
    traceback), before anything is written."""
    for args, message in ((['--n_layer=1000000000'], "the weights, optimizer and activations need at least"),
                          (['--n_embd=1000000000', '--n_head=1'], "need more bytes than a 64-bit count holds")):
        t0 = time.time()
        r = run('train.py', *TINY, f'--out_dir={tmp_path / "out"}', f'--data_dir={char_data}', *args, timeout=60)
        assert message in one_line(r) and time.time() - t0 < 30 and not (tmp_path / 'out' / 'metrics.jsonl').exists()


def test_sample_sizes_a_checkpoint_before_building_it(tmp_path, char_data):
    out = tmp_path / 'run'
    train(out, char_data, '--max_iters=1', '--eval_interval=1')
    ckpt = torch.load(out / 'ckpt.pt', weights_only=True)
    ckpt['model_args']['n_layer'] = 10 ** 6  # the file stays small; the model it asks for does not fit anywhere
    (tmp_path / 'huge').mkdir()
    torch.save(ckpt, tmp_path / 'huge' / 'ckpt.pt')
    t0 = time.time()
    r = run('sample.py', f'--out_dir={tmp_path / "huge"}', '--num_samples=1', timeout=60)
    assert "model (1000000 layers, n_embd 64) and num_samples=1: the weights, caches and activations need at least" \
        in one_line(r) and time.time() - t0 < 30


def test_an_untrusted_file_gets_no_advice_to_load_it_unsafely(tmp_path, char_data):
    """torch's message for a file weights_only refuses says to retry with weights_only=False: not passed on."""
    (tmp_path / 'ckpt.pt').write_bytes(os.urandom(4096))
    for r in (run('sample.py', f'--out_dir={tmp_path}'),
              run('train.py', *TINY, f'--out_dir={tmp_path}', f'--data_dir={char_data}', '--init_from=resume')):
        err = one_line(r)
        assert 'cannot load checkpoint' in err and 'weights_only' not in err and 'trusted source' not in err, err


def test_a_broken_last_pt_names_the_checkpoint_that_loads(tmp_path, char_data):
    train(tmp_path, char_data, '--max_iters=2', '--eval_interval=1')
    (tmp_path / 'last.pt').write_bytes((tmp_path / 'ckpt.pt').read_bytes()[:3000])
    r = run('train.py', *TINY, f'--out_dir={tmp_path}', f'--data_dir={char_data}', '--init_from=resume',
            '--max_iters=4')
    assert re.search(rf"cannot load checkpoint {tmp_path / 'last.pt'}: .*; {tmp_path / 'ckpt.pt'} \(iteration \d\) "
                     rf"loads: move {tmp_path / 'last.pt'} away to resume from it", one_line(r))


def test_a_closed_pipe_or_hangup_saves_like_an_interrupt(tmp_path, char_data):
    """`train.py | head`: the reader goes away; a hung-up terminal: SIGHUP. Both save last.pt and exit 130, no
    traceback; the resume command goes to stderr when stdout is gone."""
    for how in ('pipe', 'hup'):
        out = tmp_path / how
        p = subprocess.Popen([sys.executable, 'train.py', *TINY, f'--out_dir={out}', f'--data_dir={char_data}',
                              '--max_iters=100000', '--eval_interval=100000', '--log_interval=1'], cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        lines = []
        while sum(line.startswith('iter ') for line in lines) < 3:  # a few iterations logged
            lines.append(p.stdout.readline())
            assert lines[-1], lines
        if how == 'pipe':
            p.stdout.close()
        else:
            p.send_signal(signal.SIGHUP)
        err = p.communicate(timeout=60)[1] if how == 'hup' else p.stderr.read()
        p.wait(timeout=60)
        assert p.returncode == 130 and 'Traceback' not in err, err
        assert torch.load(out / 'last.pt', weights_only=True)['iter_num'] >= 3
        if how == 'pipe':
            assert 'interrupted before iteration' in err and '--init_from=resume' in err, err


def test_sample_ends_quietly_when_its_reader_goes_and_ctrl_c_is_one_line(tmp_path, char_data):
    train(tmp_path, char_data, '--max_iters=1', '--eval_interval=1')
    cmd = [sys.executable, 'sample.py', f'--out_dir={tmp_path}', '--num_samples=1', '--max_new_tokens=100000',
           '--device=cpu']
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.read(50)
    p.stdout.close()  # `| head -c 50`
    assert p.wait(timeout=60) == 0 and b'Traceback' not in p.stderr.read()
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # a foreground Ctrl-C: a
    p.stdout.read(50)  # suite started in the background (`.ci/run &`) passes SIGINT ignored on, and Python keeps it so
    p.send_signal(signal.SIGINT)
    try:
        err = p.communicate(timeout=60)[1]
    except subprocess.TimeoutExpired:  # leave no process generating 100,000 tokens beside the rest of the suite
        p.kill()
        raise AssertionError(f"sample.py still ran 60 s after SIGINT; stderr: {p.communicate()[1]!r}") from None
    assert p.returncode == 130 and err.strip() == 'error: interrupted', err


def test_an_interrupt_during_start_up_stops_at_once(tmp_path, char_data):
    """SIGTERM while torch is still being imported: the process ends there (it used to build the model first, and a
    huge one for minutes)."""
    p = subprocess.Popen([sys.executable, 'train.py', *TINY, f'--out_dir={tmp_path}', f'--data_dir={char_data}'],
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 30
    while '/numpy/' not in open(f'/proc/{p.pid}/maps').read():  # past the handler, importing torch
        assert time.time() < deadline and p.poll() is None
        time.sleep(0.01)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 130 and out == '', out  # nothing after the imports ran: no 'tokens per iteration'
    assert err == "error: interrupted before training started; nothing was written\n", err


def test_a_full_disk_while_logging_stops_with_the_log_whole(tmp_path, char_data):
    """metrics.jsonl appended at every iteration until the (size-limited) disk is full: one line, exit 2, every row
    whole; then a resume whose log rewrite cannot fit: one line, the log as it was, no temp file."""
    out = tmp_path / 'run'
    train(out, char_data, '--max_iters=2', '--eval_interval=2')
    limit = os.path.getsize(out / 'metrics.jsonl') + 2000  # a dozen rows more; checkpoints are saved at the end only
    r = run('train.py', *TINY, f'--out_dir={out}', f'--data_dir={char_data}', '--init_from=resume', '--max_iters=200',
            '--eval_interval=200', '--log_interval=1', limit=limit)
    assert f"cannot write {out / 'metrics.jsonl'}: " in one_line(r) and "the log's last row whole" in r.stderr
    rows = metrics(out)  # every line parses
    assert len(rows) > 10 and os.path.getsize(out / 'metrics.jsonl') <= limit
    before = digest(out / 'metrics.jsonl')
    r = run('train.py', *TINY, f'--out_dir={out}', f'--data_dir={char_data}', '--init_from=resume', '--max_iters=1000',
            limit=100)  # below the rows it keeps (those before its checkpoint)
    assert f"cannot write {out / 'metrics.jsonl'}: " in one_line(r)
    assert digest(out / 'metrics.jsonl') == before and not list(out.glob('*.tmp*'))


def test_the_log_is_strict_json_after_a_divergence(tmp_path, char_data):
    r = run('train.py', *TINY, f'--out_dir={tmp_path}', f'--data_dir={char_data}', '--learning_rate=1e12',
            '--grad_clip=0', '--max_iters=30', '--eval_interval=1')
    assert 'non-finite' in one_line(r)
    strict = lambda c: (_ for _ in ()).throw(ValueError(f"{c} is not JSON"))
    rows = [json.loads(line, parse_constant=strict) for line in open(tmp_path / 'metrics.jsonl')]
    assert any(v is None for row in rows for v in row.values())  # the non-finite loss, as null


def test_bench_readme_is_rewritten_whole_or_not_at_all(tmp_path):
    """bench.py --readme under a file-size limit below README.md's size: one line, README.md unchanged."""
    shutil.copy(os.path.join(ROOT, 'README.md'), tmp_path)
    before = digest(tmp_path / 'README.md')
    r = run(os.path.join(ROOT, 'bench.py'), 'cache', '--readme', '--layouts=mha', cwd=tmp_path,
            limit=os.path.getsize(tmp_path / 'README.md') // 2)
    assert "cannot write README.md: " in one_line(r)
    assert digest(tmp_path / 'README.md') == before and not [p for p in os.listdir(tmp_path) if '.tmp' in p]


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
    """W&B failing to start: one line before training (nothing written). Failing later (a read-only HOME made the
    samples table raise): one warning, and training, checkpoints and metrics.jsonl go on."""
    fake = tmp_path / 'fake'
    fake.mkdir()
    (fake / 'wandb.py').write_text(FAKE_WANDB)
    env = {'PYTHONPATH': str(fake), 'HOME': str(tmp_path), 'WANDB_API_KEY': None}
    args = ['train.py', *TINY, f'--data_dir={char_data}', '--wandb_log=True', '--max_iters=4', '--eval_interval=2']
    r = run(*args, f'--out_dir={tmp_path / "online"}', '--wandb_mode=online', env=env)
    assert "wandb_mode=online needs W&B credentials" in one_line(r)
    r = run(*args, f'--out_dir={tmp_path / "init"}', env={**env, 'FAKE_WANDB': 'init'})
    assert "W&B could not start (RuntimeError: wandb.errors.UsageError" in one_line(r)
    assert not os.path.exists(tmp_path / 'init' / 'ckpt.pt')
    r = run(*args, f'--out_dir={tmp_path / "log"}', env={**env, 'FAKE_WANDB': 'log'})
    assert r.returncode == 0 and 'Traceback' not in r.stderr, r.stderr
    assert r.stderr.count('warning: W&B logging stopped (PermissionError') == 1, r.stderr
    assert os.path.isfile(tmp_path / 'log' / 'ckpt.pt') and max(m['iter'] for m in metrics(tmp_path / 'log')) == 4


def test_bench_never_replaces_a_folder_it_did_not_write(tmp_path):
    """bench.py train replaces OUT/train/LAYOUT with a new run: not when that folder holds someone else's files."""
    (tmp_path / 'train' / 'mha').mkdir(parents=True)
    (tmp_path / 'train' / 'mha' / 'thesis.tex').write_text('precious')
    r = run('bench.py', 'train', '--layouts=mha', '--max_iters=1', f'--out={tmp_path}')
    assert "holds files bench.py did not write" in one_line(r)
    assert (tmp_path / 'train' / 'mha' / 'thesis.tex').read_text() == 'precious'
