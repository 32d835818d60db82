"""
What both tiny Shakespeare prepare scripts share (find the text, split it 90/10, write the .bin
files), and what reads a prepared data folder: its meta.json, its tokenizer, its .bin files.
"""
import errno
import importlib.util
import json
import os
import sys
import urllib.request

import numpy as np

from configurator import Parser, fail_on
from run.interrupts import end_on_lost_output, on_closed_output

URL = 'https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt'
ENV = 'SHAKESPEARE_PATH'


class PrepareError(Exception):
    """A problem the user can fix; the scripts print it as one line and exit non-zero."""


def read_text(input_path=None, download_to=None):
    """The tiny Shakespeare text from input_path, else $SHAKESPEARE_PATH, else a previous download
    at download_to, else downloaded there (a temp file, then a rename: an interrupted download
    leaves no half input.txt). An input_path '' is refused."""
    path = input_path if input_path is not None else os.environ.get(ENV) or None
    if path is not None:
        if not os.path.isfile(path):
            where = '$' + ENV if input_path is None else '--input'
            raise PrepareError(f"no text file at {path!r} (from {where})")
    elif download_to and os.path.isfile(download_to):
        path = download_to
    else:
        try:
            with urllib.request.urlopen(URL, timeout=15) as r:
                text = r.read().decode('utf-8')
        except (OSError, ValueError) as e:
            offline = f"offline? point {ENV}=PATH (or prepare.py --input PATH) at a local input.txt"
            raise PrepareError(f"could not download tiny Shakespeare ({e}); {offline}") from None
        if download_to:
            os.makedirs(os.path.dirname(download_to) or '.', exist_ok=True)
            tmp = f"{download_to}.tmp{os.getpid()}"
            with open(tmp, 'w', encoding='utf-8') as f:
                f.write(text)
            os.replace(tmp, download_to)
        return text
    try:
        with open(path, encoding='utf-8') as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise PrepareError(f"cannot read {path!r}: {e}") from None
    if not text:
        raise PrepareError(f"{path!r} is empty")
    return text


def check_meta(meta):
    """meta.json's content as a prepare script writes it, else ValueError naming what is wrong."""
    vocab = meta.get('vocab_size') if isinstance(meta, dict) else None
    if type(vocab) is not int or not 1 <= vocab <= 2 ** 16:
        raise ValueError("meta has no vocab_size in [1, 65536] (token ids are uint16)")
    kind, itos = meta.get('kind'), meta.get('itos')
    if kind == 'char':
        if not (isinstance(itos, list) and len(itos) == vocab
                and all(isinstance(c, str) and len(c) == 1 for c in itos)):
            raise ValueError(f"meta's itos should list vocab_size={vocab} characters (strings of "
                             "length 1)")
    elif kind != 'tiktoken' or not isinstance(meta.get('encoding'), str):
        raise ValueError(f"meta's kind {kind!r} should be 'char' (with itos) or 'tiktoken' "
                         "(with encoding)")
    return meta


def tokenizer(meta):
    """(encode, decode) of a prepared dataset's meta; encode raises ValueError naming characters it
    cannot encode."""
    if meta['kind'] == 'char':
        stoi = {ch: i for i, ch in enumerate(meta['itos'])}

        def encode(s):
            unknown = sorted(set(c for c in s if c not in stoi))
            if unknown:
                raise ValueError(f"characters outside the vocabulary: {''.join(unknown)!r} "
                                 f"({', '.join(ascii(c) for c in unknown)})")
            return [stoi[c] for c in s]
        return encode, lambda ids: ''.join(meta['itos'][i] for i in ids)
    import tiktoken  # lazy: only a BPE data set needs it (it downloads its encodings)
    try:
        enc = tiktoken.get_encoding(meta['encoding'])
    except Exception as e:
        raise PrepareError(f"cannot load tiktoken encoding {meta['encoding']!r} "
                           f"({type(e).__name__}); it is downloaded on first use: run once with a "
                           "network, or set TIKTOKEN_CACHE_DIR to a cached copy") from None
    special = {'<|endoftext|>'} & enc.special_tokens_set
    return lambda s: enc.encode(s, allowed_special=special), enc.decode


def prompt(start, encode):
    """(text, token ids) of sample.py's --start: the text, or FILE:path's; else a PrepareError."""
    text = read_prompt(start[5:]) if start.startswith('FILE:') else start
    try:
        ids = encode(text)
    except ValueError as e:
        raise PrepareError(f"the prompt has {e}") from None
    if not ids:
        raise PrepareError("the prompt is empty: give at least one token with --start=... "
                           "(the default is a newline)")
    return text, ids


def read_prompt(path, most=2 ** 26):
    """The text of a prompt file, its newlines read as text mode reads them; at most 64 MiB
    (/dev/zero is not a prompt). Else a PrepareError."""
    try:
        with open(path, 'rb') as f:
            data, more = f.read(most), f.read(1)
        if more:
            raise PrepareError(f"the prompt file {path!r} holds more than {most:,} bytes: the "
                               "model sees only its last block_size tokens; give a shorter file")
        return data.decode('utf-8').replace('\r\n', '\n').replace('\r', '\n')
    except OSError as e:
        raise PrepareError(f"cannot read the prompt file {path!r}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise PrepareError(f"the prompt file {path!r} is not UTF-8 text (byte {e.start})") from None


def sample_prompt(meta):
    """(ids, decode) of train.py's samples: a newline (nanoGPT's default prompt), or token 0 in a
    vocabulary without one; decode None when the tokenizer cannot be loaded (a BPE whose encoding
    cannot be downloaded): no samples."""
    try:
        encode, decode = tokenizer(meta)
        return encode('\n'), decode
    except ValueError:
        return [0], decode
    except PrepareError:
        return [0], None


def open_data(data_dir, block_size, remake, prepare=None):
    """meta.json's content of a prepared data folder whose train.bin and val.bin are whole and
    longer than block_size, made first by the script prepare (train.py's rank 0) if it has no
    train.bin; else a PrepareError in one line (remake: how to make the files anew)."""
    if prepare and not os.path.exists(os.path.join(data_dir, 'train.bin')):
        prepare_with(prepare, data_dir)
    try:
        meta, tokens = read_data(data_dir)
    except (OSError, ValueError, RecursionError) as e:  # (RecursionError: a JSON nested too deep)
        raise PrepareError(f"dataset in {data_dir} is missing or broken ({e}); prepare it anew: "
                           f"{remake}") from None
    for split, n in tokens.items():
        if n <= block_size:
            raise PrepareError(f"{data_dir}/{split}.bin has {n:,} tokens, not more than "
                               f"block_size={block_size}: lower it")
    return meta


def read_data(data_dir):
    """(meta.json's content, {split: tokens}) of a prepared data folder, with train.bin and val.bin
    checked: OSError if a file is missing, ValueError naming what is broken. Only regular files: a
    FIFO would block the open for ever, signals deferred."""
    for name in ('meta.json', 'train.bin', 'val.bin'):
        if os.path.exists(path := os.path.join(data_dir, name)) and not os.path.isfile(path):
            raise ValueError(f"{name} is not a regular file")
    with open(os.path.join(data_dir, 'meta.json'), encoding='utf-8') as f:
        meta = check_meta(json.load(f))
    tokens = {}
    for split in ('train', 'val'):
        size = os.path.getsize(path := os.path.join(data_dir, f'{split}.bin'))
        if size % 2:
            raise ValueError(f"{split}.bin has {size} bytes, an odd number: truncated")
        top = int(np.memmap(path, dtype=np.uint16, mode='r').max()) if size else 0
        if top >= meta['vocab_size']:  # an embedding lookup would fail in the batch that holds it
            raise ValueError(f"{split}.bin holds token id {top}, outside meta.json's vocab_size "
                             f"{meta['vocab_size']}")
        tokens[split] = size // 2
    return meta, tokens


def split(text, train_fraction=0.9):
    """First 90% of the characters for training, the last 10% for validation (as nanoGPT)."""
    n = int(len(text) * train_fraction)
    return text[:n], text[n:]


def save(out_dir, train_ids, val_ids, meta):
    """train.bin / val.bin as uint16 token ids and meta.json: all three written to temp files, then
    renamed, so a failed write (disk full) leaves the previous dataset whole, and no temp file."""
    if meta['vocab_size'] > 2 ** 16:
        raise PrepareError(f"vocab_size {meta['vocab_size']} does not fit uint16")
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, name) for name in ('train.bin', 'val.bin', 'meta.json')]
    tmp = f".tmp{os.getpid()}"  # per process: two runs preparing one folder never share a temp file
    try:
        np.asarray(train_ids, dtype=np.uint16).tofile(paths[0] + tmp)
        np.asarray(val_ids, dtype=np.uint16).tofile(paths[1] + tmp)
        with open(paths[2] + tmp, 'w', encoding='utf-8') as f:
            json.dump(meta, f, ensure_ascii=False)
        for path in paths:
            os.replace(path + tmp, path)
    finally:
        for path in paths:  # what a failed write left behind
            if os.path.isfile(path + tmp):
                os.remove(path + tmp)
    print(f"{out_dir}: train {len(train_ids):,} tokens, val {len(val_ids):,} tokens, "
          f"vocab {meta['vocab_size']:,}")


def cli(prepare, description):
    """argparse for a prepare script: --input PATH, --out_dir DIR; errors as one line, exit 2."""
    here = os.path.dirname(os.path.abspath(sys.argv[0]))
    p = Parser(prog=os.path.relpath(sys.argv[0]), description=description)  # as typed from here
    p.add_argument('--input', help=f'local input.txt (default: ${ENV}, else download)')
    p.add_argument('--out_dir', default=here,
                   help='where train.bin, val.bin, meta.json go (default: beside this script)')
    on_closed_output(end_on_lost_output)  # stdout's disk full: said as such, not as the dataset's
    args = p.parse_args()  # (after: --help >&- would print to stderr)
    with fail_on(PrepareError):
        run_prepare(prepare, args.out_dir, args.input)


def prepare_with(script, out_dir):
    """Run a prepare script's prepare(out_dir), as train.py does on first use, saying where the text
    comes from."""
    source = os.environ.get(ENV) or "a download (offline? set SHAKESPEARE_PATH=/path/to/input.txt)"
    print(f"preparing {os.path.basename(os.path.dirname(script))} into {out_dir} from {source}")
    spec = importlib.util.spec_from_file_location('prepare', script)
    spec.loader.exec_module(module := importlib.util.module_from_spec(spec))
    run_prepare(module.prepare, out_dir)


def run_prepare(prepare, out_dir, input_path=None):
    """prepare(out_dir, input_path), with a failed write (out_dir unwritable or a file, disk full) a
    PrepareError."""
    try:
        if os.path.exists(out_dir) and not os.path.isdir(out_dir):  # before any download
            raise FileExistsError(errno.EEXIST, 'File exists')
        prepare(out_dir, input_path)
    except OSError as e:
        raise PrepareError(f"cannot write the dataset to {out_dir!r}: {e.strerror or e}") from None
