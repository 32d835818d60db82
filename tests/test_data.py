"""The data: preparing it (char level, BPE with a tiktoken.Encoding built here, MQAR; no download),
and train.py reading a data folder: a broken one, a FIFO in it or a dataset that is no folder of
data is one line, exit 2, the run's files kept."""
import json
import os
import random
import shutil
import signal
import time

import numpy as np
import pytest
import torch

from conftest import (ROOT, SHAKESPEARE, TINY_TRAIN, digest, find_text, live_run, one_line, refused,
                      run, small_gpt2_like_encoding, start, train)
from data import common
from data.mqar.prepare import load, zoology
from data.shakespeare.prepare import prepare as prepare_bpe

CHAR_PREPARE = 'data/shakespeare_char/prepare.py'


def test_char_prepare_matches_nanogpt(char_data):
    meta = json.load(open(os.path.join(char_data, 'meta.json'), encoding='utf-8'))
    train_ids = np.fromfile(os.path.join(char_data, 'train.bin'), dtype=np.uint16)
    val_ids = np.fromfile(os.path.join(char_data, 'val.bin'), dtype=np.uint16)
    assert meta['vocab_size'] == 65 == len(meta['itos'])
    assert (len(train_ids), len(val_ids)) == (1_003_854, 111_540)
    text = open(SHAKESPEARE, encoding='utf-8').read()
    decoded = ''.join(meta['itos'][i] for i in np.concatenate([train_ids, val_ids]))
    assert decoded == text  # lossless, in order, nothing dropped at the split
    assert meta['itos'] == sorted(meta['itos'])


def test_bpe_prepare_with_a_local_encoding(tmp_path):
    enc = small_gpt2_like_encoding()
    prepare_bpe(str(tmp_path), SHAKESPEARE, enc=enc)
    meta = json.load(open(tmp_path / 'meta.json'))
    assert meta == {'kind': 'tiktoken', 'encoding': 'test-bpe', 'vocab_size': 259}
    train_ids = np.fromfile(tmp_path / 'train.bin', dtype=np.uint16)
    val_ids = np.fromfile(tmp_path / 'val.bin', dtype=np.uint16)
    text = open(SHAKESPEARE, encoding='utf-8').read()
    n = int(len(text) * 0.9)
    assert enc.decode(train_ids.tolist()) == text[:n] and enc.decode(val_ids.tolist()) == text[n:]
    assert len(train_ids) < n and 258 in train_ids  # the merges were used


def test_offline_without_a_local_copy_says_how(tmp_path, monkeypatch):
    monkeypatch.delenv(common.ENV, raising=False)
    monkeypatch.setattr(common, 'URL', 'http://127.0.0.1:9/input.txt')  # nothing listens there
    with pytest.raises(common.PrepareError, match='SHAKESPEARE_PATH=PATH'):
        common.read_text(None, download_to=str(tmp_path / 'input.txt'))


def test_the_tests_find_the_text_where_a_user_has_it(tmp_path, monkeypatch):
    """$SHAKESPEARE_PATH, else data/shakespeare_char/input.txt (where the README's first command
    downloads it), else ../shared/..., else a download; offline with none of them, the reason."""
    root = tmp_path / 'clone'
    root.mkdir()
    monkeypatch.delenv(common.ENV, raising=False)
    monkeypatch.setattr(common, 'URL', 'http://127.0.0.1:9/input.txt')  # offline
    assert 'could not download tiny Shakespeare' in find_text(str(root))
    shared = tmp_path / 'shared' / 'data' / 'tinyshakespeare' / 'input.txt'
    shared.parent.mkdir(parents=True)
    shared.write_text('shared copy')
    assert os.path.samefile(find_text(str(root)), shared)
    (root / 'data' / 'shakespeare_char').mkdir(parents=True)
    (root / 'data' / 'shakespeare_char' / 'input.txt').write_text('downloaded by prepare')
    assert find_text(str(root)) == str(root / 'data' / 'shakespeare_char' / 'input.txt')
    monkeypatch.setenv(common.ENV, str(shared))
    assert find_text(str(root)) == str(shared)


PREPARE_REFUSALS = [  # (arguments after --input SHAKESPEARE --out_dir OUT, what prepare says)
    (['--input', '/no/such/file.txt'], "no text file at '/no/such/file.txt' (from --input)"),
    (['--inptu', 'x'], "unrecognized arguments: --inptu x (see: python "
                       "data/shakespeare_char/prepare.py --help)"),
    # not $SHAKESPEARE_PATH, nor a download
    (['--input', ''], "no text file at '' (from --input)"),
    (['--out_dir', 'A-FILE'], "cannot write the dataset to 'A-FILE': File exists"),
    (['--out_dir', 'A-FILE/sub'], "cannot write the dataset to 'A-FILE/sub': Not a directory"),
]


@pytest.mark.parametrize('args,message', PREPARE_REFUSALS)
def test_prepare_script_bad_input_is_one_line(tmp_path, args, message):
    """One line, exit 2, nothing written (a file in the way of --out_dir kept)."""
    (tmp_path / 'out').mkdir()
    (tmp_path / 'a-file').write_text('kept')
    a_file = lambda s: s.replace('A-FILE', str(tmp_path / 'a-file'))
    r = run(CHAR_PREPARE, '--input', SHAKESPEARE, '--out_dir', str(tmp_path / 'out'),
            *map(a_file, args))
    assert r.returncode == 2 and r.stderr.strip() == f"error: {a_file(message)}"
    assert os.listdir(tmp_path / 'out') == [] and (tmp_path / 'a-file').read_text() == 'kept'


def test_a_failed_write_leaves_the_previous_dataset_whole(tmp_path):
    """All three files go to temp files first, then are renamed: a write that fails (here
    meta.json's, disk full alike) changes none of the previous files and leaves no temp file."""
    names = ('train.bin', 'val.bin', 'meta.json')
    for name in names:
        (tmp_path / name).write_text(f'previous {name}')
    (tmp_path / f'meta.json.tmp{os.getpid()}').mkdir()  # its write fails
    with pytest.raises(OSError):
        common.save(str(tmp_path), [1, 2, 3], [4], {'kind': 'char', 'vocab_size': 5,
                                                    'itos': list('abcde')})
    assert all((tmp_path / n).read_text() == f'previous {n}' for n in names)
    assert sorted(os.listdir(tmp_path)) == sorted([*names, f'meta.json.tmp{os.getpid()}'])


def test_a_killed_prepare_script_leaves_no_temp_file(tmp_path):
    """SIGTERM while a prepare script writes train.bin.tmpPID: exit 143, the temp file removed (it
    was left)."""
    big = tmp_path / 'big.txt'
    big.write_text(open(SHAKESPEARE, encoding='utf-8').read() * 40)  # (CI sets no SHAKESPEARE_PATH)
    out = tmp_path / 'data'
    p = start(CHAR_PREPARE, '--out_dir', str(out), '--input', str(big))
    temp_files = lambda: [f for f in os.listdir(out) if '.tmp' in f]
    deadline = time.time() + 60
    while not (out.is_dir() and temp_files()):
        assert time.time() < deadline and p.poll() is None, "it ended before it was signalled"
        time.sleep(0.005)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 143 and not temp_files(), os.listdir(out)
    assert err.strip() == 'error: stopped by SIGTERM', err  # one line


def test_your_own_text_in_two_commands(tmp_path):
    """The README's two commands: prepare my.txt at the character level, then train on it."""
    text = open(SHAKESPEARE, encoding='utf-8').read()[:50_000] + ' café ☃\n' * 50
    (tmp_path / 'my.txt').write_text(text, encoding='utf-8')
    r = run(CHAR_PREPARE, '--input', str(tmp_path / 'my.txt'), '--out_dir', str(tmp_path / 'mine'))
    # its own characters
    assert r.returncode == 0 and f'vocab {len(set(text))}' in r.stdout, r.stdout + r.stderr
    r = train(tmp_path / 'out-mine', tmp_path / 'mine', '--max_iters=2')
    assert 'step 2:' in r.stdout
    assert json.load(open(tmp_path / 'mine' / 'meta.json'))['itos'][-1] == '☃'


def test_a_prepare_under_a_live_run_changes_nothing_it_reads(tmp_path, char_data):
    """Re-preparing a live run's data folder with a larger vocabulary: the run keeps reading the
    files it started with (a silently wrong model, or an IndexError with the steps lost, before),
    saves its own meta, and its checkpoint samples; the next run reads the new data."""
    data = tmp_path / 'data'
    shutil.copytree(char_data, data)
    before = json.load(open(data / 'meta.json'))
    p = live_run(tmp_path / 'out', data)
    # '#' sorts before most characters: their ids move; '☃', 'é' take ids past the old vocabulary
    text = open(SHAKESPEARE, encoding='utf-8').read().replace('\n', '\n#☃é')
    (tmp_path / 'my.txt').write_text(text, encoding='utf-8')
    r = run(CHAR_PREPARE, '--input', str(tmp_path / 'my.txt'), '--out_dir', str(data))
    assert r.returncode == 0 and json.load(open(data / 'meta.json')) != before
    log = tmp_path / 'out' / 'metrics.jsonl'
    rows = len(log.read_text().splitlines())
    while len(log.read_text().splitlines()) < rows + 5:  # more iterations, past the prepare
        assert p.poll() is None, p.stderr.read()
        time.sleep(0.1)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130 and 'Traceback' not in err, err
    ckpt = torch.load(tmp_path / 'out' / 'last.pt', weights_only=True)
    assert ckpt['meta'] == before and ckpt['model_args']['vocab_size'] == before['vocab_size']
    r = run('sample.py', f'--out_dir={tmp_path / "out"}', '--max_new_tokens=20', '--num_samples=1')
    assert r.returncode == 0, r.stderr


def test_dataset_names_a_folder_of_data_and_never_runs_another_script(tmp_path):
    """--dataset is a folder of data/ with a training text: never a path to another script, nor
    data/mqar (bench.py's recall data: its prepare.py takes other arguments, a traceback)."""
    evil = tmp_path / 'evil'
    evil.mkdir()
    (evil / 'prepare.py').write_text(f"open({str(tmp_path / 'ran')!r}, 'w').write('ran')\n")
    for name in (str(evil), os.path.relpath(evil, os.path.join(ROOT, 'data')), 'no such', 'mqar'):
        r = run('train.py', *TINY_TRAIN, f'--out_dir={tmp_path / "out"}', f'--dataset={name}')
        said = f"dataset={name!r} is unknown: give one of ['shakespeare', 'shakespeare_char']"
        assert said in one_line(r)
        assert not (tmp_path / 'ran').exists() and not (tmp_path / 'out').exists()


def broken_data(tmp_path, char_data, kind):
    """char_data's folder with one thing wrong."""
    if kind == 'a file':
        (tmp_path / 'a-file').write_text('not a folder')
        return tmp_path / 'a-file'
    folder = tmp_path / f'data-{kind}'
    shutil.copytree(char_data, folder)
    meta = json.loads((folder / 'meta.json').read_text())
    if kind == 'truncated':
        with open(folder / 'val.bin', 'r+b') as f:
            f.truncate(31)
    elif kind == 'nometa':
        os.remove(folder / 'meta.json')
    elif kind == 'random':  # random bytes as token ids: most are outside the 65-symbol vocabulary
        (folder / 'train.bin').write_bytes(random.Random(0).randbytes(4096))
    elif kind.startswith('fifo '):
        (folder / kind[5:]).unlink()
        os.mkfifo(folder / kind[5:])
    elif kind == 'deep':
        (folder / 'meta.json').write_text('[' * 100000 + ']' * 100000)
    else:
        meta = {'{}': {}, '[]': [], 'zero': {**meta, 'vocab_size': 0},
                'huge': {'kind': 'tiktoken', 'encoding': 'gpt2', 'vocab_size': 10 ** 12},
                'small': {**meta, 'vocab_size': 10, 'itos': meta['itos'][:10]}}[kind]
        (folder / 'meta.json').write_text(json.dumps(meta))
    return folder


NO_VOCAB = "meta has no vocab_size in [1, 65536]"
DATA_REFUSALS = [  # (char_data's folder broken so, or flags; what train.py says)
    ('truncated', "val.bin has 31 bytes, an odd number: truncated"),
    ('nometa', "meta.json"),
    ('{}', NO_VOCAB), ('[]', NO_VOCAB), ('zero', NO_VOCAB),
    ('huge', NO_VOCAB + " (token ids are uint16)"),
    ('random', "train.bin holds token id"),  # an IndexError at the first eval before
    ('small', "train.bin holds token id 64, outside meta.json's vocab_size 10"),
    ('deep', "is missing or broken (maximum recursion depth"),  # meta.json nested 100,000 deep
    # a FIFO hung start-up for ever, Ctrl-C deferred: only SIGKILL ended it, leaving train.lock
    ('fifo meta.json', "meta.json is not a regular file"),
    ('fifo val.bin', "val.bin is not a regular file"),
    # a data_dir given is never prepared into: a typo trained on Shakespeare
    ('a file', "no train.bin in data_dir="),
    ('--data_dir=/nonexistent/mien', "no train.bin in data_dir='/nonexistent/mien': make one "
                                     "(python data/shakespeare_char/prepare.py"),
    ('--block_size=2000000', "train.bin has 1,003,854 tokens, not more than block_size=2000000: "
                             "lower it"),
]


@pytest.mark.parametrize('case,message', DATA_REFUSALS, ids=[case for case, _ in DATA_REFUSALS])
def test_train_refuses_bad_data_in_one_line(tmp_path, trained, char_data, case, message):
    """One line, exit 2, within seconds (never a hang), the run it was to replace kept (even with
    --overwrite=True: old checkpoints go only once the first step ends)."""
    if case.startswith('--'):
        flags = [case]
    else:
        flags = [f'--data_dir={broken_data(tmp_path, char_data, case)}']
    before = digest(trained / 'ckpt.pt'), digest(trained / 'metrics.jsonl')
    assert message in refused(trained, char_data, *flags, '--overwrite=True', timeout=60)
    assert (digest(trained / 'ckpt.pt'), digest(trained / 'metrics.jsonl')) == before


def test_zoology_layout_queries_every_key_once_after_its_pairs_with_power_law_gaps():
    """Zoology's MQAR, one position a pair (key * vocab + value): distinct keys and values in their
    halves of the vocabulary, each key queried once after the pairs (value 0 there) with its pair's
    value as the target, -1 elsewhere; the gaps follow the power law (the first gap far likelier
    than a late one); bad sizes refused."""
    vocab, N, L = 64, 6, 40
    x, y = zoology(vocab, L, N, 500, np.random.default_rng(0))
    assert x.shape == y.shape == (500, L)
    for row_x, row_y in zip(x, y):
        keys, values = row_x[:N] // vocab, row_x[:N] % vocab
        assert len(set(keys)) == len(set(values)) == N
        assert (keys >= 1).all() and (keys < 32).all() and (values >= 32).all()
        asked = (row_y >= 0).nonzero()[0]
        assert len(asked) == N and (asked >= N).all()
        assert (row_x[N:] % vocab == 0).all()  # no value after the pairs
        assert sorted(row_x[asked] // vocab) == sorted(keys)
        assert all(row_y[i] == dict(zip(keys, values))[row_x[i] // vocab] for i in asked)
    gaps = np.concatenate([(row >= 0).nonzero()[0] - N for row in y])
    assert (gaps == 0).sum() > 5 * (gaps == L - N - 1).sum()
    with pytest.raises(ValueError, match="holds at most 31 distinct"):
        # 32 pairs: 31 keys in a 64-token vocabulary
        zoology(vocab, 80, 32, 1, np.random.default_rng(0))
    with pytest.raises(ValueError, match="need 2 positions"):
        zoology(vocab, 10, 6, 1, np.random.default_rng(0))  # 6 pairs leave 4 query positions


def test_mqar_prepare_writes_every_set_and_refuses_bad_input(tmp_path):
    mqar = lambda *a: run(os.path.join(ROOT, 'data', 'mqar', 'prepare.py'), *a,
                          f'--out_dir={tmp_path}', timeout=None)
    sizes = ['--vocab=32', '--train=2500', '--val=7', '--power_a=0.5']
    r = mqar(*sizes, '--sets=12:2,20:6')
    assert r.returncode == 0, r.stderr
    sets = load(tmp_path / 'mqar.npz')
    assert list(sets) == [(12, 2), (20, 6)]
    assert sets[12, 2][0].shape == (2500, 12) and sets[20, 6][3].shape == (7, 20)
    x, y = sets[20, 6][:2]
    assert (x[:, :6] // 32 < 16).all() and (x[:, :6] % 32 >= 16).all()
    assert ((y >= 0).sum(1) == 6).all()
    # rows drawn afresh, block after block (1,000 at a time)
    assert len({tuple(row) for row in x[:, :6]}) > 2400
    assert json.loads((tmp_path / 'mqar.json').read_text()) == dict(
        kind='mqar', vocab=32, sets=[[12, 2], [20, 6]], train=2500, val=7, seed=0, power_a=0.5)
    # never overwritten: MQAR writes mqar.json
    (tmp_path / 'meta.json').write_text('another data set')
    for bad in ('--sets=8:0', '--sets=8:5', '--sets=8', '--sets=x', '--train=0', '--seed=-1',
                '--power_a=0', '--vocab=3', '--vocab=100000', '--vocab=8 --sets=64:4',
                '--train=999999999999'):
        r = mqar(*bad.split())
        assert r.returncode == 2 and 'Traceback' not in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) <= 3 and 'python python' not in r.stderr
    # its halves: keys 1-3, 4-7
    assert "holds at most 3 distinct keys" in mqar('--vocab=8', '--sets=64:4').stderr
    assert "in L >= 2N positions" in mqar('--sets=12:7').stderr  # a query position for each pair
    # counted before anything is built
    assert "need at least" in mqar('--train=999999999999').stderr
    assert (tmp_path / 'meta.json').read_text() == 'another data set'
    replaced = "replacing the data set made with {'vocab': 32, 'sets': [[12, 2], [20, 6]]"
    for sets, said in (('12:2,20:6', False), ('12:3', True)):  # the same: silent; another: said
        r = mqar(*sizes, f'--sets={sets}')
        assert r.returncode == 0 and (replaced in r.stdout) == said, r.stdout
    (tmp_path / 'mqar.json').write_text('[1]')  # its settings unreadable: still said
    r = mqar('--vocab=32', '--sets=12:3', '--train=30')
    assert r.returncode == 0 and 'replacing a data set of unknown settings' in r.stdout, r.stdout
    (tmp_path / 'mqar.json').unlink()
    (tmp_path / 'mqar.json').mkdir()  # a folder in the way: refused before mqar.npz is replaced
    kept = (tmp_path / 'mqar.npz').read_bytes()
    r = mqar('--vocab=32', '--sets=12:5', '--train=30')
    assert r.returncode == 2 and 'Is a directory' in r.stderr, r.stderr
    assert (tmp_path / 'mqar.npz').read_bytes() == kept
