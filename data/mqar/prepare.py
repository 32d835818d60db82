"""
Multi-query associative recall (MQAR; Arora et al. 2023, "Zoology"): the recall test of the linear layouts.

A sequence holds N key-value pairs, then the N keys again in a random order; at each query the model must say the
value its key was paired with. Loss and accuracy count those answers only (the other targets are -1, which the
model's cross-entropy ignores). One change from Zoology: a pair is one token (id key * VALUES + value), not two,
so a single attention layer can look it up; Zoology's two-token pairs also need an induction circuit, which our
tiny CPU models did not learn in minutes (MHA: 45% at N = 4 after 1,500 steps).

    token ids: pairs 0 .. KEYS*VALUES-1 | queries (one per key) | answers (one per value) | padding
    x: p1 p2 ... pN  q1 q2 ... qN  pad ...      y: -1 ... -1  a1 a2 ... aN  -1 ...    (a_i: the value of q_i's pair)

    python data/mqar/prepare.py                      # data/mqar/mqar.npz: N = 4, 8, 16, 24, 32, padded to 64 tokens
    python data/mqar/prepare.py --pairs=8,16 --train=20000 --val=500 --seed=1
"""
import errno
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from interrupts import exit_on_signals, memory_errors_in_one_line  # noqa: E402

if __name__ == '__main__':  # first: Ctrl-C or a kill during the slow imports below is one line too
    memory_errors_in_one_line('--train, --val')
    exit_on_signals()  # (a kill mid-write leaves no temp file)
import numpy as np  # noqa: E402

from configurator import Parser, checked  # noqa: E402

KEYS, VALUES = 32, 16
QUERY, ANSWER = KEYS * VALUES, KEYS * VALUES + KEYS  # the first query id, the first answer id
PAD = ANSWER + VALUES
VOCAB = PAD + 1


def sequences(n_pairs, count, rng, length=None):
    """(x, y), int64 (count, length or 2 n_pairs): N pairs with distinct keys, then their keys in a random order."""
    length = length or 2 * n_pairs
    if not 1 <= n_pairs <= KEYS or length < 2 * n_pairs:
        raise ValueError(f"{n_pairs} pairs in {length} tokens: give 1 to {KEYS} pairs (each key appears once), "
                         f"and 2 tokens a pair")
    k = np.argsort(rng.random((count, KEYS)), axis=1)[:, :n_pairs]        # distinct keys per sequence
    v = rng.integers(0, VALUES, (count, n_pairs))                          # values, repeats allowed
    order = np.argsort(rng.random((count, n_pairs)), axis=1)               # the queries, in a random order
    x, y = np.full((count, length), PAD, dtype=np.int64), np.full((count, length), -1, dtype=np.int64)
    x[:, :n_pairs] = k * VALUES + v
    x[:, n_pairs:2 * n_pairs] = QUERY + np.take_along_axis(k, order, 1)
    y[:, n_pairs:2 * n_pairs] = ANSWER + np.take_along_axis(v, order, 1)
    return x, y


def zoology(vocab, length, n_pairs, count, rng, power_a=0.01):
    """(x, y), int64 (count, length): Zoology's MQAR (multiquery_ar.py) in its one-position variant, the layout #45
    moves to. Keys are ids 1 .. vocab/2 - 1, values vocab/2 .. vocab - 1, both distinct within a sequence; the N pairs
    come first, one position each, packed as key * vocab + value (the model embeds key + value there); then each key
    alone (key * vocab) at a gap after the pairs drawn from Zoology's power law (p(gap) ~ gap^(power_a - 1): near
    ones likelier), and random tokens (token * vocab) between. y: the pair's value at its key's query, else -1."""
    half, space = vocab // 2, length - n_pairs
    if not (n_pairs <= min(half - 1, vocab - half) and n_pairs <= space):
        raise ValueError(f"{n_pairs} pairs in {length} tokens of a {vocab}-token vocabulary: give at most "
                         f"{min(half - 1, vocab - half)} pairs, and a query position for each after them")
    keys = 1 + np.argsort(rng.random((count, half - 1)), axis=1)[:, :n_pairs]            # distinct keys
    values = half + np.argsort(rng.random((count, vocab - half)), axis=1)[:, :n_pairs]   # distinct values
    p = power_a * np.arange(1, space + 1) ** (power_a - 1)
    gumbel = -np.log(-np.log(rng.random((count, space))))  # top-N of log p + Gumbel: N gaps drawn without replacement
    gaps = np.argsort(-(np.log(p / p.sum()) + gumbel), axis=1)[:, :n_pairs]
    x = rng.integers(0, vocab, (count, length)) * vocab                                  # noise: a token, no value
    y = np.full((count, length), -1, dtype=np.int64)
    x[:, :n_pairs] = keys * vocab + values
    np.put_along_axis(x, n_pairs + gaps, keys * vocab, axis=1)
    np.put_along_axis(y, n_pairs + gaps, values, axis=1)
    return x, y


def prepare(out_dir, pairs=(4, 8, 16, 24, 32), train=20000, val=500, seed=0):
    """out_dir/mqar.npz: train_x_N, train_y_N, val_x_N, val_y_N per N, all padded to 2 max(N); and mqar.json."""
    rng, length = np.random.default_rng(seed), 2 * max(pairs)
    arrays = {}
    for n in pairs:
        for split, count in (('train', train), ('val', val)):
            arrays[f'{split}_x_{n}'], arrays[f'{split}_y_{n}'] = sequences(n, count, rng, length)
    os.makedirs(out_dir, exist_ok=True)
    for name in ('mqar.npz', 'mqar.json'):  # a folder in the way: refused before either file is replaced
        if os.path.isdir(os.path.join(out_dir, name)):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), os.path.join(out_dir, name))
    meta = dict(kind='mqar', vocab_size=VOCAB, keys=KEYS, values=VALUES, pairs=list(pairs), length=length,
                train=train, val=val, seed=seed)
    tmp = os.path.join(out_dir, f'.tmp{os.getpid()}')
    try:
        with open(tmp + '.npz', 'wb') as f:  # temp files, then renames: never half a data set
            np.savez_compressed(f, **arrays)
        with open(tmp + '.json', 'w') as f:
            json.dump(meta, f)
        os.replace(tmp + '.npz', os.path.join(out_dir, 'mqar.npz'))
        os.replace(tmp + '.json', os.path.join(out_dir, 'mqar.json'))  # not meta.json: never another data set's
    finally:  # what a failed write or a kill (SIGTERM) left behind
        for left in (tmp + '.npz', tmp + '.json'):
            if os.path.isfile(left):
                os.remove(left)
    return os.path.join(out_dir, 'mqar.npz')


def main():
    count = checked(int, lambda v: 1 <= v <= 10 ** 6, "give an integer from 1 to 1,000,000")
    pairs = checked(lambda s: sorted({int(x) for x in s.split(',')}), lambda v: 1 <= v[0] and v[-1] <= KEYS,
                    f"give integers from 1 to {KEYS}, comma-separated")
    p = Parser(prog='data/mqar/prepare.py', description=__doc__)
    p.add_argument('--pairs', type=pairs, default='4,8,16,24,32', help='numbers of pairs N (default: 4,8,16,24,32)')
    p.add_argument('--train', type=count, default=20000, help='training sequences per N (default: 20000)')
    p.add_argument('--val', type=count, default=500, help='validation sequences per N (default: 500)')
    seed = checked(int, lambda v: v >= 0, "give an integer >= 0")
    p.add_argument('--seed', type=seed, default=0, help='(default: 0)')
    p.add_argument('--out_dir', default=os.path.dirname(os.path.abspath(__file__)), help='(default: data/mqar)')
    args = p.parse_args()
    asked, before, settings = dict(pairs=args.pairs, train=args.train, val=args.val, seed=args.seed), None, \
        os.path.join(args.out_dir, 'mqar.json')
    try:  # a data set there before is replaced: say which, so that another one is not lost unnoticed
        if os.path.isfile(settings):  # (a FIFO there would block the read)
            with open(settings) as f:
                before = {k: v for k, v in json.load(f).items() if k in asked}
    except (OSError, ValueError, AttributeError):  # unreadable, not JSON, not a dict
        pass
    replacing = os.path.isfile(os.path.join(args.out_dir, 'mqar.npz')) and before != asked
    said = f"the data set made with {before}" if before else "a data set of unknown settings (no readable mqar.json)"
    try:
        print(f"wrote {prepare(args.out_dir, args.pairs, args.train, args.val, args.seed)}"
              + f" (replacing {said})" * replacing)
    except OSError as e:
        p.error(f"--out_dir {args.out_dir!r}: {e.strerror or e}" + (f": {e.filename}" if e.filename else ""))
    except MemoryError:
        p.error(f"--train={args.train} and --val={args.val}: more sequences than this machine's memory holds")


if __name__ == '__main__':
    main()
