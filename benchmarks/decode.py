"""
bench.py decode: the decode roofline, decode cost vs context, generation with and without the cache.

The roofline of one cached decode step (batch 16, t=2048): the bytes it reads and the FLOPs it
computes, against the floors measured alongside it; where the step's time goes (torch.profiler);
then a step's cost against the context, and greedy generation's tokens/s. Written as it goes to
--out/decode.partial.md (each roofline row as it finishes): a stopped run keeps what it measured.
"""
import collections
import copy
import os
import statistics
from unittest.mock import patch

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.common import (LAYOUTS, LEGEND_OUTSIDE, MORE, add_device, add_layouts,
                               compile_options, count, flag, listed, machine, plot, progress, row,
                               table)
from benchmarks.timing import generate_in_turns, take_turns
from configurator import check_device, check_memory, checked
from model import GPT, GPTConfig
from run.checkpoint import write_atomic
from run.settings import num_params

ROUNDS = 15  # of every decode timing: each round runs every step once
# a context is prefilled token by token's worth of work, even into a linear layout's fixed state
LONGEST = 2 ** 20
context = checked(int, lambda v: 1 <= v <= LONGEST, f"give an integer from 1 to {LONGEST:,}")
contexts = listed(int, lambda v: 1 <= v[0] and v[-1] <= LONGEST,
                  f"give integers from 1 to {LONGEST:,}")
gen_tokens = checked(int, lambda v: 1 <= v <= 240, "give 1 to 240 (block 256, prompt 16)")


def add_arguments(p):
    add_layouts(p)
    add_device(p, '')
    add_model_flags(p, batch=16, dtype='float32', batch_is='batch of the roofline')
    flag(p, 'contexts', '64,128,256,512,1024,2048', contexts,
         'the contexts of decode cost vs context')
    p.add_argument('--compile', action='store_true',
                   help="the roofline's step compiled too (a static cache; CUDA graphs on a GPU)")


def add_model_flags(p, batch, dtype, batch_is):
    """The model's sizes, the roofline's batch and context, the generation's tokens, the dtype."""
    flag(p, 'n_layer', 6, count, 'layers')
    flag(p, 'n_head', 6, count, 'heads')
    flag(p, 'n_embd', 384, count, 'width')
    flag(p, 'batch', batch, count, batch_is)
    flag(p, 't', 2048, context, 'context of the roofline')
    flag(p, 'gen_tokens', 240, gen_tokens, 'new tokens of the generation table')
    flag(p, 'dtype', dtype, str, 'float32, bfloat16 or float16')


def check(args, error):
    check_device_and_dtype(args, error)
    what = f"--t={args.t}, --batch={args.batch}, --contexts, the sizes: weights and caches"
    check_sizes(args, args.contexts, args.compile, what)


def report(args):
    return decode_report(args)


def model_sizes(args):  # MLA at the paper's ratios
    return dict(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)


def check_device_and_dtype(args, error):
    check_device(args.device, args.dtype)
    if args.device == 'cpu' and args.dtype == 'float16':
        error("--dtype=float16 on CPU: no fp16 matmul kernels here (a 2048^2 product took 69 s, "
              "0.13 s in float32); use float32 or bfloat16")


def check_sizes(args, contexts, compiled, what):
    """Every layout's model at the sizes (a ValueError for one it refuses), and the bytes all their
    weights and caches need at once, counted, nothing built: one line and exit 2 where the device
    has less."""
    dtype = getattr(torch, args.dtype)
    cfgs = [GPTConfig(**LAYOUTS[a], **model_sizes(args)) for a in args.layouts]
    weights = sum(num_params(c) for c in cfgs) * dtype.itemsize
    # the roofline: a cache of t + 1 tokens a sequence (and the compiled step's), the token ids
    steps = sum(c.cache_bytes(args.t + 1, dtype) * args.batch * (1 + compiled) for c in cfgs)
    steps += 8 * args.batch * (args.t + 1) * len(cfgs)
    # decode cost vs context: a full cache at every context, and MLA's uncached scores
    longest = max(contexts, default=0)
    sweep = sum(c.cache_bytes(longest + 1, dtype) * len(contexts) for c in cfgs)
    sweep += ('mla' in [c.softmax for c in cfgs]) * longest ** 2 * args.n_head * 4
    check_memory(weights + max(steps, sweep), args.device, what)


# --- the roofline of one decode step --------------------------------------------------------------

@torch.inference_mode()
@torch.no_grad()  # (a static cache's FlexAttention has no backward on a CPU)
def roofline(layouts, sizes, batch, contexts, device, dtype, compile=False, uncached=False,
             rounds=ROUNDS, chunk=512, said=lambda attn, runs: None):
    """A cached decode step per layout and context t, eager (and compiled; and uncached: the
    forward over the t + 1 tokens that the step spares). Each layout's steps take turns with the
    floors' large copy and large product, so that its fraction of the floor compares times taken
    together; said(attn, runs) once a layout is done (runs: every one so far)."""
    # the floors: an m x m product, a copy of n floats
    m, n = (8192, 2 ** 28) if device.startswith('cuda') else (2048, 2 ** 26)
    a, b = (torch.randn(m, m, device=device, dtype=dtype) for _ in range(2))
    x, y = torch.ones(n, device=device), torch.empty(n, device=device)
    floors, runs = {'copy': lambda: y.copy_(x), 'product': lambda: a @ b}, {}
    kinds = ['eager'] + ['compiled'] * compile + ['no cache'] * uncached
    for attn in layouts:
        progress(f"decode steps at batch {batch}: {attn}")
        config = GPTConfig(**LAYOUTS[attn], **sizes, block_size=max(contexts) + 1)
        model = GPT(config).to(device, dtype).eval()
        net = torch.compile(model, **compile_options(device)) if compile else None
        idx = torch.randint(0, config.vocab_size, (batch, max(contexts) + 1), device=device)
        fns = dict(floors)
        for t in contexts:
            cache = model.init_cache(batch)
            prefill(model, idx, t, cache, chunk, f"{attn}, eager")
            fns[t, 'eager'] = decode_step(model, idx[:, t:t + 1], cache, t)
            runs[attn, t] = counted(fns[t, 'eager'], model, cache)
            if compile:  # the same step over a static cache, one graph
                fns[t, 'compiled'] = decode_step(net, idx[:, t:t + 1],
                                                 static_copy(model, cache, batch), t)
            if uncached:
                fns[t, 'no cache'] = lambda window=idx[:, :t + 1]: model(window)[0]
        if compile:
            # measured on 2 CPU cores with an empty inductor cache: 20-40 s a layout, MLA's too
            progress(f"{attn}: compiling its step (~30 s on 2 CPU cores; seconds once cached)")
        for fn in fns.values():
            fn()  # warm-up (compilation); from now on each cache holds the t + 1 keys it reads
        # floors: the machine's best round; steps: their median round
        times = take_turns(fns, device, rounds)
        bandwidth = 2 * 4 * n / min(times['copy'])  # a copy reads 4 bytes a float, and writes 4
        rate = 2 * m ** 3 / min(times['product'])
        for t in contexts:
            run = runs[attn, t]
            run.update(bandwidth=bandwidth, rate=rate)
            run['ms'] = {kind: statistics.median(times[t, kind]) * 1000 for kind in kinds}
            run['floors'] = {'bytes': run['bytes'] / bandwidth * 1000,
                             'FLOPs': run['flops'] / rate * 1000}
        said(attn, runs)
    return runs


def static_copy(model, cache, batch):
    """A static cache (fixed shapes: one compiled graph) holding what cache holds: filled by a
    copy, not by a prefill that would run FlexAttention uncompiled (slow, and it warns)."""
    static = model.init_cache(batch, static=True)
    for mine, theirs in zip(static.layers, cache.layers):
        for name, buf in mine.buffers.items():
            buf.copy_(theirs.buffers[name])
    static.pos.fill_(len(cache))
    return static


def prefill(model, idx, t, cache, chunk, what):
    """idx's first t tokens into cache, in chunks: bounded memory for the materialized attention."""
    for i in range(0, t, chunk):
        model(idx[:, i:min(i + chunk, t)], cache=cache)
        if (i // chunk + 1) % 64 == 0:  # a long context's prefill takes minutes: say where it is
            progress(f"{what}: prefilled {min(i + chunk, t):,} of {t:,} tokens")


def decode_step(net, token, cache, t):
    """The step at t, as often as it is called: the token at t again over the cache, the same work
    each time."""
    def step():
        # in place, and not in the graph: there the mask reads an input
        cache.pos = cache.pos.fill_(t) if torch.is_tensor(cache.pos) else t
        return net(token, cache=cache)[0]
    return step


def counted(step, model, cache):
    """What one step computes, counted on SDPA's math backend (the counter sees no fused kernels),
    and what it reads: every weight and, now that it ran, the cache of t + 1 keys."""
    math = [SDPBackend.MATH]
    counter = FlopCounterMode(display=False)
    with patch('ops.softmax.DECODE_BACKENDS', math), sdpa_kernel(math), counter:
        step()
    weights = sum(p.nbytes for p in model.parameters())
    return dict(flops=counter.get_total_flops(), bytes=weights + cache.nbytes)


def roofline_section(runs, batch, t, path):
    """The roofline table, and its plot into path: ms per step against the bytes it reads, with the
    floors."""
    mb = {attn: run['bytes'] / 1e6 for (attn, _), run in runs.items()}
    ends = [min(mb.values()) / 1.5, max(mb.values()) * 1.5]
    best = max(run['bandwidth'] for run in runs.values())  # the lowest floor any row had
    floor = f'bytes floor: bytes / {best / 1e9:.1f} GB/s'
    lines = [(ends, [x * 1e6 / best * 1000 for x in ends], floor, dict(color='black', ls='--'))]
    for i, ((attn, _), run) in enumerate(runs.items()):
        for k, marker, fill in (('eager', 'o', 'full'), ('compiled', 's', 'none')):
            if k in run['ms']:
                style = dict(color=f'C{i}', marker=marker, ls='', fillstyle=fill)
                lines.append(([mb[attn]], [run['ms'][k]], f'{attn}, {k} step', style))
        lines.append(([mb[attn]], [run['floors']['FLOPs']], f'{attn}, FLOP floor',
                      dict(color=f'C{i}', marker='_', ms=16, mew=2, ls='')))
    plot(path, lines, LEGEND_OUTSIDE, xscale='log', yscale='log',
         title='decode step vs bytes read, with the floors', ylabel='ms per decode step',
         xlabel='bytes one decode step must read: weights + cache (MB)')
    return roofline_table(runs, batch, t)


def span(values, form):  # a range, or one number where its ends print alike
    low, high = form.format(min(values)), form.format(max(values))
    return low if low == high else f"{low}-{high}"


def roofline_table(runs, batch, t):
    """A row per layout: bytes, FLOPs, both floors, and each kind of step's ms and fraction of
    its floor."""
    kinds, rows = list(next(iter(runs.values()))['ms']), []
    for (attn, _), run in runs.items():
        ms, floors = run['ms'], run['floors']
        binds = max(floors, key=floors.get)
        timed = [f"{ms[k]:.3g} | **{100 * floors[binds] / ms[k]:.3g}%**" for k in kinds]
        rows.append(row(attn, f"{run['bytes'] / 1e6:,.3g} MB", f"{run['flops'] / 1e9:.3g}",
                        f"{floors['bytes']:.3g}", f"{floors['FLOPs']:.3g}", binds, *timed))
    bandwidth = span([run['bandwidth'] / 1e9 for run in runs.values()], '{:.1f}')
    rate = span([run['rate'] / 1e9 for run in runs.values()], '{:,.0f}')
    floors = (f"bandwidth **{bandwidth} GB/s** (a large tensor copy, read + write bytes), matmul "
              f"rate **{rate} GFLOP/s** (one large square product)")
    header = ['layout', 'bytes read: weights + cache', 'GFLOP', 'bytes floor ms', 'FLOP floor ms',
              'binds', *[f"{k} {what}" for k in kinds for what in ('ms', '% of floor')]]
    return (f"Cached decode step, batch {batch}, context t={t} (the step attends to t + 1 keys). "
            f"Each layout's steps take {ROUNDS} rounds of turns with the floors' copy and product, "
            "in a new order each round; its floors: the best round (across the rows: "
            f"{floors}), its steps: the median.\n\n" + table(header, rows))


# --- where a decode step's time goes ----------------------------------------------------------------

# what each operator the profile names does in a decode step (any other: said by its name alone)
ROLES = {
    'aten::_scaled_dot_product_flash_attention_for_cpu': "the attention product over the cache",
    'aten::_scaled_dot_product_efficient_attention': "the attention product over the cache",
    'aten::_flash_attention_forward': "the attention product over the cache",
    'aten::bmm': "batched products: a linear layout's state, MLA's W_UK and W_UV",
    'aten::baddbmm': "the scores q kᵀ over the cache",
    'aten::mm': "the weights: q/k/v and output projections, the MLP, the head",
    'aten::addmm': "the weights, with a bias",
    'aten::_softmax': "the softmax over the scores",
    'aten::copy_': "copies: cache writes, layout changes, dtype casts",
    'aten::index_copy_': "a static cache's writes",
    'aten::native_layer_norm': "the layer norms",
    'aten::gelu': "the MLP's activation",
    'aten::cat': "concatenations (MLA's query and latent)",
    'aten::flip': "RoPE's pair swap",
    'aten::mul': "elementwise products (RoPE, scales)",
    'aten::add': "elementwise sums (RoPE, residuals)",
    'aten::einsum': "MLA's absorbed products (bmm inside)",
}


@torch.inference_mode()
def decode_profile(layouts, sizes, batch, t, device, dtype, steps=5, top=4):
    """The eager cached decode step under torch.profiler, each of its steps after the roofline's
    large copy (so it reads cold, as there): its kernels (CUDA; on a CPU, its aten ops), split
    into the attention product, the weights' products and the rest, each next to the bytes it
    must read; then the few that take the most time, and what each named one does."""
    kind = 'device' if device.startswith('cuda') else 'cpu'
    activities = [torch.profiler.ProfilerActivity.CPU]
    if kind == 'device':
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    n = 2 ** 28 if kind == 'device' else 2 ** 26
    x, y = torch.ones(n, device=device), torch.empty(n, device=device)
    rows, named, copies = [], {}, []
    for attn in layouts:
        progress(f"profile of a decode step: {attn}")
        config = GPTConfig(**LAYOUTS[attn], **sizes, block_size=t + 1)
        model = GPT(config).to(device, dtype).eval()
        idx, cache = torch.randint(0, 65, (batch, t + 1), device=device), model.init_cache(batch)
        prefill(model, idx, t, cache, 512, f"{attn}, profiled")
        step = decode_step(model, idx[:, t:], cache, t)
        step()
        self_us, calls = collections.Counter(), collections.Counter()  # by op, over the steps
        for _ in range(steps):
            # the roofline's copy, timed: it also leaves the caches full of other bytes
            copies += take_turns({'copy': lambda: y.copy_(x)}, device, 1)['copy']
            # (acc_events: torch 2.11 warns on stderr without it)
            with torch.profiler.profile(activities=activities, acc_events=True) as prof:
                step()
            for e in prof.key_averages():
                if (kind == 'device' or e.key.startswith('aten::')) and self_time(e, kind) > 0:
                    self_us[e.key] += self_time(e, kind)
                    calls[e.key] += e.count
        parts = collections.Counter()
        for key, us in self_us.items():
            parts[part_of(key, attn)] += us
        weights = sum(p.nbytes for p in model.parameters())
        ms = lambda us: f"{us / steps / 1000:.3g}"
        bandwidth = 8 * n / min(copies)
        floor = lambda nbytes: f"{nbytes / bandwidth * 1000:.3g}"
        busiest = self_us.most_common(top)
        shares = "; ".join(f"`{key[:60]}` {100 * us / sum(self_us.values()):.0f}% "
                           f"(x{calls[key] // steps})" for key, us in busiest)
        named.update((key, ROLES[key]) for key, _ in busiest if key in ROLES)
        rows.append(row(attn, ms(sum(self_us.values())), f"{ms(parts['attention'])} / "
                        f"{floor(cache.nbytes)}", f"{ms(parts['weights'])} / {floor(weights)}",
                        ms(parts['the rest']), sum(calls.values()) // steps, shares))
    ops = 'kernels' if kind == 'device' else 'aten ops'
    header = ['layout', f'{kind} ms a step',
              'attention (or state) products ms / cache bytes floor ms',
              "weights' products ms / weight bytes floor ms", 'the rest ms', f'{ops} a step',
              'the busiest (share of the step, calls a step)']
    legend = "\n".join(f"- `{key}`: {role}" for key, role in named.items())
    return table(header, rows) + ("\n" + legend + "\n" if legend else "")


def self_time(event, kind):  # microseconds
    return getattr(event, f'self_{kind}_time_total')


def part_of(key, attn):
    """The part of a decode step a kernel or aten op does: the attention product over the cache (a
    linear layout's: its state's products), a product with the weights (MLA's absorbed W_UK, W_UV
    included), or the rest."""
    low = key.lower()
    state = key == 'aten::bmm' and attn != 'mla'  # (MLA's bmm: its absorbed weights)
    if 'attention' in low or 'flash' in low or 'fmha' in low or state:
        return 'attention'
    products = key in ('aten::mm', 'aten::addmm', 'aten::bmm') or 'gemm' in low
    return 'weights' if products else 'the rest'


# --- generation with and without the cache --------------------------------------------------------

@torch.inference_mode()
def generation(layouts, sizes, device, dtype, compile=False, prompt=16, new=240, batches=(1, 8)):
    """Greedy tokens/s without the cache, with it (and compiled): each way twice, taking turns;
    the faster counts."""
    kinds, rows = ['no cache', 'cache'] + ['cache, compiled'] * compile, []
    for attn in layouts:
        progress(f"generation: {attn}")
        config = GPTConfig(**LAYOUTS[attn], **sizes, block_size=256)
        model = GPT(config).to(device, dtype).eval()
        ways = {'no cache': (model, None), 'cache': (model, 'cache')}
        if compile:  # a copy, compiled in place (stream() calls self(...)), over a static cache
            ways['cache, compiled'] = (copy.deepcopy(model), 'static')
            ways['cache, compiled'][0].compile(**compile_options(device))
        for batch in batches:
            idx = torch.randint(0, config.vocab_size, (batch, prompt), device=device)
            out = generate_in_turns(ways, idx, new, device, 2, temperature=0)
            secs = {k: min(out[k][2]) for k in kinds}
            speed = [f"{batch * new / secs[k]:,.1f}" for k in kinds]
            same = [agree(model, idx, out['no cache'][0], out[k][0]) for k in kinds[1:]]
            speedup = f"{secs['no cache'] / secs['cache']:.1f}x"
            rows.append(row(attn, batch, *speed, speedup, *same))
    header = ['layout', 'batch', *[f"tokens/s, {k}" for k in kinds], 'cache speedup',
              *[f"identical tokens, {k}" for k in kinds[1:]]]
    return table(header, rows)


def agree(model, idx, ref, other, tol=1e-4):
    """'yes' if two greedy runs agree; where they part, a near-tie if ref's top two logits are
    within tol, else 'NO'."""
    if torch.equal(ref, other):
        return 'yes'
    row, col = (ref != other).nonzero()[0].tolist()
    top = model(torch.cat([idx[row:row + 1], ref[row:row + 1, :col]], 1))[0][0, -1].float().topk(2)
    gap = (top.values[0] - top.values[1]).item()
    if gap < tol and other[row, col] in top.indices:
        return f"a near-tie at token {col} ({gap:.0e} apart)"
    return 'NO'


# --- the decode report ----------------------------------------------------------------------------

def decode_report(args):
    """The roofline at --batch and --t, where its eager steps' time goes, the cost vs context at
    batch 1, and generation with and without the cache. Written to --out/decode.partial.md as it
    goes, each roofline row said as it finishes: a run stopped midway keeps what it measured, and
    an earlier decode.md."""
    layouts, contexts, device = args.layouts, args.contexts, args.device
    dtype, sizes = getattr(torch, args.dtype), model_sizes(args)
    path = os.path.join(args.out, 'decode.partial.md')  # (decode.md: the finished report)
    text = f"Machine: {machine()}. Model: {described(args)}.\n\n**Roofline of one decode step**\n\n"

    def so_far(more=''):  # bench.py deletes it once decode.md is written
        write_atomic(path, text + more + "\n_(The run was still going, or was stopped, here.)_\n")

    def said(attn, runs):
        run = runs[attn, args.t]
        floor = max(run['floors'].values())
        steps = ", ".join(f"{k} {ms:.3g} ms ({100 * floor / ms:.3g}% of its floor)"
                          for k, ms in run['ms'].items())
        progress(f"{attn}: {steps}")
        so_far(roofline_table(runs, args.batch, args.t))
    runs = roofline(layouts, sizes, args.batch, [args.t], device, dtype, args.compile, said=said)
    text += roofline_section(runs, args.batch, args.t, os.path.join(args.out, 'roofline.png'))
    text += f"\n![decode step vs bytes read](roofline.png)\n{MORE}\n"
    profile = decode_profile(layouts, sizes, args.batch, args.t, device, dtype)
    text += (f"**Where an eager decode step's time goes**, batch {args.batch}, t={args.t} "
             "(torch.profiler, 5 steps, each after the roofline's copy: cold, as there; each "
             f"part's floor: its bytes at that copy's bandwidth):\n\n{profile}\n")
    so_far()
    costs = roofline(layouts, sizes, 1, contexts, device, dtype, uncached=True)
    text += cost_section(costs, layouts, contexts, os.path.join(args.out, 'decode.png'))
    so_far()
    text += (f"\n**Generation, {args.gen_tokens} new tokens after a 16-token prompt, block 256, "
             "greedy, eager** (the best of two runs each way):\n\n")
    return text + generation(layouts, sizes, device, dtype, new=args.gen_tokens)


def cost_section(costs, layouts, contexts, path):
    """Decode cost vs context: a cached step against a forward over the t + 1 tokens, and its
    plot into path."""
    ms = lambda attn, t, kind: costs[attn, t]['ms'][kind]
    ways = (('eager', 'cached', 'o', '-'), ('no cache', 'no cache', 'x', '--'))
    lines = [(contexts, [ms(attn, t, k) for t in contexts], f'{attn}, {kind}',
              dict(color=f'C{i}', marker=marker, ls=ls))
             for i, attn in enumerate(layouts) for k, kind, marker, ls in ways]
    plot(path, lines, dict(fontsize=7, ncol=2), xscale='log', yscale='log',
         title='decode cost vs context, batch 1',
         xlabel='context length t (tokens already seen)', ylabel='ms per generated token')
    cost = lambda attn, t: f"{ms(attn, t, 'eager'):.3g} / {ms(attn, t, 'no cache'):,.1f}"
    cost_table = table(['layout', *[f"t={t} cached / no cache" for t in contexts]],
                       [row(attn, *(cost(attn, t) for t in contexts)) for attn in layouts])
    return ("**Decode cost vs context**, batch 1, eager, ms per generated token (a cached step / "
            f"a forward over the t + 1 tokens), medians of {ROUNDS} rounds taken like the "
            "roofline's (so each step reads its weights cold):\n\n" + cost_table +
            "\n![decode cost vs context](decode.png)\n")


def described(args):
    """The model, its dtype and device, and how its steps ran."""
    mla = GPTConfig(attn='mla', **model_sizes(args))
    how = 'eager'
    if args.compile:
        how += (", and the roofline's step compiled: torch.compile(fullgraph=True) over a static "
                "cache" + ', CUDA graphs' * args.device.startswith('cuda'))
    return (f"{args.n_layer} layers, {args.n_head} heads, n_embd {args.n_embd}, MLA d_c "
            f"{mla.kv_lora_rank} d_R {mla.rope_head_dim}, random init, {args.dtype}, device "
            f"{args.device}, {how}")
