"""
Benchmarks that print numbers measured side by side in one run (never timed tests).

    python bench.py cache                 # cache elements / bytes per token, formula vs measured
    python bench.py cache --readme        # ... and rewrite the table in README.md
    python bench.py train                 # the CPU preset for every layout: losses, speed, curves
    python bench.py train --nanogpt PATH  # ... plus training-step time next to nanoGPT's model.py at PATH
    python bench.py decode                # decode roofline (batch 16, t=2048), cache memory, decode vs context,
                                          # cached vs uncached generation
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
from model import GPT, GPTConfig, ATTN_LAYOUTS, apply_rope, attend


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
        if attn == 'linear':
            per_token = f"— (state {formula:,})"
            fp16 = '—'
        else:
            per_token = f"{formula // T:,}"
            fp16 = f"{formula // T * 2:,}"
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


def machine():
    cpu = platform.processor() or platform.machine()
    try:
        with open('/proc/cpuinfo') as f:
            cpu = next(line.split(':', 1)[1].strip() for line in f if line.startswith('model name'))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads"


START = time.time()


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


def new_plot():
    import matplotlib
    matplotlib.use('Agg')  # files only, no display
    import matplotlib.pyplot as plt
    return plt.subplots(figsize=(7, 4.5))


def save_plot(fig, ax, path, **legend):
    ax.grid(alpha=0.3, which='both')
    ax.legend(**legend)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_curves(runs, path):
    fig, ax = new_plot()
    for attn, run in runs.items():
        evals = [r for r in run['rows'] if 'val/loss' in r]
        ax.plot([r['iter'] for r in evals], [r['val/loss'] for r in evals], label=attn, marker='.')
    ax.set_xlabel('iteration')
    ax.set_ylabel('val loss')
    ax.set_ylim(top=min(3.0, ax.get_ylim()[1]))
    ax.set_title('tiny Shakespeare (char), CPU preset: 4 layers, 4 heads, 128 wide, block 64')
    save_plot(fig, ax, path)


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
    text = "\n".join(lines) + "\n"
    if recovered:
        text += ("\nShare of the gap to MHA opened by mean-pooling that 5% uptraining closes: " +
                 ", ".join(recovered) + ".\n")
    return text + f"\nUptraining: peak learning rate {lr:g}, warmup a tenth of the run, cosine to {lr / 10:g}.\n"


def plot_convert(runs, max_iters, uptrain, path):
    fig, ax = new_plot()
    xs = [100 * n / max_iters for n in uptrain]
    ax.axhline(runs['mha']['val']['val/loss'], color='black', ls='--', label=f'MHA, {max_iters} iters')
    for attn, color in (('gqa', 'tab:blue'), ('mqa', 'tab:orange')):
        ax.plot(xs, [runs[attn, n]['val']['val/loss'] for n in uptrain], color=color,
                marker='o', label=f'{attn.upper()} mean-pooled from MHA, then uptrained')
        ax.axhline(runs[attn, 'scratch']['val']['val/loss'], color=color, ls=':',
                   label=f'{attn.upper()} from scratch, {max_iters} iters')
    ax.set_xlabel("uptraining iterations, % of MHA's training")
    ax.set_ylabel('val loss')
    ax.set_title('MHA -> GQA / MQA: K/V heads mean-pooled, then uptrained (CPU preset)')
    save_plot(fig, ax, path, fontsize=8)


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


def memory_table(layouts, sizes, contexts, device, dtype):
    """Bytes per token and at several context lengths: the formula next to a real cache's nbytes."""
    rows = ["| layout | T | formula bytes | measured `cache.nbytes` | bytes / token | measured / formula |",
            "|---|---|---|---|---|---|"]
    for attn in layouts:
        cfg = GPTConfig(attn=attn, **{**sizes, 'block_size': max(contexts)})
        model = GPT(cfg).to(device=device, dtype=dtype).eval()
        cache = model.init_cache(1)
        with torch.no_grad():
            for T in contexts:
                model(torch.randint(0, cfg.vocab_size, (1, T - len(cache)), device=device), cache=cache)
                f = cfg.cache_bytes(T, dtype)
                rows.append(f"| {attn} | {T} | {f:,} | {cache.nbytes:,} | {cache.nbytes / T:,.1f} | "
                            f"{cache.nbytes / f:.3f} |")
    return "\n".join(rows) + "\n"


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


def build(cfg, device, dtype, compile=False):
    """A random-init model for inference. Compiled with fullgraph=True (a graph break raises) and no
    silent fallback to eager at the recompile limit, so a figure labelled 'compiled' is one."""
    model = GPT(cfg).to(device=device, dtype=dtype).eval()
    if compile:
        torch._dynamo.reset()  # each model gets the whole recompile budget:
        torch._dynamo.config.recompile_limit = 32  # batch sizes, prefill, decode, windows specialize, then go dynamic
        torch._dynamo.config.fail_on_recompile_limit_hit = True
        model.compile(fullgraph=True)
    return model


@torch.inference_mode()
def decode_costs(layouts, sizes, contexts, device, dtype, compile=False, rounds=15):
    """ms per generated token at each context length t: one cached decode step against t cached tokens,
    and the uncached alternative, one forward over the t + 1 token window. The contexts take turns
    (one step each per round), so a slow moment of the machine hits them all alike."""
    out = {}
    for attn in layouts:
        progress(f"decode cost vs context: {attn}")
        cfg = GPTConfig(attn=attn, **{**sizes, 'block_size': max(contexts) + rounds + 1})
        model = build(cfg, device, dtype, compile)
        idx = torch.randint(0, cfg.vocab_size, (1, cfg.block_size), device=device)
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


@torch.inference_mode()
def roofline(layouts, sizes, batch, t, device, dtype, compile=True, rounds=15, chunk=512):
    """One cached decode step per layout at batch `batch` and context t, eager and (compile=True) compiled with
    torch.compile(fullgraph=True), next to its two floors: the bytes it must read (every weight once, and the
    filled cache) / bandwidth, and its FLOPs / matmul rate. The machine measurements and the steps take turns,
    one each per round, so a slow moment of the machine hits them all alike."""
    runs = {}
    for attn in layouts:
        progress(f"roofline: {attn}")
        model = build(GPTConfig(attn=attn, **{**sizes, 'block_size': t + 1}), device, dtype)
        idx = torch.randint(0, model.config.vocab_size, (batch, t + 1), device=device)
        cache = model.init_cache(batch)
        for i in range(0, t, chunk):  # prefill in chunks: bounded memory for the materialized attention
            model(idx[:, i:min(i + chunk, t)], cache=cache)

        def step(model=model, cache=cache, idx=idx):  # the token at position t, again and again
            cache.pos = t
            return model(idx[:, t:], cache=cache)[0]
        step()  # warm-up; from now on the cache holds the t + 1 keys each step attends to
        steps = {'eager': step}
        if compile:
            torch._dynamo.reset()
            steps['compiled'] = torch.compile(step, fullgraph=True)  # one graph, or an error: never silently eager
            steps['compiled']()  # compiles
        # the step's two big parts alone: attention over every layer's filled cache, every weight times a batch
        if attn != 'linear':
            kvs = [[buf[:, :, :t + 1] for buf in layer.bufs] for layer in cache.layers]  # MLA: one buffer, K = V
            q = torch.randn(batch, model.config.n_head, 1, kvs[0][0].size(-1), device=device, dtype=dtype)
            steps['attention alone'] = lambda kvs=kvs, q=q: [attend(q, kv[0], kv[-1]) for kv in kvs]
        linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
        xs = [torch.randn(batch, m.in_features, device=device, dtype=dtype) for m in linears]
        steps['weights alone'] = lambda linears=linears, xs=xs: [m(x) for m, x in zip(linears, xs)]
        weights = sum(p.nbytes for p in model.parameters())
        runs[attn] = dict(steps=steps, bytes=weights + cache.nbytes, part_bytes={
            'attention alone': cache.nbytes, 'weights alone': weights}, flops=step_flops(step), times={k: [] for k in steps})
    bandwidths, rates = [], []
    for _ in range(rounds):
        bandwidth, rate = machine_floors(device, dtype)
        bandwidths.append(bandwidth)
        rates.append(rate)
        for run in runs.values():
            for kind, step in run['steps'].items():
                run['times'][kind].append(timed(step, device, reps=1, warmup=False))
    bandwidth, rate = statistics.median(bandwidths), statistics.median(rates)
    for run in runs.values():
        run['ms'] = {kind: statistics.median(times) * 1000 for kind, times in run['times'].items()}
        run['floors'] = {'bytes': run['bytes'] / bandwidth * 1000, 'FLOPs': run['flops'] / rate * 1000}
    return runs, bandwidth, rate


def roofline_table(runs, bandwidth, rate, batch, t):
    kinds = [k for k in next(iter(runs.values()))['ms'] if k in ('eager', 'compiled')]
    rows = [f"Cached decode step, batch {batch}, context t={t} (the step attends to t + 1 keys); floors measured in the same run: bandwidth "
            f"**{bandwidth / 1e9:.1f} GB/s** (a large tensor copy, read + write bytes), matmul rate "
            f"**{rate / 1e9:,.0f} GFLOP/s** (one large square product); medians of {len(runs[next(iter(runs))]['times'][kinds[0]])} "
            "interleaved rounds.\n",
            "| layout | bytes read: weights + cache | GFLOP | bytes floor ms | FLOP floor ms | binds | " +
            " | ".join(f"{k} ms | {k} % of floor" for k in kinds) + " |", "|---|---|---|---|---|---|" + "---|---|" * len(kinds)]
    for attn, run in runs.items():
        binds = max(run['floors'], key=run['floors'].get)
        rows.append(f"| {attn} | {run['bytes'] / 1e6:,.3g} MB | {run['flops'] / 1e9:.3g} | {run['floors']['bytes']:.3g} | "
                    f"{run['floors']['FLOPs']:.3g} | {binds} | " +
                    " | ".join(f"{run['ms'][k]:.3g} | **{100 * run['floors'][binds] / run['ms'][k]:.0f}%**" for k in kinds) + " |")
    rows += ["\nWhere the eager step goes: its two big parts timed alone in the same rounds (attention over every "
             "layer's filled cache; every weight matrix times a batch of vectors), the bytes each reads over its time, "
             "and what is left of the step (the other operators and their dispatch):\n",
             "| layout | attention alone ms | its read rate | weight products alone ms | their read rate | "
             "rest of the eager step ms |", "|---|---|---|---|---|---|"]
    for attn, run in runs.items():
        cells = [f"{run['ms'][k]:.3g} | {run['part_bytes'][k] / run['ms'][k] / 1e6:.1f} GB/s" if k in run['ms'] else "— | —"
                 for k in ('attention alone', 'weights alone')]
        rest = run['ms']['eager'] - run['ms'].get('attention alone', 0) - run['ms']['weights alone']
        rows.append(f"| {attn} | {cells[0]} | {cells[1]} | {rest:.3g} |")
    return "\n".join(rows) + "\n"


def plot_roofline(runs, bandwidth, path):
    fig, ax = new_plot()
    mb = [run['bytes'] / 1e6 for run in runs.values()]
    xs = [min(mb) / 1.5, max(mb) * 1.5]
    ax.plot(xs, [x * 1e6 / bandwidth * 1000 for x in xs], color='black', ls='--',
            label=f'bytes floor: bytes / {bandwidth / 1e9:.1f} GB/s')
    for i, (attn, run) in enumerate(runs.items()):
        x = run['bytes'] / 1e6
        ax.plot(x, run['ms']['eager'], 'o', color=f'C{i}', label=f'{attn}, eager step')
        ax.annotate(attn, (x, run['ms']['eager']), textcoords='offset points', xytext=(6, 4), fontsize=8)
        if 'compiled' in run['ms']:
            ax.plot(x, run['ms']['compiled'], 's', color=f'C{i}', fillstyle='none')
        ax.plot(x, run['floors']['FLOPs'], '_', ms=16, mew=2, color=f'C{i}')
    ax.plot([], [], 's', color='gray', fillstyle='none', label='compiled step (same colour)')
    ax.plot([], [], '_', ms=16, mew=2, color='gray', label='FLOP floor: FLOPs / matmul rate')
    ax.set_xscale('log')
    ax.set_yscale('log')
    ax.set_xlabel('bytes one decode step must read: weights + cache (MB)')
    ax.set_ylabel('ms per decode step')
    ax.set_title('decode step vs bytes read, with the floors')
    save_plot(fig, ax, path, fontsize=7, loc='upper left', bbox_to_anchor=(1.01, 1))  # outside: no point hidden


@torch.inference_mode()
def generation_speedup(layouts, sizes, device, dtype, compile=False, prompt=16, new=240, batches=(1, 8)):
    """Greedy generation, `new` tokens after a 16-token prompt at block 256, with and without the
    cache; each way run twice, taking turns, the faster run counted."""
    rows = ["| layout | batch | tokens/s with cache | tokens/s without | speedup | identical greedy tokens |",
            "|---|---|---|---|---|---|"]
    for attn in layouts:
        progress(f"generation: {attn}")
        cfg = GPTConfig(attn=attn, **{**sizes, 'block_size': 256})
        model = build(cfg, device, dtype, compile)
        for batch in batches:
            idx = torch.randint(0, cfg.vocab_size, (batch, prompt), device=device)
            out, secs = {}, {True: [], False: []}
            for use_cache in (True, False, True, False):
                model.generate(idx, 4, temperature=0, use_cache=use_cache)  # warm-up
                sync(device)
                t0 = time.perf_counter()
                out[use_cache] = model.generate(idx, new, temperature=0, use_cache=use_cache)
                sync(device)
                secs[use_cache].append(time.perf_counter() - t0)
            cached, plain = min(secs[True]), min(secs[False])
            rows.append(f"| {attn} | {batch} | {batch * new / cached:,.1f} | {batch * new / plain:,.1f} | "
                        f"{plain / cached:.1f}x | {'yes' if torch.equal(out[True], out[False]) else 'NO'} |")
    return "\n".join(rows) + "\n"


def mla_explicit_decode(attn, x, rope, pos, cache):
    """MLA decode without absorption, for comparison only: the same cache, but K and V re-materialized
    from every cached latent at every step (what the absorbed path avoids)."""
    B, L, _ = x.size()
    H, dh, dR, dc = attn.n_head, attn.dh, attn.dR, attn.dc
    q = attn.c_q(x).view(B, L, H, dh + dR).transpose(1, 2)
    q = torch.cat([q[..., :dh], apply_rope(q[..., dh:], rope)], dim=-1)
    c, k_rope = attn.kv_down(x).unsqueeze(1).split([dc, dR], dim=-1)
    latent, _ = cache.update(pos, torch.cat([attn.kv_norm(c), apply_rope(k_rope, rope)], dim=-1))
    S = latent.size(2)
    k = torch.cat([attn.k_up(latent[..., :dc]).view(B, S, H, dh).transpose(1, 2),
                   latent[..., dc:].expand(B, H, S, dR)], dim=-1)
    v = attn.v_up(latent[..., :dc]).view(B, S, H, dh).transpose(1, 2)
    y = attend(q, k, v, attn.scale)
    return attn.c_proj(y.transpose(1, 2).reshape(B, L, H * dh))


@torch.no_grad()
def mla_absorbed_vs_explicit(sizes, device, dtype, t=1024, steps=20):
    """One MLA layer's decode step at context t, absorbed (the model's) vs explicit; same outputs."""
    cfg = GPTConfig(attn='mla', **{**sizes, 'block_size': t + 2 * steps + 2})
    model = GPT(cfg).to(device=device, dtype=dtype).eval()
    attn = model.transformer.h[0].attn
    x = torch.randn(1, t + steps, cfg.n_embd, device=device, dtype=dtype)
    res = {}
    for name, step in (('absorbed', attn.forward), ('explicit', lambda *a: mla_explicit_decode(attn, *a))):
        cache = attn.init_cache(1, cfg.block_size, dtype, device)
        attn(x[:, :t], model.rope(torch.arange(t, device=device)), 0, cache)
        outs, times = [], []
        for i in range(steps):
            sync(device)
            t0 = time.perf_counter()
            outs.append(step(x[:, t + i:t + i + 1], model.rope(torch.arange(t + i, t + i + 1, device=device)), t + i, cache))
            sync(device)
            times.append(time.perf_counter() - t0)
        res[name] = (statistics.median(times[1:]) * 1000, torch.cat(outs, 1))
    err = (res['absorbed'][1] - res['explicit'][1]).abs().max().item()
    return res['absorbed'][0], res['explicit'][0], err


def train_step_times(layouts, sizes, device, dtype, Ts=(256, 1024), batch=4):
    """Prefill (no-grad forward into a cache, batch 1) and training step (forward + backward, batch 4)."""
    rows = ["| layout | T | prefill ms | train fwd+bwd ms |", "|---|---|---|---|"]
    for attn in layouts:
        progress(f"prefill / train step: {attn}")
        for T in Ts:
            cfg = GPTConfig(attn=attn, **{**sizes, 'block_size': T})
            model = GPT(cfg).to(device=device, dtype=dtype)
            idx = torch.randint(0, cfg.vocab_size, (batch, T), device=device)

            def prefill():
                with torch.no_grad():
                    model(idx[:1], cache=model.init_cache(1))

            def step():
                _, loss = model(idx, idx)
                loss.backward()
            rows.append(f"| {attn} | {T} | {timed(prefill, device, 3) * 1000:,.1f} | "
                        f"{timed(step, device, 3) * 1000:,.1f} |")
    return "\n".join(rows) + "\n"


def plot_decode(costs, layouts, contexts, path):
    fig, ax = new_plot()
    for i, attn in enumerate(layouts):
        color = f"C{i}"
        ax.plot(contexts, [costs[attn, t][0] for t in contexts], color=color, marker='o', label=f"{attn}, cached")
        ax.plot(contexts, [costs[attn, t][1] for t in contexts], color=color, ls='--', marker='x',
                label=f"{attn}, no cache")
    ax.set_xscale('log', base=2)
    ax.set_yscale('log')
    ax.set_xlabel('context length t (tokens already seen)')
    ax.set_ylabel('ms per generated token')
    ax.set_title('decode cost vs context, batch 1')
    save_plot(fig, ax, path, fontsize=7, ncol=2)


def decode_report(layouts, sizes, contexts, device, dtype, out, gen_tokens=240, step_T=(256, 1024), compile=False,
                  batch=16, t=2048, roofline_compile=True):
    runs, bandwidth, rate = roofline(layouts, sizes, batch, t, device, dtype, roofline_compile)
    plot_roofline(runs, bandwidth, os.path.join(out, 'roofline.png'))
    costs = decode_costs(layouts, sizes, contexts, device, dtype, compile)
    plot_decode(costs, layouts, contexts, os.path.join(out, 'decode.png'))
    head = "| layout | " + " | ".join(f"t={t} cached / no cache" for t in contexts) + " |"
    rows = [head, "|---|" + "---|" * len(contexts)]
    for attn in layouts:
        rows.append(f"| {attn} | " + " | ".join(f"{costs[attn, t][0]:.2f} / {costs[attn, t][1]:.1f}"
                                              for t in contexts) + " |")
    mla = GPTConfig(attn='mla', **sizes)
    text = (f"Machine: {machine()}. Model: {sizes['n_layer']} layers, {sizes['n_head']} heads, "
            f"n_embd {sizes['n_embd']}, MLA d_c {mla.kv_lora_rank} d_R {mla.rope_head_dim}, random init, "
            f"{str(dtype).replace('torch.', '')}, device {device}"
            f"{'; (c) and the generation table with torch.compile(fullgraph=True), the rest eager' if compile else ', eager'}.\n\n"
            "**(a) Roofline of one decode step**\n\n" + roofline_table(runs, bandwidth, rate, batch, t) +
            f"\n![decode step vs bytes read]({os.path.join(out, 'roofline.png')})\n"
            "\n**(b) Cache memory, formula vs measured** (one sequence):\n\n" +
            memory_table(layouts, sizes, [c for c in contexts if c <= 1024] or contexts[:1], device, dtype) +
            "\n**The 7B table**, from `GPTConfig.cache_bytes` (nothing allocated):\n\n" + seven_b_table() +
            "\n**(c) Decode cost vs context**, batch 1, ms per generated token (cached / without cache):\n\n" +
            "\n".join(rows) + "\n")
    lo = min(contexts, key=lambda c: abs(c - 128))
    if 'linear' in layouts and lo < max(contexts):
        ratio = costs['linear', max(contexts)][0] / costs['linear', lo][0]
        text += f"\nLinear attention, cached ms/token at t={max(contexts)} / at t={lo}: **{ratio:.2f}**\n"
    if 'mla' in layouts:
        absorbed, explicit, err = mla_absorbed_vs_explicit(sizes, device, dtype)
        text += (f"\nOne MLA layer, decode step at t=1024: absorbed **{absorbed:.3f} ms**, explicit (K, V "
                 f"re-materialized from the latents) {explicit:.3f} ms, explicit / absorbed = "
                 f"**{explicit / absorbed:.2f}**; outputs agree to {err:.1e}.\n")
    text += (f"\n**Generation, {gen_tokens} new tokens after a 16-token prompt, block 256, greedy** (the best "
             "of two runs each way):\n\n" +
             generation_speedup(layouts, sizes, device, dtype, compile, new=gen_tokens) +
             "\n**(d) Prefill and training step** (prefill: batch 1 into a cache; training: batch 4):\n\n" +
             train_step_times(layouts, sizes, device, dtype, step_T) +
             f"\n![decode cost vs context]({os.path.join(out, 'decode.png')})\n")
    return text


def replace_readme_section(text, name, body):
    start, end = f"<!-- {name} -->", f"<!-- /{name} -->"
    pattern = re.compile(re.escape(start) + ".*?" + re.escape(end), re.S)
    if not pattern.search(text):
        raise SystemExit(f"error: README.md has no '{start}' ... '{end}' section to rewrite")
    return pattern.sub(lambda _: f"{start}\n{body}{end}", text)


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not argparse's usage block
        self.exit(2, f"error: {message} (see: python {self.prog} --help)\n")


def main(argv=None):
    memory_errors_in_one_line()  # e.g. --t too large for this machine
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest='mode', required=True)
    modes = {'cache': 'cache elements/bytes per token at the default config, formula vs measured',
             'train': 'train the CPU preset for each layout: losses, ms/iter, val-loss plot',
             'decode': 'decode roofline, cache memory, decode cost vs context, generation speedup, prefill/train step',
             'convert': 'MHA -> GQA/MQA by mean-pooling, with and without uptraining, vs from scratch'}
    parsers = {m: sub.add_parser(m, help=h) for m, h in modes.items()}
    for m, q in parsers.items():
        if m != 'convert':
            q.add_argument('--layouts', default=','.join(ATTN_LAYOUTS), help='comma-separated subset of the layouts')
        q.add_argument('--readme', action='store_true', help='rewrite this table in README.md')
        if m != 'cache':
            q.add_argument('--out', default='results', help='folder for runs, tables and plots (default: results)')
    t = parsers['train']
    t.add_argument('--max_iters', type=int, help='default: 2000 on cpu (the CPU preset), 5000 on cuda (baby GPT)')
    t.add_argument('--device', default='cpu', help='cpu: the CPU preset; cuda[:N]: the full baby-GPT recipe')
    t.add_argument('--nanogpt', help="path to nanoGPT's model.py: also time its training step next to ours")
    t.add_argument('extra', nargs='*', help='more --key=value for train.py (after --)')
    c = parsers['convert']
    c.add_argument('--max_iters', type=int, default=2000, help="MHA's (and the from-scratch models') iterations")
    c.add_argument('--fractions', default='0,0.01,0.025,0.05,0.1', help='uptraining, fractions of max_iters')
    c.add_argument('--lr', type=float, default=1e-3, help='peak learning rate of uptraining')
    c.add_argument('extra', nargs='*', help='more --key=value for train.py (after --)')
    d = parsers['decode']
    d.add_argument('--n_layer', type=int, default=6)
    d.add_argument('--n_head', type=int, default=6)
    d.add_argument('--n_embd', type=int, default=384)
    d.add_argument('--contexts', default='64,128,256,512,1024,2048', help='comma-separated context lengths')
    d.add_argument('--device', default='cpu')
    d.add_argument('--dtype', default='float32', choices=['float32', 'bfloat16', 'float16'])
    d.add_argument('--gen_tokens', type=int, default=240, help='new tokens in the generation speedup run')
    d.add_argument('--step_T', default='256,1024', help='sequence lengths of the prefill / training-step table')
    d.add_argument('--compile', action='store_true', help='torch.compile the models of (c) and the generation table')
    d.add_argument('--batch', type=int, default=16, help='batch of the roofline table')
    d.add_argument('--t', type=int, default=2048, help='context of the roofline table')
    d.add_argument('--eager_only', action='store_true', help='no compiled column in the roofline (needs no compiler)')
    args = p.parse_args(argv)
    fail = parsers[args.mode].error  # says: see python bench.py MODE --help
    layouts = args.layouts.split(',') if args.mode != 'convert' else []
    unknown = [x for x in layouts if x not in ATTN_LAYOUTS]
    if unknown:
        fail(f"unknown layout(s) {unknown}; choose from {', '.join(ATTN_LAYOUTS)}")
    if args.mode != 'cache' and os.path.exists(args.out) and not os.path.isdir(args.out):
        fail(f"--out {args.out!r}: File exists; give a folder to write the results in")

    def make_out():  # after every argument is checked
        try:
            os.makedirs(args.out, exist_ok=True)
        except OSError as e:
            fail(f"--out {args.out!r}: {e.strerror}; give a folder to write the results in")
        if not os.access(args.out, os.W_OK):
            fail(f"--out {args.out!r} is not writable")
    if args.mode == 'cache':
        body = cache_table(layouts)
    elif args.mode == 'train':
        args.max_iters = (2000 if args.device == 'cpu' else 5000) if args.max_iters is None else args.max_iters
        if args.max_iters < 1:
            fail(f"--max_iters={args.max_iters} must be >= 1")
        if not re.fullmatch(r'cpu|cuda(:\d+)?', args.device) or (args.device != 'cpu' and not torch.cuda.is_available()):
            fail(f"--device {args.device!r}: give cpu, or cuda[:N] where CUDA is available")
        if args.nanogpt and not os.path.isfile(args.nanogpt):
            fail(f"--nanogpt {args.nanogpt!r}: no such file")
        make_out()
        every = 100 if args.device == 'cpu' else 250
        runs = train_runs(layouts, args.out, args.max_iters, args.extra, args.device, every)
        plot_curves(runs, os.path.join(args.out, 'train_val_loss.png'))
        recipe = 'config/<layout>.py + config/cpu.py' if args.device == 'cpu' else 'config/<layout>.py (baby GPT, bf16)'
        body = (f"`python bench.py train --max_iters={args.max_iters} --device={args.device}` on {machine()}: {recipe}, "
                f"seed 1337, the same batches for every layout, evaluated every {every} iterations; losses at the last "
                f"one; cache bytes/token at block_size in the run's dtype.\n\n" + train_table(runs, every))
        if args.nanogpt:
            ms = step_time_vs_nanogpt(args.nanogpt)
            ref = ms['nanoGPT']
            body += ("\nTraining-step time on the same recipe, models taking turns in one process "
                     "(median of 6 rounds x 20 steps):\n\n| model | ms/step | vs nanoGPT |\n|---|---|---|\n" +
                     "".join(f"| {k} | {v:.2f} | {v / ref:.3f} |\n" for k, v in ms.items()))
        body += f"\n![val loss curves]({os.path.join(args.out, 'train_val_loss.png')})\n"
    elif args.mode == 'convert':
        try:
            fractions = sorted(float(f) for f in args.fractions.split(','))
        except ValueError:
            fail(f"--fractions {args.fractions!r}: give comma-separated numbers")
        if args.max_iters < 1 or not all(0 <= f <= 1 for f in fractions) or not 0 < args.lr < math.inf:
            fail("--max_iters must be >= 1, --fractions in [0, 1] and --lr a number > 0")
        uptrain = sorted({round(f * args.max_iters) for f in fractions})
        make_out()
        runs = convert_runs(args.out, args.max_iters, uptrain, args.lr, args.extra)
        plot_convert(runs, args.max_iters, uptrain, os.path.join(args.out, 'convert.png'))
        command = ' '.join(['python bench.py convert', f'--max_iters={args.max_iters}', f'--lr={args.lr:g}',
                            *(['--', *args.extra] if args.extra else [])])
        body = (f"`{command}` on {machine()}: config/cpu.py (4 layers, 4 heads, 128 wide, block 64), seed "
                f"1337, val loss = mean of the same 200 val batches.\n\n" +
                convert_table(runs, args.max_iters, uptrain, args.lr) + f"\n![conversion]({os.path.join(args.out, 'convert.png')})\n")
    else:
        try:
            contexts = sorted(int(c) for c in args.contexts.split(','))
        except ValueError:
            fail(f"--contexts {args.contexts!r}: give comma-separated integers")
        if contexts[0] < 1:
            fail("--contexts must be >= 1")
        if not re.fullmatch(r'cpu|cuda(:\d+)?', args.device):
            fail(f"--device {args.device!r}: give cpu, cuda or cuda:N")
        if args.device.startswith('cuda') and not torch.cuda.is_available():
            fail(f"--device {args.device}: CUDA is not available here")
        for name in ('n_layer', 'n_head', 'n_embd'):
            if getattr(args, name) < 1:
                fail(f"--{name} must be >= 1")
        sizes = dict(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)  # MLA: d_c, d_R at the paper's ratios
        try:
            for attn in layouts:
                GPTConfig(attn=attn, **sizes)
        except ValueError as e:
            fail(str(e))
        torch.manual_seed(0)
        for name in ('batch', 't', 'gen_tokens'):
            if getattr(args, name) < 1:
                fail(f"--{name}={getattr(args, name)} must be >= 1")
        try:
            step_T = tuple(int(t) for t in args.step_T.split(','))
        except ValueError:
            fail(f"--step_T {args.step_T!r}: give comma-separated integers")
        if min(step_T) < 1:
            fail("--step_T must be >= 1")
        make_out()
        body = decode_report(layouts, sizes, contexts, args.device, getattr(torch, args.dtype), args.out,
                             args.gen_tokens, step_T, args.compile, args.batch, args.t, not args.eager_only)
    if args.mode != 'cache':
        with open(os.path.join(args.out, f'{args.mode}.md'), 'w') as f:
            f.write(body)
    print(body)
    if args.readme:
        with open('README.md') as f:
            text = f.read()
        with open('README.md', 'w') as f:
            f.write(replace_readme_section(text, f'{args.mode}-table', body))


if __name__ == '__main__':
    with without_profiler_lines():
        main()
