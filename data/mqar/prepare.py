"""
Multi-query associative recall (MQAR; Arora et al. 2023, "Zoology"): the recall test of bench.py
mqar.

Zoology's data (zoology/data/multiquery_ar.py) in its one-position variant: a sequence of L
positions opens with N key-value pairs, then each key comes back once as a query, at a gap after
the pairs drawn from a power law (near ones likelier), with random tokens between (keys among
them, as in Zoology: only a query is answered); at a query the model must say its key's value.
Keys are token ids 1 .. vocab/2 - 1, values vocab/2 .. vocab - 1, both distinct within a sequence.
Loss and accuracy count the answers only (the other targets are -1, which the model's
cross-entropy ignores).

One position a pair: it holds key * vocab + value, and the model embeds it as emb(key) +
emb(value) (benchmarks/mqar.py's PairEmbedding); a query or a random token t is t * vocab, emb(t) + emb(0)
(0 is never a key or a value). Zoology's two-token pairs (k v k v ...) also need an induction step,
which Zoology's models get from a short conv in front of every mixer; ours have none in front of
softmax attention, so with two tokens the test would measure that conv, not what a layout's state
holds. One position keeps the lookup, and needs no embedding per (key, value) pair.

    x: k1*V+v1 ... kN*V+vN  t*V ... k7*V ... t*V ... k2*V ...
    y: -1 ...      -1       -1  ... v7   ... -1  ... v2   ...

    python data/mqar/prepare.py             # data/mqar/mqar.npz: bench.py mqar's CPU sets
    python data/mqar/prepare.py --vocab=8192 --sets=64:4,128:8,256:16,512:64 --train=100000
                                            # Zoology's
"""
import errno
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from run.interrupts import exit_on_signals, memory_errors_in_one_line  # noqa: E402

if __name__ == '__main__':  # first: Ctrl-C or a kill during the slow imports below is one line too
    memory_errors_in_one_line('--train, --val')
    exit_on_signals()  # (a kill mid-write leaves no temp file)
import numpy as np  # noqa: E402

from configurator import Parser, check_memory, checked  # noqa: E402

SETS = ((64, 4), (64, 8), (128, 16), (128, 32), (256, 64))  # (L, N) on a CPU; Zoology's: bench.py
BLOCK = 1000  # sequences drawn at once: the key draw sorts vocab/2 numbers a row


def zoology(vocab, length, n_pairs, count, rng, power_a=0.01):
    """(x, y), int64 (count, length): Zoology's MQAR (multiquery_ar.py) in its one-position variant.
    Keys are ids 1 .. vocab/2 - 1, values vocab/2 .. vocab - 1, both distinct within a sequence; the
    N pairs come first, one position each, packed as key * vocab + value (the model embeds key +
    value there); then each key alone (key * vocab) at a gap after the pairs drawn from Zoology's
    power law (p(gap) ~ gap^(power_a - 1): near ones likelier), and random tokens (token * vocab)
    between. y: the pair's value at its key's query, else -1."""
    half, space = vocab // 2, length - n_pairs
    if n_pairs > space:
        raise ValueError(f"{n_pairs} pairs in {length} tokens: a pair and its query need "
                         "2 positions (L >= 2N)")
    most = min(half - 1, vocab - half)
    if n_pairs > most:
        raise ValueError(f"{n_pairs} pairs: a {vocab}-token vocabulary holds at most {most} "
                         "distinct keys and values a sequence")
    # n_pairs distinct ids a row, of first .. first + n - 1
    distinct = lambda first, n: first + np.argsort(rng.random((count, n)), axis=1)[:, :n_pairs]
    keys, values = distinct(1, half - 1), distinct(half, vocab - half)
    # the gaps: top-N of log p + Gumbel noise, N gaps drawn without replacement
    p = power_a * np.arange(1, space + 1) ** (power_a - 1)
    gumbel = -np.log(-np.log(rng.random((count, space))))
    gaps = np.argsort(-(np.log(p / p.sum()) + gumbel), axis=1)[:, :n_pairs]
    x = rng.integers(0, vocab, (count, length)) * vocab  # noise: a token, no value
    y = np.full((count, length), -1, dtype=np.int64)
    x[:, :n_pairs] = keys * vocab + values
    np.put_along_axis(x, n_pairs + gaps, keys * vocab, axis=1)
    np.put_along_axis(y, n_pairs + gaps, values, axis=1)
    return x, y


def settings(vocab, sets, train, val, seed, power_a):
    """What mqar.json says of the data set beside it (main() compares it before replacing one)."""
    sets = [list(s) for s in sets]
    return dict(vocab=vocab, sets=sets, train=train, val=val, seed=seed, power_a=power_a)


def prepare(out_dir, vocab=512, sets=SETS, train=20000, val=500, seed=0, power_a=0.01):
    """out_dir/mqar.npz: train_x_L_N, train_y_L_N, val_x_L_N, val_y_L_N per (L, N) of sets; and
    mqar.json (not meta.json: never another data set's). Temp files, then renames: never half a data
    set, and a folder in the way is refused before either file is replaced."""
    rng, arrays = np.random.default_rng(seed), {}
    for L, n in sets:
        for split, count in (('train', train), ('val', val)):
            blocks = [zoology(vocab, L, n, min(BLOCK, count - i), rng, power_a)
                      for i in range(0, count, BLOCK)]
            x, y = (np.concatenate(a) for a in zip(*blocks))
            arrays[f'{split}_x_{L}_{n}'], arrays[f'{split}_y_{L}_{n}'] = x, y
    os.makedirs(out_dir, exist_ok=True)
    paths = {ext: os.path.join(out_dir, f'mqar.{ext}') for ext in ('npz', 'json')}
    for path in paths.values():
        if os.path.isdir(path):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
    meta = {'kind': 'mqar', **settings(vocab, sets, train, val, seed, power_a)}
    tmp = os.path.join(out_dir, f'.tmp{os.getpid()}')
    try:
        with open(tmp + '.npz', 'wb') as f:
            np.savez_compressed(f, **arrays)
        with open(tmp + '.json', 'w') as f:
            json.dump(meta, f)
        os.replace(tmp + '.npz', paths['npz'])
        os.replace(tmp + '.json', paths['json'])
    finally:  # what a failed write or a kill (SIGTERM) left behind
        for left in (tmp + '.npz', tmp + '.json'):
            if os.path.isfile(left):
                os.remove(left)
    return paths['npz']


def load(path):
    """{(L, N): (train_x, train_y, val_x, val_y)} of a prepare()d file, as numpy arrays."""
    data = np.load(path)
    sets = sorted({tuple(int(s) for s in k.split('_')[-2:]) for k in data.files})
    names = lambda L, n: [f'{split}_{xy}_{L}_{n}' for split in ('train', 'val') for xy in 'xy']
    return {(L, n): tuple(data[name] for name in names(L, n)) for L, n in sets}


def sets_flag(text):
    """--sets: '128:8,64:4' -> ((64, 4), (128, 8)), sorted by N then L (the last: most pairs)."""
    sets = {tuple(int(s) for s in item.split(':')) for item in text.split(',')}
    return tuple(sorted(sets, key=lambda s: s[::-1]))


valid_sets = lambda sets: all(len(s) == 2 and 1 <= s[1] and 2 * s[1] <= s[0] for s in sets)
parse_sets = checked(sets_flag, valid_sets, "give L:N, N >= 1 pairs in L >= 2N positions (each "
                     "pair and its query), comma-separated")
parse_vocab = checked(int, lambda v: 4 <= v <= 65536, "give an integer from 4 to 65,536")


def main():
    count = checked(int, lambda v: v >= 1, "give an integer >= 1")
    seed = checked(int, lambda v: v >= 0, "give an integer >= 0")
    power_a = checked(float, lambda v: 1e-3 <= v <= 1, "give a number in [0.001, 1]")
    cpu = ','.join(f'{L}:{n}' for L, n in SETS)
    here = os.path.dirname(os.path.abspath(__file__))
    p = Parser(prog='data/mqar/prepare.py', description=__doc__)
    p.add_argument('--vocab', type=parse_vocab, default=256,
                   help='token ids: keys in its lower half, values in its upper '
                        '(default: 256; Zoology: 8192)')
    p.add_argument('--sets', type=parse_sets, default=cpu,
                   help=f'(length L, pairs N) of each set (default: {cpu}; '
                        'Zoology: 64:4,128:8,256:16,512:64)')
    p.add_argument('--train', type=count, default=20000,
                   help='training sequences per set (default: 20000)')
    p.add_argument('--val', type=count, default=500,
                   help='validation sequences per set (default: 500)')
    p.add_argument('--power_a', type=power_a, default=0.01,
                   help="the gaps' power law, p(gap) ~ gap^(power_a - 1) (default: Zoology's 0.01)")
    p.add_argument('--seed', type=seed, default=0, help='(default: 0)')
    p.add_argument('--out_dir', default=here, help='(default: data/mqar)')
    args = p.parse_args()
    given = (args.vocab, args.sets, args.train, args.val, args.seed, args.power_a)
    # one sequence of each set: a vocabulary too small for its pairs is refused before anything is
    # built; then the memory of x and y (int64), counted
    try:
        [zoology(args.vocab, L, n, 1, np.random.default_rng(0)) for L, n in args.sets]
    except ValueError as e:
        p.error(f"--vocab={args.vocab}, --sets: {e}")
    check_memory(16 * (args.train + args.val) * sum(L for L, _ in args.sets), 'cpu',
                 f"--train={args.train}, --val={args.val} and --sets")
    # a data set there before is replaced: say which, so that another one is not lost unnoticed
    asked, before = settings(*given), None
    path = os.path.join(args.out_dir, 'mqar.json')
    try:
        if os.path.isfile(path):  # (a FIFO there would block the read)
            with open(path) as f:
                before = {k: v for k, v in json.load(f).items() if k in asked}
    except (OSError, ValueError, AttributeError):  # unreadable, not JSON, not a dict
        pass
    replacing = os.path.isfile(os.path.join(args.out_dir, 'mqar.npz')) and before != asked
    said = (f"the data set made with {before}" if before
            else "a data set of unknown settings (no readable mqar.json)")
    try:
        print(f"wrote {prepare(args.out_dir, *given)}" + f" (replacing {said})" * replacing)
    except OSError as e:
        where = f": {e.filename}" if e.filename else ""
        p.error(f"--out_dir {args.out_dir!r}: {e.strerror or e}{where}")
    except MemoryError:
        p.error(f"--train={args.train} and --val={args.val}: more sequences than this machine's "
                "memory holds")


if __name__ == '__main__':
    main()
