"""Nothing lost, round 4: what a second hostile pass found after round 3's fixes (and the run's files moved into
checkpoint.py): files swapped under a live run, links at our temp names, flags past int64, crafted checkpoints and
data, a kill in a prepare script, a bench run that never ran."""
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

from conftest import ROOT, SHAKESPEARE
from test_hostile import one_line, run
from test_train import TINY, train


def live_run(out, char_data):
    """train.py logging every iteration for a long time, once it has logged a few rows to metrics.jsonl."""
    p = subprocess.Popen([sys.executable, 'train.py', *TINY, f'--out_dir={out}', f'--data_dir={char_data}',
                          '--max_iters=100000', '--eval_interval=100000', '--log_interval=1'], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    logged = 0
    while logged < 3:
        line = p.stdout.readline()
        assert line, p.stderr.read()
        logged += line.startswith('iter ')
    return p


def test_a_log_swapped_for_a_fifo_or_a_folder_is_one_line_never_a_hang(tmp_path, char_data):
    """metrics.jsonl replaced under a live run: by a FIFO (an append blocked for good, deaf to SIGTERM), by a folder
    (a traceback from the cut-back), or the whole out_dir deleted: each one line, exit 2, within seconds."""
    for how in ('fifo', 'dir', 'gone'):
        out = tmp_path / how
        p = live_run(out, char_data)
        if how == 'gone':
            for f in out.iterdir():
                f.unlink()
            out.rmdir()
        else:
            (out / 'metrics.jsonl').unlink()
            os.mkfifo(out / 'metrics.jsonl') if how == 'fifo' else (out / 'metrics.jsonl').mkdir()
        _, err = p.communicate(timeout=60)
        assert p.returncode == 2 and 'Traceback' not in err and len(err.strip().splitlines()) == 1, err
        assert "cannot write" in err and "metrics.jsonl" in err, err


def test_links_at_our_temp_names_are_never_followed(tmp_path, char_data):
    """Dangling links at NAME.tmpPID (this run's own temp names) used to make the run write a checkpoint outside
    out_dir and turn metrics.jsonl into a link: the links are removed, the files are written inside."""
    out, victim = tmp_path / 'out', tmp_path / 'victim'
    out.mkdir()
    cmd = ' '.join([f'ln -s {victim}-ckpt {out}/ckpt.pt.tmp$$; ln -s {victim}-log {out}/metrics.jsonl.tmp$$; exec',
                    sys.executable, 'train.py', *TINY, f'--out_dir={out}', f'--data_dir={char_data}', '--max_iters=4',
                    '--eval_interval=2'])
    r = subprocess.run(['bash', '-c', cmd], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert not list(tmp_path.glob('victim*')) and not (out / 'metrics.jsonl').is_symlink()
    assert torch.load(out / 'ckpt.pt', weights_only=True)['iter_num'] == 4
    assert not [f for f in os.listdir(out) if '.tmp' in f]


def test_integers_past_int64_and_nested_json_are_one_line(tmp_path, char_data):
    """A width past int64 (a TypeError from torch), a warmup of 10^400 (an OverflowError in get_lr, after the lock), a
    meta.json nested 100,000 deep (a RecursionError): one line each, nothing written."""
    deep = tmp_path / 'deep'
    deep.mkdir()
    for name in ('train.bin', 'val.bin'):
        (deep / name).write_bytes(open(os.path.join(char_data, name), 'rb').read())
    (deep / 'meta.json').write_text('[' * 100000 + ']' * 100000)
    for args, message in ((['--n_embd=10000000000000000000', '--n_head=1'], "is out of range (|value| < 2**62)"),
                          ([f"--warmup_iters=1{'0' * 400}"], "is out of range"),
                          ([f'--data_dir={deep}'], "is missing or broken (maximum recursion depth")):
        out = tmp_path / 'out'
        r = run('train.py', *TINY, f'--out_dir={out}', f'--data_dir={char_data}', *args)
        assert message in one_line(r) and not (out / 'metrics.jsonl').exists()


def test_crafted_checkpoints_are_one_line(tmp_path, char_data):
    """sample.py: a vocabulary larger or smaller than the model's (an IndexError deep in embedding or decode), weights
    that are NaN (torch.multinomial's error); a resume: a negative iteration, a NaN best loss."""
    train(tmp_path / 'run', char_data, '--max_iters=2', '--eval_interval=2')
    state = torch.load(tmp_path / 'run' / 'ckpt.pt', weights_only=True)
    itos = state['meta']['itos']
    cases = {'big': {**state, 'meta': {**state['meta'], 'vocab_size': 100, 'itos': itos + ['x'] * (100 - len(itos))}},
             'small': {**state, 'meta': {**state['meta'], 'vocab_size': 3, 'itos': itos[:3]}},
             'nan': {**state, 'model': {k: torch.full_like(v, float('nan')) if v.is_floating_point() else v
                                        for k, v in state['model'].items()}},
             'negative': {**state, 'iter_num': -5}, 'nanbest': {**state, 'best_val_loss': float('nan')},
             'minusinf': {**state, 'best_val_loss': -math.inf}}  # (no evaluation could ever beat it: ckpt.pt frozen)
    for name, ckpt in cases.items():
        (tmp_path / name).mkdir()
        torch.save(ckpt, tmp_path / name / 'ckpt.pt')
    for name, message in (('big', "its vocabulary has 100 tokens, its model 65"),
                          ('small', "its vocabulary has 3 tokens, its model 65"), ('nan', "is not finite")):
        r = run('sample.py', f'--out_dir={tmp_path / name}', '--num_samples=1', '--max_new_tokens=5', '--device=cpu')
        assert message in one_line(r)
    for name, message in (('negative', "no iter_num of the right kind"), ('nanbest', "no best_val_loss of the right"),
                          ('minusinf', "no best_val_loss of the right"), ('nan', "is not finite")):  # (was a NaN loss)
        r = run('train.py', *TINY, f'--out_dir={tmp_path / name}', f'--data_dir={char_data}', '--init_from=resume',
                '--max_iters=4')
        assert message in one_line(r)


def test_a_killed_prepare_script_leaves_no_temp_file(tmp_path):
    """SIGTERM while a prepare script writes train.bin.tmpPID: exit 143, the temp file removed (it was left)."""
    big = tmp_path / 'big.txt'
    big.write_text(open(SHAKESPEARE, encoding='utf-8').read() * 40)  # (CI sets no SHAKESPEARE_PATH)
    out = tmp_path / 'data'
    p = subprocess.Popen([sys.executable, 'data/shakespeare_char/prepare.py', '--out_dir', str(out), '--input',
                          str(big)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 60
    while not (out.is_dir() and [f for f in os.listdir(out) if '.tmp' in f]):
        assert time.time() < deadline and p.poll() is None, "the prepare script ended before it was signalled"
        time.sleep(0.005)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 143 and not [f for f in os.listdir(out) if '.tmp' in f], os.listdir(out)
    assert err.decode().strip() == 'error: stopped by SIGTERM', err  # one line


@pytest.mark.parametrize('sig', [signal.SIGINT, signal.SIGTERM], ids=['SIGINT', 'SIGTERM'])
@pytest.mark.parametrize('delay', [0.1, 0.6])
def test_the_other_scripts_stopped_during_start_up_say_one_line(tmp_path, sig, delay):
    """sample.py, bench.py and a prepare script stopped while torch or numpy is still being imported (Ctrl-C gave a
    traceback, or pybind11's abort inside torch's import; SIGTERM nothing at all): one line on stderr, exit 130 or
    143. Their handlers come before the slow imports."""
    for script, *args in (('sample.py', f'--out_dir={tmp_path / "none"}'),
                          ('data/shakespeare_char/prepare.py', f'--out_dir={tmp_path / "none"}'),
                          ('bench.py', 'cache', '--layouts=mha', f'--out={tmp_path / "bench"}')):
        p = subprocess.Popen([sys.executable, script, *args], cwd=ROOT, text=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # as a foreground Ctrl-C
        time.sleep(delay)
        p.send_signal(sig)
        err = p.communicate(timeout=60)[1]
        if p.returncode not in (0, 2):  # (2: it was that fast, and found no checkpoint or text: one line too)
            assert p.returncode == 128 + sig and err.strip() == ('error: interrupted' if sig == signal.SIGINT else
                                                                 'error: stopped by SIGTERM'), (script, err)
        assert 'Traceback' not in err and len(err.strip().splitlines()) <= 1, (script, err)


def test_bench_keeps_its_earlier_run_when_train_py_ran_none(tmp_path):
    """`bench.py train -- --help`: train.py exits 0 without a run; bench.py deleted its earlier run, then crashed.
    And decode in float16 on a CPU (fp16 matmuls ~500x slower, an 18-minute floor) is refused at once."""
    earlier = tmp_path / 'train' / 'mha'
    earlier.mkdir(parents=True)
    (earlier / 'metrics.jsonl').write_text(json.dumps({'iter': 0}) + '\n')  # a folder bench.py wrote
    r = run('bench.py', 'train', '--layouts=mha', '--max_iters=1', f'--out={tmp_path}', '--', '--help')
    assert r.returncode == 2 and 'Traceback' not in r.stderr and "ended without a run" in r.stderr.splitlines()[-1]
    assert (earlier / 'metrics.jsonl').read_text() == '{"iter": 0}\n'  # (bench.py's progress lines go to stderr too)
    for mode in ('decode', 'gpu'):  # (gpu on a CPU in float16 ran its roofline's fp16 products for minutes)
        r = run('bench.py', mode, '--layouts=mha', '--dtype=float16', '--device=cpu', f'--out={tmp_path}')
        assert "--dtype=float16 on CPU" in one_line(r)


def test_linear_layouts_hostile_pass(tmp_path):
    """The hostile pass on the linear layouts (#23): data/mqar is bench.py's recall data, not a training text (its
    prepare.py takes other arguments: a traceback); bench.py builds every layout's model with the extras before
    the first run (a hybrid that does not fit --n_layer failed after the other layouts had trained)."""
    r = run('train.py', *TINY, '--dataset=mqar', f'--out_dir={tmp_path / "out"}')
    assert "dataset='mqar' is unknown: give one of ['shakespeare', 'shakespeare_char']" in one_line(r)
    r = run('bench.py', 'train', '--max_iters=2', '--layouts=gated_deltanet,hybrid', f'--out={tmp_path / "bench"}', '--',
            '--n_layer=2')
    assert "layout hybrid with --n_layer=2: GPTConfig.attn='gated_deltanet*3+gqa' is invalid: has 4 layers" in one_line(r)
    assert not (tmp_path / 'bench' / 'train').exists() and not (tmp_path / 'out').exists()  # no run started


def test_crafted_optimizer_and_wandb_states_are_one_line(tmp_path, char_data):
    """A resume from a checkpoint whose optimizer moments have another shape (torch's load_state_dict accepts them;
    the first AdamW step fails after an evaluation) or whose groups are not dicts: one line, the file untouched. A
    'wandb' entry of the wrong kinds (samples None, a name that is a number) is dropped, not a traceback."""
    train(tmp_path / 'run', char_data, '--max_iters=2', '--eval_interval=2')
    state = torch.load(tmp_path / 'run' / 'ckpt.pt', weights_only=True)
    first = next(iter(state['optimizer']['state']))
    moments = {**state['optimizer']['state'], first: {**state['optimizer']['state'][first], 'exp_avg': torch.zeros(3)}}
    cases = {'moment': {**state, 'optimizer': {**state['optimizer'], 'state': moments}},
             'groups': {**state, 'optimizer': {**state['optimizer'], 'param_groups': [1, 2]}}}
    for (name, ckpt), why in zip(cases.items(), ["ValueError: its optimizer state is not AdamW's for these weights",
                                                 "TypeError: "]):
        (tmp_path / name).mkdir()
        torch.save(ckpt, tmp_path / name / 'ckpt.pt')
        before = (tmp_path / name / 'ckpt.pt').read_bytes()
        r = run('train.py', *TINY, f'--out_dir={tmp_path / name}', f'--data_dir={char_data}', '--init_from=resume',
                '--max_iters=4')
        assert f"cannot resume from {tmp_path / name / 'ckpt.pt'}: {why}" in one_line(r)
        assert (tmp_path / name / 'ckpt.pt').read_bytes() == before
    (tmp_path / 'wandb').mkdir()
    torch.save({**state, 'wandb': {'samples': None, 'name': 5, 'id': 'abcd1234', 'step': True}},
               tmp_path / 'wandb' / 'ckpt.pt')
    env = {'WANDB_MODE': 'offline', 'WANDB_API_KEY': None, 'HOME': str(tmp_path), 'WANDB_SILENT': 'true',
           'WANDB_DIR': str(tmp_path)}
    r = train(tmp_path / 'wandb', char_data, '--init_from=resume', '--max_iters=4', '--eval_interval=2',
              '--wandb_log=True', env=env)
    assert re.search(r"^W&B run \S+ \(offline\)", r.stdout, re.M) and 'Traceback' not in r.stderr, r.stdout
    assert torch.load(tmp_path / 'wandb' / 'ckpt.pt', weights_only=True)['wandb']['id'] == 'abcd1234'


def test_a_resume_into_a_live_run_without_a_checkpoint_names_the_run(tmp_path, char_data):
    """--init_from=resume into an out_dir whose live run has not saved yet: that run is named, not only "no
    checkpoint"; once its lock is free, the plain message again."""
    import fcntl
    tmp_path.joinpath('train.lock').touch()
    args = ('train.py', *TINY, f'--out_dir={tmp_path}', f'--data_dir={char_data}', '--init_from=resume')
    with open(tmp_path / 'train.lock', 'a') as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a live run holds it
        assert "no checkpoint (ckpt.pt or last.pt) in out_dir=" in (err := one_line(run(*args)))
        assert "yet: a train.py run is using it" in err
    assert "is using it" not in one_line(run(*args))


def test_conversion_and_start_up_hostile_pass(tmp_path, char_data):
    """Bytes changed inside a checkpoint (torch.load reads most such changes as other weights, or as a pickle it
    refuses) are named corrupted; a conversion source with a weight missing, or a block_size longer than the data,
    is one line; so is a RANK left in the environment outside torchrun, and a gradient_accumulation_steps that
    torchrun's processes cannot share."""
    import numpy as np
    from run.checkpoint import FileError, read_checkpoint
    train(tmp_path / 'run', char_data, '--max_iters=2', '--eval_interval=2')
    good = (tmp_path / 'run' / 'ckpt.pt').read_bytes()
    for offset in (100, 1500, len(good) // 2, len(good) - 5000):  # the pickle, its tensors
        changed = bytearray(good)
        changed[offset:offset + 16] = bytes(b ^ 0x5A for b in changed[offset:offset + 16])
        (tmp_path / 'flip.pt').write_bytes(changed)
        with pytest.raises(FileError, match='corrupted'):
            read_checkpoint(str(tmp_path / 'flip.pt'))
    state = torch.load(tmp_path / 'run' / 'ckpt.pt', weights_only=True)
    (tmp_path / 'missing').mkdir()
    torch.save({**state, 'model': {k: v for k, v in state['model'].items() if 'h.1.mlp.c_fc' not in k}},
               tmp_path / 'missing' / 'ckpt.pt')
    r = run('train.py', *TINY, '--attn=gqa', f'--init_from={tmp_path / "missing"}', f'--out_dir={tmp_path / "x"}',
            f'--data_dir={char_data}', '--max_iters=2')
    assert 'cannot convert' in one_line(r) and 'Missing key' in r.stderr and not (tmp_path / 'x' / 'ckpt.pt').exists()
    long_run = ['config/cpu.py', '--n_layer=1', '--n_head=2', '--n_embd=16', '--batch_size=2', '--eval_iters=1']
    train(tmp_path / 'long', char_data, '--max_iters=1', '--eval_interval=1', '--block_size=300', base=long_run)
    short = tmp_path / 'short'  # the same vocabulary, a val.bin of 280 tokens: enough for cpu.py's 64, not 300
    short.mkdir()
    (short / 'meta.json').write_bytes(open(os.path.join(char_data, 'meta.json'), 'rb').read())
    (np.arange(2000) % 65).astype(np.uint16).tofile(short / 'train.bin')
    (np.arange(280) % 65).astype(np.uint16).tofile(short / 'val.bin')
    r = run('train.py', *long_run, '--attn=gqa', f'--init_from={tmp_path / "long"}', f'--out_dir={tmp_path / "y"}',
            f'--data_dir={short}', '--max_iters=2')
    assert 'val.bin has 280 tokens, not more than block_size=300' in one_line(r)
    r = run('train.py', *TINY, f'--out_dir={tmp_path / "z"}', f'--data_dir={char_data}', env={'RANK': '0'})
    assert 'use torchrun or unset it' in one_line(r)
    r = run('train.py', *TINY, f'--out_dir={tmp_path / "z"}', f'--data_dir={char_data}', '--gradient_accumulation_steps=3',
            env={'RANK': '0', 'WORLD_SIZE': '2'})  # torchrun's 2 processes: checked before any work
    assert 'gradient_accumulation_steps=3 must be a multiple of the 2 DDP processes' in one_line(r)
    for world in ('\u00b2', ' 2 '):  # a superscript 2 (isdigit, but not int's), spaces (int's, not isdigit's)
        r = run('train.py', *TINY, f'--out_dir={tmp_path / "z"}', f'--data_dir={char_data}',
                '--gradient_accumulation_steps=3', env={'RANK': '0', 'WORLD_SIZE': world})
        assert r.returncode == 2 and 'Traceback' not in r.stderr, r.stderr
    assert not (tmp_path / 'z').exists()


def test_a_changed_name_length_in_the_zip_is_named_corrupted_not_loaded_shifted(tmp_path):
    """A flipped bit in a part's local header (its name's length) makes torch.load read that weight from shifted
    bytes, with no error, and makes zipfile fail to decode the name rather than report a CRC: still corrupted."""
    import struct
    import zipfile
    from dataclasses import asdict
    from run.checkpoint import FileError, read_checkpoint
    from model import GPT, GPTConfig
    cfg = GPTConfig(attn='deltanet', n_layer=2, n_head=2, n_embd=32, block_size=16)
    state = {'model': GPT(cfg).state_dict(), 'model_args': asdict(cfg), 'iter_num': 1, 'best_val_loss': 1.0}
    torch.save(state, tmp_path / 'good.pt')
    good = (tmp_path / 'good.pt').read_bytes()
    parts = zipfile.ZipFile(tmp_path / 'good.pt').infolist()
    at = parts[len(parts) // 2].header_offset + 26  # the local header's file name length
    for flip in (0x40, 0x80):
        bad = bytearray(good)
        bad[at:at + 2] = struct.pack('<H', struct.unpack('<H', bad[at:at + 2])[0] ^ flip)
        (tmp_path / 'bad.pt').write_bytes(bad)
        loaded = torch.load(tmp_path / 'bad.pt', weights_only=True)['model']  # what the check stands in front of
        assert any(not torch.equal(loaded[k], v) for k, v in state['model'].items())
        with pytest.raises(FileError, match=r"corrupted: its zip headers do not read"):
            read_checkpoint(str(tmp_path / 'bad.pt'))
    read_checkpoint(str(tmp_path / 'good.pt'))



def test_a_part_marked_a_folder_a_bad_zip64_locator_and_the_old_format_are_refused(tmp_path):
    """One bit of a central-directory entry (the DOS folder attribute) makes torch.load fill that tensor with
    whatever memory held, while every CRC still checks; a changed disk number in the zip64 locator made zipfile's
    is_zipfile raise (a traceback); torch.save's old, non-zip format has no CRC at all; zeros or text are no
    torch.save file at all, said so. Each is one FileError."""
    import struct
    from dataclasses import asdict
    from run.checkpoint import FileError, read_checkpoint
    from model import GPT, GPTConfig
    cfg = GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=16)
    state = {'model': GPT(cfg).state_dict(), 'model_args': asdict(cfg)}
    torch.save(state, tmp_path / 'good.pt')
    good = (tmp_path / 'good.pt').read_bytes()
    folder, at = bytearray(good), good.find(b'PK\x01\x02')  # the central directory's entries
    while True:
        name_len, extra, comment = struct.unpack('<HHH', folder[at + 28:at + 34])
        if folder[at + 46:at + 46 + name_len].endswith(b'data/0'):
            folder[at + 38] |= 0x10  # the external attributes' low byte: MS-DOS "directory"
            break
        at += 46 + name_len + extra + comment
    locator = bytearray(good)
    locator[good.rfind(b'PK\x06\x07') + 4] = 1  # "the zip64 end record is on disk 1"
    torch.save(state, tmp_path / 'old.pt', _use_new_zipfile_serialization=False)
    torch.load(tmp_path / 'old.pt', weights_only=True)  # loads: nothing in it to check against
    for name, data, message in (('folder.pt', folder, r"corrupted: .*data/0 is marked a folder"),
                                ('locator.pt', locator, r"corrupted|truncated"),
                                ('old.pt', None, r"torch.save's old format, with no CRCs to check it by"),
                                ('zeros.pt', bytes(4096), r"not a torch.save file: it begins as neither a zip nor a pickle"),
                                ('text.pt', b'hello world', r"not a torch.save file")):  # (torch: .tar advice; KeyError)
        if data is not None:
            (tmp_path / name).write_bytes(data)
        with pytest.raises(FileError, match=message):
            read_checkpoint(str(tmp_path / name), keys=('model',))
    read_checkpoint(str(tmp_path / 'good.pt'), keys=('model',))
