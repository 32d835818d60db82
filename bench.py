"""
Benchmarks that print numbers measured side by side in one run (never timed tests). Each mode writes its full
report to --out/MODE.md (default out-bench/); --readme writes results/MODE.md and puts its headline into README.md.

    python bench.py cache                 # cache bytes per token: the model's formula vs a real cache
    python bench.py train                 # the CPU preset for every layout: losses, speed, val-loss curves
    python bench.py train --nanogpt PATH  # ... and the training step next to nanoGPT's model.py at PATH
    python bench.py decode                # decode roofline (batch 16, t=2048), decode vs context, generation
    python bench.py decode --compile      # ... with compiled columns (a static cache; on CUDA, CUDA graphs)
    python bench.py convert               # MHA -> GQA / MQA by mean-pooling K/V heads, then uptraining
    python bench.py mqar                  # associative recall vs the number of pairs: what a fixed state can hold
    python bench.py gpu --nanogpt PATH    # the one GPU report: roofline, generation, training step, profile, fla
"""
from run.interrupts import end_on_lost_output, exit_at_once, exit_on_signals, memory_errors_in_one_line, on_closed_output

if __name__ == '__main__':  # first: Ctrl-C (and SIGTERM, SIGHUP) during the slow imports below is one line too
    exit_at_once()

import copy
import dataclasses
import json
import math
import os
import platform
import re
import runpy
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from multiprocessing import get_context
from unittest.mock import patch

import numpy as np
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from run.checkpoint import FileError, in_use, remove_run, why, write_atomic
from configurator import Parser, check_device, check_memory, checked, describe, fail, parse_value
from data.mqar.prepare import SETS, load, parse_sets, parse_vocab, prepare, zoology
from benchmarks.timing import generate_in_turns, take_turns
from ops.linear import linear_chunked
from ops.linear_fla import FLA, fla_runs, linear_fla
from model import ATTN_LAYOUTS, GPT, GPTConfig, LINEAR_RULES, num_params

os.environ.setdefault('KINETO_LOG_LEVEL', '6')  # no 'USDT: profiler_start' lines (inductor profiles GPU kernels)
START = time.time()
MORE = "\n<!-- the README shows the report down to here -->\n"  # a report's headline, then its details
PLOTS = []  # saved once the whole report is done: a run that fails or is stopped leaves the saved ones alone
HYBRID = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), 'config', 'hybrid.py'))['attn']
LAYOUTS = {**{a: a for a in ATTN_LAYOUTS}, 'hybrid': HYBRID}  # bench's names: config/NAME.py's attn

# --- Shared: the machine, progress, timing, tables and plots ------------------------------------------------

def machine():
    cpu = platform.processor() or platform.machine()
    if os.path.isfile('/proc/cpuinfo'):  # Linux: the CPU's model name
        cpu = next((ln.split(':', 1)[1].strip() for ln in open('/proc/cpuinfo') if ln.startswith('model name')), cpu)
    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads"

def progress(what):
    """One line on stderr per run or layout of a long benchmark: never silent for minutes."""
    print(f"[{time.time() - START:5.0f} s] {what}", file=sys.stderr, flush=True)

def compile_options(device):
    """fullgraph=True: one graph or an error, never a silent eager fallback; on CUDA, CUDA graphs too. dynamic=False:
    every model its own static graph (the same step code serves ten layouts: automatic dynamic shapes made a K/V head
    count symbolic, and SDPA refused it), and room for them all before the recompile limit fails the run."""
    torch._dynamo.reset()
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    return dict(fullgraph=True, dynamic=False, mode='reduce-overhead' if device.startswith('cuda') else None)

def table(header, rows):  # markdown
    return "\n".join([f"| {' | '.join(header)} |", "|---" * len(header) + "|", *rows]) + "\n"

def plot(path, lines, legend, **axes):
    """One figure for path, saved with the report (PLOTS): lines are (xs, ys, label, matplotlib style); axes: title,
    labels, scales."""
    from matplotlib.figure import Figure  # lazy: only the modes that plot load it; no pyplot, no backend to choose
    fig = Figure(figsize=(7, 4.5), layout='tight')
    ax = fig.subplots()
    for xs, ys, label, style in lines:
        ax.plot(xs, ys, label=label, **style)
    ax.set(**axes)
    ax.grid(alpha=0.3, which='both')
    ax.legend(**legend)
    PLOTS.append(lambda: write_atomic(path, lambda f: fig.savefig(f, dpi=110, format='png')))

# --- cache: bytes per token, the model's formula next to a real cache ---------------------------------------

@torch.no_grad()
def cache_report(layouts=LAYOUTS):
    """Per layout: the cache GPTConfig.cache_elements predicts, and a real cache's nbytes after T tokens."""
    rows = []
    for name in layouts:
        cfg = GPTConfig(attn=LAYOUTS[name])
        T, model = cfg.block_size, GPT(cfg).eval()
        cache = model.init_cache(1)
        model(torch.randint(0, cfg.vocab_size, (1, T)), cache=cache)
        state, formula = cfg.cache_elements(0), cfg.cache_bytes(T)
        per_token = cfg.cache_elements(1) - state
        rows.append(f"| {name} | {cfg.n_kv_head if 'n_kv_head' in cfg.used_fields() else '—'} | {per_token:,} | "
                    f"{cfg.cache_bytes(1, torch.float16) - cfg.cache_bytes(0, torch.float16):,} | {state:,} | "
                    f"{formula:,} | {cache.nbytes:,} | {cache.nbytes / formula:.3f} |")
    mla = GPTConfig(attn='mla')  # the sizes its layers get
    return (f"Config: {cfg.n_layer} layers, {cfg.n_head} heads, n_embd {cfg.n_embd} (head_dim {cfg.head_dim}), "
            f"block_size {T}, MLA d_c={mla.kv_lora_rank} d_R={mla.rope_head_dim}, hybrid {HYBRID!r}; cache of 1 "
            f"sequence after T={T} tokens, float32 (a linear layer's state is float32 in every dtype).\n\n" +
            table(['layout', 'K/V heads', 'cache elements / token (all layers)', 'bytes / token at fp16',
                   'fixed state elements (all layers)', f'formula bytes at T={T} (fp32)', 'measured `cache.nbytes`',
                   'measured / formula'], rows))

# --- train: every layout on one recipe, and the step next to nanoGPT's; convert: MHA -> GQA / MQA -----------

def command(args, *options):
    """The command line of a report: the mode, its options, --layouts if not all, and the extras for train.py."""
    layouts = [] if args.layouts == list(LAYOUTS) else [f"--layouts={','.join(args.layouts)}"]
    return ' '.join(['python bench.py', args.mode, *options, *layouts] + (['--', *args.extra] if args.extra else []))

def train_run(run_dir, args):
    """train.py with args into run_dir: its metrics.jsonl rows, evaluations, parameters, tokens/iter."""
    new = run_dir + '.new'  # an earlier run in run_dir is replaced once this one succeeded, never lost to a failed one
    for d in (run_dir, new):  # folders bench.py made: never a user's that happens to sit there
        if os.path.isdir(d) and os.listdir(d) and not os.path.isfile(os.path.join(d, 'metrics.jsonl')):
            fail(f"{d} holds files bench.py did not write (no metrics.jsonl): move them, or give another --out")
        if in_use(d):  # (before the run: a live one is found now, not after this layout trained)
            fail(f"{d} is in use by a live train.py run: wait for it to end, or give another --out")
    remove(new)
    cmd = [sys.executable, 'train.py', *args, f'--out_dir={new}', '--wandb_log=False']
    progress(' '.join(cmd[1:]))
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        fail(f"train.py failed in {new}: {(r.stderr.strip().splitlines() or ['?'])[-1].removeprefix('error: ')}")
    if not os.path.isfile(os.path.join(new, 'metrics.jsonl')):  # (train.py -- --help: exit 0, no run)
        fail(f"train.py ended without a run in {new} (its flags asked for --help?); {run_dir} kept as it was")
    remove(run_dir)
    os.replace(new, run_dir)
    rows = [json.loads(line) for line in open(os.path.join(run_dir, 'metrics.jsonl'))]
    return dict(rows=rows, evals=[r for r in rows if 'val/loss' in r],
                params=re.search(r"([\d.]+)M param", r.stdout)[1],
                tokens=int(re.search(r"tokens per iteration will be: ([\d,]+)", r.stdout)[1].replace(',', '')))

def remove(run_dir):
    """A run folder bench.py made, deleted under its lock: never while a train.py writes it."""
    try:
        remove_run(run_dir)
    except (FileError, OSError) as e:
        fail(str(e) if isinstance(e, FileError) else f"cannot remove {run_dir}: {e.strerror}")

def check_models(args, recipe, layouts=None):
    """Each layout's model as train.py will build it (config/NAME.py, the recipe's files, the extras), before the
    first run: one the extras break fails now, not after the layouts before it trained and replaced their runs."""
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
            fail(f"layout {attn} with {' '.join(args.extra)}: {describe(e) if isinstance(e, TypeError) else e}")

def train_report(args):
    """Every layout, same seed and batches (CPU: nanoGPT's CPU preset; CUDA: the baby-GPT recipe, bf16)."""
    cpu, rows = args.device == 'cpu', []
    every, recipe = (100, ['config/cpu.py']) if cpu else (250, [f'--device={args.device}'])
    check_models(args, recipe)
    runs = {attn: train_run(os.path.join(args.out, 'train', attn), [
        f'config/{attn}.py', *recipe, f'--max_iters={args.max_iters}', f'--lr_decay_iters={args.max_iters}',
        f'--eval_interval={every}', '--log_interval=1', *args.extra]) for attn in args.layouts}
    for attn, run in runs.items():
        last, best = run['evals'][-1], min(run['evals'], key=lambda r: r['val/loss'])
        steps = [row for row in run['rows'] if 'ms_per_iter' in row]  # the median step: of those without an eval
        ms = statistics.median(row['ms_per_iter'] for row in [s for s in steps if s['iter'] % every] or steps)
        rows.append(f"| {attn} | {run['params']}M | {last['cache_bytes_per_token']:,.0f} | {last['train/loss']:.4f} | "
                    f"{last['val/loss']:.4f} | {best['val/loss']:.4f} ({best['iter']}) | {ms:.1f} | "
                    f"{run['tokens'] / ms * 1000:,.0f} |")
    plot(os.path.join(args.out, 'train_val_loss.png'), [([r['iter'] for r in run['evals']], [r['val/loss'] for r in
         run['evals']], attn, dict(marker='.')) for attn, run in runs.items()], {},
         ylim=(None, max(3.0, *(run['evals'][-1]['val/loss'] + 0.5 for run in runs.values()))),
         title='tiny Shakespeare (char): val loss', xlabel='iteration', ylabel='val loss')
    nanogpt = [f'--nanogpt={args.nanogpt}'] if args.nanogpt else []
    return (f"`{command(args, f'--max_iters={args.max_iters}', f'--device={args.device}', *nanogpt)}` on {machine()}: "
            f"{'config/<layout>.py + config/cpu.py' if cpu else 'config/<layout>.py (baby GPT, bf16)'}, seed 1337, the "
            f"same batches for every layout, evaluated every {every} iterations; losses at the last one; cache "
            "bytes/token at block_size in the run's dtype.\n\n" +
            table(['layout', 'params', 'cache bytes/token', 'train loss', 'val loss', 'best val (iteration)',
                   'median ms/iter', 'tokens/s'], rows) +
            "\n![val loss curves](train_val_loss.png)\n" + MORE +
            (step_time_vs_nanogpt(args.nanogpt, args.layouts) if args.nanogpt else ''))

CPU_PRESET = dict(n_layer=4, n_head=4, n_embd=128, block_size=64, batch=12)  # config/cpu.py's model and batch

def step_time_vs_nanogpt(nanogpt_path, layouts=(), rounds=30, steps=10, device='cpu', dtype=torch.float32,
                         sizes=CPU_PRESET, compile=False):
    """The training step of nanoGPT's model.py at nanogpt_path (None: left out), of our MHA and of each of layouts
    (config/NAME.py's attn and MLP), the models taking turns (compile: each also as a compiled copy, one graph): a
    table, with each step's ratio to nanoGPT's and to our MHA's. dtype: autocast's, as train.py."""
    sizes = dict(sizes)
    batch, sizes = sizes.pop('batch'), {**sizes, 'vocab_size': 65, 'dropout': 0.0, 'bias': False}
    torch.manual_seed(0)
    ng = runpy.run_path(nanogpt_path) if nanogpt_path is not None else {}  # its GPT, GPTConfig
    models = {"nanoGPT": ng['GPT'](ng['GPTConfig'](**sizes))} if ng else {}
    models |= {"ours, mha, pos_emb='learned'": GPT(GPTConfig(attn='mha', pos_emb='learned', **sizes)),
               "ours, mha, RoPE (default)": GPT(GPTConfig(attn='mha', **sizes))}
    for name in (a for a in layouts if a != 'mha'):
        match = runpy.run_path(os.path.join('config', f'{name}.py')).get('match_mha_params', False)
        models[f"ours, {name}"] = GPT(GPTConfig(attn=LAYOUTS[name], match_mha_params=match, **sizes))
    models = {k: m.to(device) for k, m in models.items()}
    if compile:  # a copy of each, compiled (its own weights and optimizer state)
        options = compile_options(device) | {'mode': None}  # (no CUDA graphs: the step's optimizer is outside)
        models |= {f"{k}, compiled": torch.compile(copy.deepcopy(m), **options) for k, m in list(models.items())}
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
    times = take_turns({k: lambda k=k: train(models[k], opts[k]) for k in models}, device, rounds + 1)
    ms = {k: [s / steps * 1000 for s in v[1:]] for k, v in times.items()}  # round 0: the warm-up (compilation)
    ratios = lambda k, to: [a / b for a, b in zip(ms[k], ms[to])]  # each round's
    ratio = lambda k, to: f"{statistics.median(ratios(k, to)):.3f}" if to in ms else '—'
    mha = 'ours, mha, RoPE (default)'
    quartiles = lambda r: statistics.quantiles(r, n=4)[::2] if len(r) > 1 else r * 2  # (1 round: its own)
    spread = lambda k: '-'.join(f"{q:.2f}" for q in quartiles(ratios(k, mha)))  # the middle half of the rounds
    return (f"\nTraining-step time on the same recipe, models taking turns in one process (medians of {rounds} "
            f"rounds x {steps} steps; the ratios: the median of each round's ratio):\n\n" +
            table(['model', 'ms/step', 'vs nanoGPT', 'vs our MHA'], [
                f"| {k} | {statistics.median(v):.2f} | {ratio(k, 'nanoGPT')} | {ratio(k, mha)} |"
                for k, v in ms.items()]) +
            f"\nHow much a ratio moves from round to round, the middle half of the {rounds} rounds' ratios to our MHA: " +
            "; ".join(f"{k.removeprefix('ours, ')} {spread(k)}" for k in ms if k != mha) + ".\n")

def convert_report(args):
    """Ainslie et al. 2023: MHA; GQA and MQA from scratch, and mean-pooled from MHA then uptrained (CPU preset)."""
    iters, lr, out = args.max_iters, args.lr, os.path.join(args.out, 'convert')
    name = {'mha': 'MHA', 'gqa': 'GQA, 2 K/V heads', 'mqa': 'MQA'}
    ups = sorted({round(f * iters) for f in args.fractions})  # uptraining iterations
    shown = min([n for n in ups if n] or [0], key=lambda n: abs(n / iters - 0.05))  # the headline's: 5%, or nearest
    check_models(args, ['config/cpu.py'], ['mha', 'gqa', 'mqa'])

    def run(folder, attn, n, *more):
        return train_run(os.path.join(out, folder), [
            f'config/{attn}.py', 'config/cpu.py', '--eval_iters=200', '--log_interval=1000000', *args.extra,
            f'--max_iters={n}', f'--lr_decay_iters={max(n, 1)}', f'--eval_interval={max(n, 1)}', *more])
    runs = {('mha', None): run('mha', 'mha', iters)}  # {(layout, uptraining iterations or None): the run}
    for attn in ('gqa', 'mqa'):
        runs[attn, None] = run(f'{attn}-scratch', attn, iters, '--match_mha_params=False')
        runs |= {(attn, n): run(f'{attn}-uptrain-{n}', attn, n, f"--init_from={os.path.join(out, 'mha')}",
                                f'--warmup_iters={n // 10}', f'--learning_rate={lr}', f'--min_lr={lr / 10}') for n in ups}
    val = {key: r['evals'][-1]['val/loss'] for key, r in runs.items()}
    mha = val['mha', None]
    how = lambda n: ('trained from scratch' if n is None else
                     f'MHA mean-pooled, uptrained {n / iters:.1%}' if n else 'MHA mean-pooled, no uptraining')
    rows = {(a, n): f"| {name[a]} | {how(n)} | {iters:,}{'' if n is None else f' + {n:,}'} | {r['params']}M | "
            f"{r['evals'][-1]['cache_bytes_per_token']:,.0f} | {val[a, n]:.4f} | {val[a, n] - mha:+.4f} |"
            for (a, n), r in runs.items()}
    header = ['model', 'made by', 'iterations', 'params', 'cache bytes/token (fp32)', 'val loss', "minus MHA's"]
    summary = table(header, [row for (a, n), row in rows.items() if n in (None, 0, shown)])
    if shown and 0 in ups:  # the share of the gap that uptraining closes
        summary += (f"\nShare of the gap to MHA opened by mean-pooling that {100 * shown / iters:g}% uptraining closes: "
                    + ", ".join(f"{name[a]} {(val[a, 0] - val[a, shown]) / (val[a, 0] - mha):.0%}" if val[a, 0] > mha
                                else f"{name[a]}: no gap" for a in ('gqa', 'mqa')) + ".\n")
    fractions = ','.join(f'{f:g}' for f in args.fractions)
    evals = ['200', *(x.split('=')[1] for x in args.extra if x.startswith('--eval_iters='))][-1]  # the last one counts
    return (f"`{command(args, f'--max_iters={iters}', f'--lr={lr:g}', f'--fractions={fractions}')}` on {machine()}: "
            f"config/cpu.py (4 layers, 4 heads, 128 wide, block 64), seed 1337, val loss = mean of the same {evals} val "
            "batches.\n\n" + summary + MORE + "\n**Every run**:\n\n" + table(header, list(rows.values())) +
            f"\nUptraining: peak learning rate {lr:g}, warmup a tenth of the run, cosine to {lr / 10:g}.\n")

# --- decode: the roofline of one step, the cost vs context, generation with and without the cache -----------

ROUNDS = 15  # of every decode timing: each round runs every step once

@torch.inference_mode()
@torch.no_grad()  # (a static cache's FlexAttention has no backward on a CPU)
def roofline(layouts, sizes, batch, contexts, device, dtype, compile=False, uncached=False, rounds=ROUNDS, chunk=512):
    """A cached decode step per layout and context t, eager (and compiled; and uncached: the forward over the t + 1
    tokens that the step spares), taking turns with the floors' large copy and large product."""
    m, n = (8192, 2 ** 28) if device.startswith('cuda') else (2048, 2 ** 26)  # an m x m product, a copy of n floats
    a, b = (torch.randn(m, m, device=device, dtype=dtype) for _ in range(2))
    x, y = torch.ones(n, device=device), torch.empty(n, device=device)
    fns, runs, math = {'copy': lambda: y.copy_(x), 'product': lambda: a @ b}, {}, [SDPBackend.MATH]
    kinds, options = ['eager'] + ['compiled'] * compile, compile_options(device) if compile else {}
    for attn in layouts:
        progress(f"decode steps at batch {batch}: {attn}")
        model = GPT(GPTConfig(attn=LAYOUTS[attn], **sizes, block_size=max(contexts) + 1)).to(device, dtype).eval()
        idx = torch.randint(0, model.config.vocab_size, (batch, max(contexts) + 1), device=device)
        for t in contexts:
            for kind in kinds:  # compiled: the same step over a static cache, one graph
                cache = model.init_cache(batch, static=kind == 'compiled')
                for i in range(0, t, chunk):  # prefill in chunks: bounded memory for the materialized attention
                    model(idx[:, i:min(i + chunk, t)], cache=cache)
                    if (i // chunk + 1) % 64 == 0:  # a long context's prefill takes minutes: say where it is
                        progress(f"{attn}, {kind}: prefilled {min(i + chunk, t):,} of {t:,} tokens")

                net = torch.compile(model, **options) if kind == 'compiled' else model

                def step(net=net, token=idx[:, t:t + 1], cache=cache, t=t):  # the token at t again: the same work
                    cache.pos = cache.pos.fill_(t) if torch.is_tensor(cache.pos) else t  # (in place; not in the graph:
                    return net(token, cache=cache)[0]                                 # there the mask reads an input)
                fns[attn, t, kind] = step
                if kind == 'eager':  # what one step computes (on SDPA's math backend: the counter sees no fused
                    counter = FlopCounterMode(display=False)
                    with patch('ops.softmax.DECODE_BACKENDS', math), sdpa_kernel(math), counter as fc:
                        step()  # kernels), and what it reads (now that it ran, the cache holds t + 1 keys)
                    runs[attn, t] = dict(flops=fc.get_total_flops(),
                                         bytes=sum(p.nbytes for p in model.parameters()) + cache.nbytes)
            if uncached:
                fns[attn, t, 'no cache'] = lambda model=model, window=idx[:, :t + 1]: model(window)[0]
    for fn in fns.values():
        fn()  # warm-up (compilation); from now on each cache holds the t + 1 keys its step attends to
    times = take_turns(fns, device, rounds)  # floors: the machine's best round; steps: their median round
    bandwidth, rate = 2 * 4 * n / min(times['copy']), 2 * m ** 3 / min(times['product'])  # a copy reads 4 B, writes 4
    for (attn, t), run in runs.items():
        run['ms'] = {kind: statistics.median(times[attn, t, kind]) * 1000 for kind in kinds + ['no cache'] * uncached}
        run['floors'] = {'bytes': run['bytes'] / bandwidth * 1000, 'FLOPs': run['flops'] / rate * 1000}
    return runs, bandwidth, rate

def roofline_section(runs, bandwidth, rate, batch, t, path):
    """The roofline table, and its plot into path: ms per step against the bytes it reads, with the floors."""
    kinds, rows, mb = list(next(iter(runs.values()))['ms']), [], {a: run['bytes'] / 1e6 for (a, _), run in runs.items()}
    ends = [min(mb.values()) / 1.5, max(mb.values()) * 1.5]
    lines = [(ends, [x * 1e6 / bandwidth * 1000 for x in ends], f'bytes floor: bytes / {bandwidth / 1e9:.1f} GB/s',
              dict(color='black', ls='--'))]
    for i, ((attn, _), run) in enumerate(runs.items()):
        ms, floors = run['ms'], run['floors']
        binds = max(floors, key=floors.get)
        rows.append(f"| {attn} | {mb[attn]:,.3g} MB | {run['flops'] / 1e9:.3g} | {floors['bytes']:.3g} | "
                    f"{floors['FLOPs']:.3g} | {binds} | " +
                    " | ".join(f"{ms[k]:.3g} | **{100 * floors[binds] / ms[k]:.3g}%**" for k in kinds) + " |")
        lines += [([mb[attn]], [ms[k]], f'{attn}, {k} step', dict(color=f'C{i}', marker=m, ls='', fillstyle=f))
                  for k, m, f in (('eager', 'o', 'full'), ('compiled', 's', 'none')) if k in ms]
        lines.append(([mb[attn]], [floors['FLOPs']], f'{attn}, FLOP floor',
                      dict(color=f'C{i}', marker='_', ms=16, mew=2, ls='')))
    plot(path, lines, dict(fontsize=7, loc='upper left', bbox_to_anchor=(1.01, 1)), xscale='log', yscale='log',
         title='decode step vs bytes read, with the floors', ylabel='ms per decode step',
         xlabel='bytes one decode step must read: weights + cache (MB)')
    return (f"Cached decode step, batch {batch}, context t={t} (the step attends to t + 1 keys); floors measured in "
            f"the same run: bandwidth **{bandwidth / 1e9:.1f} GB/s** (a large tensor copy, read + write bytes), matmul "
            f"rate **{rate / 1e9:,.0f} GFLOP/s** (one large square product). Each of {ROUNDS} rounds times every step, "
            "the copy and the product once, in a new order; floors: the best round, steps: the median.\n\n" +
            table(['layout', 'bytes read: weights + cache', 'GFLOP', 'bytes floor ms', 'FLOP floor ms', 'binds',
                   *[f"{k} {what}" for k in kinds for what in ('ms', '% of floor')]], rows))

@torch.inference_mode()
def generation(layouts, sizes, device, dtype, compile=False, prompt=16, new=240, batches=(1, 8)):
    """Greedy tokens/s without the cache, with it (and compiled): each way twice, taking turns; the faster counts."""
    kinds, rows = ['no cache', 'cache'] + ['cache, compiled'] * compile, []
    for attn in layouts:
        progress(f"generation: {attn}")
        model = GPT(GPTConfig(attn=LAYOUTS[attn], **sizes, block_size=256)).to(device, dtype).eval()
        ways = {'no cache': (model, None), 'cache': (model, 'cache')}
        if compile:  # a copy, compiled in place (stream() calls self(...)), over a static cache
            ways['cache, compiled'] = (copy.deepcopy(model), 'static')
            ways['cache, compiled'][0].compile(**compile_options(device))
        for batch in batches:
            idx = torch.randint(0, model.config.vocab_size, (batch, prompt), device=device)
            out = generate_in_turns(ways, idx, new, device, 2, temperature=0)
            secs = {k: min(out[k][2]) for k in kinds}
            rows.append(f"| {attn} | {batch} | " + " | ".join(f"{batch * new / secs[k]:,.1f}" for k in kinds) +
                        f" | {secs['no cache'] / secs['cache']:.1f}x | " + " | ".join(
                            agree(model, idx, out['no cache'][0], out[k][0]) for k in kinds[1:]) + " |")
    return table(['layout', 'batch', *[f"tokens/s, {k}" for k in kinds], 'cache speedup',
                  *[f"identical tokens, {k}" for k in kinds[1:]]], rows)

def agree(model, idx, ref, other, tol=1e-4):
    """'yes' if two greedy runs agree; where they part, a near-tie if ref's top two logits are within tol, else 'NO'."""
    if torch.equal(ref, other):
        return 'yes'
    row, col = (ref != other).nonzero()[0].tolist()
    top = model(torch.cat([idx[row:row + 1], ref[row:row + 1, :col]], 1))[0][0, -1].float().topk(2)
    gap = (top.values[0] - top.values[1]).item()
    return f"a near-tie at token {col} ({gap:.0e} apart)" if gap < tol and other[row, col] in top.indices else 'NO'

def decode_report(args, sizes):
    """The roofline at --batch and --t, the cost vs context at batch 1, and generation with and without the cache."""
    layouts, contexts, device, dtype = args.layouts, args.contexts, args.device, getattr(torch, args.dtype)
    roof = roofline_section(*roofline(layouts, sizes, args.batch, [args.t], device, dtype, args.compile), args.batch,
                            args.t, os.path.join(args.out, 'roofline.png'))
    costs = roofline(layouts, sizes, 1, contexts, device, dtype, uncached=True)[0]
    plot(os.path.join(args.out, 'decode.png'), [
        (contexts, [costs[attn, t]['ms'][k] for t in contexts], f'{attn}, {kind}', dict(color=f'C{i}', marker=m, ls=ls))
        for i, attn in enumerate(layouts)
        for k, kind, m, ls in (('eager', 'cached', 'o', '-'), ('no cache', 'no cache', 'x', '--'))],
        dict(fontsize=7, ncol=2), xscale='log', yscale='log', title='decode cost vs context, batch 1',
        xlabel='context length t (tokens already seen)', ylabel='ms per generated token')
    mla = GPTConfig(attn='mla', **sizes)
    how = ('compiled: torch.compile(fullgraph=True) over a static cache' +
           (', CUDA graphs' if device.startswith('cuda') else '')) if args.compile else 'eager'
    text = (f"Machine: {machine()}. Model: {sizes['n_layer']} layers, {sizes['n_head']} heads, n_embd "
            f"{sizes['n_embd']}, MLA d_c {mla.kv_lora_rank} d_R {mla.rope_head_dim}, random init, {args.dtype}, "
            f"device {device}, {how}.\n\n**Roofline of one decode step**\n\n{roof}\n"
            f"![decode step vs bytes read](roofline.png)\n{MORE}\n**Decode cost vs context**, batch 1, eager, ms per "
            f"generated token (a cached step / a forward over the t + 1 tokens), medians of {ROUNDS} rounds taken "
            "like the roofline's (so each step reads its weights cold):\n\n" +
            table(['layout', *[f"t={t} cached / no cache" for t in contexts]], [f"| {attn} | " + " | ".join(
                f"{costs[attn, t]['ms']['eager']:.3g} / {costs[attn, t]['ms']['no cache']:,.1f}" for t in contexts) + " |"
                for attn in layouts]))
    return text + (f"\n![decode cost vs context](decode.png)\n\n**Generation, {args.gen_tokens} new tokens after a "
                   "16-token prompt, block 256, greedy** (the best of two runs each way):\n\n" +
                   generation(layouts, sizes, device, dtype, args.compile, new=args.gen_tokens))

# --- gpu: the one report a lent GPU runs -----------------------------------------------------------------------

def gpu_report(args, sizes):
    """Every section a GPU session needs, each written to --out/gpu.md and printed as it finishes (a run stopped at
    its time limit keeps what it measured): the decode roofline eager and compiled, generation at batch 1 eager and
    compiled, the training step next to nanoGPT's eager and compiled, and fla's kernels against ours."""
    device, dtype, sections = args.device, getattr(torch, args.dtype), []
    gpu = torch.cuda.get_device_name(device) if device.startswith('cuda') else 'no GPU'

    def section(title, text):
        sections.append(f"**{title}**\n\n{text.strip()}\n")
        write_atomic(os.path.join(args.out, 'gpu.md'), '\n'.join(sections))
        print(sections[-1], flush=True)
    given = [f'--{k}={getattr(args, k)}' for k in ('device', 'dtype', 'batch', 't', 'n_layer', 'n_head', 'n_embd',
                                                  'gen_tokens')]  # every setting: the command reruns it
    section('The run', f"`{command(args, *given)}` on {machine()}, {gpu}; fla "
            f"{'installed' if FLA else 'not installed'}.")
    section(f"Roofline of one decode step, batch {args.batch}, t={args.t}, eager and compiled", roofline_section(
        *roofline(args.layouts, sizes, args.batch, [args.t], device, dtype, compile=True), args.batch, args.t,
        os.path.join(args.out, 'roofline.png')))
    section(f"Generation at batch 1, {args.gen_tokens} new tokens after 16, block 256, greedy", generation(
        args.layouts, sizes, device, dtype, compile=True, new=args.gen_tokens, batches=(1,)))
    section(f"Training step, block 256, batch {args.batch}, {args.dtype} autocast, eager and compiled",
            step_time_vs_nanogpt(args.nanogpt, args.layouts, rounds=5, steps=5, device=device, dtype=dtype,
                                 sizes={**sizes, 'block_size': 256, 'batch': args.batch}, compile=True)
            + ("" if args.nanogpt is not None else "\n(no --nanogpt PATH given: nanoGPT's model.py not timed)"))
    section(f"Where an eager decode step's time goes, batch {args.batch}, t={args.t} (torch.profiler, 5 steps)",
            decode_profile(args.layouts, sizes, args.batch, args.t, device, dtype))
    section(f"fla's kernels against ours, forward + backward, batch {args.batch}, 256 tokens, float32 inputs",
            fla_vs_ours(args.layouts, sizes, args.batch, device))
    return '\n'.join(sections)

@torch.inference_mode()
def decode_profile(layouts, sizes, batch, t, device, dtype, steps=5, top=4):
    """The eager cached decode step under torch.profiler: its kernels (CUDA; on a CPU, its aten ops) and the few that
    take the most time, per layout: why one layout's step costs more than another's that reads more."""
    kind = 'device' if device.startswith('cuda') else 'cpu'
    activities = [torch.profiler.ProfilerActivity.CPU] + [torch.profiler.ProfilerActivity.CUDA] * (kind == 'device')
    rows = []
    for attn in layouts:
        model = GPT(GPTConfig(attn=LAYOUTS[attn], **sizes, block_size=t + 1)).to(device, dtype).eval()
        idx, cache = torch.randint(0, 65, (batch, t + 1), device=device), model.init_cache(batch)
        for i in range(0, t, 512):  # prefill in chunks (as roofline)
            model(idx[:, i:min(i + 512, t)], cache=cache)
        step = lambda: (setattr(cache, 'pos', t), model(idx[:, t:], cache=cache))
        step()
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(steps):
                step()
        events = [e for e in prof.key_averages() if getattr(e, f'self_{kind}_time_total') > 0]
        if kind == 'cpu':
            events = [e for e in events if e.key.startswith('aten::')]
        total = sum(getattr(e, f'self_{kind}_time_total') for e in events)
        busiest = sorted(events, key=lambda e: -getattr(e, f'self_{kind}_time_total'))[:top]
        rows.append(f"| {attn} | {total / steps / 1000:.3g} | {sum(e.count for e in events) // steps} | " + "; ".join(
            f"`{e.key[:60]}` {100 * getattr(e, f'self_{kind}_time_total') / total:.0f}%" for e in busiest) + " |")
    return table(['layout', f'{kind} ms a step', 'kernels a step' if kind == 'device' else 'aten ops a step',
                  'the busiest (share of the step)'], rows)

def fla_vs_ours(layouts, sizes, batch, device, T=256, rounds=10):
    """Each linear rule's update, forward and backward, on fla's kernels (linear_fla) and on ours (linear_chunked),
    taking turns, from the inputs LinearAttention feeds them: ms, and the largest difference of output and gradients.
    Where fla cannot run, one line that says so (the sections above then ran ours)."""
    if not fla_runs(torch.empty(0, device=device)):
        return "Not measured: " + (f"fla's kernels run on CUDA, not {device}." if FLA else
                                   "fla is not installed here (pip install -r requirements-gpu.txt).")
    H, d, rows = sizes['n_head'], sizes['n_embd'] // sizes['n_head'], []
    for layout in (a for a in layouts if a in LINEAR_RULES):
        forget, delta = LINEAR_RULES[layout]
        gen = torch.Generator(device).manual_seed(0)
        rand = lambda *shape: torch.randn(*shape, device=device, generator=gen)
        unit = lambda x: torch.nn.functional.normalize(x, dim=-1)
        q, k = (rand(batch, H, T, d).sigmoid() for _ in 'qk') if layout == 'linear' else (  # (phi's: > 0)
            unit(rand(batch, H, T, d)) * d ** -0.5, unit(rand(batch, H, T, d)))
        v = torch.cat([rand(batch, H, T, d), torch.ones(batch, H, T, 1, device=device)], -1) if layout == 'linear' \
            else rand(batch, H, T, d)
        g = -rand(batch, H, T).abs() if forget else None
        beta = rand(batch, H, T).sigmoid() if delta else torch.ones(batch, H, T, device=device)
        xs = [x.requires_grad_() for x in (q, k, v, g, beta) if x is not None]
        do, out = rand(*v.shape), {}

        def run(name, f):
            y = f(q, k, v, g, beta, None, delta, *([64] if f is linear_chunked else []), keep_state=False)[0]
            out[name] = [y, *torch.autograd.grad(y, xs, do, allow_unused=True)]
        times = take_turns({name: lambda name=name, f=f: run(name, f)
                            for name, f in (('ours', linear_chunked), ('fla', linear_fla))}, device, rounds + 1)
        ms = {name: statistics.median(t[1:]) * 1000 for name, t in times.items()}  # round 0: the warm-up
        diff = max((a - b).abs().max().item() for a, b in zip(out['ours'], out['fla']) if a is not None)
        rows.append(f"| {layout} | {ms['ours']:.2f} | {ms['fla']:.2f} | {ms['ours'] / ms['fla']:.1f}x | {diff:.1e} |")
    return table(['layout', 'ours, ms', 'fla, ms', 'fla faster by', 'largest difference (output, gradients)'], rows)

# --- mqar: associative recall against the number of pairs, what a fixed state can hold -----------------------

def capacity(d_k, pairs, trials=50):
    """No training: N random unit keys and values written into one head's state by three rewrites of the chapter's
    table (model.py's linear_chunked), then every key read back; recall = the read is nearest its own value."""
    g, recall = torch.Generator().manual_seed(0), {}
    rules = {'accumulate (linear)': (0.0, False), 'fixed decay (retnet, γ = 1 - 2^-5)': (math.log1p(-2 ** -5), False),
             'delta rule (deltanet), β = 1': (0.0, True)}  # name: (log α, delta)
    for n in pairs:
        k, v = (torch.nn.functional.normalize(torch.randn(trials, 1, n, d_k, generator=g), dim=-1) for _ in range(2))
        for name, (log_alpha, delta) in rules.items():
            _, S = linear_chunked(k, k, v, torch.full((trials, 1, n), log_alpha), torch.ones(trials, 1, n),
                                  torch.zeros(trials, 1, d_k, d_k), delta, 64)
            nearest = ((k @ S) @ v.transpose(-2, -1)).argmax(-1)  # (trials, 1, n): whose value each read is closest to
            recall[name, n] = (nearest == torch.arange(n)).float().mean().item()
    return rules, recall

# every layout alike: 2 layers, learned positions (no RoPE), MHA's parameter count, no short conv in front of any mixer
MQAR = dict(n_layer=2, n_head=4, n_embd=64, pos_emb='learned', chunk_size=32, match_mha_params=True)
ZOOLOGY = dict(vocab=8192, sets=((64, 4), (128, 8), (256, 16), (512, 64)), train=100000, batch=256, max_iters=5000)
MQAR_DATA = {'cpu': dict(vocab=256, sets=SETS, train=20000, batch=64, max_iters=1000), 'cuda': ZOOLOGY}
# each layout's best peak lr of `bench.py mqar --lrs=3e-4,1e-3,3e-3` (2 seeds, 1,000 steps; 2026-12-05, 82 minutes on
# 2 cores, results/mqar.md); the others' best: 1e-3. At 3e-3 the linear rules but 'linear' stayed near chance.
MQAR_LR, MQAR_SWEPT = {'mha': 3e-3, 'linear': 3e-3}, "2026-12-05's sweep --lrs=0.0003,0.001,0.003"


class PairEmbedding(torch.nn.Module):
    """data/mqar's positions, key * vocab + value, embedded as wte(key) + wte(value): the model's own tied rows."""

    def __init__(self, wte, vocab):
        super().__init__()
        self.wte, self.vocab = wte, vocab

    def forward(self, idx):
        return self.wte(idx // self.vocab) + self.wte(idx % self.vocab)

def mqar_model(name, vocab, block_size, conv=1):
    attn = {**LAYOUTS, 'hybrid': 'gated_deltanet+gqa'}[name]  # (1:1 on 2 layers)
    taps = dict(conv_size=conv) if 'conv_size' in GPTConfig(attn=attn).used_fields() else {}  # (1 tap: no conv)
    model = GPT(GPTConfig(attn=attn, vocab_size=vocab, block_size=block_size, **MQAR, **taps))
    model.transformer.wte = PairEmbedding(model.transformer.wte, vocab)
    return model

def mqar_recall(model, sets):
    """{(L, N): the share of its validation answers right}."""
    model.eval()
    with torch.no_grad():
        right = {s: [(model(x, y)[0].argmax(-1) == y)[y >= 0].float().mean() for x, y in
                     zip(val_x.split(250), val_y.split(250))] for s, (_, _, val_x, val_y) in sets.items()}
    model.train()
    return {s: torch.stack(r).mean().item() for s, r in right.items()}

def mqar_run(path, name, lr, seed, max_iters, batch, device, label, conv=1, eval_every=250, stop=0.99):
    """One layout trained on every (L, N) set of path at one peak lr and seed, as Zoology does: AdamW (weight decay
    0.1), warmup then cosine to 0, a batch of one set per step in turn; every eval_every steps its recall, stopping at
    stop. On one thread as a worker of mqar_report's pool: its numbers never depend on the machine's core count."""
    torch.set_num_threads(1)
    sets = {s: [torch.from_numpy(a).to(device) for a in arrays] for s, arrays in load(path).items()}
    vocab = int(json.load(open(os.path.join(os.path.dirname(path), 'mqar.json')))['vocab'])
    torch.manual_seed(seed)
    model = mqar_model(name, vocab, max(L for L, _ in sets), conv).to(device)
    decay = [p for p in model.parameters() if p.dim() >= 2]  # as train.py: matrices and embeddings decay
    opt = torch.optim.AdamW([{'params': decay}, {'params': [p for p in model.parameters() if p.dim() < 2],
                                                 'weight_decay': 0.0}], lr=lr, betas=(0.9, 0.98), weight_decay=0.1)
    g, order, warmup = torch.Generator().manual_seed(seed), list(sets), max(1, max_iters // 20)
    curve, start = [], time.time()
    for it in range(max_iters + 1):  # the same batches for every layout and lr, at one seed
        if it and it % eval_every == 0 or it == max_iters:
            curve.append((it, mqar_recall(model, sets)))
            recall = statistics.mean(curve[-1][1].values())
            progress(f"mqar {label}: step {it}, recall {recall:.1%}")
            if recall >= stop or it == max_iters:
                break
        train_x, train_y = sets[order[it % len(order)]][:2]
        rows = torch.randint(0, train_x.size(0), (batch,), generator=g).to(device)
        for group in opt.param_groups:
            group['lr'] = lr * min((it + 1) / warmup, 0.5 * (1 + math.cos(math.pi * it / max_iters)))
        loss = model(train_x[rows], train_y[rows])[1]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    crossed = {p: next((it for it, r in curve if statistics.mean(r.values()) >= p), None) for p in (0.5, 0.9, 0.99)}
    return dict(recall=curve[-1][1], steps=curve[-1][0], crossed=crossed, seconds=time.time() - start,
                curve=[(it, statistics.mean(r.values())) for it, r in curve])

def mqar_data(args):  # the data set's settings: the device's, then the flags'
    return MQAR_DATA['cuda' if args.device.startswith('cuda') else 'cpu'] | {
        k: v for k in ('vocab', 'sets') if (v := getattr(args, k))}

def mqar_report(args):
    """Per layout, the 2-layer model trained on MQAR to 99% recall or max_iters at each lr and seed (one thread a run,
    as many at once as there are cores), its best lr kept as Zoology does; recall per set; the untrained capacity."""
    cuda, data = args.device.startswith('cuda'), mqar_data(args)
    lrs = {name: args.lrs or [MQAR_LR.get(name, 1e-3)] for name in args.layouts}  # all, or each layout's best
    runs = [(name, lr, seed) for name in args.layouts for lr in lrs[name] for seed in range(args.seeds)]
    workers = min(len(runs), 4 if cuda else os.cpu_count() or 1)
    progress(f"mqar: {len(runs)} runs of up to {args.max_iters} steps, {workers} at a time"
             + " on one thread each" * (not cuda))
    # the data deleted and the workers ended on leaving, an error, Ctrl-C or SIGTERM too (spawn: forked torch threads
    # hang). The workers ignore Ctrl-C from their start, imports too: this process ends them
    interrupt = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        pool = get_context('spawn').Pool(workers)
    finally:
        signal.signal(signal.SIGINT, interrupt)
    with tempfile.TemporaryDirectory(dir=args.out, prefix='.mqar-data-') as data_dir, pool:
        try:  # seeded, seconds: never a user's data
            path = prepare(data_dir, data['vocab'], data['sets'], data['train'])
        except OSError as e:
            fail(f"cannot write the MQAR data in {args.out}: {why(e, data_dir)}")
        todo = {run: pool.apply_async(mqar_run, (path, *run, args.max_iters, data['batch'], args.device,
                                                 f"run {k} of {len(runs)} ({run[0]}, lr {run[1]:g}, seed {run[2]})",
                                                 args.conv_size)) for k, run in enumerate(runs, 1)}
        acc = {run: result.get() for run, result in todo.items()}
    sets, seeds = data['sets'], range(args.seeds)
    mean = lambda name, lr, s=None: statistics.mean(statistics.mean(acc[name, lr, seed]['recall'].values()) if s is None
                                                    else acc[name, lr, seed]['recall'][s] for seed in seeds)
    steps = lambda name, lr: statistics.mean(acc[name, lr, seed]['steps'] for seed in seeds)
    best = {name: max(lrs[name], key=lambda lr: (min(mean(name, lr), 0.99), -steps(name, lr)))  # past 99%: the fastest
            for name in args.layouts}
    head_dim, L = MQAR['n_embd'] // MQAR['n_head'], max(L for L, _ in sets)
    cfg = {name: mqar_model(name, data['vocab'], L, args.conv_size).config for name in args.layouts}
    state = {(name, L_): cfg[name].cache_elements(L_) for name in args.layouts for L_, _ in sets}
    pairs, (hard_L, hard_n) = [n for _, n in sets], sets[-1]
    rules, recall = capacity(head_dim, sorted(set(pairs)))
    legend, percent = dict(fontsize=7, loc='upper left', bbox_to_anchor=(1.01, 1)), 'answers recalled (%)'
    plot(os.path.join(args.out, 'mqar.png'),
         [(pairs, [100 * mean(name, best[name], s) for s in sets], name, dict(marker='o', color=f'C{i}'))
          for i, name in enumerate(args.layouts)] +
         [(sorted(set(pairs)), [100 * recall[r, n] for n in sorted(set(pairs))], f'untrained state: {r}',
           dict(ls=':', color='gray', marker=m)) for r, m in zip(rules, 'x+^')] +
         [([head_dim] * 2, [0, 100], f'head_dim d_k = {head_dim} (the state\'s rank)', dict(color='black', ls='--'))],
         legend, title='MQAR: recall vs number of pairs (best lr)', xlabel='key-value pairs N in the sequence',
         ylabel=percent, ylim=(0, 102))
    plot(os.path.join(args.out, 'mqar-state.png'),
         [([state[name, hard_L]], [100 * mean(name, best[name], sets[-1])], name, dict(marker='o', color=f'C{i}'))
          for i, name in enumerate(args.layouts)], legend, xscale='log', ylim=(0, 102), ylabel=percent,
         title=f'MQAR: recall at L = {hard_L}, N = {hard_n} vs the state (Zoology\'s figure)',
         xlabel=f'state: cache elements a sequence at L = {hard_L} (log)')
    crossed = lambda name, lr, seed, p: acc[name, lr, seed]['crossed'][p] or '—'
    def rising(name, lr):  # what the runs that stopped short of 99% gained in their last evaluation interval
        gains = [r['curve'][-1][1] - r['curve'][-2][1] for r in (acc[name, lr, seed] for seed in seeds)
                 if r['crossed'][0.99] is None and len(r['curve']) > 1]
        return f"{100 * statistics.mean(gains):+.1f}%" if gains else '—'
    per_seed = lambda name, lr, ps=(0.5, 0.9, 0.99): '; '.join('/'.join(str(crossed(name, lr, seed, p)) for p in ps)
                                                               for seed in seeds)
    trained = table(['layout', 'best lr', f'state at L = {L}', *[f"L={L_},N={n}" + " (= d_k)" * (n == head_dim)
                                                                for L_, n in sets], 'steps to 50/90/99%, each seed',
                     'gained in the last 250 steps, short of 99%'],
                    [f"| {name} | {best[name]:g} | {state[name, L]:,} | " + " | ".join(
                        f"{100 * mean(name, best[name], s):.1f}%" for s in sets) + f" | {per_seed(name, best[name])} | "
                     f"{rising(name, best[name])} |"
                     for name in args.layouts])
    every = sorted({lr for v in lrs.values() for lr in v})
    every_lr = table(['layout', *[f"lr {lr:g}" for lr in every]],
                     [f"| {name} | " + " | ".join(f"{100 * mean(name, lr):.1f}% (99% at {per_seed(name, lr, [0.99])})"
                                                  if lr in lrs[name] else "not run" for lr in every) + " |"
                      for name in args.layouts])
    untrained = table(['rewrite (one head, no training)', *[f"N={n}" for n in sorted(set(pairs))]],
                      [f"| {r} | " + " | ".join(f"{100 * recall[r, n]:.1f}%" for n in sorted(set(pairs))) + " |"
                       for r in rules])
    swept = ','.join(f'{lr:g}' for lr in every)
    minutes = sum(r['seconds'] for r in acc.values()) / 60
    how = (f"at each peak lr ({swept}), each layout's best kept by mean recall (as Zoology reports its sweep)"
           if args.lrs else f"at each layout's best peak lr of {MQAR_SWEPT} (bench.py's MQAR_LR)")
    given = dict(lrs=args.lrs and swept, seeds=args.seeds != 2 and args.seeds, conv_size=args.conv_size > 1 and
                 args.conv_size, device=cuda and args.device, vocab=args.vocab,
                 sets=args.sets and ','.join(f'{L_}:{n}' for L_, n in sets))
    given = [f'--{k}={v}' for k, v in given.items() if v]  # the flags given, and the lrs swept
    conv = (f"a short conv of {args.conv_size} taps in front of the linear mixers (softmax attention has none)"
            if args.conv_size > 1 else "no short conv")
    return (f"`{command(args, f'--max_iters={args.max_iters}', *given)}` on "
            f"{machine().rsplit(',', 1)[0]}{', one thread a run' * (not cuda)}: data/mqar/prepare.py's Zoology MQAR "
            f"(one position a pair; vocabulary {data['vocab']}, {data['train']:,} training sequences per set "
            f"(L, N) = {', '.join(f'({L_}, {n})' for L_, n in sets)}), a {MQAR['n_layer']}-layer model per layout "
            f"({MQAR['n_head']} heads, n_embd {MQAR['n_embd']}, head_dim d_k = {head_dim}, learned positions, {conv}, "
            f"the MLP sized to MHA's parameter count; hybrid = 'gated_deltanet+gqa'), AdamW (weight decay 0.1), "
            f"batches of {data['batch']} from one set in turn, warmup then cosine to 0 over {args.max_iters} steps, "
            f"{how}, {args.seeds} seed{'s' * (args.seeds > 1)} each; every 250 steps its recall, stopping at 99%. "
            f"Recall = answers right on 500 held-out sequences per set, the mean of the seeds (chance: a guess among "
            f"the {data['vocab'] - data['vocab'] // 2} values); steps to 50/90/99%: the first evaluation at or past it, "
            f"per seed (—: not reached). {len(runs)} runs, {minutes:.0f} run-minutes.\n\n"
            + trained + "\n![MQAR recall vs pairs](mqar.png)\n![MQAR recall vs state](mqar-state.png)\n" + MORE +
            "\n**Mean recall over the sets at each lr** (the runs the table above picks from):\n\n" + every_lr +
            "\n**The state's capacity, no training**: N random unit keys and values (d_k = "
            f"{head_dim}) written into one head's state by model.py's update, then every key read back; recall = the "
            "read is nearest its own value (50 trials):\n\n" + untrained)


# --- the command line ---------------------------------------------------------------------------------------

def readme_section(mode, report, out='results'):
    """What README.md shows of a report: its headline, with its plots' links made relative to the README."""
    headline = re.sub(r"(!\[[^]]*\]\()", rf"\g<1>{out}/", report.split(MORE)[0])
    return headline + f"\nThe whole report: [{out}/{mode}.md]({out}/{mode}.md).\n"

def main(argv=None):
    memory_errors_in_one_line('--batch, --t, --contexts, --n_embd, --n_layer')  # e.g. --t too large here
    exit_on_signals()  # SIGTERM, SIGHUP: one line, and the with blocks still end mqar's workers and delete its data
    on_closed_output(end_on_lost_output)  # the report is in --out already when it is printed
    PLOTS.clear()
    count = checked(int, lambda v: v >= 1, "give an integer >= 1")
    listed = lambda kind, ok, rule: checked(lambda text: sorted({kind(x) for x in text.split(',')}), ok, rule)
    layouts = listed(str, lambda v: set(v) <= set(LAYOUTS), "choose from " + ','.join(LAYOUTS))
    fractions = listed(float, lambda v: all(0 <= f <= 1 for f in v), "give numbers in [0, 1]")
    LONGEST = 2 ** 20  # a context is prefilled token by token's worth of work, even into a linear layout's fixed state
    contexts = listed(int, lambda v: 1 <= v[0] and v[-1] <= LONGEST, f"give integers from 1 to {LONGEST:,}")
    positive = checked(float, lambda v: 0 < v < float('inf'), "give a number > 0")
    rates = listed(float, lambda v: 0 < v[0] and v[-1] <= 1, "give numbers in (0, 1]")
    gen_tokens = checked(int, lambda v: 1 <= v <= 240, "give 1 to 240 (block 256, prompt 16)")
    p = Parser(prog='bench.py', description=__doc__)
    p.add_argument('mode', choices=['cache', 'train', 'decode', 'convert', 'mqar', 'gpu'])
    p.add_argument('extra', nargs='*', default=[], help='train, convert: more --key=value for train.py, after --')
    only = dict(extra='train, convert', compile='decode')  # {option: the modes it is for}
    for modes, flag, default, kind, what in (  # '' = for every mode
            ('cache, train, decode, mqar, gpu', 'layouts', ','.join(LAYOUTS), layouts,
             'a comma-separated subset (gpu: mha,gqa,mqa,mla,gated_deltanet,hybrid unless given)'),
            ('', 'out', None, str, 'folder for runs, reports and plots (default: out-bench; with --readme: results; '
             'gpu: results/gpu)'),
            ('train, decode, mqar, gpu', 'device', 'cpu', str, 'cpu or cuda[:N]; train on cuda runs the full baby-GPT '
             "recipe, mqar Zoology's data; gpu: cuda unless given"),
            ('train, convert, mqar', 'max_iters', None, count,
             "iterations (MHA's for convert): 2000, train on cuda 5000, mqar 1000 (on cuda 5000)"),
            ('train, gpu', 'nanogpt', None, str, "nanoGPT's model.py, to time its step next to ours"),
            ('convert', 'fractions', '0,0.01,0.025,0.05,0.1', fractions, 'uptraining, fractions of max_iters'),
            ('convert', 'lr', 1e-3, positive, 'peak learning rate of the uptraining'),
            ('mqar', 'lrs', None, rates, "peak learning rates, each layout's best kept (default: each layout's best "
             "of the sweep 3e-4,1e-3,3e-3, bench.py's MQAR_LR)"),
            ('mqar', 'seeds', 2, count, 'seeds a run: its initialization and batches'),
            ('mqar', 'conv_size', 1, count, "taps of the linear layouts' short conv (default 1: none, as in front "
             "of softmax attention)"),
            ('mqar', 'vocab', None, parse_vocab,
             "token ids, keys in the lower half, values in the upper (default: 256, on cuda Zoology's 8192)"),
            ('mqar', 'sets', None, parse_sets,
             "(length L, pairs N) of each MQAR set (default: " + ','.join(f'{L}:{n}' for L, n in SETS) +
             ", on cuda Zoology's " + ','.join(f'{L}:{n}' for L, n in ZOOLOGY['sets']) + ")"),
            ('decode, gpu', 'n_layer', 6, count, 'layers'), ('decode, gpu', 'n_head', 6, count, 'heads'),
            ('decode, gpu', 'n_embd', 384, count, 'width'),
            ('decode, gpu', 'batch', 16, count, 'batch of the roofline (gpu: 64 unless given; and of its training)'),
            ('decode, gpu', 't', 2048, checked(int, lambda v: 1 <= v <= LONGEST,
                                               f"give an integer from 1 to {LONGEST:,}"), 'context of the roofline'),
            ('decode', 'contexts', '64,128,256,512,1024,2048', contexts, 'the contexts of decode cost vs context'),
            ('decode, gpu', 'gen_tokens', 240, gen_tokens, 'new tokens of the generation table'),
            ('decode, gpu', 'dtype', 'float32', str, 'float32, bfloat16 or float16 (gpu: bfloat16 unless given)')):
        only[flag] = modes
        p.add_argument(f'--{flag}', default=default, type=kind,
                       help=f"{modes}: " * bool(modes) + what + f" (default: {default})" * bool(default))
    p.add_argument('--readme', action='store_true', help="put the report's headline into README.md")
    p.add_argument('--compile', action='store_true', help='decode: compiled columns (static cache; CUDA graphs)')
    args = p.parse_intermixed_args(argv)  # the mode, options, then -- and the extras in any order
    default = vars(p.parse_intermixed_args([args.mode]))  # (string defaults parsed by their type)
    for key, modes in only.items():
        if modes and args.mode not in modes and getattr(args, key) != default[key]:
            p.error(f"{'extra arguments ' + repr(args.extra) if key == 'extra' else '--' + key} not for {args.mode}"
                    + " (train.py's keys go after --, for train and convert)" * (args.mode in ('train', 'convert')))
    owned = ['out_dir', 'wandb_log', 'attn', 'device', 'max_iters', 'lr_decay_iters', 'eval_interval', 'log_interval',
             'init_from', 'eval_only', 'seed']
    if args.mode == 'convert':  # and the uptraining's
        owned += ['n_kv_head', 'learning_rate', 'min_lr', 'warmup_iters', 'match_mha_params']
    if clash := [x for x in args.extra if x.lstrip('-').split('=')[0] in owned or not x.startswith('--')]:
        p.error(f"{clash[0]}: " + ("bench.py sets that itself" if clash[0].startswith('--') else "not a --key=value")
                + " (the extras are train.py's --key=value; bench.py picks the config files)")
    if args.out == '' or args.readme and args.out is not None and os.path.normpath(args.out) != 'results':
        p.error(f"--out={args.out!r}: " + ("with --readme: the README links to results/, where --readme writes"
                                            if args.out else "give a folder to write the results in"))
    given = {a.split('=')[0] for a in (sys.argv[1:] if argv is None else argv) if a.startswith('--')}
    if args.mode == 'gpu':  # its own settings, unless given: a lent GPU runs `python bench.py gpu` as it is
        six = 'mha,gqa,mqa,mla,gated_deltanet,hybrid'.split(',')  # (every softmax kind, the delta rule, the hybrid:
        for key, value in dict(device='cuda', batch=64, dtype='bfloat16', layouts=six).items():  # ~40 compilations)
            setattr(args, key, getattr(args, key) if f'--{key}' in given else value)
    args.out = 'results' if args.readme else args.out or ('results/gpu' if args.mode == 'gpu' else 'out-bench')
    args.layouts = [a for a in LAYOUTS if a in args.layouts]  # in the usual order
    cuda_train = args.mode == 'train' and args.device != 'cpu'
    args.max_iters = args.max_iters or (mqar_data(args)['max_iters'] if args.mode == 'mqar' else
                                        5000 if cuda_train else 2000)
    check_device(args.device, args.dtype)
    if args.mode in ('decode', 'gpu') and args.device == 'cpu' and args.dtype == 'float16':
        p.error("--dtype=float16 on CPU: no fp16 matmul kernels here (a 2048^2 product took 69 s, 0.13 s in float32); "
                "use float32 or bfloat16")
    try:  # nanoGPT's model.py runs now, two steps: a wrong file is refused before five layouts train, not after
        args.nanogpt is None or step_time_vs_nanogpt(args.nanogpt, rounds=1, steps=1)
    except (Exception, SystemExit) as e:
        p.error(f"--nanogpt={args.nanogpt}: not nanoGPT's model.py? {describe(e)}")
    sizes = dict(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)  # decode; MLA at the paper's ratios
    readme = open('README.md').read() if args.readme and os.path.isfile('README.md') else ''
    start, end = f"<!-- {args.mode}-table -->", f"<!-- /{args.mode}-table -->"
    try:
        dtype = getattr(torch, args.dtype)
        cfgs = [GPTConfig(attn=LAYOUTS[a], **sizes) for a in args.layouts] if args.mode in ('decode', 'gpu') else []
        need = sum(num_params(c) for c in cfgs) * dtype.itemsize  # counted, nothing built; all the models at once
        if args.mode == 'mqar':  # one sequence of each set first: its vocabulary may be too small for its pairs
            data = mqar_data(args)
            [zoology(data['vocab'], L, n, 1, np.random.default_rng(0)) for L, n in data['sets']]
            [mqar_model(name, 4, max(L for L, _ in data['sets']), args.conv_size) for name in args.layouts]  # conv
            copies = 1 + (os.cpu_count() or 1)  # x and y in int64, in bench.py and in each worker
            need = 16 * (data['train'] + 500) * sum(L for L, _ in data['sets']) * copies
        compiled = args.compile or args.mode == 'gpu'
        need += max(sum(c.cache_bytes(args.t + 1, dtype) * args.batch * (1 + compiled) for c in cfgs) +
                    8 * args.batch * (args.t + 1) * len(cfgs),  # the caches, and the token ids
                    sum(c.cache_bytes(max(args.contexts) + 1, dtype) * len(args.contexts) for c in cfgs) +  # full buffers
                    ('mla' in [c.softmax for c in cfgs]) * max(args.contexts) ** 2 * args.n_head * 4)  # MLA's uncached scores
        what = f"--t={args.t}, --batch={args.batch}, --contexts, the sizes: weights and caches"
        check_memory(need, 'cpu' if args.mode == 'mqar' else args.device,
                     "--vocab, --sets: the data in every worker" if args.mode == 'mqar' else what)
        if args.mode in ('train', 'convert') and not os.path.isfile('train.py'):
            raise ValueError(f"{args.mode} runs train.py and config/ from here: run bench.py in its own folder")
        if args.readme and not (start in readme and end in readme):
            raise ValueError(f"no README.md here with a '{start}' ... '{end}' section to rewrite")
        os.makedirs(args.out, exist_ok=True)  # all checked
        tempfile.TemporaryFile(dir=args.out).close()  # writable? (os.access says yes to root, even in /sys)
        if os.path.isdir(report := os.path.join(args.out, f'{args.mode}.md')):  # found now, not after the runs
            raise ValueError(f"{report} is a folder, where the report goes: move it, or give another --out")
    except ValueError as e:
        hint = " (that is config/hybrid.py's 'hybrid': leave it out with --layouts)" if HYBRID in str(e) else ''
        p.error(str(e) + hint)
    except OSError as e:
        p.error(f"--out {args.out!r}: {e.strerror}; give a folder to write the results in")
    torch.manual_seed(0)
    report = {'cache': lambda: cache_report(args.layouts), 'train': lambda: train_report(args),
              'decode': lambda: decode_report(args, sizes), 'convert': lambda: convert_report(args),
              'mqar': lambda: mqar_report(args), 'gpu': lambda: gpu_report(args, sizes)}[args.mode]()
    try:  # each file whole or not at all: a full disk leaves the old one
        for save in PLOTS:
            save()
        write_atomic(os.path.join(args.out, f'{args.mode}.md'), report)
        if args.mode != 'gpu':  # (gpu printed each section as it finished)
            print(report.replace(MORE, '\n'))  # (the README's marker is for the file)
        if args.readme:
            head, rest = open('README.md').read().split(start, 1)  # read again: it may have been edited meanwhile
            write_atomic('README.md', head + start + "\n" + readme_section(args.mode, report, args.out) + end +
                         rest.split(end, 1)[1])
    except FileError as e:
        fail(str(e))

if __name__ == '__main__':
    main()
