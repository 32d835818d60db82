"""
Benchmarks that print numbers measured side by side in one run (never timed tests).

    python bench.py cache                 # cache elements / bytes per token, formula vs measured
    python bench.py cache --readme        # ... and rewrite the table in README.md
    python bench.py train                 # the CPU preset for every layout: losses, speed, curves
    python bench.py train --nanogpt PATH  # ... plus training-step time next to nanoGPT's model.py at PATH
"""
import argparse
import importlib.util
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time

import torch

from model import GPT, GPTConfig, ATTN_LAYOUTS


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
        elem = cache.layers[0].S.element_size() if attn == 'linear' else next(model.parameters()).element_size()
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


def train_runs(layouts, out, max_iters, extra=()):
    """Run train.py on the CPU preset for each layout (same seed, same batches); return its metrics."""
    runs = {}
    for attn in layouts:
        run_dir = os.path.join(out, 'train', attn)
        shutil.rmtree(run_dir, ignore_errors=True)
        cmd = [sys.executable, 'train.py', f'config/{attn}.py', 'config/cpu.py', f'--out_dir={run_dir}',
               f'--max_iters={max_iters}', f'--lr_decay_iters={max_iters}', '--eval_interval=100',
               '--log_interval=10', '--wandb_log=False', *extra]
        print(' '.join(cmd), file=sys.stderr)
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(f"error: train.py failed for {attn}: {r.stderr.strip().splitlines()[-1:]}")
        with open(os.path.join(run_dir, 'metrics.jsonl')) as f:
            rows = [json.loads(line) for line in f]
        params = re.search(r"([\d.]+)M parameters", r.stdout).group(1)
        runs[attn] = dict(rows=rows, params=params)
    return runs


def train_table(runs):
    lines = ["| layout | params | cache bytes/token (fp32, T=64) | train loss | val loss | best val | "
             "median ms/iter | tokens/s |", "|---|---|---|---|---|---|---|---|"]
    for attn, run in runs.items():
        evals = [r for r in run['rows'] if 'val/loss' in r]
        steps = [r['ms_per_iter'] for r in run['rows'] if 'ms_per_iter' in r and r['iter'] > 0]
        ms = statistics.median(steps)
        lines.append(f"| {attn} | {run['params']}M | {evals[-1]['cache_bytes_per_token']:,.0f} | "
                     f"{evals[-1]['train/loss']:.4f} | {evals[-1]['val/loss']:.4f} | "
                     f"{min(r['val/loss'] for r in evals):.4f} | {ms:.1f} | {12 * 64 / ms * 1000:,.0f} |")
    return "\n".join(lines) + "\n"


def plot_curves(runs, path):
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for attn, run in runs.items():
        evals = [r for r in run['rows'] if 'val/loss' in r]
        ax.plot([r['iter'] for r in evals], [r['val/loss'] for r in evals], label=attn, marker='.')
    ax.set_xlabel('iteration')
    ax.set_ylabel('val loss')
    ax.set_ylim(top=min(3.0, ax.get_ylim()[1]))
    ax.set_title('tiny Shakespeare (char), CPU preset: 4 layers, 4 heads, 128 wide, block 64')
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


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


def replace_readme_section(text, name, body):
    start, end = f"<!-- {name} -->", f"<!-- /{name} -->"
    pattern = re.compile(re.escape(start) + ".*?" + re.escape(end), re.S)
    if not pattern.search(text):
        raise SystemExit(f"error: README.md has no '{start}' ... '{end}' section to rewrite")
    return pattern.sub(lambda _: f"{start}\n{body}{end}", text)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest='mode', required=True)
    c = sub.add_parser('cache', help='cache elements/bytes per token, formula vs measured')
    c.add_argument('--layouts', default=','.join(ATTN_LAYOUTS), help='comma-separated subset of ' + ','.join(ATTN_LAYOUTS))
    c.add_argument('--readme', action='store_true', help='rewrite the cache table in README.md')
    t = sub.add_parser('train', help='train the CPU preset for each layout: losses, ms/iter, val-loss plot')
    t.add_argument('--layouts', default=','.join(ATTN_LAYOUTS))
    t.add_argument('--max_iters', type=int, default=2000)
    t.add_argument('--out', default='results', help='folder for runs, table and plot (default: results)')
    t.add_argument('--nanogpt', help="path to nanoGPT's model.py: also time its training step next to ours")
    t.add_argument('--readme', action='store_true', help='rewrite the training table in README.md')
    t.add_argument('extra', nargs='*', help='more --key=value for train.py (after --)')
    args = p.parse_args(argv)
    layouts = args.layouts.split(',')
    unknown = [x for x in layouts if x not in ATTN_LAYOUTS]
    if unknown:
        p.error(f"unknown layout(s) {unknown}; choose from {', '.join(ATTN_LAYOUTS)}")
    if args.mode == 'cache':
        section, body = 'cache-table', cache_table(layouts)
    else:
        if args.max_iters < 1:
            p.error(f"--max_iters={args.max_iters} must be >= 1")
        if args.nanogpt and not os.path.isfile(args.nanogpt):
            p.error(f"--nanogpt {args.nanogpt!r}: no such file")
        os.makedirs(args.out, exist_ok=True)
        runs = train_runs(layouts, args.out, args.max_iters, args.extra)
        plot_curves(runs, os.path.join(args.out, 'train_val_loss.png'))
        body = (f"`python bench.py train --max_iters={args.max_iters}` on {machine()}: config/<layout>.py + "
                f"config/cpu.py, seed 1337, the same batches for every layout; loss = mean of 20 eval batches "
                f"at the last iteration.\n\n" + train_table(runs))
        if args.nanogpt:
            ms = step_time_vs_nanogpt(args.nanogpt)
            ref = ms['nanoGPT']
            body += ("\nTraining-step time on the same recipe, models taking turns in one process "
                     "(median of 6 rounds x 20 steps):\n\n| model | ms/step | vs nanoGPT |\n|---|---|---|\n" +
                     "".join(f"| {k} | {v:.2f} | {v / ref:.3f} |\n" for k, v in ms.items()))
        section = 'train-table'
        with open(os.path.join(args.out, 'train.md'), 'w') as f:
            f.write(body)
    print(body)
    if args.readme:
        with open('README.md') as f:
            text = f.read()
        with open('README.md', 'w') as f:
            f.write(replace_readme_section(text, section, body))


if __name__ == '__main__':
    main()
