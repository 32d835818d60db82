"""
bench.py convert: MHA -> GQA / MQA by mean-pooling K/V heads, then uptraining.

As Ainslie et al. 2023, next to GQA and MQA trained from scratch, all on the CPU preset.
"""
import os

from benchmarks.common import MORE, command, count, flag, listed, machine, row, table
from benchmarks.train import (OWNED, add_extra, check_extras, check_models, runs_train_py,
                              train_run)
from configurator import checked

# train.py's keys that the uptraining sets too
UPTRAINING = ['n_kv_head', 'learning_rate', 'min_lr', 'warmup_iters', 'match_mha_params']
NAME = {'mha': 'MHA', 'gqa': 'GQA, 2 K/V heads', 'mqa': 'MQA'}
fractions = listed(float, lambda v: all(0 <= f <= 1 for f in v), "give numbers in [0, 1]")
positive = checked(float, lambda v: 0 < v < float('inf'), "give a number > 0")


def add_arguments(p):
    flag(p, 'max_iters', None, count, "MHA's iterations (default: 2000)")
    flag(p, 'fractions', '0,0.01,0.025,0.05,0.1', fractions, 'uptraining, fractions of max_iters')
    flag(p, 'lr', 1e-3, positive, 'peak learning rate of the uptraining')
    add_extra(p)


def check(args, error):
    check_extras(args, error, OWNED + UPTRAINING)
    args.max_iters = args.max_iters or 2000
    runs_train_py(args.mode)


def report(args):
    return convert_report(args)


def convert_report(args):
    """Ainslie et al. 2023: MHA; GQA and MQA from scratch, and mean-pooled from MHA then uptrained
    (CPU preset)."""
    iters, lr, out = args.max_iters, args.lr, os.path.join(args.out, 'convert')
    ups = sorted({round(f * iters) for f in args.fractions})  # uptraining iterations
    # the headline's: 5%, or the nearest
    shown = min([n for n in ups if n] or [0], key=lambda n: abs(n / iters - 0.05))
    check_models(args, ['config/cpu.py'], ['mha', 'gqa', 'mqa'])

    def run(folder, attn, n, *more):
        return train_run(os.path.join(out, folder), [
            f'config/{attn}.py', 'config/cpu.py', '--eval_iters=200', '--log_interval=1000000',
            *args.extra, f'--max_iters={n}', f'--lr_decay_iters={max(n, 1)}',
            f'--eval_interval={max(n, 1)}', *more])
    uptraining = lambda n: [f"--init_from={os.path.join(out, 'mha')}", f'--warmup_iters={n // 10}',
                            f'--learning_rate={lr}', f'--min_lr={lr / 10}']
    # {(layout, uptraining iterations or None): the run}
    runs = {('mha', None): run('mha', 'mha', iters)}
    for attn in ('gqa', 'mqa'):
        runs[attn, None] = run(f'{attn}-scratch', attn, iters, '--match_mha_params=False')
        for n in ups:
            runs[attn, n] = run(f'{attn}-uptrain-{n}', attn, n, *uptraining(n))
    val = {key: r['evals'][-1]['val/loss'] for key, r in runs.items()}
    rows = {(a, n): convert_row(a, n, r, iters, val) for (a, n), r in runs.items()}
    header = ['model', 'made by', 'iterations', 'params', 'cache bytes/token (fp32)', 'val loss',
              "minus MHA's"]
    summary = table(header, [line for (a, n), line in rows.items() if n in (None, 0, shown)])
    if shown and 0 in ups:
        summary += gap_closed(val, shown, iters)
    fractions = ','.join(f'{f:g}' for f in args.fractions)
    # the last --eval_iters counts
    evals = ['200', *(x.split('=')[1] for x in args.extra if x.startswith('--eval_iters='))][-1]
    run_line = command(args, f'--max_iters={iters}', f'--lr={lr:g}', f'--fractions={fractions}')
    return (f"`{run_line}` on {machine()}: config/cpu.py (4 layers, 4 heads, 128 wide, block 64), "
            f"seed 1337, val loss = mean of the same {evals} val batches.\n\n" + summary + MORE
            + "\n**Every run**:\n\n" + table(header, list(rows.values()))
            + f"\nUptraining: peak learning rate {lr:g}, warmup a tenth of the run, cosine to "
            f"{lr / 10:g}.\n")


def made_by(n, iters):  # n: the uptraining's iterations, None: from scratch
    if n is None:
        return 'trained from scratch'
    return f'MHA mean-pooled, uptrained {n / iters:.1%}' if n else 'MHA mean-pooled, no uptraining'


def convert_row(attn, n, run, iters, val):
    iterations = f"{iters:,}" + ('' if n is None else f' + {n:,}')
    return row(NAME[attn], made_by(n, iters), iterations, f"{run['params']}M",
               f"{run['evals'][-1]['cache_bytes_per_token']:,.0f}", f"{val[attn, n]:.4f}",
               f"{val[attn, n] - val['mha', None]:+.4f}")


def gap_closed(val, shown, iters):
    """The share of the gap to MHA that mean-pooling opened, closed by `shown` iterations of
    uptraining."""
    mha = val['mha', None]
    shares = [f"{NAME[a]} {(val[a, 0] - val[a, shown]) / (val[a, 0] - mha):.0%}" if val[a, 0] > mha
              else f"{NAME[a]}: no gap" for a in ('gqa', 'mqa')]
    return (f"\nShare of the gap to MHA opened by mean-pooling that {100 * shown / iters:g}% "
            "uptraining closes: " + ", ".join(shares) + ".\n")
