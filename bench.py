"""
Benchmarks that print numbers measured side by side in one run (never timed tests). Each mode writes its full
report to --out/MODE.md (default results/); --readme puts its headline into README.md.

    python bench.py cache                 # cache bytes per token: the model's formula vs a real cache; the 7B table
    python bench.py train                 # the CPU preset for every layout: losses, speed, val-loss curves
    python bench.py train --nanogpt PATH  # ... and the training step next to nanoGPT's model.py at PATH
    python bench.py decode                # decode roofline (batch 16, t=2048), decode vs context, generation
    python bench.py decode --compile      # ... with compiled columns (a static cache; on CUDA, CUDA graphs)
    python bench.py convert               # MHA -> GQA / MQA by mean-pooling K/V heads, then uptraining
"""
import argparse
import importlib.util
import json
import math
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import torch

from configurator import memory_errors_in_one_line
from model import GPT, GPTConfig, ATTN_LAYOUTS

START = time.time()
MORE = "\n<!-- the README shows the report down to here -->\n"  # a report's headline, then its details

# ----------------------------------------------------------------------------------------------
# Shared: the machine, progress, timing, plots


def machine():
    cpu = platform.processor() or platform.machine()
    try:
        with open('/proc/cpuinfo') as f:
            cpu = next(line.split(':', 1)[1].strip() for line in f if line.startswith('model name'))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads"


@contextmanager
def without_profiler_lines():
    """torch.profiler (inductor times GPU kernels with it) prints 'USDT: ... profiler_start/stop' straight to file
    descriptor 2: those lines are dropped, every other line of stderr passes."""
    sys.stderr.flush()
    stderr, (read, write) = os.dup(2), os.pipe()
    os.dup2(write, 2)
    os.close(write)

    def pump():
        with os.fdopen(read, 'rb') as f:
            for line in f:
                if not line.startswith(b'USDT:'):
                    os.write(stderr, line)
    thread = threading.Thread(target=pump)
    thread.start()
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(stderr, 2)  # closes the pipe: the pump reads to its end
        thread.join()
        os.close(stderr)


def progress(what):
    """One line on stderr per run or layout of a long benchmark: never silent for minutes."""
    print(f"[{time.time() - START:5.0f} s] {what}", file=sys.stderr, flush=True)


def sync(device):
    if device.startswith('cuda'):
        torch.cuda.synchronize()


def timed(fn, device, reps, warmup=True):
    """Median seconds of reps calls of fn (after one warm-up call)."""
    if warmup:
        fn()
    times = []
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def build(cfg, device, dtype):
    return GPT(cfg).to(device=device, dtype=dtype).eval()


def compile_options(device):
    """torch.compile(fullgraph=True): one graph or an error, never a silent fallback to eager; on CUDA with CUDA
    graphs (mode='reduce-overhead'): a decode step over a static cache is one graph replay."""
    torch._dynamo.reset()
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    return dict(fullgraph=True, mode='reduce-overhead' if device.startswith('cuda') else None)


def plot(path, title, xlabel, ylabel, lines, log=False, top=None, **legend):
    """One figure into path: lines are (xs, ys, label, matplotlib style) each; log: both axes log-scaled."""
    import matplotlib
    matplotlib.use('Agg')  # files only, no display
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for xs, ys, label, style in lines:
        ax.plot(xs, ys, label=label, **style)
    if log:
        ax.set(xscale='log', yscale='log')
    if top:
        ax.set_ylim(top=min(top, ax.get_ylim()[1]))
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.grid(alpha=0.3, which='both')
    ax.legend(**legend)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------
# cache: bytes per token, the model's formula next to a real cache

def cache_table(layouts=ATTN_LAYOUTS, T=None, **overrides):
    """Markdown table: per layout, the cache the model's own accounting predicts (GPTConfig.cache_elements)
    next to what a real cache holds after T tokens of a randomly initialised model (cache.nbytes)."""
    rows = []
    for attn in layouts:
        cfg = GPTConfig(attn=attn, **overrides)
        T = T or cfg.block_size
        torch.manual_seed(0)
        model = GPT(cfg).eval()
        cache = model.init_cache(1)
        with torch.no_grad():
            model(torch.randint(0, cfg.vocab_size, (1, T)), cache=cache)
        elem = cache.layers[0].bufs[0].element_size() if attn == 'linear' else next(model.parameters()).element_size()
        formula = cfg.cache_elements(T)
        per_token, fp16 = ((f"— (state {formula:,})", '—') if attn == 'linear' else
                           (f"{formula // T:,}", f"{formula // T * 2:,}"))
        rows.append(f"| {attn} | {cfg.n_kv_head if attn in ('mha', 'gqa', 'mqa') else '—'} | {per_token} | {fp16} | "
                    f"{formula * elem:,} | {cache.nbytes:,} | {cache.nbytes / (formula * elem):.3f} |")
    cfg = GPTConfig(**overrides)
    head = (f"Config: {cfg.n_layer} layers, {cfg.n_head} heads, n_embd {cfg.n_embd} (head_dim {cfg.head_dim}), "
            f"block_size {cfg.block_size}, MLA d_c={cfg.kv_lora_rank} d_R={cfg.rope_head_dim}; cache of 1 sequence "
            f"after T={T} tokens, float32 (linear attention's state is float32 in every dtype).\n\n"
            "| layout | K/V heads | cache elements / token (all layers) | bytes / token at fp16 | "
            f"formula bytes at T={T} (fp32) | measured `cache.nbytes` | measured / formula |\n"
            "|---|---|---|---|---|---|---|\n")
    return head + "\n".join(rows) + "\n"


def seven_b_table():
    """The classic 7B table, from the model's own accounting (GPTConfig.cache_bytes), nothing allocated:
    32 layers, 32 query heads, d_k 128, fp16, 8192 tokens; MLA at d_c = 4 d_k, d_R = d_k / 2."""
    base = dict(n_layer=32, n_head=32, n_embd=4096, block_size=8192, vocab_size=32000, kv_lora_rank=512,
                rope_head_dim=64)
    rows = ["| layout | cache KiB / token | GiB at 8192 tokens |", "|---|---|---|"]
    for name, kw in (('MHA (h_kv = 32)', dict(attn='mha')), ('GQA (h_kv = 8)', dict(attn='gqa', n_kv_head=8)),
                     ('MQA (h_kv = 1)', dict(attn='mqa')), ('MLA (d_c = 512, d_R = 64)', dict(attn='mla')),
                     ('linear (state, any T)', dict(attn='linear'))):
        cfg = GPTConfig(**base, **kw)
        per_token = cfg.cache_bytes(8192, torch.float16) / 8192 / 1024
        rows.append(f"| {name} | {per_token:,.2f} | {cfg.cache_bytes(8192, torch.float16) / 2 ** 30:.2f} |")
    rows.append(f"| weights: 7e9 parameters at fp16 | | {7e9 * 2 / 2 ** 30:.1f} |")
    return "\n".join(rows) + "\n"


def cache_report(layouts=ATTN_LAYOUTS):
    return (cache_table(layouts) + MORE + "\n**The 7B table**, from `GPTConfig.cache_bytes` (nothing allocated):\n\n" +
            seven_b_table())


# ----------------------------------------------------------------------------------------------
# train: every layout on one recipe; conversion: MHA -> GQA / MQA

def train_run(run_dir, args):
    """train.py with args into a fresh run_dir; returns its metrics.jsonl rows and its parameter count."""
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, 'train.py', *args, f'--out_dir={run_dir}', '--wandb_log=False']
    progress(' '.join(cmd[1:]))
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"error: train.py failed in {run_dir}: {r.stderr.strip().splitlines()[-1:]}")
    with open(os.path.join(run_dir, 'metrics.jsonl')) as f:
        rows = [json.loads(line) for line in f]
    return dict(rows=rows, params=re.search(r"([\d.]+)M parameters", r.stdout).group(1),
                tokens=int(re.search(r"tokens per iteration will be: ([\d,]+)", r.stdout).group(1).replace(',', '')))


def train_runs(layouts, out, max_iters, extra=(), device='cpu', eval_interval=100):
    """Run train.py for each layout (same seed, same batches): on CPU nanoGPT's CPU preset, on CUDA the full
    baby-GPT recipe (config/<layout>.py alone, bf16); return its metrics."""
    recipe = ['config/cpu.py'] if device == 'cpu' else [f'--device={device}']
    return {attn: train_run(os.path.join(out, 'train', attn),
                            [f'config/{attn}.py', *recipe, f'--max_iters={max_iters}', f'--lr_decay_iters={max_iters}',
                             f'--eval_interval={eval_interval}', '--log_interval=1', *extra])
            for attn in layouts}


def train_table(runs, eval_interval=100):
    lines = ["| layout | params | cache bytes/token | train loss | val loss | best val (iteration) | "
             "median ms/iter | tokens/s |", "|---|---|---|---|---|---|---|---|"]
    for attn, run in runs.items():
        evals = [r for r in run['rows'] if 'val/loss' in r]
        best = min(evals, key=lambda r: r['val/loss'])
        # every step's time, except those that include an evaluation (iterations 0, eval_interval, ...)
        steps = [r['ms_per_iter'] for r in run['rows'] if 'ms_per_iter' in r and r['iter'] % eval_interval]
        ms = statistics.median(steps)
        lines.append(f"| {attn} | {run['params']}M | {evals[-1]['cache_bytes_per_token']:,.0f} | "
                     f"{evals[-1]['train/loss']:.4f} | {evals[-1]['val/loss']:.4f} | "
                     f"{best['val/loss']:.4f} ({best['iter']}) | {ms:.1f} | {run['tokens'] / ms * 1000:,.0f} |")
    return "\n".join(lines) + "\n"


def plot_curves(runs, path):
    evals = {attn: [r for r in run['rows'] if 'val/loss' in r] for attn, run in runs.items()}
    plot(path, 'tiny Shakespeare (char): val loss', 'iteration', 'val loss', top=3.0,
         lines=[([r['iter'] for r in ev], [r['val/loss'] for r in ev], attn, dict(marker='.')) for attn, ev in evals.items()])


def step_time_vs_nanogpt(nanogpt_path, rounds=7, steps=20):
    """Training-step time (forward, backward, clip, AdamW) of our MHA model next to nanoGPT's, on the CPU
    preset, the models taking turns so both see the same machine state. Returns {name: median ms}."""
    spec = importlib.util.spec_from_file_location('nanogpt_model', nanogpt_path)
    ng = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ng)
    sizes = dict(n_layer=4, n_head=4, n_embd=128, block_size=64, vocab_size=65, dropout=0.0, bias=False)
    torch.manual_seed(0)
    models = {"nanoGPT": ng.GPT(ng.GPTConfig(**sizes)),
              "ours, mha, pos_emb='learned'": GPT(GPTConfig(attn='mha', pos_emb='learned', **sizes)),
              "ours, mha, RoPE (default)": GPT(GPTConfig(attn='mha', **sizes))}
    opts = {k: m.configure_optimizers(0.1, 1e-3, (0.9, 0.99), 'cpu') for k, m in models.items()}
    x = torch.randint(0, 65, (12, 64))
    y = torch.randint(0, 65, (12, 64))
    times = {k: [] for k in models}
    for _ in range(rounds):
        for k, model in models.items():
            t0 = time.perf_counter()
            for _ in range(steps):
                _, loss = model(x, y)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opts[k].step()
                opts[k].zero_grad(set_to_none=True)
            times[k].append((time.perf_counter() - t0) / steps * 1000)
    return {k: statistics.median(v[1:]) for k, v in times.items()}  # the first round warms up


def convert_runs(out, max_iters, uptrain, lr, extra=()):
    """Ainslie et al. 2023 on the CPU preset: MHA trained max_iters; GQA (2 K/V heads) and MQA trained from
    scratch as long, in the converted models' shape (MHA's MLP); GQA and MQA mean-pooled from the MHA
    checkpoint, then uptrained for each number of iterations in uptrain (peak lr, warmup a tenth, cosine to lr / 10).
    Evaluated at the start and the end only, every run on the same 200 val batches."""
    base = ['config/cpu.py', '--eval_iters=200', '--log_interval=1000000', *extra]

    def run(name, config, iters, *args):
        return train_run(os.path.join(out, 'convert', name), [config, *base, f'--max_iters={iters}',
                         f'--lr_decay_iters={max(iters, 1)}', f'--eval_interval={max(iters, 1)}', *args])
    runs = {'mha': run('mha', 'config/mha.py', max_iters)}
    for attn in ('gqa', 'mqa'):
        runs[attn, 'scratch'] = run(f'{attn}-scratch', f'config/{attn}.py', max_iters, '--match_mha_params=False')
        for n in uptrain:
            runs[attn, n] = run(f'{attn}-uptrain-{n}', f'config/{attn}.py', n,
                                f"--init_from={os.path.join(out, 'convert', 'mha')}", f'--warmup_iters={n // 10}',
                                f'--learning_rate={lr}', f'--min_lr={lr / 10}')
    for run_ in runs.values():
        run_['val'] = [r for r in run_['rows'] if 'val/loss' in r][-1]
    return runs


def convert_table(runs, max_iters, uptrain, lr):
    """The whole table, and a summary: from scratch, pooled, pooled + 5% uptraining, and the gap 5% closes."""
    mha = runs['mha']['val']['val/loss']
    name = {'mha': 'MHA', 'gqa': 'GQA, 2 K/V heads', 'mqa': 'MQA'}
    lines = ["| model | made by | iterations | params | cache bytes/token (fp32) | val loss | minus MHA's |",
             "|---|---|---|---|---|---|---|"]

    def row(label, how, iters, run):
        val = run['val']
        lines.append(f"| {label} | {how} | {iters} | {run['params']}M | {val['cache_bytes_per_token']:,.0f} | "
                     f"{val['val/loss']:.4f} | {val['val/loss'] - mha:+.4f} |")
    row('MHA', 'trained from scratch', f'{max_iters:,}', runs['mha'])
    recovered = []
    for attn in ('gqa', 'mqa'):
        row(name[attn], 'trained from scratch', f'{max_iters:,}', runs[attn, 'scratch'])
        for n in uptrain:
            how = f'MHA mean-pooled, uptrained {n / max_iters:.1%}' if n else 'MHA mean-pooled, no uptraining'
            row(name[attn], how, f'{max_iters:,} + {n:,}', runs[attn, n])
        n5 = round(0.05 * max_iters)
        if 0 in uptrain and n5 in uptrain and n5 > 0:
            l0, l5 = runs[attn, 0]['val']['val/loss'], runs[attn, n5]['val']['val/loss']
            recovered.append(f"{name[attn]} {(l0 - l5) / (l0 - mha):.0%}" if l0 > mha else f"{name[attn]}: no gap")
    headline = [line for line in lines if not re.search(r"uptrained (?!5\.0%)", line)]
    summary = "\n".join(headline) + "\n"
    if recovered:
        summary += ("\nShare of the gap to MHA opened by mean-pooling that 5% uptraining closes: " +
                    ", ".join(recovered) + ".\n")
    lr_line = f"\nUptraining: peak learning rate {lr:g}, warmup a tenth of the run, cosine to {lr / 10:g}.\n"
    return "\n".join(lines) + "\n" + lr_line, summary


def plot_convert(runs, max_iters, uptrain, path):
    xs, ends = [100 * n / max_iters for n in uptrain], [0, 100 * uptrain[-1] / max_iters or 1]
    val = lambda run: run['val']['val/loss']
    lines = [(ends, [val(runs['mha'])] * 2, f'MHA, {max_iters} iters', dict(color='black', ls='--'))]
    for attn, color in (('gqa', 'tab:blue'), ('mqa', 'tab:orange')):
        lines += [(xs, [val(runs[attn, n]) for n in uptrain], f'{attn.upper()} mean-pooled from MHA, then uptrained',
                   dict(color=color, marker='o')),
                  (ends, [val(runs[attn, 'scratch'])] * 2, f'{attn.upper()} from scratch, {max_iters} iters',
                   dict(color=color, ls=':'))]
    plot(path, 'MHA -> GQA / MQA: K/V heads mean-pooled, then uptrained (CPU preset)',
         "uptraining iterations, % of MHA's training", 'val loss', lines, fontsize=8)


# ----------------------------------------------------------------------------------------------
# decode: the roofline of one step, the cost vs context, generation with and without the cache

@torch.inference_mode()
def roofline(layouts, sizes, batch, t, device, dtype, compile=False, rounds=15, chunk=512):
    """One cached decode step per layout at batch `batch` and context t (it attends to t + 1 keys): eager, and
    (compile) compiled over a static cache, next to its two floors: the bytes it must read (every weight once,
    the filled cache) / bandwidth, and its FLOPs / matmul rate. The machine measurements and the steps take
    turns, one each per round, so a slow moment of the machine hits them all alike."""
    runs = {}
    for attn in layouts:
        progress(f"roofline: {attn}")
        model = build(GPTConfig(attn=attn, **{**sizes, 'block_size': t + 1}), device, dtype)
        idx = torch.randint(0, model.config.vocab_size, (batch, t + 1), device=device)
        cache = model.init_cache(batch)
        for i in range(0, t, chunk):  # prefill in chunks: bounded memory for the materialized attention
            model(idx[:, i:min(i + chunk, t)], cache=cache)

        def step(model=model, idx=idx, cache=cache):  # the token at position t, again and again
            cache.pos = t
            return model(idx[:, t:], cache=cache)[0]
        step()  # warm-up; from now on the cache holds the t + 1 keys each step attends to
        steps = {'eager': step}
        if compile:  # the same step over a static copy of the cache: one graph
            static = model.init_cache(batch, static=True)
            for a, b in zip((b for layer in static.layers for b in layer.bufs), (b for l in cache.layers for b in l.bufs)):
                a.copy_(b)
            steps['compiled'] = torch.compile(lambda m=model, i=idx, c=static: (c.pos.fill_(t), m(i[:, t:], cache=c)[0]),
                                              **compile_options(device))
            steps['compiled']()  # compiles
        weights = sum(p.nbytes for p in model.parameters())
        runs[attn] = dict(steps=steps, bytes=weights + cache.nbytes, flops=step_flops(step), times={k: [] for k in steps})
    bandwidths, rates = [], []
    order = [(run, kind) for run in runs.values() for kind in run['steps']]
    for r in range(rounds):
        bandwidth, rate = machine_floors(device, dtype)
        bandwidths.append(bandwidth)
        rates.append(rate)
        for run, kind in order[r % len(order):] + order[:r % len(order)]:  # each step first after the copy in turn
            run['times'][kind].append(timed(run['steps'][kind], device, reps=1, warmup=False))
    bandwidth, rate = statistics.median(bandwidths), statistics.median(rates)
    for run in runs.values():
        run['ms'] = {kind: statistics.median(times) * 1000 for kind, times in run['times'].items()}
        run['floors'] = {'bytes': run['bytes'] / bandwidth * 1000, 'FLOPs': run['flops'] / rate * 1000}
    return runs, bandwidth, rate


def roofline_table(runs, bandwidth, rate, batch, t, rounds=15):
    kinds = list(next(iter(runs.values()))['ms'])
    rows = [f"Cached decode step, batch {batch}, context t={t} (the step attends to t + 1 keys); floors measured in the "
            f"same run: bandwidth **{bandwidth / 1e9:.1f} GB/s** (a large tensor copy, read + write bytes), matmul rate "
            f"**{rate / 1e9:,.0f} GFLOP/s** (one large square product); medians of {rounds} interleaved rounds.\n",
            "| layout | bytes read: weights + cache | GFLOP | bytes floor ms | FLOP floor ms | binds | " +
            " | ".join(f"{k} ms | {k} % of floor" for k in kinds) + " |", "|---|---|---|---|---|---|" + "---|---|" * len(kinds)]
    for attn, run in runs.items():
        binds = max(run['floors'], key=run['floors'].get)
        rows.append(f"| {attn} | {run['bytes'] / 1e6:,.3g} MB | {run['flops'] / 1e9:.3g} | {run['floors']['bytes']:.3g} | "
                    f"{run['floors']['FLOPs']:.3g} | {binds} | " +
                    " | ".join(f"{run['ms'][k]:.3g} | **{100 * run['floors'][binds] / run['ms'][k]:.0f}%**" for k in kinds) + " |")
    return "\n".join(rows) + "\n"


def machine_floors(device, dtype):
    """What this machine can do, measured now: the matmul rate of one large square product in dtype, and memory
    bandwidth, (read + write bytes) / time of a large tensor copy (CPU 256 MiB, GPU 1 GiB). The copy comes
    last: it leaves the caches cold and lets the clock recover from the product's vector units."""
    m = 8192 if device.startswith('cuda') else 2048
    a, b = (torch.randn(m, m, device=device, dtype=dtype) for _ in range(2))
    rate = 2 * m ** 3 / timed(lambda: a @ b, device, reps=5)
    x = torch.ones((2 ** 30 if device.startswith('cuda') else 2 ** 28) // 4, device=device)
    y = torch.empty_like(x)
    return 2 * x.nbytes / timed(lambda: y.copy_(x), device, reps=5), rate


def step_flops(step):
    """FLOPs of one call of step, counted by torch.utils.flop_counter with SDPA on its math backend (the
    counter sees the math kernel's matrix products, not the fused kernels)."""
    import model as model_module
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode
    backends, model_module.DECODE_BACKENDS = model_module.DECODE_BACKENDS, [SDPBackend.MATH]
    try:
        with sdpa_kernel([SDPBackend.MATH]), FlopCounterMode(display=False) as counter:
            step()
    finally:
        model_module.DECODE_BACKENDS = backends
    return counter.get_total_flops()


def plot_roofline(runs, bandwidth, path):
    mb = {attn: run['bytes'] / 1e6 for attn, run in runs.items()}
    ends = [min(mb.values()) / 1.5, max(mb.values()) * 1.5]
    lines = [(ends, [x * 1e6 / bandwidth * 1000 for x in ends], f'bytes floor: bytes / {bandwidth / 1e9:.1f} GB/s',
              dict(color='black', ls='--'))]
    for i, (attn, run) in enumerate(runs.items()):
        lines += [([mb[attn]], [run['ms'][kind]], f'{attn}, {kind} step', dict(color=f'C{i}', marker=m, ls='', fillstyle=f))
                  for kind, m, f in (('eager', 'o', 'full'), ('compiled', 's', 'none')) if kind in run['ms']]
        lines.append(([mb[attn]], [run['floors']['FLOPs']], f'{attn}, FLOP floor', dict(color=f'C{i}', marker='_', ms=16,
                                                                                       mew=2, ls='')))
    plot(path, 'decode step vs bytes read, with the floors', 'bytes one decode step must read: weights + cache (MB)',
         'ms per decode step', lines, log=True, fontsize=7, loc='upper left', bbox_to_anchor=(1.01, 1))


@torch.inference_mode()
def decode_costs(layouts, sizes, contexts, device, dtype, rounds=15):
    """ms per generated token at each context length t, eager: one cached decode step against t cached tokens,
    and the uncached alternative, one forward over the t + 1 token window. The contexts take turns (one step
    each per round), so a slow moment of the machine hits them all alike."""
    out = {}
    for attn in layouts:
        progress(f"decode cost vs context: {attn}")
        model = build(GPTConfig(attn=attn, **{**sizes, 'block_size': max(contexts) + rounds + 1}), device, dtype)
        idx = torch.randint(0, model.config.vocab_size, (1, model.config.block_size), device=device)
        caches = {t: model.init_cache(1) for t in contexts}
        for t, cache in caches.items():
            model(idx[:, :t], cache=cache)
        cached, uncached = {t: [] for t in contexts}, {t: [] for t in contexts}
        for r in range(rounds):
            for t, cache in caches.items():
                n = len(cache)
                cached[t].append(timed(lambda: model(idx[:, n:n + 1], cache=cache), device, reps=1, warmup=False))
                if r < 3:
                    uncached[t].append(timed(lambda: model(idx[:, :t + 1]), device, reps=1, warmup=r == 0))
        for t in contexts:
            out[attn, t] = (statistics.median(cached[t][1:]) * 1000, statistics.median(uncached[t]) * 1000)
    return out


def plot_decode(costs, layouts, contexts, path):
    plot(path, 'decode cost vs context, batch 1', 'context length t (tokens already seen)', 'ms per generated token',
         [(contexts, [costs[attn, t][k] for t in contexts], f'{attn}, {kind}', dict(color=f'C{i}', marker=m, ls=ls))
          for i, attn in enumerate(layouts) for k, kind, m, ls in ((0, 'cached', 'o', '-'), (1, 'no cache', 'x', '--'))],
         log=True, fontsize=7, ncol=2)


@torch.inference_mode()
def generation(layouts, sizes, device, dtype, compile=False, prompt=16, new=240, batches=(1, 8)):
    """Greedy generation, `new` tokens after a 16-token prompt at block 256: without the cache, with it, and
    (compile) with a static cache through the compiled model. Each way runs twice, taking turns, after a
    warm-up; the faster run counts. Every way must give the same tokens."""
    kinds = ['no cache', 'cache'] + ['cache, compiled'] * compile
    rows = ["| layout | batch | " + " | ".join(f"tokens/s, {k}" for k in kinds) + " | cache speedup | identical tokens |",
            "|---|---|" + "---|" * (len(kinds) + 2)]
    for attn in layouts:
        progress(f"generation: {attn}")
        cfg = GPTConfig(attn=attn, **{**sizes, 'block_size': 256})
        models = dict.fromkeys(kinds[:2], build(cfg, device, dtype))
        if compile:  # a copy, compiled in place (stream() calls self(...))
            models['cache, compiled'] = build(cfg, device, dtype)
            models['cache, compiled'].load_state_dict(models['cache'].state_dict())
            models['cache, compiled'].compile(**compile_options(device))
        for batch in batches:
            idx = torch.randint(0, cfg.vocab_size, (batch, prompt), device=device)
            out, secs = {}, {k: [] for k in kinds}
            for kind in kinds * 2:
                model = models[kind]
                cache = model.init_cache(batch, static=kind == 'cache, compiled') if kind != 'no cache' else None
                run = lambda n: torch.cat(list(model.stream(idx, n, temperature=0, use_cache=cache is not None, cache=cache)), 1)
                run(4)  # warm-up (and compilation)
                sync(device)
                t0 = time.perf_counter()
                out[kind] = run(new)
                sync(device)
                secs[kind].append(time.perf_counter() - t0)
            same = all(torch.equal(out[k], out['no cache']) for k in kinds)
            rows.append(f"| {attn} | {batch} | " + " | ".join(f"{batch * new / min(secs[k]):,.1f}" for k in kinds) +
                        f" | {min(secs['no cache']) / min(secs['cache']):.1f}x | {'yes' if same else 'NO'} |")
    return "\n".join(rows) + "\n"


def decode_report(layouts, sizes, contexts, device, dtype, out, new, compile, batch, t):
    runs, bandwidth, rate = roofline(layouts, sizes, batch, t, device, dtype, compile)
    plot_roofline(runs, bandwidth, os.path.join(out, 'roofline.png'))
    costs = decode_costs(layouts, sizes, contexts, device, dtype)
    plot_decode(costs, layouts, contexts, os.path.join(out, 'decode.png'))
    rows = ["| layout | " + " | ".join(f"t={t} cached / no cache" for t in contexts) + " |", "|---|" + "---|" * len(contexts)]
    rows += [f"| {attn} | " + " | ".join(f"{costs[attn, t][0]:.2f} / {costs[attn, t][1]:.1f}" for t in contexts) + " |"
             for attn in layouts]
    mla = GPTConfig(attn='mla', **sizes)
    how = ('compiled: torch.compile(fullgraph=True) over a static cache' +
           (', CUDA graphs' if device.startswith('cuda') else '')) if compile else 'eager'
    text = (f"Machine: {machine()}. Model: {sizes['n_layer']} layers, {sizes['n_head']} heads, n_embd {sizes['n_embd']}, "
            f"MLA d_c {mla.kv_lora_rank} d_R {mla.rope_head_dim}, random init, {str(dtype).replace('torch.', '')}, "
            f"device {device}, {how}.\n\n**Roofline of one decode step**\n\n" + roofline_table(runs, bandwidth, rate, batch, t) +
            f"\n![decode step vs bytes read](roofline.png)\n" + MORE +
            "\n**Decode cost vs context**, batch 1, eager, ms per generated token (cached / without cache):\n\n" +
            "\n".join(rows) + "\n")
    lo = min(contexts, key=lambda c: abs(c - 128))
    if 'linear' in layouts and lo < max(contexts):
        ratio = costs['linear', max(contexts)][0] / costs['linear', lo][0]
        text += f"\nLinear attention, cached ms/token at t={max(contexts)} / at t={lo}: **{ratio:.2f}**\n"
    return text + (f"\n![decode cost vs context](decode.png)\n"
                   f"\n**Generation, {new} new tokens after a 16-token prompt, block 256, greedy** (the best of two "
                   "runs each way):\n\n" + generation(layouts, sizes, device, dtype, compile, new=new))


# ----------------------------------------------------------------------------------------------

def train_report(args):
    every = 100 if args.device == 'cpu' else 250
    runs = train_runs(args.layouts, args.out, args.max_iters, args.extra, args.device, every)
    plot_curves(runs, os.path.join(args.out, 'train_val_loss.png'))
    recipe = 'config/<layout>.py + config/cpu.py' if args.device == 'cpu' else 'config/<layout>.py (baby GPT, bf16)'
    body = (f"`python bench.py train --max_iters={args.max_iters} --device={args.device}` on {machine()}: {recipe}, "
            f"seed 1337, the same batches for every layout, evaluated every {every} iterations; losses at the last "
            f"one; cache bytes/token at block_size in the run's dtype.\n\n" + train_table(runs, every))
    if args.nanogpt:
        ms = step_time_vs_nanogpt(args.nanogpt)
        body += ("\nTraining-step time on the same recipe, models taking turns in one process "
                 "(median of 6 rounds x 20 steps):\n\n| model | ms/step | vs nanoGPT |\n|---|---|---|\n" +
                 "".join(f"| {k} | {v:.2f} | {v / ms['nanoGPT']:.3f} |\n" for k, v in ms.items()))
    return body + f"\n![val loss curves](train_val_loss.png)\n"


def convert_report(args):
    uptrain = sorted({round(f * args.max_iters) for f in args.fractions})
    runs = convert_runs(args.out, args.max_iters, uptrain, args.lr, args.extra)
    plot_convert(runs, args.max_iters, uptrain, os.path.join(args.out, 'convert.png'))
    command = ' '.join(['python bench.py convert', f'--max_iters={args.max_iters}', f'--lr={args.lr:g}',
                        *(['--', *args.extra] if args.extra else [])])
    table, summary = convert_table(runs, args.max_iters, uptrain, args.lr)
    return (f"`{command}` on {machine()}: config/cpu.py (4 layers, 4 heads, 128 wide, block 64), seed 1337, val loss "
            f"= mean of the same 200 val batches.\n\n" + summary + f"\n![conversion](convert.png)\n"
            + MORE + "\n**Every run**:\n\n" + table)


def readme_section(mode, report, out='results'):
    """What README.md shows of a report: its headline, its plots' links made relative to the README, and where
    the whole of it is."""
    headline = re.sub(r"(!\[[^]]*\]\()", rf"\g<1>{out}/", report.split(MORE)[0])
    return headline + f"\nThe whole report: [{out}/{mode}.md]({out}/{mode}.md).\n"


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not argparse's usage block
        self.exit(2, f"error: {message} (see: python {self.prog} --help)\n")


def main(argv=None):
    memory_errors_in_one_line('--batch, --t, --contexts, --n_embd, --n_layer')  # e.g. --t too large here
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest='mode', required=True)
    modes = {'cache': 'cache bytes per token, formula vs measured; the 7B table',
             'train': 'train every layout on one recipe: losses, ms/iter, val-loss curves',
             'decode': 'decode roofline, cost vs context, generation with/without the cache (defaults: ~10 min, 2 cores)',
             'convert': 'MHA -> GQA/MQA by mean-pooling, with and without uptraining, vs from scratch'}
    parsers = {m: sub.add_parser(m, help=h, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
               for m, h in modes.items()}
    for m, q in parsers.items():
        if m != 'convert':  # (convert: MHA, GQA and MQA)
            q.add_argument('--layouts', default=','.join(ATTN_LAYOUTS), help='comma-separated subset of the layouts')
        q.add_argument('--readme', action='store_true', help="put the report's headline into README.md")
        q.add_argument('--out', default='results', help='folder for runs, reports and plots (default: results)')
        if m != 'cache':
            q.add_argument('--device', default='cpu', help='cpu, or cuda[:N] (train: cuda runs the baby-GPT recipe)')
        if m in ('train', 'convert'):
            q.add_argument('--max_iters', type=int, help="iterations (train: 2000 on cpu, 5000 on cuda; convert: MHA's, 2000)")
            q.add_argument('extra', nargs='*', help='more --key=value for train.py (after --)')
    parsers['train'].add_argument('--nanogpt', help="path to nanoGPT's model.py: its training step next to ours")
    c = parsers['convert']
    c.add_argument('--fractions', default='0,0.01,0.025,0.05,0.1', help='uptraining, fractions of max_iters')
    c.add_argument('--lr', type=float, default=1e-3, help='peak learning rate of uptraining')
    d = parsers['decode']
    for name, default, what in (('n_layer', 6, 'layers'), ('n_head', 6, 'heads'), ('n_embd', 384, 'width'),
                                ('batch', 16, 'batch of the roofline'), ('t', 2048, 'context of the roofline'),
                                ('gen_tokens', 240, 'new tokens of the generation table')):
        d.add_argument(f'--{name}', type=int, default=default, help=what)
    d.add_argument('--contexts', default='64,128,256,512,1024,2048', help='comma-separated context lengths')
    d.add_argument('--dtype', default='float32', choices=['float32', 'bfloat16', 'float16'])
    d.add_argument('--compile', action='store_true', help='compiled columns: a static cache, on CUDA CUDA graphs')
    args = p.parse_args(argv)
    fail = parsers[args.mode].error  # says: see python bench.py MODE --help

    def numbers(name, kind):  # a comma-separated list
        try:
            return sorted(kind(x) for x in getattr(args, name).split(','))
        except ValueError:
            fail(f"--{name} {getattr(args, name)!r}: give comma-separated {'integers' if kind is int else 'numbers'}")
    layouts = numbers('layouts', str) if args.mode != 'convert' else []
    if set(layouts) - set(ATTN_LAYOUTS):
        fail(f"unknown layout(s) {sorted(set(layouts) - set(ATTN_LAYOUTS))}; choose from {', '.join(ATTN_LAYOUTS)}")
    args.layouts = [a for a in ATTN_LAYOUTS if a in layouts]  # in the usual order
    if args.mode in ('train', 'convert') and args.max_iters is None:
        args.max_iters = 5000 if args.mode == 'train' and args.device != 'cpu' else 2000
    for name in ('max_iters', 'batch', 't', 'gen_tokens', 'n_layer', 'n_head', 'n_embd'):
        if getattr(args, name, 1) < 1:
            fail(f"--{name}={getattr(args, name)} must be >= 1")
    device = getattr(args, 'device', 'cpu')
    if not re.fullmatch(r'cpu|cuda(:\d+)?', device) or (device != 'cpu' and not torch.cuda.is_available()):
        fail(f"--device {device!r}: give cpu, or cuda[:N] where CUDA is available")
    if args.mode == 'train' and args.nanogpt and not os.path.isfile(args.nanogpt):
        fail(f"--nanogpt {args.nanogpt!r}: no such file")
    if args.mode == 'convert':
        args.fractions = numbers('fractions', float)
        if not all(0 <= f <= 1 for f in args.fractions) or not 0 < args.lr < math.inf:
            fail("--fractions must be in [0, 1] and --lr a number > 0")
    if args.mode == 'decode':
        contexts = numbers('contexts', int)
        if contexts[0] < 1:
            fail("--contexts must be >= 1")
        sizes = dict(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)  # MLA: d_c, d_R at the paper's ratios
        try:
            for attn in args.layouts:
                GPTConfig(attn=attn, **sizes)
        except ValueError as e:
            fail(str(e))
    try:  # after every argument is checked
        os.makedirs(args.out, exist_ok=True)
        if not os.access(args.out, os.W_OK):
            raise PermissionError(13, 'Permission denied')
    except OSError as e:
        fail(f"--out {args.out!r}: {e.strerror}; give a folder to write the results in")
    torch.manual_seed(0)
    if args.mode == 'decode':
        report = decode_report(args.layouts, sizes, contexts, device, getattr(torch, args.dtype), args.out,
                               args.gen_tokens, args.compile, args.batch, args.t)
    else:
        report = {'cache': lambda a: cache_report(a.layouts), 'train': train_report, 'convert': convert_report}[args.mode](args)
    with open(os.path.join(args.out, f'{args.mode}.md'), 'w') as f:
        f.write(report)
    print(report)
    if args.readme:
        with open('README.md') as f:
            text = f.read()
        start, end = f"<!-- {args.mode}-table -->", f"<!-- /{args.mode}-table -->"
        if start not in text or end not in text:
            fail(f"README.md has no '{start}' ... '{end}' section to rewrite")
        head, rest = text.split(start, 1)
        with open('README.md', 'w') as f:
            f.write(head + start + "\n" + readme_section(args.mode, report, args.out) + end + rest.split(end, 1)[1])


if __name__ == '__main__':
    with without_profiler_lines():
        main()
