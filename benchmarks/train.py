"""
bench.py train: every layout on one recipe (losses, speed, curves), and the step vs nanoGPT's.

Each layout trained by train.py on the CPU preset (on CUDA the baby-GPT recipe); with --nanogpt,
the training step timed next to nanoGPT's model.py. Also the train.py runs of bench.py convert.
"""
import copy
import dataclasses
import json
import os
import re
import runpy
import statistics
import subprocess
import sys

import torch

from benchmarks.common import (LAYOUTS, MORE, add_device, add_layouts, command, compile_options,
                               count, flag, machine, plot, progress, iterations, row, table)
from benchmarks.timing import take_turns
from benchmarks.windows import band_cost, retrofit
from configurator import check_device, describe, fail, parse_value
from model import GPT, GPTConfig
from run.checkpoint import FileError, in_use, remove_run

# train.py's keys that bench.py sets itself
OWNED = ['out_dir', 'wandb_log', 'attn', 'device', 'max_iters', 'lr_decay_iters', 'eval_interval',
         'log_interval', 'init_from', 'eval_only', 'seed']


def add_arguments(p):
    add_layouts(p)
    add_device(p, '; on cuda the full baby-GPT recipe')
    flag(p, 'max_iters', None, count, "iterations (default: 2000, on cuda 5000)")
    add_nanogpt(p)
    add_extra(p)


def add_nanogpt(p):
    flag(p, 'nanogpt', None, str, "nanoGPT's model.py, to time its step next to ours")


def add_extra(p):
    p.add_argument('extra', nargs='*', default=[], help="more --key=value for train.py, after --")


def check(args, error):
    check_extras(args, error, OWNED)
    args.max_iters = iterations(args, error, 2000 if args.device == 'cpu' else 5000)
    check_device(args.device, 'float32')
    check_nanogpt(args, error)
    runs_train_py(args.mode)


def report(args):
    return train_report(args)


def check_extras(args, error, owned):
    """The extras are train.py's --key=value, none of the keys bench.py sets."""
    clash = [x for x in args.extra if x.lstrip('-').split('=')[0] in owned or not x.startswith('--')]
    if clash:
        what = "bench.py sets that itself" if clash[0].startswith('--') else "not a --key=value"
        error(f"{clash[0]}: {what} (the extras are train.py's --key=value; bench.py picks the "
              "config files)")


def check_nanogpt(args, error):
    """nanoGPT's model.py runs now, two steps: a wrong file is refused before five layouts train,
    not after."""
    if args.nanogpt is None:
        return
    try:
        step_time_vs_nanogpt(args.nanogpt, rounds=1, steps=1)
    except (Exception, SystemExit) as e:
        error(f"--nanogpt={args.nanogpt}: not nanoGPT's model.py? {describe(e)}")


def runs_train_py(mode):
    if not os.path.isfile('train.py'):
        raise ValueError(f"{mode} runs train.py and config/ from here: run bench.py in its own folder")


# --- train.py's runs ------------------------------------------------------------------------------

def train_run(run_dir, args):
    """train.py with args into run_dir: its metrics.jsonl rows, evaluations, parameters,
    tokens/iter."""
    # an earlier run in run_dir is replaced once this one succeeded, never lost to a failed one
    new = run_dir + '.new'
    for d in (run_dir, new):  # folders bench.py made: never a user's that happens to sit there
        if os.path.isdir(d) and os.listdir(d) and not os.path.isfile(os.path.join(d, 'metrics.jsonl')):
            fail(f"{d} holds files bench.py did not write (no metrics.jsonl): move them, or give "
                 "another --out")
        if in_use(d):  # (before the run: a live one is found now, not after this layout trained)
            fail(f"{d} is in use by a live train.py run: wait for it to end, or give another --out")
    remove(new)
    cmd = [sys.executable, 'train.py', *args, f'--out_dir={new}', '--wandb_log=False']
    progress(' '.join(cmd[1:]))
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        last = (r.stderr.strip().splitlines() or ['?'])[-1].removeprefix('error: ')
        fail(f"train.py failed in {new}: {last}")
    if not os.path.isfile(os.path.join(new, 'metrics.jsonl')):  # (train.py -- --help: no run)
        fail(f"train.py ended without a run in {new} (its flags asked for --help?); {run_dir} kept "
             "as it was")
    remove(run_dir)
    os.replace(new, run_dir)
    rows = [json.loads(line) for line in open(os.path.join(run_dir, 'metrics.jsonl'))]
    params = re.search(r"([\d.]+)M param", r.stdout)[1]
    tokens = re.search(r"tokens per iteration will be: ([\d,]+)", r.stdout)[1]
    return dict(rows=rows, evals=[r for r in rows if 'val/loss' in r], params=params,
                tokens=int(tokens.replace(',', '')))


def remove(run_dir):
    """A run folder bench.py made, deleted under its lock: never while a train.py writes it."""
    try:
        remove_run(run_dir)
    except (FileError, OSError) as e:
        fail(str(e) if isinstance(e, FileError) else f"cannot remove {run_dir}: {e.strerror}")


def check_models(args, recipe, layouts=None):
    """Each layout's model as train.py will build it (config/NAME.py, the recipe's files, the
    extras), before the first run: one the extras break fails now, not after the layouts before it
    trained and replaced their runs."""
    defaults = {f.name: f.default for f in dataclasses.fields(GPTConfig)}
    for attn in layouts or args.layouts:
        values = {}
        for path in [f'config/{attn}.py', *(r for r in recipe if r.endswith('.py'))]:
            values.update(runpy.run_path(path))
        for key, _, text in (x[2:].partition('=') for x in args.extra):
            values[key] = parse_value(text, defaults.get(key, ''))
        try:
            GPTConfig(**{k: v for k, v in values.items() if k in defaults})
        except (TypeError, ValueError) as e:
            why = describe(e) if isinstance(e, TypeError) else e
            fail(f"layout {attn} with {' '.join(args.extra)}: {why}")


# --- the train report -----------------------------------------------------------------------------

def train_report(args):
    """Every layout, same seed and batches (CPU: nanoGPT's CPU preset; CUDA: the baby-GPT recipe,
    bf16)."""
    cpu = args.device == 'cpu'
    every, recipe = (100, ['config/cpu.py']) if cpu else (250, [f'--device={args.device}'])
    check_models(args, recipe)
    runs = {}
    for attn in args.layouts:
        flags = [f'config/{attn}.py', *recipe, f'--max_iters={args.max_iters}',
                 f'--lr_decay_iters={args.max_iters}', f'--eval_interval={every}', '--log_interval=1',
                 *args.extra]
        runs[attn] = train_run(os.path.join(args.out, 'train', attn), flags)
    curves = [([r['iter'] for r in run['evals']], [r['val/loss'] for r in run['evals']], attn,
               dict(marker='.')) for attn, run in runs.items()]
    top = max(3.0, *(run['evals'][-1]['val/loss'] + 0.5 for run in runs.values()))
    plot(os.path.join(args.out, 'train_val_loss.png'), curves, {}, ylim=(None, top),
         title='tiny Shakespeare (char): val loss', xlabel='iteration', ylabel='val loss')
    nanogpt = [f'--nanogpt={args.nanogpt}'] if args.nanogpt else []
    run = command(args, f'--max_iters={args.max_iters}', f'--device={args.device}', *nanogpt)
    recipe = 'config/<layout>.py + config/cpu.py' if cpu else 'config/<layout>.py (baby GPT, bf16)'
    header = ['layout', 'params', 'cache bytes/token', 'train loss', 'val loss',
              'best val (iteration)', 'median ms/iter', 'tokens/s']
    text = (f"`{run}` on {machine()}: {recipe}, seed 1337, the same batches for every layout, "
            f"evaluated every {every} iterations; losses at the last one; cache bytes/token at "
            "block_size in the run's dtype.\n\n")
    text += table(header, [train_row(attn, run, every) for attn, run in runs.items()])
    text += "\n![val loss curves](train_val_loss.png)\n" + MORE
    text += step_time_vs_nanogpt(args.nanogpt, args.layouts) if args.nanogpt else ''
    if any(LAYOUTS[a].get('window') or '@' in LAYOUTS[a]['attn'] for a in args.layouts):
        text += band_cost(args.device)
    if 'mha' in runs:  # its checkpoint given a window, no training
        text += retrofit(os.path.join(args.out, 'train', 'mha', 'ckpt.pt'), args.out, args.device)
    return text


def train_row(attn, run, every):
    """A layout's losses at the last evaluation, its best, and its median step (of those without
    an evaluation)."""
    last, best = run['evals'][-1], min(run['evals'], key=lambda r: r['val/loss'])
    steps = [r for r in run['rows'] if 'ms_per_iter' in r]
    ms = statistics.median(r['ms_per_iter'] for r in [s for s in steps if s['iter'] % every] or steps)
    return row(attn, f"{run['params']}M", f"{last['cache_bytes_per_token']:,.0f}",
               f"{last['train/loss']:.4f}", f"{last['val/loss']:.4f}",
               f"{best['val/loss']:.4f} ({best['iter']})", f"{ms:.1f}",
               f"{run['tokens'] / ms * 1000:,.0f}")


# --- the training step next to nanoGPT's ----------------------------------------------------------

CPU_PRESET = dict(n_layer=4, n_head=4, n_embd=128, block_size=64, batch=12)  # config/cpu.py's


def step_time_vs_nanogpt(nanogpt_path, layouts=(), rounds=30, steps=10, device='cpu',
                         dtype=torch.float32, sizes=CPU_PRESET, compile=False):
    """The training step of nanoGPT's model.py at nanogpt_path (None: left out), of our MHA and of
    each of layouts (config/NAME.py's attn and MLP), the models taking turns (compile: each also as
    a compiled copy, one graph): a table, with each step's ratio to nanoGPT's and to our MHA's.
    dtype: autocast's, as train.py."""
    sizes = dict(sizes)
    batch, sizes = sizes.pop('batch'), {**sizes, 'vocab_size': 65, 'dropout': 0.0, 'bias': False}
    torch.manual_seed(0)
    ng = runpy.run_path(nanogpt_path) if nanogpt_path is not None else {}  # its GPT, GPTConfig
    models = {"nanoGPT": ng['GPT'](ng['GPTConfig'](**sizes))} if ng else {}
    models["ours, mha, pos_emb='learned'"] = GPT(GPTConfig(attn='mha', pos_emb='learned', **sizes))
    models["ours, mha, RoPE (default)"] = GPT(GPTConfig(attn='mha', **sizes))
    for name in (a for a in layouts if a != 'mha'):
        config = runpy.run_path(os.path.join('config', f'{name}.py'))
        match = config.get('match_mha_params', False)
        models[f"ours, {name}"] = GPT(GPTConfig(**LAYOUTS[name], match_mha_params=match, **sizes))
    models = {k: m.to(device) for k, m in models.items()}
    if compile:  # a copy of each, compiled (its own weights and optimizer state)
        # (no CUDA graphs: the step's optimizer is outside)
        options = compile_options(device) | {'mode': None}
        for k, m in list(models.items()):
            models[f"{k}, compiled"] = torch.compile(copy.deepcopy(m), **options)
    x, y = torch.randint(0, 65, (2, batch, sizes['block_size']), device=device)
    autocast = torch.autocast(device.split(':')[0], dtype=dtype, enabled=dtype != torch.float32)

    def train(model, opt):
        for _ in range(steps):
            with autocast:
                loss = model(x, y)[1]
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)
            for k, m in models.items()}
    times = take_turns({k: lambda k=k: train(models[k], opts[k]) for k in models}, device,
                       rounds + 1)
    # round 0: the warm-up (compilation)
    ms = {k: [s / steps * 1000 for s in v[1:]] for k, v in times.items()}
    mha = 'ours, mha, RoPE (default)'
    ratios = lambda k, to: [a / b for a, b in zip(ms[k], ms[to])]  # each round's
    ratio = lambda k, to: f"{statistics.median(ratios(k, to)):.3f}" if to in ms else '—'
    # the middle half of the rounds (1 round: its own)
    quartiles = lambda r: statistics.quantiles(r, n=4)[::2] if len(r) > 1 else r * 2
    spread = lambda k: '-'.join(f"{q:.2f}" for q in quartiles(ratios(k, mha)))
    rows = [row(k, f"{statistics.median(v):.2f}", ratio(k, 'nanoGPT'), ratio(k, mha))
            for k, v in ms.items()]
    spreads = "; ".join(f"{k.removeprefix('ours, ')} {spread(k)}" for k in ms if k != mha)
    return (f"\nTraining-step time on the same recipe, models taking turns in one process (medians "
            f"of {rounds} rounds x {steps} steps; the ratios: the median of each round's ratio):\n\n"
            + table(['model', 'ms/step', 'vs nanoGPT', 'vs our MHA'], rows)
            + f"\nHow much a ratio moves from round to round, the middle half of the {rounds} "
            f"rounds' ratios to our MHA: {spreads}.\n")
