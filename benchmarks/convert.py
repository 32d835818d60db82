"""
bench.py convert: MHA converted to GQA, MQA (mean-pooled) and MLA (SVD), uptrained, by cache.

As Ainslie et al. 2023 (and MHA2MLA for MLA): an MHA trained here on the CPU preset, with GQA, MQA
and MLA trained from scratch beside it; or --source: any MHA checkpoint of ours (an out_dir), or
GPT-2 (gpt2, or a save_pretrained folder; pip install -r requirements-hf.txt) on GPT-2-tokenized
data, the MHA uptrained as long as each conversion (another text: it learns it too):

    python bench.py convert
    python bench.py convert --source=out-shakespeare-char-mha
    python bench.py convert --source=gpt2 --max_iters=300 -- --dataset=shakespeare --eval_iters=20
"""
import os

from benchmarks.common import (LEGEND_OUTSIDE, MORE, command, count, flag, listed, machine, plot,
                               iterations, row, table)
from benchmarks.train import (OWNED, add_extra, check_extras, check_models, runs_train_py,
                              train_run)
from configurator import checked
from run.gpt2 import is_gpt2

# train.py's keys that the uptraining sets too
UPTRAINING = ['n_kv_head', 'learning_rate', 'min_lr', 'warmup_iters', 'match_mha_params']
NAME = {'mha': 'MHA', 'gqa': 'GQA, 2 K/V heads', 'mqa': 'MQA', 'mla': 'MLA'}
HOW = {'gqa': 'mean-pooled', 'mqa': 'mean-pooled', 'mla': 'factorised (joint SVD)'}
# a source's fine-tuning: the CPU preset's settings but its shape (the source's), its block cropped
TUNING = ['--device=cpu', '--compile=False', '--batch_size=12', '--block_size=64', '--dropout=0.0']
fractions = listed(float, lambda v: all(0 <= f <= 1 for f in v), "give numbers in [0, 1]")
positive = checked(float, lambda v: 0 < v < float('inf'), "give a number > 0")


def add_arguments(p):
    flag(p, 'max_iters', None, count, "MHA's iterations, or with --source the fine-tuning's "
         "(default: 2000)")
    flag(p, 'fractions', '0,0.01,0.025,0.05,0.1', fractions, 'fine-tuning, fractions of max_iters')
    flag(p, 'lr', 1e-3, positive, 'peak learning rate of the fine-tuning')
    flag(p, 'source', None, str, "an MHA to convert instead of training one: an out_dir with its "
         "ckpt.pt, or GPT-2 (gpt2, gpt2-medium, ..., a save_pretrained folder)")
    add_extra(p)


def check(args, error):
    check_extras(args, error, OWNED + UPTRAINING)
    args.max_iters = iterations(args, error, 2000)
    mha = args.source and os.path.isfile(os.path.join(args.source, 'ckpt.pt'))
    if args.source and not (mha or is_gpt2(args.source)):
        error(f"--source={args.source}: give an out_dir with an MHA ckpt.pt, or GPT-2 (gpt2, "
              "gpt2-medium, -large, -xl, or a folder save_pretrained wrote)")
    runs_train_py(args.mode)


def report(args):
    return convert_report(args)


def convert_report(args):
    """MHA, trained here or --source; GQA, MQA and MLA converted from it and fine-tuned (and, for an
    MHA trained here, from scratch)."""
    iters, lr, out, source = args.max_iters, args.lr, os.path.join(args.out, 'convert'), args.source
    ups = sorted({round(f * iters) for f in args.fractions})  # fine-tuning iterations
    # the headline's: 5%, or the nearest
    shown = min([n for n in ups if n] or [0], key=lambda n: abs(n / iters - 0.05))
    if not source:
        check_models(args, ['config/cpu.py'], ['mha', 'gqa', 'mqa', 'mla'])

    def run(folder, attn, n, *more):
        recipe = TUNING if source else [f'config/{attn}.py', 'config/cpu.py']
        return train_run(os.path.join(out, folder), [
            *recipe, f'--attn={attn}', '--eval_iters=200', '--log_interval=1000000', *args.extra,
            f'--max_iters={n}', f'--lr_decay_iters={max(n, 1)}', f'--eval_interval={max(n, 1)}',
            *more])
    mha = source or os.path.join(out, 'mha')
    tuning = lambda n: [f"--init_from={mha}", f'--warmup_iters={n // 10}', f'--learning_rate={lr}',
                        f'--min_lr={lr / 10}']
    # {(layout, uptraining iterations or None: from scratch): the run}; a source's MHA uptrained too
    runs = {} if source else {('mha', None): run('mha', 'mha', iters)}
    for attn in ('mha', 'gqa', 'mqa', 'mla'):
        if not source and attn != 'mha':
            runs[attn, None] = run(f'{attn}-scratch', attn, iters, '--match_mha_params=False')
        for n in ups if source or attn != 'mha' else []:
            runs[attn, n] = run(f'{attn}-uptrain-{n}', attn, n, *tuning(n))
    val = {key: r['evals'][-1]['val/loss'] for key, r in runs.items()}
    cache = {key: r['evals'][-1]['cache_bytes_per_token'] for key, r in runs.items()}
    rows = {(a, n): convert_row(a, n, r, iters, val, source) for (a, n), r in runs.items()}
    header = ['model', 'made by', 'iterations', 'params', 'cache bytes/token (fp32)', 'val loss',
              "minus MHA's" + " (as uptrained)" * bool(source)]
    summary = table(header, [line for (a, n), line in rows.items() if n in (None, 0, shown)])
    if shown and 0 in ups:
        summary += gap_closed(val, shown, iters)
    loss_against_cache(os.path.join(args.out, 'convert.png'), val, cache, ups)
    fractions = ','.join(f'{f:g}' for f in args.fractions)
    # the last --eval_iters counts
    evals = ['200', *(x.split('=')[1] for x in args.extra if x.startswith('--eval_iters='))][-1]
    run_line = command(args, f'--max_iters={iters}', f'--lr={lr:g}', f'--fractions={fractions}',
                       *[f'--source={source}'] * bool(source))
    what = (f"{source} converted, uptrained with {' '.join(TUNING[2:])} (a longer block_size "
            "cropped to it)" if source else "config/cpu.py (4 layers, 4 heads, 128 wide, block 64)")
    return (f"`{run_line}` on {machine()}: {what}, seed 1337, val loss = mean of the same {evals} "
            f"val batches.\n\n" + summary + "\n![val loss vs cache bytes per token](convert.png)\n"
            + MORE + "\n**Every run**:\n\n" + table(header, list(rows.values()))
            + f"\nUptraining: peak learning rate {lr:g}, warmup a tenth of the run, cosine to "
            f"{lr / 10:g}. MLA: d_c = 4 head_dim, d_R = head_dim / 2 (train.py's defaults; "
            "--kv_lora_rank, --rope_head_dim after -- set others); run/convert.py's to_mla says "
            "how the keys, values and positions are carried over.\n")


def made_by(attn, n, iters, source):  # n: the uptraining's iterations, None: from scratch
    if n is None:
        return 'trained from scratch'
    how = source if attn == 'mha' else f'MHA {HOW[attn]}'
    return f'{how}, uptrained {n / iters:.1%}' if n else f'{how}, no uptraining'


def mha(val, n):
    """The val loss a conversion uptrained n iterations is compared with: the source MHA uptrained
    as long, or the MHA trained here."""
    return val.get(('mha', n), val.get(('mha', None)))


def convert_row(attn, n, run, iters, val, source):
    iterations = f"{iters:,}" + ('' if n is None else f' + {n:,}') if not source else f"{n:,}"
    return row(NAME[attn], made_by(attn, n, iters, source), iterations, f"{run['params']}M",
               f"{run['evals'][-1]['cache_bytes_per_token']:,.0f}", f"{val[attn, n]:.4f}",
               f"{val[attn, n] - mha(val, n):+.4f}")


def gap_closed(val, shown, iters):
    """The share of each conversion's gap to MHA that `shown` iterations of uptraining close."""
    gap = lambda a, n: val[a, n] - mha(val, n)
    shares = [f"{NAME[a]} {1 - gap(a, shown) / gap(a, 0):.0%}" if gap(a, 0) > 0
              else f"{NAME[a]}: no gap" for a in ('gqa', 'mqa', 'mla')]
    return (f"\nShare of the gap to MHA opened by converting that {100 * shown / iters:g}% "
            "uptraining closes: " + ", ".join(shares) + ".\n")


def loss_against_cache(path, val, cache, ups):
    """Each conversion's val loss against its cache bytes per token, uptrained 0 iterations (the
    top point) to the most; the models trained from scratch as squares, in their layout's colour."""
    lines = []
    for attn, color in (('mha', 'C0'), ('gqa', 'C1'), ('mqa', 'C3'), ('mla', 'C4')):
        if (attn, ups[0]) in val:
            xs, ys = [cache[attn, n] for n in ups], [val[attn, n] for n in ups]
            label = f"{NAME[attn]}, {ups[0]}-{ups[-1]} it."
            lines.append((xs, ys, label, dict(marker='o', color=color)))
        if (attn, None) in val:
            lines.append(([cache[attn, None]], [val[attn, None]], f"{NAME[attn]}, from scratch",
                          dict(marker='s', ls='', color=color, mfc='none', ms=9)))
    plot(path, lines, LEGEND_OUTSIDE, xlabel='cache bytes per token (fp32)', ylabel='val loss',
         title='Converted from MHA, then uptrained')
