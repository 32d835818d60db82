"""A run's files (run/checkpoint.py): each written whole or not at all, a failed write or a full
disk keeping the old one; a checkpoint read as tensors only, its CRCs checked, a broken or crafted
one refused in one line by train.py and sample.py alike; one live run per out_dir; a divergence
saves nothing; a SIGKILL never leaves a checkpoint that does not load."""
import fcntl
import json
import math
import os
import random
import re
import shutil
import signal
import struct
import subprocess
import sys
import time
import zipfile
from dataclasses import asdict

import pytest
import torch

from conftest import (ROOT, TINY_TRAIN, digest, live_run, metrics, one_line, refused, run, start,
                      tiny, train)
from model import GPT, GPTConfig
from run import checkpoint
from run.checkpoint import FileError, load_optimizer, read_checkpoint, remove_run


def nan_weights(model):
    return {k: torch.full_like(v, float('nan')) if v.is_floating_point() else v
            for k, v in model.items()}


def first(mapping):
    return next(iter(mapping))


def one_element(model, value):
    """model's weights with one element of the first set to value: the rest finite."""
    w = model[first(model)].clone()
    w.view(-1)[-1] = value
    return {**model, first(model): w}


# Each a checkpoint with one thing wrong: its bytes, or trained's state changed so
BYTES = {'text': lambda good: b'not a checkpoint at all', 'empty': lambda good: b'',
         'corrupt': lambda good: good[:5000], 'random': lambda good: os.urandom(4096)}
STATES = {
    'striter': lambda s: {**s, 'iter_num': str(s['iter_num'])},
    'negative': lambda s: {**s, 'iter_num': -5},
    'nanbest': lambda s: {**s, 'best_val_loss': float('nan')},
    # (no evaluation could ever beat it: ckpt.pt frozen)
    'minusinf': lambda s: {**s, 'best_val_loss': -math.inf},
    'nan': lambda s: {**s, 'model': nan_weights(s['model'])},
    'onenan': lambda s: {**s, 'model': one_element(s['model'], math.nan)},
    'oneinf': lambda s: {**s, 'model': one_element(s['model'], -math.inf)},
    'int64': lambda s: {**s, 'model': {k: v.long() if k == first(s['model']) else v
                                       for k, v in s['model'].items()}},
    'missing': lambda s: {**s, 'model': {k: v for k, v in s['model'].items()
                                         if k != first(s['model'])}},
    'extra': lambda s: {**s, 'model': {**s['model'], 'transformer.extra.weight': torch.zeros(3)}},
    'nooptim': lambda s: {k: v for k, v in s.items() if k != 'optimizer'},
    # torch's load_state_dict accepts moments of another shape: the first AdamW step failed
    'moment': lambda s: {**s, 'optimizer': {**s['optimizer'], 'state': {
        k: {**v, 'exp_avg': torch.zeros(3)} if k == first(s['optimizer']['state']) else v
        for k, v in s['optimizer']['state'].items()}}},
    'groups': lambda s: {**s, 'optimizer': {**s['optimizer'], 'param_groups': [1, 2]}},
    'nokind': lambda s: {**s, 'meta': {k: v for k, v in s['meta'].items() if k != 'kind'}},
    'shortitos': lambda s: {**s, 'meta': {**s['meta'], 'itos': s['meta']['itos'][:5]}},
    # a token of 2 characters: not a character vocabulary
    'wideitos': lambda s: {**s, 'meta': {**s['meta'], 'itos': ['ab'] + s['meta']['itos'][1:]}},
    'bigvocab': lambda s: {**s, 'meta': {**s['meta'], 'vocab_size': 100,
                                         'itos': s['meta']['itos'] + ['x'] * (100 - 65)}},
    'smallvocab': lambda s: {**s, 'meta': {**s['meta'], 'vocab_size': 3,
                                           'itos': s['meta']['itos'][:3]}},
}


def broken(tmp_path, trained, kind):
    """A folder of its own holding trained's ckpt.pt with one thing wrong ('none': no ckpt.pt)."""
    folder = tmp_path / kind
    folder.mkdir()
    if kind in BYTES:
        (folder / 'ckpt.pt').write_bytes(BYTES[kind]((trained / 'ckpt.pt').read_bytes()))
    elif kind in STATES:
        state = torch.load(trained / 'ckpt.pt', weights_only=True)
        torch.save(STATES[kind](state), folder / 'ckpt.pt')
    return folder


DIVERGE = ['--learning_rate=1e12', '--grad_clip=0']
NOT_ADAMW = "its optimizer state is not AdamW's for these weights"
RESUME_FROM = [  # (trained's checkpoint broken so, or trained itself; flags; what train.py says)
    ('corrupt', [], "ckpt.pt: truncated or corrupted, not a whole torch.save file (5,000 bytes)"),
    ('empty', [], "ckpt.pt: truncated or corrupted, not a whole torch.save file (0 bytes)"),
    ('random', [], "cannot load checkpoint"),
    ('striter', [], "no iter_num of the right kind in it"),
    ('negative', [], "no iter_num of the right kind"),
    ('nanbest', [], "no best_val_loss of the right"),
    ('minusinf', [], "no best_val_loss of the right"),
    ('nan', [], "is not finite"),  # (was a NaN loss)
    ('onenan', [], "is not finite"),  # one element is enough
    ('oneinf', [], "is not finite"),
    ('missing', [], "Missing key(s) in state_dict"),
    ('extra', [], 'Unexpected key(s) in state_dict: "transformer.extra.weight"'),
    ('nooptim', [], "no optimizer of the right kind in it: not a checkpoint of train.py"),
    ('moment', [], "cannot resume from {ckpt}: ValueError: " + NOT_ADAMW),
    ('groups', [], "cannot resume from {ckpt}: TypeError: "),  # groups that are not dicts
    (None, [*DIVERGE, '--max_iters=200', '--eval_interval=1000'], "loss is nan at iteration"),
    # a diverged evaluation is never saved
    (None, [*DIVERGE, '--max_iters=30', '--eval_interval=1', '--always_save_checkpoint=True'],
     "gave a non-finite loss"),
    # stopped before its sample
    (None, [*DIVERGE, '--max_iters=30', '--eval_interval=5', '--log_interval=1000',
            '--sample_every_eval=True'], "gave a non-finite loss"),
]


@pytest.mark.parametrize('kind,args,message', RESUME_FROM,
                         ids=[kind or ' '.join(args) for kind, args, _ in RESUME_FROM])
def test_a_resume_from_a_broken_checkpoint_is_one_line(tmp_path, trained, char_data, kind, args,
                                                       message):
    """One line, exit 2, the checkpoint kept as it was; torch's advice for a file weights_only
    refuses (retry with weights_only=False) is not passed on."""
    out = broken(tmp_path, trained, kind) if kind else trained
    before = digest(out / 'ckpt.pt')
    err = refused(out, char_data, '--init_from=resume', *args)
    assert message.format(ckpt=out / 'ckpt.pt') in err
    assert 'weights_only' not in err and 'trusted source' not in err, err
    assert digest(out / 'ckpt.pt') == before


SAMPLE_FROM = [  # (trained's checkpoint broken so, what sample.py says)
    ('none', "no checkpoint (ckpt.pt or last.pt) in"),
    ('text', "cannot load checkpoint"),
    ('empty', "cannot load checkpoint"),
    ('random', "cannot load checkpoint"),
    ('nokind', "meta's kind None should be 'char' (with itos) or 'tiktoken'"),
    ('shortitos', "meta's itos should list vocab_size=65 characters"),
    ('wideitos', "meta's itos should list vocab_size=65 characters (strings of length 1)"),
    # an IndexError deep in the embedding, or in decode
    ('bigvocab', "its vocabulary has 100 tokens, its model 65"),
    ('smallvocab', "its vocabulary has 3 tokens, its model 65"),
    ('nan', "is not finite"),  # (torch.multinomial's error)
    ('int64', "is not a floating-point tensor"),
]


@pytest.mark.parametrize('kind,message', SAMPLE_FROM, ids=[kind for kind, _ in SAMPLE_FROM])
def test_sample_from_a_broken_checkpoint_is_one_line(tmp_path, trained, kind, message):
    out = broken(tmp_path, trained, kind)
    err = one_line(run('sample.py', f'--out_dir={out}', '--num_samples=1', '--max_new_tokens=5',
                       '--device=cpu'))
    assert message in err and 'weights_only' not in err and 'trusted source' not in err, err


def test_int64_weights_are_refused_not_cast(saved, tmp_path):
    """Weights saved as int64 loaded silently (load_state_dict casts them) and the loss went to
    ln 65: named."""
    state = saved[1]
    name = first(state['model'])
    torch.save(STATES['int64'](state), tmp_path / 'ckpt.pt')
    said = f"its weight '{re.escape(name)}' is not a floating-point tensor " \
           r"\(torch.int64, torch.strided, on cpu\)"
    with pytest.raises(FileError, match=said):
        read_checkpoint(str(tmp_path / 'ckpt.pt'))


def test_a_broken_last_pt_names_the_checkpoint_that_loads(tmp_path, trained, char_data):
    shutil.copy(trained / 'ckpt.pt', tmp_path)
    (tmp_path / 'last.pt').write_bytes((tmp_path / 'ckpt.pt').read_bytes()[:3000])
    err = refused(tmp_path, char_data, '--init_from=resume', '--max_iters=6')
    last, ckpt = tmp_path / 'last.pt', tmp_path / 'ckpt.pt'
    assert re.search(rf"cannot load checkpoint {last}: .*; {ckpt} \(iteration \d\) loads: move "
                     rf"{last} away to resume from it", err)


def test_changed_bytes_are_named_corrupted(tmp_path, trained):
    """Bytes changed inside a checkpoint (torch.load reads most such changes as other weights, or
    as a pickle it refuses) are named corrupted."""
    good = (trained / 'ckpt.pt').read_bytes()
    for offset in (100, 1500, len(good) // 2, len(good) - 5000):  # the pickle, its tensors
        changed = bytearray(good)
        changed[offset:offset + 16] = bytes(b ^ 0x5A for b in changed[offset:offset + 16])
        (tmp_path / 'flip.pt').write_bytes(changed)
        with pytest.raises(FileError, match='corrupted'):
            read_checkpoint(str(tmp_path / 'flip.pt'))


def test_a_changed_name_length_in_the_zip_is_named_corrupted_not_loaded_shifted(tmp_path):
    """A flipped bit in a part's local header (its name's length) makes torch.load read that
    weight from shifted bytes, with no error, and makes zipfile fail to decode the name rather
    than report a CRC: still corrupted."""
    cfg = GPTConfig(attn='deltanet', n_layer=2, n_head=2, n_embd=32, block_size=16)
    state = {'model': GPT(cfg).state_dict(), 'model_args': asdict(cfg), 'iter_num': 1,
             'best_val_loss': 1.0}
    torch.save(state, tmp_path / 'good.pt')
    good = (tmp_path / 'good.pt').read_bytes()
    parts = zipfile.ZipFile(tmp_path / 'good.pt').infolist()
    at = parts[len(parts) // 2].header_offset + 26  # the local header's file name length
    for flip in (0x40, 0x80):
        bad = bytearray(good)
        bad[at:at + 2] = struct.pack('<H', struct.unpack('<H', bad[at:at + 2])[0] ^ flip)
        (tmp_path / 'bad.pt').write_bytes(bad)
        # what the check stands in front of
        loaded = torch.load(tmp_path / 'bad.pt', weights_only=True)['model']
        assert any(not torch.equal(loaded[k], v) for k, v in state['model'].items())
        with pytest.raises(FileError, match=r"corrupted: its zip headers do not read"):
            read_checkpoint(str(tmp_path / 'bad.pt'))
    read_checkpoint(str(tmp_path / 'good.pt'))


def test_a_part_marked_a_folder_a_bad_zip64_locator_and_the_old_format_are_refused(tmp_path):
    """One bit of a central-directory entry (the DOS folder attribute) makes torch.load fill that
    tensor with whatever memory held, while every CRC still checks; a changed disk number in the
    zip64 locator made zipfile's is_zipfile raise (a traceback); torch.save's old, non-zip format
    has no CRC at all; zeros or text are no torch.save file at all, said so. Each is one
    FileError."""
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
    not_torch = r"not a torch.save file: it begins as neither a zip nor a pickle"
    for name, data, message in (
            ('folder.pt', folder, r"corrupted: .*data/0 is marked a folder"),
            ('locator.pt', locator, r"corrupted|truncated"),
            ('old.pt', None, r"torch.save's old format, with no CRCs to check it by"),
            ('zeros.pt', bytes(4096), not_torch),
            # (torch: .tar advice; KeyError)
            ('text.pt', b'hello world', r"not a torch.save file")):
        if data is not None:
            (tmp_path / name).write_bytes(data)
        with pytest.raises(FileError, match=message):
            read_checkpoint(str(tmp_path / name), keys=('model',))
    read_checkpoint(str(tmp_path / 'good.pt'), keys=('model',))


class Payload:
    """A pickle that would run a command when loaded unsafely."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f'touch {self.marker}',)


def test_a_pickle_that_runs_code_is_refused_with_its_reason(tmp_path):
    """The refusal printed torch's preamble cut mid-word ("In PyTorch 2.6, we changed the default
    value of the fr") and dropped the reason: now the reason, and the command never ran."""
    torch.save({'model': Payload(tmp_path / 'ran')}, tmp_path / 'ckpt.pt')
    said = r"not a file of tensors that loads safely \(.*GLOBAL posix\.system.*\)$"
    with pytest.raises(FileError, match=said) as e:
        read_checkpoint(str(tmp_path / 'ckpt.pt'))
    assert 'PyTorch 2.6' not in str(e.value) and not (tmp_path / 'ran').exists()


def test_no_pickle_anywhere():
    """Checkpoints are loaded with weights_only=True everywhere; vocabularies are JSON."""
    unsafe = r"^\s*import pickle|pickle\.load|torch\.load\((?![^)]*weights_only=True)"
    offenders = []
    for folder, _, files in os.walk(ROOT):
        parts = os.path.relpath(folder, ROOT).split(os.sep)
        if any(p.startswith('.') or p in ('results', 'wandb', '__pycache__') for p in parts):
            continue
        for name in files:
            if name.endswith('.py') and name != 'test_checkpoint.py':  # (this file says it)
                text = open(os.path.join(folder, name), encoding='utf-8').read()
                if re.search(unsafe, text, re.M):
                    offenders.append(name)
    assert offenders == []


def test_a_crafted_optimizer_state_is_refused():
    """A step < 0, not whole or of a type that wraps, a moment that is not finite or not real, a
    negative second moment, a key AdamW does not keep (amsgrad's max_exp_avg_sq), a weight
    without its state: one ValueError each (one line in train.py)."""
    model = GPT(tiny())
    adamw = lambda: torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt = adamw()
    model(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long))[1].backward()
    opt.step()
    good = opt.state_dict()
    load_optimizer(adamw(), good)  # the untouched state loads
    one = first(good['state'])
    s = good['state'][one]
    last = lambda t, value: torch.cat([t.flatten()[:-1], t.new_tensor([value])]).view_as(t)
    for bad in ({'step': torch.tensor(-1.0)}, {'step': torch.tensor(1.5)},
                # steps that wrap or stick at + 1 (tracebacks)
                {'step': torch.tensor(True)}, {'step': torch.tensor(127, dtype=torch.int8)},
                {'step': torch.tensor(2048.0).half()},
                {'exp_avg': torch.full_like(s['exp_avg'], float('nan'))},
                {'exp_avg_sq': -s['exp_avg_sq'] - 1}, {'max_exp_avg_sq': s['exp_avg_sq']},
                # one element is enough
                {'exp_avg_sq': last(s['exp_avg_sq'], -1.0)},
                {'exp_avg': last(s['exp_avg'], math.inf)},
                # (cast, said nothing)
                {'exp_avg': s['exp_avg'].to(torch.complex64)}, {'exp_avg': s['exp_avg'].long()}):
        crafted = {**good, 'state': {**good['state'], one: {**s, **bad}}}
        with pytest.raises(ValueError, match=NOT_ADAMW):
            load_optimizer(adamw(), crafted)
    # moments restarted from zero: refused
    for partial in ({}, {k: v for k, v in good['state'].items() if k != one}):
        with pytest.raises(ValueError, match=NOT_ADAMW):
            load_optimizer(adamw(), {**good, 'state': partial})


def test_a_checkpoint_that_vanishes_while_being_read(tmp_path, saved, monkeypatch, capsys):
    """--eval_only=True takes no lock: a live run that saves ckpt.pt removes last.pt between our
    listing and opening it (a traceback): the vanished one is skipped, or named in one line if it
    was the only one."""
    shutil.copy(saved[0] / 'ckpt.pt', tmp_path)
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
    said = "were removed while being read (a live run saving?); try again"
    assert said in capsys.readouterr().err


def test_a_checkpoint_removed_after_torch_load_read_it_is_named_so(tmp_path, saved, monkeypatch):
    """Removed after torch.load read it and before its CRCs were checked: it was called
    torch.save's old format."""
    shutil.copy(saved[0] / 'ckpt.pt', tmp_path)
    load = torch.load
    monkeypatch.setattr(checkpoint.torch, 'load',
                        lambda path, **kw: (load(path, **kw), os.remove(path))[0])
    with pytest.raises(FileError, match="removed while being read"):
        read_checkpoint(str(tmp_path / 'ckpt.pt'))


def test_only_train_pys_own_temp_files_are_cleaned(tmp_path, char_data):
    """Stale NAME.tmpPID files of train.py's own NAMEs go when a run starts writing; a user's
    files never, nor in a run that is refused (which keeps ckpt.pt too)."""
    out = tmp_path / 'run'
    train(out, char_data, '--max_iters=2', '--eval_interval=2')
    mine = {'notes.tmp1': 'precious', 'thesis.tmp2024.tex': 'x', 'ckpt.pt.tmp12x': 'not a pid',
            'a.tmp5': 'y'}
    for name, text in mine.items():
        (out / name).write_text(text)
    (out / 'dir.tmp5').mkdir()
    (out / 'ckpt.pt.tmp777').write_bytes(b'half a checkpoint')  # a killed run's
    (out / 'metrics.jsonl.tmp778').write_text('{"iter"')
    before = digest(out / 'ckpt.pt')
    said = "ckpt.pt exists: continue that run with --init_from=resume, replace it with " \
           "--overwrite=True"
    assert said in refused(out, char_data, '--max_iters=2')
    assert digest(out / 'ckpt.pt') == before and (out / 'ckpt.pt.tmp777').exists()
    assert all((out / n).read_text() == t for n, t in mine.items())
    train(out, char_data, '--max_iters=2', '--eval_interval=2', '--overwrite=True')
    assert all((out / n).read_text() == t for n, t in mine.items()) and (out / 'dir.tmp5').is_dir()
    assert not (out / 'ckpt.pt.tmp777').exists() and not (out / 'metrics.jsonl.tmp778').exists()


def test_links_at_our_temp_names_are_never_followed(tmp_path, char_data):
    """Dangling links at NAME.tmpPID (this run's own temp names) used to make the run write a
    checkpoint outside out_dir and turn metrics.jsonl into a link: the links are removed, the
    files are written inside."""
    out, victim = tmp_path / 'out', tmp_path / 'victim'
    out.mkdir()
    links = f'ln -s {victim}-ckpt {out}/ckpt.pt.tmp$$; ln -s {victim}-log {out}/metrics.jsonl.tmp$$'
    cmd = ' '.join([f'{links}; exec', sys.executable, 'train.py', *TINY_TRAIN, f'--out_dir={out}',
                    f'--data_dir={char_data}', '--max_iters=4', '--eval_interval=2'])
    r = subprocess.run(['bash', '-c', cmd], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert not list(tmp_path.glob('victim*')) and not (out / 'metrics.jsonl').is_symlink()
    assert torch.load(out / 'ckpt.pt', weights_only=True)['iter_num'] == 4
    assert not [f for f in os.listdir(out) if '.tmp' in f]


@pytest.mark.parametrize('stop', [KeyboardInterrupt, SystemExit])
def test_an_interrupted_write_leaves_no_temp_file(tmp_path, stop):
    """A signal while a file is written (SystemExit from our handlers, or Ctrl-C): the old file
    kept, no NAME.tmpPID left beside it."""
    (tmp_path / 'report.md').write_text('old')

    def interrupted(f):
        f.write(b'half')
        raise stop
    with pytest.raises(stop):
        checkpoint.write_atomic(str(tmp_path / 'report.md'), interrupted)
    assert os.listdir(tmp_path) == ['report.md'] and (tmp_path / 'report.md').read_text() == 'old'


def test_a_failed_save_is_one_line_and_leaves_the_old_checkpoint(tmp_path, trained, char_data):
    """A write that fails mid-checkpoint (here a 64 KiB file-size limit, as a full disk would):
    one line, exit 2, the previous ckpt.pt intact and no partial temp file left to break the next
    resume."""
    out = tmp_path / 'run'
    shutil.copytree(trained, out)
    before = digest(out / 'ckpt.pt')
    err = refused(out, char_data, '--init_from=resume', '--max_iters=8', '--eval_interval=1',
                  '--always_save_checkpoint=True', limit=64 * 1024)
    assert f"cannot write {out / 'ckpt.pt'}: " in err and f'ckpt.pt in {out} kept' in err
    assert digest(out / 'ckpt.pt') == before and not list(out.glob('ckpt.pt.tmp*'))


def test_a_full_disk_while_logging_stops_with_the_log_whole(tmp_path, char_data):
    """metrics.jsonl appended at every iteration until the (size-limited) disk is full: one line,
    exit 2, every row whole; then a resume whose log rewrite cannot fit: one line, the log as it
    was, no temp file."""
    out = tmp_path / 'run'
    train(out, char_data, '--max_iters=2', '--eval_interval=2')
    # a dozen rows more; checkpoints are saved at the end only
    limit = os.path.getsize(out / 'metrics.jsonl') + 2000
    err = refused(out, char_data, '--init_from=resume', '--max_iters=200', '--eval_interval=200',
                  '--log_interval=1', limit=limit)
    assert f"cannot write {out / 'metrics.jsonl'}: " in err and "the log's last row whole" in err
    rows = metrics(out)  # every line parses
    assert len(rows) > 10 and os.path.getsize(out / 'metrics.jsonl') <= limit
    before = digest(out / 'metrics.jsonl')
    # below the rows it keeps (those before its checkpoint)
    err = refused(out, char_data, '--init_from=resume', '--max_iters=1000', limit=100)
    assert f"cannot write {out / 'metrics.jsonl'}: " in err
    assert digest(out / 'metrics.jsonl') == before and not list(out.glob('*.tmp*'))


def test_a_log_swapped_for_a_fifo_or_a_folder_is_one_line_never_a_hang(tmp_path, char_data):
    """metrics.jsonl replaced under a live run: by a FIFO (an append blocked for good, deaf to
    SIGTERM), by a folder (a traceback from the cut-back), or the whole out_dir deleted: each one
    line, exit 2, within seconds."""
    for how in ('fifo', 'dir', 'gone'):
        out = tmp_path / how
        p = live_run(out, char_data)
        if how == 'gone':
            for f in out.iterdir():
                f.unlink()
            out.rmdir()
        else:
            (out / 'metrics.jsonl').unlink()
            (os.mkfifo if how == 'fifo' else os.mkdir)(out / 'metrics.jsonl')
        _, err = p.communicate(timeout=60)
        lines = err.strip().splitlines()
        assert p.returncode == 2 and 'Traceback' not in err and len(lines) == 1, err
        assert "cannot write" in err and "metrics.jsonl" in err, err


def test_a_second_run_into_a_live_out_dir_is_refused(tmp_path, char_data):
    """Two runs writing one out_dir would race on its files: the second is refused in one line
    while the first lives, and the lock dies with the first (a killed run leaves nothing stuck,
    nor its temp files)."""
    args = ['train.py', *TINY_TRAIN, f'--out_dir={tmp_path}', f'--data_dir={char_data}',
            '--max_iters=100000', '--eval_interval=100000']
    first = start(*args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    log, deadline = tmp_path / 'metrics.jsonl', time.time() + 60
    while not log.exists() or log.stat().st_size < 200:
        assert time.time() < deadline and first.poll() is None
        time.sleep(0.1)
    assert 'is in use by another train.py run' in one_line(run(*args))
    assert first.poll() is None  # the first trains on
    first.kill()
    first.wait()
    # as a kill inside a save leaves it
    (tmp_path / 'ckpt.pt.tmp12345').write_bytes(b'half a checkpoint')
    # the dead run's lock is gone (its log without a checkpoint: replaced only with --overwrite)
    train(tmp_path, char_data, '--max_iters=2', '--overwrite=True')
    assert not list(tmp_path.glob('ckpt.pt.tmp*'))


def test_a_resume_into_a_live_run_without_a_checkpoint_names_the_run(tmp_path, char_data):
    """--init_from=resume into an out_dir whose live run has not saved yet: that run is named, not
    only "no checkpoint"; once its lock is free, the plain message again."""
    tmp_path.joinpath('train.lock').touch()
    with open(tmp_path / 'train.lock', 'a') as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a live run holds it
        err = refused(tmp_path, char_data, '--init_from=resume')
        assert "no checkpoint (ckpt.pt or last.pt) in out_dir=" in err
        assert "yet: a train.py run is using it" in err
    assert "is using it" not in refused(tmp_path, char_data, '--init_from=resume')


def test_overwrite_replaces_a_finished_run(tmp_path, trained, char_data):
    """--overwrite=True: the old checkpoints are removed when the new run starts, and its log
    starts anew."""
    out = tmp_path / 'run'
    shutil.copytree(trained, out)
    shutil.copy(trained / 'ckpt.pt', out / 'last.pt')
    r = train(out, char_data, '--max_iters=2', '--overwrite=True', '--n_layer=1')
    assert f"removed {out / 'last.pt'} (--overwrite=True)" in r.stdout
    assert sorted(os.listdir(out)) == ['ckpt.pt', 'metrics.jsonl', 'train.lock']
    ckpt = torch.load(out / 'ckpt.pt', weights_only=True)
    assert ckpt['iter_num'] == 2 and ckpt['model_args']['n_layer'] == 1
    assert [row['iter'] for row in metrics(out) if 'val/loss' in row] == [0, 2]


def test_a_diverged_fresh_run_saves_no_checkpoint_and_logs_strict_json(tmp_path, char_data):
    """A loss that diverges: one line, exit 2, no checkpoint; the non-finite loss logged as null
    (metrics.jsonl stays strict JSON)."""
    err = refused(tmp_path, char_data, *DIVERGE, '--max_iters=30', '--eval_interval=1',
                  '--always_save_checkpoint=True')
    assert 'non-finite' in err and 'no checkpoint was written' in err
    assert not (tmp_path / 'ckpt.pt').exists()
    strict = lambda c: pytest.fail(f"{c} in metrics.jsonl")
    rows = [json.loads(line, parse_constant=strict) for line in open(tmp_path / 'metrics.jsonl')]
    assert any(v is None for row in rows for v in row.values())  # the non-finite loss, as null


def test_non_finite_weights_are_never_saved_by_an_interrupt(tmp_path, char_data):
    """A step that leaves a weight infinite, then SIGTERM (patched in: AdamW.step): one line,
    nothing saved."""
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
    r = run('-c', hook, *TINY_TRAIN, f'--out_dir={tmp_path}', f'--data_dir={char_data}',
            '--max_iters=20')
    assert one_line(r).strip() == ("error: the weights at iteration 1 are not finite: not saved, "
                                   "no checkpoint was written (try a lower learning_rate)")
    assert not list(tmp_path.glob('*.pt'))


def test_out_of_memory_at_the_first_step_leaves_no_out_dir(tmp_path, char_data):
    """Out of memory at the first step was one line but left the new out_dir and its train.lock
    (os._exit skipped the run's cleanup): the atexit cleanups run first now."""
    args = ['train.py', *TINY_TRAIN, f'--data_dir={char_data}',
            f'--out_dir={tmp_path / "new" / "out"}']
    oom = ("import sys, runpy, torch\n"
           "def step(self, *a, **k):\n"
           "    raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 9 GiB')\n"
           f"torch.optim.AdamW.step = step\nsys.argv = {args!r}\n"
           "runpy.run_path('train.py', run_name='__main__')\n")
    r = run('-c', oom, timeout=300)
    said = "error: out of memory (OutOfMemoryError: CUDA out of memory"
    assert r.returncode == 2 and said in r.stderr, r.stderr
    assert 'Traceback' not in r.stderr and not (tmp_path / 'new').exists()


def test_out_dir_paths_are_blamed_right(tmp_path, char_data):
    """A file, a dangling link or a folder where the run writes a file: one line naming that path,
    before anything is written (a folder at ckpt.pt once failed only at the first save);
    A/../B is B, with no stray empty A beside it."""
    (tmp_path / 'a').mkdir()
    (tmp_path / 'a' / 'ckpt.pt').write_text('')
    os.symlink(tmp_path / 'nowhere', tmp_path / 'dangling')
    for name in ('train.lock', 'ckpt.pt', 'metrics.jsonl'):
        (tmp_path / name.replace('.', '-') / name).mkdir(parents=True)
    for out_dir, said in ((tmp_path / 'a' / 'ckpt.pt', "ckpt.pt' is a file, not a folder"),
                          (tmp_path / 'dangling', "dangling' is a link to"),
                          *((tmp_path / n.replace('.', '-'), f"/{n} is a folder, where this run "
                             "writes a file") for n in ('train.lock', 'ckpt.pt', 'metrics.jsonl'))):
        before = sorted(os.listdir(out_dir)) if out_dir.is_dir() else None
        assert said in refused(out_dir, char_data, '--max_iters=1')
        assert (sorted(os.listdir(out_dir)) if out_dir.is_dir() else None) == before
    train(f'{tmp_path}/A/../B', char_data, '--max_iters=1')
    assert (tmp_path / 'B' / 'ckpt.pt').is_file() and not (tmp_path / 'A').exists()


def test_an_earlier_log_without_a_checkpoint_is_never_replaced_silently(tmp_path, char_data):
    """A run that left a log but no checkpoint (diverged, killed before its first save,
    max_iters=0): a new run there is refused without --overwrite, the log kept; with it,
    replaced."""
    train(tmp_path, char_data, '--max_iters=0')
    log = (tmp_path / 'metrics.jsonl').read_text()
    assert log and not list(tmp_path.glob('*.pt'))
    said = refused(tmp_path, char_data, '--max_iters=1')
    assert "metrics.jsonl holds an earlier run's log (it saved no checkpoint)" in said
    assert (tmp_path / 'metrics.jsonl').read_text() == log
    train(tmp_path, char_data, '--max_iters=1', '--overwrite=True')
    assert [row['iter'] for row in metrics(tmp_path)] == [0, 0, 1]


def test_a_live_run_is_never_removed(tmp_path):
    """remove_run (bench.py's, before it replaces a run) checks and takes the lock first: a live
    folder is refused; once its lock is free, removed."""
    run_dir = tmp_path / 'mha'
    run_dir.mkdir()
    (run_dir / 'metrics.jsonl').write_text('{"iter": 0}\n')
    with open(run_dir / 'train.lock', 'a') as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(FileError, match="in use by a live train.py run"):
            remove_run(str(run_dir))
    remove_run(str(run_dir))  # the lock free: removed
    assert not run_dir.exists()


@pytest.mark.slow
def test_stress_random_sigkill_and_sigterm(tmp_path, char_data):
    """20+ runs of one training, each stopped at a random moment by SIGKILL or SIGTERM (half each),
    each resuming the last: it saves every iteration, so kills land inside saves. After every stop
    the newest state loads and never goes back; at the end a last resume finishes, and
    metrics.jsonl is one log: in order, no row twice."""
    rng = random.Random(0)
    every = ['--eval_interval=1', '--eval_iters=1', '--log_interval=1',
             '--always_save_checkpoint=True']
    args = ['train.py', *TINY_TRAIN, f'--out_dir={tmp_path}', f'--data_dir={char_data}',
            '--max_iters=100000', *every]
    log = tmp_path / 'metrics.jsonl'
    resumed_at, mid_save, kinds = [], 0, []
    # 20 tries, more only until a SIGKILL has landed in a save (4 in 10 do)
    for attempt in range(40):
        if attempt >= 20 and mid_save:
            break
        resume = ['--init_from=resume'] if list(tmp_path.glob('*.pt')) else []
        rows = len(log.read_text().splitlines()) if resume else 0
        p = start(*args, *resume)
        deadline = time.time() + 60
        # until it trains; then several saves a second
        while not (log.exists() and len(log.read_text().splitlines()) > rows + 2):
            if p.poll() is not None:
                break
            assert time.time() < deadline
            time.sleep(0.02)
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
        # every file loads
        states = [torch.load(f, weights_only=True)['iter_num'] for f in tmp_path.glob('*.pt')]
        resumed_at.append(max(states))
    assert mid_save >= 1 and kinds.count(signal.SIGTERM) >= 5 and kinds.count(signal.SIGKILL) >= 5
    assert len(resumed_at) >= 20 and resumed_at == sorted(resumed_at)
    assert resumed_at[-1] > resumed_at[0]
    end = resumed_at[-1] + 3
    train(tmp_path, char_data, '--init_from=resume', f'--max_iters={end}', *every)
    rows = metrics(tmp_path)  # every line parses
    key = lambda row: (row['iter'], 'val/loss' in row)
    assert [row['iter'] for row in rows] == sorted(row['iter'] for row in rows)  # never going back
    assert len(set(map(key, rows))) == len(rows)  # no row twice
    every_row = {(i, e) for i in range(end + 1) for e in (True, False)} - {(end, False)}
    assert {key(row) for row in rows} == every_row
    assert torch.load(tmp_path / 'ckpt.pt', weights_only=True)['iter_num'] == end
