"""
bench.py cache: cache bytes per token, the model's formula next to a real cache.

Per layout, the cache GPTConfig.cache_elements predicts, and a real cache's nbytes after
block_size tokens.
"""
import torch

from benchmarks.common import HYBRID, LAYOUTS, MORE, add_layouts, row, table
from model import GPT, GPTConfig


def add_arguments(p):
    add_layouts(p)


def check(args, error):
    """Nothing to check but the flags: it builds the default models, on a CPU."""


def report(args):
    return cache_report(args.layouts)


@torch.no_grad()
def cache_report(layouts=LAYOUTS):
    """Per layout: the cache GPTConfig.cache_elements predicts, and a real cache's nbytes after T
    tokens."""
    rows, ratios, per_token_fp16, states = [], [], {}, []
    for name in layouts:
        cfg = GPTConfig(attn=LAYOUTS[name])
        T, model = cfg.block_size, GPT(cfg).eval()
        cache = model.init_cache(1)
        model(torch.randint(0, cfg.vocab_size, (1, T)), cache=cache)
        state, formula = cfg.cache_elements(0), cfg.cache_bytes(T)
        per_token = cfg.cache_elements(1) - state
        kv_heads = cfg.n_kv_head if 'n_kv_head' in cfg.used_fields() else '—'
        fp16 = cfg.cache_bytes(1, torch.float16) - cfg.cache_bytes(0, torch.float16)
        rows.append(row(name, kv_heads, f"{per_token:,}", f"{fp16:,}", f"{state:,}", f"{formula:,}",
                        f"{cache.nbytes:,}", f"{cache.nbytes / formula:.3f}"))
        ratios.append(f"{cache.nbytes / formula:.3f}")
        if per_token:  # (a hybrid: and its linear layers' state)
            per_token_fp16[name] = f"{fp16:,}" + " + a fixed state" * bool(state)
        else:  # a linear layout: nothing per token
            states.append(formula)
    mla = GPTConfig(attn='mla')  # the sizes its layers get
    config = (f"Config: {cfg.n_layer} layers, {cfg.n_head} heads, n_embd {cfg.n_embd} "
              f"(head_dim {cfg.head_dim}), block_size {T}, MLA d_c={mla.kv_lora_rank} "
              f"d_R={mla.rope_head_dim}, hybrid {HYBRID!r}")
    header = ['layout', 'K/V heads', 'cache elements / token (all layers)', 'bytes / token at fp16',
              'fixed state elements (all layers)', f'formula bytes at T={T} (fp32)',
              'measured `cache.nbytes`', 'measured / formula']
    # the headline: the measurement against the formula, and what each layout keeps
    low, high = min(ratios), max(ratios)
    headline = (f"A real cache's `nbytes` over the formula: {low}" + f" to {high}" * (low != high)
                + f", over {len(ratios)} layouts.")
    if per_token_fp16:
        headline += " Bytes per token at fp16: " + ", ".join(
            f"{name} {b}" for name, b in per_token_fp16.items()) + "."
    if states:
        headline += (f" The linear layouts keep a fixed state instead: {min(states):,}"
                     + f" to {max(states):,}" * (min(states) != max(states))
                     + " bytes (fp32) at any T.")
    return (f"{config}; cache of 1 sequence after T={T} tokens, float32 (a linear layer's state is "
            f"float32 in every dtype).\n\n{headline}\n{MORE}\n" + table(header, rows))
