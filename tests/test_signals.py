"""Stops from outside: Ctrl-C, SIGTERM, SIGHUP, a SIGKILLed DDP rank, a closed or full stdout. The
run saves last.pt and exits 130 with the resume command on stderr; during start-up nothing is left
behind; every script says one line, never a traceback (resuming: test_resume.py)."""
import json
import os
import re
import resource
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import DDP, ROOT, SHAKESPEARE, TINY_TRAIN, digest, live_run, one_line, start


def importing(p):
    """Wait until p has mapped numpy's library: past its first lines (the handler), importing."""
    deadline = time.time() + 30
    while '/numpy/' not in open(f'/proc/{p.pid}/maps').read():
        assert time.time() < deadline and p.poll() is None
        time.sleep(0.01)


def test_an_interrupt_during_start_up_stops_at_once(tmp_path, char_data):
    """SIGTERM while torch is still being imported: the process ends there (it used to build the
    model first, and a huge one for minutes)."""
    p = start('train.py', *TINY_TRAIN, f'--out_dir={tmp_path}', f'--data_dir={char_data}')
    importing(p)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=60)
    # nothing after the imports ran: no 'tokens per iteration'
    assert p.returncode == 130 and out == '', out
    assert err == "error: interrupted before training started; nothing was written\n", err


@pytest.mark.slow
def test_sigint_at_start_up_is_one_line(tmp_path, char_data):
    """Ctrl-C at moments from start-up into the first iterations: one line, never a traceback;
    before the loop exit 130 and nothing written (an earlier run's log is kept), in it the usual
    save."""
    before_loop = 0
    earlier = '{"iter": 0, "val/loss": 1.5}\n'  # of a run that saved no checkpoint
    for delay in (0.0, 0.5, 1.0, 2.0, 3.5):
        out_dir = tmp_path / str(delay)
        out_dir.mkdir()
        (out_dir / 'metrics.jsonl').write_text(earlier)
        p = start('train.py', *TINY_TRAIN, f'--out_dir={out_dir}', f'--data_dir={char_data}',
                  '--max_iters=100000', '--eval_interval=100000', '--overwrite=True')
        importing(p)
        time.sleep(delay)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
        assert 'Traceback' not in err and p.returncode == 130, err
        if 'nothing was written' in err:  # before the loop, or in the first evaluation
            before_loop += 1
            assert re.fullmatch(r"error: interrupted before (training started|the first training "
                                r"step); nothing was written", err.strip()), err
            # (a lock it made is removed again)
            assert set(os.listdir(out_dir)) == {'metrics.jsonl'}
            assert (out_dir / 'metrics.jsonl').read_text() == earlier
        else:
            said = r"interrupted before iteration \d+: its state saved to .*; continue with:\n"
            assert re.fullmatch(said + r"  .*\n", err), err
    assert before_loop >= 1


def test_an_interrupt_stops_a_long_evaluation_within_seconds(trained, char_data):
    """SIGTERM during a 100000-batch evaluation: dropped at the next batch, nothing written by
    eval_only."""
    before = digest(trained / 'ckpt.pt')
    p = start('train.py', *TINY_TRAIN, f'--out_dir={trained}', f'--data_dir={char_data}',
              '--init_from=resume', '--eval_only=True', '--eval_iters=100000')
    # the start-up's lines up to the evaluation's (slow on a loaded machine: no fixed sleep)
    started = ['']
    while 'evaluating' not in started[-1]:
        started.append(p.stdout.readline())
        assert started[-1], (started, p.stderr.read())
    time.sleep(2)  # well into the evaluation (100000 batches take minutes)
    assert p.poll() is None
    t0 = time.time()
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=60)
    assert time.time() - t0 < 10 and 'step 4:' not in ''.join(started) + out, (out, err)
    assert p.returncode == 130
    assert err.strip() == "error: interrupted during the evaluation; nothing was written"
    assert digest(trained / 'ckpt.pt') == before


@pytest.mark.parametrize('how', ['pipe', 'hup'])
def test_a_closed_pipe_or_hangup_saves_like_an_interrupt(tmp_path, char_data, how):
    """`train.py | head`: the reader goes away; a hung-up terminal: SIGHUP. Both save last.pt and
    exit 130, no traceback; the resume command goes to stderr when stdout is gone."""
    p = live_run(tmp_path, char_data)
    if how == 'pipe':
        p.stdout.close()
        err = p.stderr.read()
    else:
        p.send_signal(signal.SIGHUP)
        err = p.communicate(timeout=60)[1]
    p.wait(timeout=60)
    assert p.returncode == 130 and 'Traceback' not in err, err
    assert torch.load(tmp_path / 'last.pt', weights_only=True)['iter_num'] >= 3
    if how == 'pipe':
        assert 'interrupted before iteration' in err and '--init_from=resume' in err, err


def test_a_full_disk_under_stdout_saves_the_run_and_says_so(tmp_path, char_data):
    """stdout on a disk that fills mid-run (its file at a size limit; the checkpoints' disk has
    room) was an OSError traceback that lost the steps since the last save: it stops as an
    interrupt does, last.pt saved, the reason in one line. /dev/full from the start: one line,
    nothing written. Both exit 1, as every error does (130 is Ctrl-C's)."""
    limit = 2 ** 24
    log = tmp_path / 'log.txt'
    # the stdout's disk nearly full; the checkpoints (~1 MB) still fit
    log.write_bytes(b'.' * (limit - 3000))
    size = lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    args = ['train.py', *TINY_TRAIN, f'--data_dir={char_data}']
    with open(log, 'ab') as out:
        r = subprocess.run([sys.executable, *args, f'--out_dir={tmp_path / "o"}',
                            '--max_iters=100000', '--log_interval=1'], cwd=ROOT, stdout=out,
                           stderr=subprocess.PIPE, text=True, timeout=300, preexec_fn=size)
    assert r.returncode == 1 and 'Traceback' not in r.stderr, r.stderr
    head = r.stderr.splitlines()[0]
    last = tmp_path / 'o' / 'last.pt'
    assert re.fullmatch(rf"cannot write to stdout \(File too large\) before iteration (\d+): its "
                        rf"state saved to {re.escape(str(last))}; continue with:", head), r.stderr
    iteration = int(re.search(r'\d+', head)[0])
    assert torch.load(last, weights_only=True)['iter_num'] == iteration > 0
    with open('/dev/full', 'w') as full:
        r = subprocess.run([sys.executable, *args, f'--out_dir={tmp_path / "f"}'], cwd=ROOT,
                           stdout=full, stderr=subprocess.PIPE, text=True, timeout=300)
    assert r.returncode == 1 and r.stderr == ("error: cannot write to stdout (No space left on "
                                                "device) before training started; nothing was "
                                                "written\n"), r.stderr
    assert not (tmp_path / 'f').exists()


def test_the_other_scripts_on_a_full_stdout_say_one_line(tmp_path, trained):
    """sample.py: one line, exit 1. bench.py's report printed to /dev/full was a traceback (the
    report is in --out by then); a prepare script whose stdout is full blamed the dataset, which it
    had written whole."""
    full_disk = "error: cannot write to stdout (No space left on device)"
    with open('/dev/full', 'w') as full:
        stdout_full = lambda *args: subprocess.run([sys.executable, *args], cwd=ROOT, stdout=full,
                                                   stderr=subprocess.PIPE, text=True, timeout=300)
        r = stdout_full('sample.py', f'--out_dir={trained}', '--max_new_tokens=5')
        assert r.returncode == 1 and r.stderr.splitlines()[-1] == full_disk, r.stderr
        r = stdout_full('bench.py', 'cache', '--layouts=mha', f'--out={tmp_path / "b"}')
        assert one_line(r, code=1) == full_disk + '\n'
        assert (tmp_path / 'b' / 'cache.md').exists()
        r = stdout_full('data/shakespeare_char/prepare.py', f'--out_dir={tmp_path / "p"}',
                        f'--input={SHAKESPEARE}')
        assert one_line(r, code=1) == full_disk + '\n'
        assert sorted(os.listdir(tmp_path / 'p')) == ['meta.json', 'train.bin', 'val.bin']


def test_sample_ends_quietly_when_its_reader_goes_and_ctrl_c_is_one_line(trained):
    args = ['sample.py', f'--out_dir={trained}', '--num_samples=1', '--max_new_tokens=100000',
            '--device=cpu']
    p = start(*args)
    p.stdout.read(50)
    p.stdout.close()  # `| head -c 50`
    assert p.wait(timeout=60) == 0 and 'Traceback' not in p.stderr.read()
    # a foreground Ctrl-C: a suite started in the background (`.ci/run &`) passes SIGINT ignored
    # on, and Python keeps it so
    p = start(*args, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    p.stdout.read(50)
    p.send_signal(signal.SIGINT)
    try:
        err = p.communicate(timeout=60)[1]
    except subprocess.TimeoutExpired:  # leave no process generating 100,000 tokens beside the rest
        p.kill()
        said = f"sample.py still ran 60 s after SIGINT; stderr: {p.communicate()[1]!r}"
        raise AssertionError(said) from None
    assert p.returncode == 130 and err.strip() == 'error: interrupted', err


@pytest.mark.parametrize('sig', [signal.SIGINT, signal.SIGTERM], ids=['SIGINT', 'SIGTERM'])
# 0.3 s: inside torch's import (~2 s here), past Python's own start-up, which no handler can cover
# (at 0.1 s a loaded machine had not imported site yet: a kill, not our handler)
@pytest.mark.parametrize('delay', [0.3, 0.6])
def test_the_other_scripts_stopped_during_start_up_say_one_line(tmp_path, sig, delay):
    """sample.py, bench.py and a prepare script stopped while torch or numpy is still being
    imported (Ctrl-C gave a traceback, or pybind11's abort inside torch's import; SIGTERM nothing
    at all): one line on stderr, exit 130 or 143. Their handlers come before the slow imports."""
    said = 'error: interrupted' if sig == signal.SIGINT else 'error: stopped by SIGTERM'
    for script, *args in (('sample.py', f'--out_dir={tmp_path / "none"}'),
                          ('data/shakespeare_char/prepare.py', f'--out_dir={tmp_path / "none"}'),
                          ('bench.py', 'cache', '--layouts=mha', f'--out={tmp_path / "bench"}')):
        # as a foreground Ctrl-C
        p = start(script, *args, stdout=subprocess.DEVNULL,
                  preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        time.sleep(delay)
        p.send_signal(sig)
        err = p.communicate(timeout=60)[1]
        # (2: it was that fast, and found no checkpoint or text: one line too)
        if p.returncode not in (0, 2):
            assert p.returncode == 128 + sig and err.strip() == said, (script, err)
        assert 'Traceback' not in err and len(err.strip().splitlines()) <= 1, (script, err)


@pytest.mark.slow
@pytest.mark.parametrize('killed', [0, 1])
def test_ddp_a_killed_rank_leaves_one_line_from_the_other(tmp_path, char_data, killed):
    """SIGKILL of rank 1 printed rank 0's whole gloo traceback; with rank 0 killed, rank 1's line
    pointed to "rank 0's error", which never came. Now the survivor says one line, naming a
    stopped rank."""
    p = start(*DDP, 'train.py', *TINY_TRAIN, f'--out_dir={tmp_path}', f'--data_dir={char_data}',
              '--max_iters=100000', '--log_interval=1', '--gradient_accumulation_steps=2')
    deadline, log = time.time() + 120, tmp_path / 'metrics.jsonl'
    while not log.exists() or log.read_text().count('batch') < 3:
        assert time.time() < deadline and p.poll() is None
        time.sleep(0.2)
    ranks = {}
    for pid in os.listdir('/proc'):
        try:
            env = open(f'/proc/{pid}/environ', 'rb').read().split(b'\0')
            cmd = open(f'/proc/{pid}/cmdline', 'rb').read()
        except OSError:
            continue
        ours = f'--out_dir={tmp_path}'.encode() in cmd
        if b'train.py' in cmd and b'torch.distributed.run' not in cmd and ours:
            ranks.update({int(v[5:]): int(pid) for v in env if v.startswith(b'RANK=')})
    os.kill(ranks[killed], signal.SIGKILL)
    _, err = p.communicate(timeout=120)
    ours = [line for line in err.splitlines() if line.startswith(('error:', '[rank'))]
    said = rf"error: rank {1 - killed}: RuntimeError: .* \(another rank stopped: killed, or its " \
           r"own error says why\)"
    assert len(ours) == 1 and re.fullmatch(said, ours[0]), err


@pytest.mark.parametrize('script', ['train.py --help', 'sample.py --help', 'bench.py --help',
                                    'data/shakespeare_char/prepare.py --help'])
def test_a_closed_stdout_is_not_an_error(script):
    """`>&-` closes the descriptor (Python's sys.stdout is None): the output goes nowhere, as to
    /dev/null; no AttributeError at the first print, no error."""
    r = subprocess.run(f"{sys.executable} {script} >&-", shell=True, cwd=ROOT,
                       stderr=subprocess.PIPE, text=True, timeout=120)
    assert r.returncode == 0 and r.stderr == '', r.stderr


@pytest.mark.parametrize('closed', ['>&-', '2>&-', '>&- 2>&-'])
def test_a_run_with_closed_streams_trains_saves_and_lets_go(tmp_path, char_data, closed):
    """cron, a detached shell: stdout or stderr closed is not an error. The run trains and saves,
    exits 0 and releases its lock; nothing printed lands in a file that took the closed
    descriptor (the lock, the log)."""
    args = ' '.join([*TINY_TRAIN, '--max_iters=6', f'--out_dir={tmp_path}',
                     f'--data_dir={char_data}'])
    r = subprocess.run(f"{sys.executable} train.py {args} {closed}", shell=True, cwd=ROOT,
                       stdout=None if '>&-' in closed else subprocess.PIPE,
                       stderr=None if '2>&-' in closed else subprocess.PIPE, timeout=300)
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(tmp_path)) == ['ckpt.pt', 'metrics.jsonl', 'train.lock']
    assert (tmp_path / 'train.lock').read_text() == ''
    rows = [json.loads(line) for line in open(tmp_path / 'metrics.jsonl')]
    assert rows[-1]['iter'] == 6
    from run.checkpoint import in_use
    assert not in_use(tmp_path)
