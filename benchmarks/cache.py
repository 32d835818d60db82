"""
bench.py cache: cache bytes per token, the model's formula next to a real cache, and real models.

Per layout, the cache GPTConfig.cache_elements predicts, and a real cache's nbytes after
block_size tokens. Then published models (Hugging Face config.json files: models/ holds some) and
a model given by its sizes (default: the founding chapter's 7B-class model): the cache per token and
at each --context for --batch sequences, next to the weights, as published (a windowed layer keeps
its last sliding_window tokens) and re-laid out as each of our layouts. The same formulas as
GPTConfig's (model.py). The families it reads: llama, mistral, qwen2, qwen3, falcon, gpt2,
deepseek_v2, deepseek_v3, qwen3_next, gemma2, gemma3_text, gpt_oss (others: --sizes).

    python bench.py cache --models=path/to/config.json --context=32768 --batch=8
    python bench.py cache --sizes=n_layer=80,n_head=64,n_kv_head=8,head_dim=128,params=70e9
"""
import os

import torch

from benchmarks.common import (HYBRID, LAYOUTS, MORE, ROOT, add_layouts, flag, listed, row,
                               table)
from benchmarks.models import CHAPTER, ModelError, from_sizes, read_config
from configurator import checked
from model import GPT, GPTConfig

DTYPES = {'float32': torch.float32, 'bfloat16': torch.bfloat16, 'float16': torch.float16,
          'float8': torch.float8_e4m3fn}
KiB, GiB = 2 ** 10, 2 ** 30


def add_arguments(p):
    add_layouts(p)
    flag(p, 'models', os.path.relpath(os.path.join(ROOT, 'models')), str,
         "published config.json files (or folders of them), comma-separated")
    flag(p, 'sizes', CHAPTER, str, "a softmax model by its sizes: n_layer, n_head, head_dim "
         "[, n_kv_head, params]")
    # bounds far past any model's, below what a float's GiB can hold
    flag(p, 'context', '8192,131072', listed(int, lambda v: 1 <= v[0] and v[-1] <= 2 ** 50,
                                             "give integers from 1 to 2^50"),
         'tokens in the cache, comma-separated: a column each')
    flag(p, 'batch', 1, checked(int, lambda v: 1 <= v <= 2 ** 30, "give an integer from 1 to 2^30"),
         'sequences')
    dtype = checked(DTYPES.get, bool, f"choose from {', '.join(DTYPES)}")
    flag(p, 'dtype', 'bfloat16', dtype, f"{', '.join(DTYPES)}: the type of the cached keys and "
         "values, and of the weights (a linear layer's state: float32 at least)")


def check(args, error):
    """Every config read before any work: one line for the first one we cannot read."""
    paths = []
    try:  # a model's folder: its config.json; another folder: its .json files
        for path in args.models.split(',') if args.models else []:
            if os.path.isfile(os.path.join(path, 'config.json')):
                path = os.path.join(path, 'config.json')
            if os.path.isdir(path):
                found = sorted(f for f in os.listdir(path) if f.endswith('.json'))
                if not found:
                    raise ModelError(f"--models={path}: a folder without a config.json or .json "
                                     "files")
                paths += [os.path.join(path, f) for f in found]
            else:
                paths.append(path)
        sized = [from_sizes(args.sizes)] if args.sizes else []
        args.published = sized + [read_config(p) for p in paths]
    except ModelError as e:
        error(str(e))
    except OSError as e:
        error(f"--models: cannot list {e.filename}: {e.strerror}")


def report(args):
    text = cache_report(args.layouts)
    head, more = text.split(MORE)
    models = [m for m in args.published if m.source]
    if models:
        head += "\n" + models_line(models, args) + "\n"
    return head + MORE + more + "".join(model_section(m, args) for m in args.published)


@torch.no_grad()
def cache_report(layouts=LAYOUTS):
    """Per layout: the cache GPTConfig.cache_elements predicts, and a real cache's nbytes after T
    tokens."""
    rows, ratios, per_token_fp16, states = [], [], {}, []
    for name in layouts:
        cfg = GPTConfig(**LAYOUTS[name])
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
            window = max(cfg.windows)  # (its windowed layers stop there)
            stops = f" (its windowed layers: {window} tokens at most)" * bool(window)
            per_token_fp16[name] = f"{fp16:,}" + " + a fixed state" * bool(state) + stops
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


# --- real models ----------------------------------------------------------------------------------

def relaid(m):
    """Our layouts at a published model's sizes: {name: GPTConfig or None where it cannot be}."""
    shape = dict(n_layer=m.n_layer, n_head=m.n_head, n_embd=m.n_head * m.head_dim, block_size=1)
    gqa = m.n_head // 4  # groups of 4 query heads: the chapter's 8 of 32
    layouts = {'mha': {}, f'gqa, {gqa} K/V heads': dict(n_kv_head=gqa), 'mqa': {}, 'mla': {},
               'gated_deltanet': {}, 'hybrid': dict(n_kv_head=gqa)}
    cfgs = {}
    for name, extra in layouts.items():
        try:
            cfgs[name] = GPTConfig(**LAYOUTS[name.split(',')[0]], **shape, **extra)
        except ValueError:  # (71 heads have no groups of 4)
            cfgs[name] = None
    return cfgs


def kib(n):
    return f"{n / KiB:,.2f}".rstrip('0').rstrip('.')


def keeps(cfg):
    """What each layer of a re-laid-out model keeps, said as the published ones are."""
    d, H = cfg.head_dim, cfg.n_head
    said = {'mla': f"MLA, d_c {cfg.kv_lora_rank} + d_R {cfg.rope_head_dim}",
            'gated_deltanet': f"Gated DeltaNet, {H} heads of {d} x {d}"}
    return ' + '.join(f"{n} x " + said.get(a, f"softmax, {cfg.n_kv_head} K/V heads of {d}")
                      for a, n in cfg.layer_counts().items())


def model_rows(m, args):
    """(layout, what it keeps, bytes per token (the first's: a window caps the sum, not the
    rate), [bytes at each --context x --batch]) as published, then re-laid out."""
    B, size = args.batch, args.dtype.itemsize
    first = m.cache_bytes(1, size) - m.cache_bytes(0, size)
    name = 'as published' if m.source else 'as given'
    rows = [(name, m.layout(), first, [m.cache_bytes(T, size) * B for T in args.context])]
    for name, cfg in relaid(m).items():
        if cfg is None:
            why = f"{m.n_head} query heads have no groups of 4"
            rows.append((name.split(',')[0], why, None, None))
            continue
        first = cfg.cache_bytes(1, args.dtype) - cfg.cache_bytes(0, args.dtype)
        totals = [cfg.cache_bytes(T, args.dtype) * B for T in args.context]
        rows.append((name, keeps(cfg), first, totals))
    return rows


def model_section(m, args):
    weights = m.params * args.dtype.itemsize
    at = lambda T: f'GiB at {T:,} tokens' + f' x {args.batch}' * (args.batch > 1)
    longest = f' at {args.context[-1]:,}' * (len(args.context) > 1)
    header = ['layout', 'what each layer keeps', 'KiB / token', *map(at, args.context),
              f'cache / weights{longest}' * bool(weights)]
    lines, reach = [], lambda T: not m.context or T <= m.context  # (past it: not a model's cache)
    for name, what, per_tok, totals in model_rows(m, args):
        totals = [t if totals and reach(T) else None
                  for T, t in zip(args.context, totals or [None] * len(args.context))]
        gib = [f"{t / GiB:,.2f}" if t is not None else '—' for t in totals]
        ratio = [f"{totals[-1] / weights:.2f}" if totals[-1] else '—'] if weights else []
        lines.append(row(name, what, '—' if per_tok is None else kib(per_tok), *gib, *ratio))
    count = f"{m.params / 1e9:,.1f}B" if m.params >= 1e9 else f"{m.params / 1e6:,.1f}M"
    about = (f"{count} parameters, {weights / GiB:,.1f} GiB of weights at "
             f"{args.dtype.itemsize * 8} bits; " if weights else '')
    notes = ''.join(f"; {n}" for n in m.notes)
    if not all(map(reach, args.context)):
        notes += f"; — past its max_position_embeddings, {m.context:,} tokens"
    if m.windowed:
        notes += "; its windowed layers stop adding KiB / token once their windows are full"
    return (f"\n**{m.name}**: {about}{m.n_layer} layers, {m.n_head} query heads of {m.head_dim}; "
            f"caches at {args.dtype.itemsize * 8} bits{notes}.\n\n"
            + table([h for h in header if h], lines))


def models_line(models, args):
    """The README's line: what each published model keeps per token, and what its windows keep at
    its longest context (the longest --context, or its max_position_embeddings if shorter)."""
    state = lambda m: ' + a fixed state' * any(state for _, _, _, state, _ in m.groups)
    said = [f"{m.name} {kib(model_rows(m, args)[0][2])}{state(m)}" for m in models]
    line = (f"The configs in {args.models}, as published, KiB per token at "
            f"{args.dtype.itemsize * 8} bits: {', '.join(said)}; each next to its weights and "
            "re-laid out as our layouts in the whole report.")
    size, windowed = args.dtype.itemsize, [m for m in models if m.windowed]
    longest = lambda m: min(args.context[-1], m.context or args.context[-1])
    gib = lambda m, windows=True: m.cache_bytes(longest(m), size, windows) * args.batch / GiB
    said = [f"{m.name} {gib(m):,.2f} GiB at {longest(m):,} ({gib(m, False):,.2f} were every layer "
            "global)" for m in windowed]
    if said:
        line += (f" With their windows, at their longest context (up to {args.context[-1]:,} "
                 f"tokens): {', '.join(said)}.")
    return line
