"""Nothing lost, round 4 (#46): a resume trains with what it says, a crafted optimizer state or int64 weights are
refused or overridden, never trained as told."""
import os
import re

import pytest
import torch

from run.checkpoint import FileError, load_optimizer, read_checkpoint
from conftest import tiny
from model import GPT
from test_hostile import one_line, run
from test_train import TINY, train


@pytest.fixture(scope='module')
def saved(tmp_path_factory, char_data):
    """A 4-iteration run (ckpt.pt at 4) and its checkpoint."""
    out = tmp_path_factory.mktemp('saved')
    train(out, char_data, '--max_iters=4', '--eval_interval=4', '--dropout=0')
    return out, torch.load(out / 'ckpt.pt', weights_only=True)


def resume(out, data, *args):
    return train(out, data, '--max_iters=6', '--eval_interval=6', '--dropout=0', '--init_from=resume', *args)


def test_a_resume_applies_changed_optimizer_settings_and_names_every_change(tmp_path, char_data, saved):
    """--weight_decay, --beta1, --beta2 on a resume are the settings it trains with (torch's load_state_dict took the
    file's), and the `changed:` line names them with the other settings that differ (--seed, --grad_clip, how a linear
    layout computes, out_dir: the file was moved), not only the schedule's."""
    (tmp_path / 'ckpt.pt').write_bytes((saved[0] / 'ckpt.pt').read_bytes())
    r = resume(tmp_path, char_data, '--weight_decay=0.7', '--beta1=0.5', '--beta2=0.6', '--seed=7', '--grad_clip=0.5',
               '--chunk_size=16')
    said = re.search(r"; changed: (.*)\n", r.stdout)[1].split(', ')
    assert sorted(said) == sorted(['max_iters 4 -> 6', 'eval_interval 4 -> 6', 'weight_decay 0.1 -> 0.7',
                                   'beta1 0.9 -> 0.5', 'beta2 0.99 -> 0.6', 'seed 1337 -> 7', 'grad_clip 1.0 -> 0.5',
                                   'chunk_size 64 -> 16', f"out_dir {str(saved[0])!r} -> {str(tmp_path)!r}"]), said
    groups = torch.load(tmp_path / 'ckpt.pt', weights_only=True)['optimizer']['param_groups']
    assert [(g['betas'], g['weight_decay']) for g in groups] == [((0.5, 0.6), 0.7), ((0.5, 0.6), 0.0)]


def test_a_crafted_optimizer_group_is_overridden_and_the_resume_is_the_plain_one(tmp_path, char_data, saved):
    """maximize, a negative eps, betas > 1, amsgrad, capturable, a weight decay in a checkpoint's param_groups: the
    run's own settings train, bit for bit as a resume from the untouched file (torch trained as the file said, or
    failed at the first step)."""
    out, state = saved
    crafted = dict(maximize=True, eps=-1.0, betas=(5.0, 0.99), amsgrad=True, capturable=True, weight_decay=3.0, lr=9.0)
    state = {**state, 'optimizer': {**state['optimizer'], 'param_groups': [
        {**g, **crafted} for g in state['optimizer']['param_groups']]}}
    for name, ckpt in (('plain', None), ('crafted', state)):
        (tmp_path / name).mkdir()
        if ckpt:
            torch.save(ckpt, tmp_path / name / 'ckpt.pt')
        else:
            (tmp_path / name / 'ckpt.pt').write_bytes((out / 'ckpt.pt').read_bytes())
        resume(tmp_path / name, char_data)
    a, b = (torch.load(tmp_path / name / 'ckpt.pt', weights_only=True) for name in ('plain', 'crafted'))
    assert a['iter_num'] == b['iter_num'] == 6
    assert all(torch.equal(a['model'][k], b['model'][k]) for k in a['model'])


def test_a_crafted_optimizer_state_is_refused():
    """A step < 0, not whole or of a type that wraps, a moment that is not finite or not real, a negative second
    moment, a key AdamW does not keep (amsgrad's max_exp_avg_sq), a weight without its state: one ValueError each
    (one line in train.py)."""
    model = GPT(tiny())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long))[1].backward()
    opt.step()
    good = opt.state_dict()
    load_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), good)  # the untouched state loads
    first = next(iter(good['state']))
    s = good['state'][first]
    for bad in ({'step': torch.tensor(-1.0)}, {'step': torch.tensor(1.5)},
                {'exp_avg': torch.full_like(s['exp_avg'], float('nan'))}, {'exp_avg_sq': -s['exp_avg_sq'] - 1},
                {'max_exp_avg_sq': s['exp_avg_sq']}, {'step': torch.tensor(True)},  # (steps that wrap or stick at + 1:
                {'step': torch.tensor(127, dtype=torch.int8)}, {'step': torch.tensor(2048.0).half()},  # tracebacks)
                {'exp_avg': s['exp_avg'].to(torch.complex64)}, {'exp_avg': s['exp_avg'].long()}):  # (cast, said nothing)
        crafted = {**good, 'state': {**good['state'], first: {**s, **bad}}}
        with pytest.raises(ValueError, match="its optimizer state is not AdamW's for these weights"):
            load_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), crafted)
    for partial in ({}, {k: v for k, v in good['state'].items() if k != first}):  # moments restarted from zero: refused
        with pytest.raises(ValueError, match="its optimizer state is not AdamW's for these weights"):
            load_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), {**good, 'state': partial})


def test_int64_weights_are_refused_not_cast(tmp_path, saved):
    """Weights saved as int64 loaded silently (load_state_dict casts them) and the loss went to ln 65: named."""
    out, state = saved
    name = next(iter(state['model']))
    torch.save({**state, 'model': {**state['model'], name: state['model'][name].long()}}, tmp_path / 'ckpt.pt')
    with pytest.raises(FileError, match=f"its weight '{re.escape(name)}' is not a floating-point tensor "
                                        r"\(torch.int64, torch.strided, on cpu\)"):
        read_checkpoint(str(tmp_path / 'ckpt.pt'))
    r = run('sample.py', f'--out_dir={tmp_path}', '--max_new_tokens=2')
    assert "is not a floating-point tensor" in one_line(r)


def test_bench_never_deletes_a_live_run(tmp_path):
    """bench.py train removed a folder a live train.py was writing (the live run then overwrote bench's ckpt.pt and
    mixed its iterations into metrics.jsonl): the lock is checked and taken first, and a live folder refused."""
    import fcntl
    for folder in ('mha', 'mha.new'):
        run_dir = tmp_path / folder / 'train' / 'mha' if folder == 'mha' else tmp_path / 'new' / 'train' / 'mha.new'
        run_dir.mkdir(parents=True)
        (run_dir / 'metrics.jsonl').write_text('{"iter": 0}\n')
        with open(run_dir / 'train.lock', 'a') as lock:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a live train.py holds it
            r = run('bench.py', 'train', '--layouts=mha', '--max_iters=1', f'--out={run_dir.parent.parent}')
            assert f"{run_dir} is in use by a live train.py run" in one_line(r)
        assert (run_dir / 'metrics.jsonl').read_text() == '{"iter": 0}\n'
    from run.checkpoint import remove_run
    with open(run_dir / 'train.lock', 'a') as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(FileError, match="in use by a live train.py run"):
            remove_run(str(run_dir))
    remove_run(str(run_dir))  # the lock free: removed
    assert not run_dir.exists()


def test_a_full_disk_under_stdout_saves_the_run_and_says_so(tmp_path, char_data):
    """stdout on a disk that fills mid-run (its file at a size limit; the checkpoints' disk has room) was an OSError
    traceback that lost the steps since the last save: it stops as an interrupt does, last.pt saved, the reason in
    one line. /dev/full from the start: one line, nothing written; sample.py: one line, exit 1."""
    import resource
    import subprocess
    import sys
    from conftest import ROOT
    from test_train import environ
    limit = 2 ** 24
    log = tmp_path / 'log.txt'
    log.write_bytes(b'.' * (limit - 3000))  # the stdout's disk nearly full; the checkpoints (~1 MB) still fit
    with open(log, 'ab') as out:
        r = subprocess.run([sys.executable, 'train.py', *TINY, f'--data_dir={char_data}', f'--out_dir={tmp_path / "o"}',
                            '--max_iters=100000', '--log_interval=1'], cwd=ROOT, stdout=out, stderr=subprocess.PIPE,
                           text=True, timeout=300, env=environ(None),
                           preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit)))
    assert r.returncode == 130 and 'Traceback' not in r.stderr, r.stderr
    head = r.stderr.splitlines()[0]
    assert re.fullmatch(rf"cannot write to stdout \(File too large\) before iteration (\d+): its state saved to "
                        rf"{re.escape(str(tmp_path / 'o' / 'last.pt'))}; continue with:", head), r.stderr
    assert torch.load(tmp_path / 'o' / 'last.pt', weights_only=True)['iter_num'] == int(re.search(r'\d+', head)[0]) > 0
    with open('/dev/full', 'w') as full:
        r = subprocess.run([sys.executable, 'train.py', *TINY, f'--data_dir={char_data}',
                            f'--out_dir={tmp_path / "f"}'], cwd=ROOT, stdout=full, stderr=subprocess.PIPE, text=True, timeout=300, env=environ(None))
        assert r.returncode == 130 and r.stderr == ("error: cannot write to stdout (No space left on device) before "
                                                    "training started; nothing was written\n"), r.stderr
        assert not (tmp_path / 'f').exists()
        r = subprocess.run([sys.executable, 'sample.py', f'--out_dir={tmp_path / "o"}', '--max_new_tokens=5'],
                           cwd=ROOT, stdout=full, stderr=subprocess.PIPE, text=True, timeout=300, env=environ(None))
        assert r.returncode == 1 and r.stderr.splitlines()[-1] == "error: cannot write to stdout (No space left on " \
                                                                  "device)", r.stderr


def test_a_fifo_in_the_data_folder_is_one_line_not_a_hang(tmp_path, char_data):
    """meta.json (or a .bin) a FIFO hung start-up for ever, Ctrl-C deferred: only SIGKILL ended it, leaving
    train.lock."""
    import os
    import shutil
    for name in ('meta.json', 'val.bin'):
        data = tmp_path / name
        shutil.copytree(char_data, data)
        (data / name).unlink()
        os.mkfifo(data / name)
        r = run('train.py', *TINY, f'--data_dir={data}', f'--out_dir={tmp_path / "out"}', timeout=60)
        assert f"{name} is not a regular file" in one_line(r)
        assert not (tmp_path / 'out').exists()


def test_a_checkpoint_that_vanishes_while_being_read(tmp_path, saved, monkeypatch, capsys):
    """--eval_only=True takes no lock: a live run that saves ckpt.pt removes last.pt between our listing and opening
    it (a traceback): the vanished one is skipped, or named in one line if it was the only one."""
    from run import checkpoint
    (tmp_path / 'ckpt.pt').write_bytes((saved[0] / 'ckpt.pt').read_bytes())
    (tmp_path / 'last.pt').write_bytes(b'soon gone')
    listed = checkpoint.checkpoints(str(tmp_path))
    (tmp_path / 'last.pt').unlink()
    monkeypatch.setattr(checkpoint, 'checkpoints', lambda out_dir: listed)
    with pytest.raises(FileError, match="removed while being read"):
        read_checkpoint(str(tmp_path / 'last.pt'))
    meta, config = saved[1]['meta'], read_checkpoint(str(tmp_path / 'ckpt.pt'))[1]
    path, ckpt = checkpoint.resume_state(str(tmp_path), 'cpu', meta, config, 'data')
    assert path == str(tmp_path / 'ckpt.pt') and ckpt['iter_num'] == 4
    (tmp_path / 'ckpt.pt').unlink()
    with pytest.raises(SystemExit):
        checkpoint.resume_state(str(tmp_path), 'cpu', meta, config, 'data')
    assert "were removed while being read (a live run saving?); try again" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize('killed', [0, 1])
def test_ddp_a_killed_rank_leaves_one_line_from_the_other(tmp_path, char_data, killed):
    """SIGKILL of rank 1 printed rank 0's whole gloo traceback; with rank 0 killed, rank 1's line pointed to "rank 0's
    error", which never came. Now the survivor says one line, naming a stopped rank."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from conftest import ROOT
    from test_train import environ
    p = subprocess.Popen([sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2',
                          'train.py', *TINY, f'--out_dir={tmp_path}', f'--data_dir={char_data}', '--max_iters=100000',
                          '--log_interval=1', '--gradient_accumulation_steps=2'], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=environ(None))
    deadline = time.time() + 120
    while not (tmp_path / 'metrics.jsonl').exists() or (tmp_path / 'metrics.jsonl').read_text().count('batch') < 3:
        assert time.time() < deadline and p.poll() is None
        time.sleep(0.2)
    ranks = {}
    for pid in os.listdir('/proc'):
        try:
            env = open(f'/proc/{pid}/environ', 'rb').read().split(b'\0')
            cmd = open(f'/proc/{pid}/cmdline', 'rb').read()
        except OSError:
            continue
        if b'train.py' in cmd and b'torch.distributed.run' not in cmd and f'--out_dir={tmp_path}'.encode() in cmd:
            ranks.update({int(v[5:]): int(pid) for v in env if v.startswith(b'RANK=')})
    os.kill(ranks[killed], signal.SIGKILL)
    _, err = p.communicate(timeout=120)
    ours = [line for line in err.splitlines() if line.startswith(('error:', '[rank'))]
    assert len(ours) == 1 and re.fullmatch(rf"error: rank {1 - killed}: RuntimeError: .* \(another rank stopped: "
                                           r"killed, or its own error says why\)", ours[0]), err


def children(pid):
    """The live (not zombie) processes whose parent is pid."""
    import os
    found = []
    for p in filter(str.isdigit, os.listdir('/proc')):
        try:
            stat = open(f'/proc/{p}/stat').read().rsplit(')', 1)[1].split()
        except OSError:
            continue
        if int(stat[1]) == pid and stat[0] != 'Z':
            found.append(int(p))
    return found


def alive(pid):
    try:
        return open(f'/proc/{pid}/stat').read().rsplit(')', 1)[1].split()[0] != 'Z'
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.parametrize('wait', [0, 3])
@pytest.mark.parametrize('sig', ['SIGINT', 'SIGTERM'])
def test_bench_mqar_stopped_ends_its_workers_and_deletes_its_data(tmp_path, sig, wait):
    """Ctrl-C left .mqar-data-XXXX/ in --out; SIGTERM died silently, left it, and orphaned the training workers (still
    running 40 s later); Ctrl-C while the workers imported torch printed their tracebacks. Now: one line, the folder
    gone, no worker left."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from conftest import ROOT
    p = subprocess.Popen([sys.executable, 'bench.py', 'mqar', '--layouts=mha,linear', '--seeds=1', '--vocab=16',
                          '--sets=12:2,16:4', '--max_iters=100000', f'--out={tmp_path}'], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.time() + 120
    data = lambda: [f.name for f in tmp_path.iterdir() if f.name.startswith('.mqar-data-')]
    while len(workers := [c for c in children(p.pid) if b'spawn_main' in open(f'/proc/{c}/cmdline', 'rb').read()]) < 2 \
            or not data():  # (the workers start first, then the data is written)
        assert time.time() < deadline and p.poll() is None, p.stderr.read() if p.poll() is not None else 'slow'
        time.sleep(0.05)
    time.sleep(wait)  # the workers importing torch, or training
    os.killpg(p.pid, getattr(signal, sig)) if sig == 'SIGINT' else p.send_signal(signal.SIGTERM)  # (a terminal's: all)
    _, err = p.communicate(timeout=60)
    assert p.returncode == (130 if sig == 'SIGINT' else 128 + signal.SIGTERM), err
    assert err.splitlines()[-1] == ('error: interrupted' if sig == 'SIGINT' else 'error: stopped by SIGTERM'), err
    assert 'Traceback' not in err and 'KeyboardInterrupt' not in err and 'leaked' not in err, err
    assert not data()
    time.sleep(1)
    assert not [w for w in workers if alive(w)]


def test_out_of_memory_at_the_first_step_leaves_no_out_dir(tmp_path, char_data):
    """Out of memory at the first step was one line but left the new out_dir and its train.lock (os._exit skipped the
    run's cleanup): the atexit cleanups run first now."""
    import subprocess
    import sys
    from conftest import ROOT
    from test_train import environ
    args = ['train.py', *TINY, f'--data_dir={char_data}', f'--out_dir={tmp_path / "new" / "out"}']
    oom = ("import sys, runpy, torch\n"
           "def step(self, *a, **k): raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 9 GiB')\n"
           f"torch.optim.AdamW.step = step\nsys.argv = {args!r}\nrunpy.run_path('train.py', run_name='__main__')\n")
    r = subprocess.run([sys.executable, '-c', oom], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env=environ(None))
    assert r.returncode == 2 and "error: out of memory (OutOfMemoryError: CUDA out of memory" in r.stderr, r.stderr
    assert 'Traceback' not in r.stderr and not (tmp_path / 'new').exists()


class Payload:
    """A pickle that would run a command when loaded unsafely."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import os
        return os.system, (f'touch {self.marker}',)


def test_a_pickle_that_runs_code_is_refused_with_its_reason(tmp_path):
    """The refusal printed torch's preamble cut mid-word ("In PyTorch 2.6, we changed the default value of the fr")
    and dropped the reason: now the reason, and the command never ran."""
    torch.save({'model': Payload(tmp_path / 'ran')}, tmp_path / 'ckpt.pt')
    with pytest.raises(FileError, match=r"not a file of tensors that loads safely \(.*GLOBAL posix\.system.*\)$") as e:
        read_checkpoint(str(tmp_path / 'ckpt.pt'))
    assert 'PyTorch 2.6' not in str(e.value) and not (tmp_path / 'ran').exists()


def test_a_flag_the_layout_does_not_use_on_a_resume_names_no_other_flag(tmp_path, char_data, saved):
    """--init_from=resume --conv_size=3 on an MHA run suggested --n_kv_head=4 (MHA's own default, filled in): the
    refusal names the flag, and no setting the run already has."""
    (tmp_path / 'ckpt.pt').write_bytes((saved[0] / 'ckpt.pt').read_bytes())
    r = run('train.py', *TINY, f'--data_dir={char_data}', f'--out_dir={tmp_path}', '--init_from=resume',
            '--conv_size=3')
    assert "GPTConfig.conv_size=3 is invalid: no layer of attn='mha' uses it\n" == one_line(r)[len('error: '):]


def test_a_checkpoint_removed_after_torch_load_read_it_is_named_so(tmp_path, saved, monkeypatch):
    """Removed after torch.load read it and before its CRCs were checked: it was called torch.save's old format."""
    from run import checkpoint
    (tmp_path / 'ckpt.pt').write_bytes((saved[0] / 'ckpt.pt').read_bytes())
    load = torch.load
    monkeypatch.setattr(checkpoint.torch, 'load', lambda path, **kw: (load(path, **kw), os.remove(path))[0])
    with pytest.raises(FileError, match="removed while being read"):
        read_checkpoint(str(tmp_path / 'ckpt.pt'))


def test_a_resume_rewrites_foreign_non_finite_rows_as_null(tmp_path, char_data, saved):
    """A NaN a user appended to metrics.jsonl was copied as is into the resumed log: not strict JSON any more."""
    import json
    for name in ('ckpt.pt', 'metrics.jsonl'):
        (tmp_path / name).write_bytes((saved[0] / name).read_bytes())
    with open(tmp_path / 'metrics.jsonl', 'a') as f:
        f.write('{"iter": 2, "val/loss": NaN, "train/loss": -Infinity}\n')
    resume(tmp_path, char_data)
    strict = lambda name: pytest.fail(f"{name} in metrics.jsonl")
    rows = [json.loads(line, parse_constant=strict) for line in open(tmp_path / 'metrics.jsonl')]
    assert {'iter': 2, 'val/loss': None, 'train/loss': None} in rows and rows[-1]['iter'] == 6


def test_bench_and_prepare_on_a_full_disk_say_one_line(tmp_path):
    """bench.py's report printed to /dev/full was a traceback (the report is in --out by then); a prepare script
    whose stdout is full blamed the dataset, which it had written whole."""
    import subprocess
    import sys
    from conftest import ROOT
    with open('/dev/full', 'w') as full:
        r = subprocess.run([sys.executable, 'bench.py', 'cache', '--layouts=mha', f'--out={tmp_path / "b"}'], cwd=ROOT,
                           stdout=full, stderr=subprocess.PIPE, text=True, timeout=300)
        assert r.returncode == 1 and r.stderr == "error: cannot write to stdout (No space left on device)\n", r.stderr
        assert (tmp_path / 'b' / 'cache.md').exists()
        from conftest import SHAKESPEARE
        r = subprocess.run([sys.executable, 'data/shakespeare_char/prepare.py', f'--out_dir={tmp_path / "p"}',
                            f'--input={SHAKESPEARE}'], cwd=ROOT, stdout=full, stderr=subprocess.PIPE, text=True,
                           timeout=300)
        assert r.returncode == 1 and r.stderr == "error: cannot write to stdout (No space left on device)\n", r.stderr
        assert sorted(os.listdir(tmp_path / 'p')) == ['meta.json', 'train.bin', 'val.bin']
    r = run('bench.py', 'mqar', '--layouts=mha', '--seeds=1', '--vocab=16', '--sets=12:2,16:4', '--max_iters=5',
            f'--out={tmp_path / "m"}', limit=2 ** 16)  # (its data set past the file-size limit)
    assert r.returncode == 2 and 'Traceback' not in r.stderr, r.stderr  # (its progress line, then one line)
    assert r.stderr.splitlines()[-1] == f"error: cannot write the MQAR data in {tmp_path / 'm'}: File too large"
    assert not [f for f in os.listdir(tmp_path / 'm') if f.startswith('.mqar-data-')]
