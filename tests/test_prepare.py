"""Dataset preparation on the shared text; BPE with a tiktoken.Encoding built here (no download)."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tiktoken

from conftest import ROOT, SHAKESPEARE
from data import common
from data.shakespeare.prepare import prepare as prepare_bpe


def test_char_prepare_matches_nanogpt(char_data):
    meta = json.load(open(os.path.join(char_data, 'meta.json'), encoding='utf-8'))
    train = np.fromfile(os.path.join(char_data, 'train.bin'), dtype=np.uint16)
    val = np.fromfile(os.path.join(char_data, 'val.bin'), dtype=np.uint16)
    assert meta['vocab_size'] == 65 == len(meta['itos'])
    assert (len(train), len(val)) == (1_003_854, 111_540)
    text = open(SHAKESPEARE, encoding='utf-8').read()
    decoded = ''.join(meta['itos'][i] for i in np.concatenate([train, val]))
    assert decoded == text  # lossless, in order, nothing dropped at the split
    assert meta['itos'] == sorted(meta['itos'])


def small_gpt2_like_encoding():
    """Byte-level BPE with GPT-2's split pattern and three merges: enough to test the pipeline offline."""
    ranks = {bytes([i]): i for i in range(256)}
    for merge in (b'th', b'the', b' the'):
        ranks[merge] = len(ranks)
    pat = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
    return tiktoken.Encoding(name='test-bpe', pat_str=pat, mergeable_ranks=ranks, special_tokens={})


def test_bpe_prepare_with_a_local_encoding(tmp_path):
    enc = small_gpt2_like_encoding()
    prepare_bpe(str(tmp_path), SHAKESPEARE, enc=enc)
    meta = json.load(open(tmp_path / 'meta.json'))
    assert meta == {'kind': 'tiktoken', 'encoding': 'test-bpe', 'vocab_size': 259}
    train = np.fromfile(tmp_path / 'train.bin', dtype=np.uint16)
    val = np.fromfile(tmp_path / 'val.bin', dtype=np.uint16)
    text = open(SHAKESPEARE, encoding='utf-8').read()
    n = int(len(text) * 0.9)
    assert enc.decode(train.tolist()) == text[:n] and enc.decode(val.tolist()) == text[n:]
    assert len(train) < n and 258 in train  # the merges were used


def test_offline_without_a_local_copy_says_how(tmp_path, monkeypatch):
    monkeypatch.delenv(common.ENV, raising=False)
    monkeypatch.setattr(common, 'URL', 'http://127.0.0.1:9/input.txt')  # nothing listens there
    with pytest.raises(common.PrepareError, match='SHAKESPEARE_PATH=PATH'):
        common.read_text(None, download_to=str(tmp_path / 'input.txt'))


@pytest.mark.parametrize('args,message', [
    (['--input', '/no/such/file.txt'], "no text file at '/no/such/file.txt' (from --input)"),
    (['--inptu', 'x'], "unrecognized arguments: --inptu x (see: python data/shakespeare_char/prepare.py --help)"),
    (['--input', ''], "no text file at '' (from --input)"),  # not $SHAKESPEARE_PATH, nor a download
])
def test_prepare_script_bad_input_is_one_line(tmp_path, args, message):
    r = subprocess.run([sys.executable, 'data/shakespeare_char/prepare.py', '--out_dir', str(tmp_path), *args],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.strip() == f"error: {message}"
    assert os.listdir(tmp_path) == []


def test_a_failed_write_leaves_the_previous_dataset_whole(tmp_path):
    """All three files go to temp files first, then are renamed: a write that fails (here meta.json's, disk full
    alike) changes none of the previous files and leaves no temp file."""
    for name in ('train.bin', 'val.bin', 'meta.json'):
        (tmp_path / name).write_text(f'previous {name}')
    (tmp_path / f'meta.json.tmp{os.getpid()}').mkdir()  # its write fails
    with pytest.raises(OSError):
        common.save(str(tmp_path), [1, 2, 3], [4], {'kind': 'char', 'vocab_size': 5, 'itos': list('abcde')})
    assert all((tmp_path / n).read_text() == f'previous {n}' for n in ('train.bin', 'val.bin', 'meta.json'))
    assert sorted(os.listdir(tmp_path)) == ['meta.json', f'meta.json.tmp{os.getpid()}', 'train.bin', 'val.bin']


def test_prepare_into_a_file_or_unwritable_folder_is_one_line(tmp_path):
    (tmp_path / 'a-file').write_text('kept')
    for out, why in ((tmp_path / 'a-file', 'File exists'), (tmp_path / 'a-file' / 'sub', 'Not a directory')):
        r = subprocess.run([sys.executable, 'data/shakespeare_char/prepare.py', '--input', SHAKESPEARE,
                            '--out_dir', str(out)], cwd=ROOT, capture_output=True, text=True)
        assert r.returncode == 2 and r.stderr.strip() == f"error: cannot write the dataset to {str(out)!r}: {why}"
    assert (tmp_path / 'a-file').read_text() == 'kept'


def test_the_tests_find_the_text_where_a_user_has_it(tmp_path, monkeypatch):
    """$SHAKESPEARE_PATH, else data/shakespeare_char/input.txt (where the README's first command downloads it),
    else ../shared/..., else a download; offline with none of them, the reason."""
    from conftest import find_text
    root = tmp_path / 'clone'
    root.mkdir()
    monkeypatch.delenv(common.ENV, raising=False)
    monkeypatch.setattr(common, 'URL', 'http://127.0.0.1:9/input.txt')  # nothing listens there: offline
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


def test_your_own_text_in_two_commands(tmp_path):
    """The README's two commands: prepare my.txt at the character level, then train on it."""
    from test_train import TINY
    text = open(SHAKESPEARE, encoding='utf-8').read()[:50_000] + ' café ☃\n' * 50
    (tmp_path / 'my.txt').write_text(text, encoding='utf-8')
    r = subprocess.run([sys.executable, 'data/shakespeare_char/prepare.py', '--input', str(tmp_path / 'my.txt'),
                        '--out_dir', str(tmp_path / 'mine')], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0 and f'vocab {len(set(text))}' in r.stdout, r.stdout + r.stderr  # its own characters
    r = subprocess.run([sys.executable, 'train.py', *TINY, f'--data_dir={tmp_path / "mine"}',
                        f'--out_dir={tmp_path / "out-mine"}', '--max_iters=2'], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0 and 'step 2:' in r.stdout, r.stderr
    assert json.load(open(tmp_path / 'mine' / 'meta.json'))['itos'][-1] == '☃'


def test_zoology_layout_queries_every_key_once_after_its_pairs_with_power_law_gaps():
    """Zoology's MQAR, one position a pair (key * vocab + value): distinct keys and values in their halves of the
    vocabulary, each key queried once after the pairs (value 0 there) with its pair's value as the target, -1
    elsewhere; the gaps follow the power law (the first gap far likelier than a late one); bad sizes refused."""
    import numpy as np
    from data.mqar.prepare import zoology
    vocab, N, L = 64, 6, 40
    x, y = zoology(vocab, L, N, 500, np.random.default_rng(0))
    assert x.shape == y.shape == (500, L)
    for row_x, row_y in zip(x, y):
        keys, values = row_x[:N] // vocab, row_x[:N] % vocab
        assert len(set(keys)) == len(set(values)) == N and (keys >= 1).all() and (keys < 32).all() and (values >= 32).all()
        asked = (row_y >= 0).nonzero()[0]
        assert len(asked) == N and (asked >= N).all() and (row_x[N:] % vocab == 0).all()  # no value after the pairs
        assert sorted(row_x[asked] // vocab) == sorted(keys)
        assert all(row_y[i] == dict(zip(keys, values))[row_x[i] // vocab] for i in asked)
    gaps = np.concatenate([(row >= 0).nonzero()[0] - N for row in y])
    assert (gaps == 0).sum() > 5 * (gaps == L - N - 1).sum()
    with pytest.raises(ValueError, match="holds at most 31 distinct"):
        zoology(vocab, 80, 32, 1, np.random.default_rng(0))  # 32 pairs: 31 keys in a 64-token vocabulary
    with pytest.raises(ValueError, match="need 2 positions"):
        zoology(vocab, 10, 6, 1, np.random.default_rng(0))  # 6 pairs leave 4 query positions


def test_mqar_prepare_writes_every_set_and_refuses_bad_input(tmp_path):
    import json
    import subprocess
    import sys
    import numpy as np
    from conftest import ROOT
    from data.mqar.prepare import load
    script = os.path.join(ROOT, 'data', 'mqar', 'prepare.py')
    run = lambda *a: subprocess.run([sys.executable, script, *a, f'--out_dir={tmp_path}'], capture_output=True, text=True)
    r = run('--vocab=32', '--sets=12:2,20:6', '--train=2500', '--val=7', '--power_a=0.5')
    assert r.returncode == 0, r.stderr
    sets = load(tmp_path / 'mqar.npz')
    assert list(sets) == [(12, 2), (20, 6)] and sets[12, 2][0].shape == (2500, 12) and sets[20, 6][3].shape == (7, 20)
    x, y = sets[20, 6][:2]
    assert (x[:, :6] // 32 < 16).all() and (x[:, :6] % 32 >= 16).all() and ((y >= 0).sum(1) == 6).all()
    assert len({tuple(row) for row in x[:, :6]}) > 2400  # rows drawn afresh, block after block (1,000 at a time)
    assert json.loads((tmp_path / 'mqar.json').read_text()) == dict(
        kind='mqar', vocab=32, sets=[[12, 2], [20, 6]], train=2500, val=7, seed=0, power_a=0.5)
    (tmp_path / 'meta.json').write_text('another data set')  # never overwritten: MQAR writes mqar.json
    for bad in ('--sets=8:0', '--sets=8:5', '--sets=8', '--sets=x', '--train=0', '--seed=-1', '--power_a=0',
                '--vocab=3', '--vocab=100000', '--vocab=8 --sets=64:4', '--train=999999999999'):
        r = run(*bad.split())
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) <= 3 and 'Traceback' not in r.stderr, r.stderr
        assert 'python python' not in r.stderr
    assert "holds at most 3 distinct keys" in run('--vocab=8', '--sets=64:4').stderr  # its halves: keys 1-3, 4-7
    assert "in L >= 2N positions" in run('--sets=12:7').stderr  # a query position for each pair
    assert "need at least" in run('--train=999999999999').stderr  # counted before anything is built
    assert (tmp_path / 'meta.json').read_text() == 'another data set'
    for sets, said in (('12:2,20:6', False), ('12:3', True)):  # the same data set: silent; another: what it replaced
        r = run('--vocab=32', f'--sets={sets}', '--train=2500', '--val=7', '--power_a=0.5')
        assert r.returncode == 0 and ("replacing the data set made with {'vocab': 32, 'sets': [[12, 2], [20, 6]]"
                                      in r.stdout) == said, r.stdout
    (tmp_path / 'mqar.json').write_text('[1]')  # its settings unreadable: still said
    r = run('--vocab=32', '--sets=12:3', '--train=30')
    assert r.returncode == 0 and 'replacing a data set of unknown settings' in r.stdout, r.stdout
    (tmp_path / 'mqar.json').unlink()
    (tmp_path / 'mqar.json').mkdir()  # a folder in the way: refused before mqar.npz is replaced
    kept = (tmp_path / 'mqar.npz').read_bytes()
    r = run('--vocab=32', '--sets=12:5', '--train=30')
    assert r.returncode == 2 and 'Is a directory' in r.stderr and (tmp_path / 'mqar.npz').read_bytes() == kept, r.stderr
