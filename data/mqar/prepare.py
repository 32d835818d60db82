"""
Multi-query associative recall (MQAR; Arora et al. 2023, "Zoology"): the recall test of the linear layouts.

A sequence is N key-value pairs, then the N keys again in a random order, each followed by its value:

    k1 v1 k2 v2 ... kN vN   q1 a1 q2 a2 ... qN aN      (q_i is some k_j, a_i its v_j)

Keys and values come from disjoint token ranges; the loss is on the answers only (the target at q_i is a_i,
elsewhere -1, which the model's cross-entropy ignores). A model that recalls every pair scores 100%.

    python data/mqar/prepare.py                       # data/mqar/mqar.npz: pairs 4, 8, 16, 32, 64
    python data/mqar/prepare.py --pairs=8,16 --train=20000 --val=500 --seed=1
"""
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from configurator import Parser, checked  # noqa: E402

KEYS = VALUES = 64  # token ids: keys 0..63, values 64..127


def sequences(n_pairs, count, rng, keys=KEYS, values=VALUES):
    """(x, y), int64 (count, 4 * n_pairs): the tokens, and the targets (-1 but at each query: its answer)."""
    if not 1 <= n_pairs <= keys:
        raise ValueError(f"{n_pairs} pairs: give 1 to {keys} (each key appears once)")
    k = np.argsort(rng.random((count, keys)), axis=1)[:, :n_pairs]        # distinct keys per sequence
    v = keys + rng.integers(0, values, (count, n_pairs))                  # values, repeats allowed
    order = np.argsort(rng.random((count, n_pairs)), axis=1)              # the queries, in a random order
    x = np.empty((count, 4 * n_pairs), dtype=np.int64)
    x[:, 0:2 * n_pairs:2], x[:, 1:2 * n_pairs:2] = k, v
    x[:, 2 * n_pairs::2] = np.take_along_axis(k, order, 1)
    x[:, 2 * n_pairs + 1::2] = np.take_along_axis(v, order, 1)
    y = np.full_like(x, -1)
    y[:, 2 * n_pairs::2] = x[:, 2 * n_pairs + 1::2]                       # at a query: predict its value
    return x, y


def prepare(out_dir, pairs=(4, 8, 16, 32, 64), train=20000, val=500, seed=0):
    """out_dir/mqar.npz with train_x_N, train_y_N, val_x_N, val_y_N per N, and meta.json; returns the npz path."""
    rng = np.random.default_rng(seed)
    arrays = {}
    for n in pairs:
        for split, count in (('train', train), ('val', val)):
            arrays[f'{split}_x_{n}'], arrays[f'{split}_y_{n}'] = sequences(n, count, rng)
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, 'mqar.npz')
    with open(path + '.tmp.npz', 'wb') as f:  # temp file, then rename: never half a data set
        np.savez_compressed(f, **arrays)
    meta = dict(kind='mqar', vocab_size=KEYS + VALUES, keys=KEYS, values=VALUES, pairs=list(pairs), train=train,
                val=val, seed=seed)
    with open(os.path.join(out_dir, 'meta.json.tmp'), 'w') as f:
        json.dump(meta, f)
    os.replace(path + '.tmp.npz', path)
    os.replace(os.path.join(out_dir, 'meta.json.tmp'), os.path.join(out_dir, 'meta.json'))
    return path


def main():
    count = checked(int, lambda v: v >= 1, "give an integer >= 1")
    pairs = checked(lambda s: sorted({int(x) for x in s.split(',')}), lambda v: 1 <= v[0] and v[-1] <= KEYS,
                    f"give integers from 1 to {KEYS}, comma-separated")
    p = Parser(prog='python data/mqar/prepare.py', description=__doc__)
    p.add_argument('--pairs', type=pairs, default='4,8,16,32,64', help='numbers of key-value pairs (default: 4,8,16,32,64)')
    p.add_argument('--train', type=count, default=20000, help='training sequences per N (default: 20000)')
    p.add_argument('--val', type=count, default=500, help='validation sequences per N (default: 500)')
    p.add_argument('--seed', type=int, default=0, help='(default: 0)')
    p.add_argument('--out_dir', default=os.path.dirname(os.path.abspath(__file__)), help='(default: data/mqar)')
    args = p.parse_args()
    try:
        print(f"wrote {prepare(args.out_dir, args.pairs, args.train, args.val, args.seed)}")
    except OSError as e:
        p.error(f"--out_dir {args.out_dir!r}: {e.strerror}")


if __name__ == '__main__':
    main()
