"""
Benchmarks that print numbers measured side by side in one run (never timed tests).

    python bench.py cache                 # cache elements / bytes per token, formula vs measured
    python bench.py cache --readme        # ... and rewrite the table in README.md
"""
import argparse
import platform
import re
import sys

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
    args = p.parse_args(argv)
    layouts = args.layouts.split(',')
    unknown = [x for x in layouts if x not in ATTN_LAYOUTS]
    if unknown:
        p.error(f"unknown layout(s) {unknown}; choose from {', '.join(ATTN_LAYOUTS)}")
    table = cache_table(layouts)
    print(table)
    print(f"(torch {torch.__version__}, {platform.machine()}, {platform.python_version()})", file=sys.stderr)
    if args.readme:
        with open('README.md') as f:
            text = f.read()
        with open('README.md', 'w') as f:
            f.write(replace_readme_section(text, 'cache-table', table))


if __name__ == '__main__':
    main()
