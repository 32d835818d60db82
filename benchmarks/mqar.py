"""
bench.py mqar: associative recall vs the number of pairs, what a fixed state can hold.

The MQAR experiment (Zoology's multi-query associative recall). Each layout is a 2-layer GPT
trained with train.py's AdamW and schedule; what is MQAR's own: its data (data/mqar/prepare.py),
the embedding of a pair, the scoring, the learning-rate sweep and the report.
"""
import json
import math
import os
import signal
import statistics
import tempfile
import time
from multiprocessing import get_context

import numpy as np
import torch

from benchmarks.common import (LAYOUTS, LEGEND_OUTSIDE, MORE, add_device, add_layouts, command,
                               count, flag, listed, machine, plot, progress, iterations, row,
                               table)
from configurator import check_device, check_memory, fail
from data.mqar.prepare import SETS, load, parse_sets, parse_vocab, prepare, zoology
from model import GPT, GPTConfig
from ops.linear import linear_chunked
from ops.window import sees
from run.checkpoint import why
from run.optim import adamw, cosine_lr

# every layout alike: 2 layers, learned positions (no RoPE), MHA's parameter count; the linear
# layouts' own short conv off (conv_size=1): --conv_size puts one conv in front of every mixer
MQAR = dict(n_layer=2, n_head=4, n_embd=64, pos_emb='learned', chunk_size=32,
            match_mha_params=True)
HEAD_DIM = MQAR['n_embd'] // MQAR['n_head']
ZOOLOGY = dict(vocab=8192, sets=((64, 4), (128, 8), (256, 16), (512, 64)), train=100000,
               batch=256, max_iters=5000)
MQAR_DATA = {'cpu': dict(vocab=256, sets=SETS, train=20000, batch=64, max_iters=1000),
             'cuda': ZOOLOGY}
# each layout's best peak lr of `bench.py mqar --lrs=3e-4,1e-3,3e-3` (2 seeds, 1,000 steps;
# 2026-12-05, 82 minutes on 2 cores: git log results/mqar.md); the others' best: 1e-3. At 3e-3
# the linear rules but 'linear' stayed near chance.
# The windowed stacks: of 2026-12-07's sweep, 1 seed (results/mqar-windows-sweep.md), where mha@8
# stayed near chance at every rate.
MQAR_LR = {'mha': 3e-3, 'linear': 3e-3, 'mha@8': 3e-4, 'mha@8+sinks': 3e-3}
MQAR_SWEPT = ("2026-12-05's sweep --lrs=0.0003,0.001,0.003 (the windows': 2026-12-07's, 1 seed, "
              "results/mqar-windows-sweep.md)")
# MQAR's stacks: every layout, the hybrid 1:1 on 2 layers, and windows shorter and longer than the
# sequences (64 to 256 tokens), with and without StreamingLLM's 4 sinks. MQA at a window of 32
# keys and MHA at 8 keep 2,048 elements a sequence, as much as the linear rules' state.
WINDOWS = {'mqa@32': dict(attn='mqa', window=32),
           'mqa@32+sinks': dict(attn='mqa', window=32, n_sink=4),
           'mqa@128': dict(attn='mqa', window=128), 'mha@8': dict(attn='mha', window=8),
           'mha@8+sinks': dict(attn='mha', window=8, n_sink=4)}
MQAR_LAYOUTS = {**{a: f for a, f in LAYOUTS.items() if a not in ('sliding', 'local_global')},
                'hybrid': dict(attn='gated_deltanet+gqa'), **WINDOWS}
rates = listed(float, lambda v: 0 < v[0] and v[-1] <= 1, "give numbers in (0, 1]")


def add_arguments(p):
    pairs = lambda sets: ','.join(f'{L}:{n}' for L, n in sets)
    add_layouts(p, names=MQAR_LAYOUTS)
    add_device(p, "; on cuda Zoology's data")
    flag(p, 'max_iters', None, count, "iterations (default: 1000, on cuda 5000)")
    flag(p, 'lrs', None, rates, "peak learning rates, each layout's best kept (default: each "
                                "layout's best of the sweep 3e-4,1e-3,3e-3: benchmarks/mqar.py's MQAR_LR)")
    flag(p, 'seeds', 2, count, 'seeds a run: its initialization and batches')
    flag(p, 'conv_size', 1, count, "taps of a short causal conv in front of every mixer, softmax "
                                   "too, as Zoology's (the identity at init); 1: none")
    flag(p, 'vocab', None, parse_vocab, "token ids, keys in the lower half, values in the upper "
                                        "(default: 256, on cuda Zoology's 8192)")
    flag(p, 'sets', None, parse_sets, f"(length L, pairs N) of each MQAR set (default: "
                                      f"{pairs(SETS)}, on cuda Zoology's {pairs(ZOOLOGY['sets'])})")


def check(args, error):
    """The data's settings and every layout's model, before any run: one sequence of each set (its
    vocabulary may be too small for its pairs), each model at the longest set (a conv longer than
    it is refused), the memory."""
    data = mqar_data(args)
    args.max_iters = iterations(args, error, data['max_iters'])
    check_device(args.device, 'float32')
    for L, n in data['sets']:
        zoology(data['vocab'], L, n, 1, np.random.default_rng(0))
    for name in args.layouts:
        mqar_model(name, 4, longest(data['sets']), args.conv_size)
    copies = 1 + (os.cpu_count() or 1)  # x and y in int64, in bench.py and in each worker
    need = 16 * (data['train'] + 500) * sum(L for L, _ in data['sets']) * copies
    check_memory(need, 'cpu', "--vocab, --sets: the data in every worker")


def report(args):
    return mqar_report(args)


def mqar_data(args):  # the data set's settings: the device's, then the flags'
    given = {k: v for k in ('vocab', 'sets') if (v := getattr(args, k))}
    return MQAR_DATA['cuda' if args.device.startswith('cuda') else 'cpu'] | given


def longest(sets):  # the longest sequence of the (L, N) sets
    return max(L for L, _ in sets)


# --- the model, its training and its recall -------------------------------------------------------

class PairEmbedding(torch.nn.Module):
    """data/mqar's positions, key * vocab + value, embedded as wte(key) + wte(value): the model's
    own tied rows."""

    def __init__(self, wte, vocab):
        super().__init__()
        self.wte, self.vocab = wte, vocab

    def forward(self, idx):
        return self.wte(idx // self.vocab) + self.wte(idx % self.vocab)


class ConvFirst(torch.nn.Module):
    """A mixer with a short causal conv in front: each channel of its input, the sum of its last
    `taps` tokens' values, weighted per tap; the same in front of every mixer, softmax too. The
    identity at init (the current token's tap 1, the others 0): nn.Conv1d's default init (fla's
    ShortConvolution's, and the linear layers' own), uniform in ±1/sqrt(taps), starts by smearing
    each key with its neighbours, which cost the linear rules most of their recall here."""

    def __init__(self, mixer, channels, taps):
        super().__init__()
        self.mixer, self.taps = mixer, taps
        self.weight = torch.nn.Parameter(torch.zeros(channels, 1, taps))
        with torch.no_grad():
            self.weight[:, 0, -1] = 1.0  # the last tap is the current token's

    def forward(self, x, *rest):  # x: (B, T, C)
        x = torch.nn.functional.pad(x.transpose(1, 2), (self.taps - 1, 0))  # causal: pad the past
        x = torch.nn.functional.conv1d(x, self.weight, groups=x.size(1)).transpose(1, 2)
        return self.mixer(x, *rest)


def mqar_model(name, vocab, block_size, conv=1):
    stack = MQAR_LAYOUTS[name]
    has_conv = 'conv_size' in GPTConfig(attn=stack['attn']).used_fields()
    own = dict(conv_size=1) if has_conv else {}  # the linear layers' own conv off
    model = GPT(GPTConfig(**stack, vocab_size=vocab, block_size=block_size, **MQAR, **own))
    model.transformer.wte = PairEmbedding(model.transformer.wte, vocab)
    if conv > 1:
        if conv > block_size:
            raise ValueError(f"--conv_size={conv} is invalid: must be <= block_size={block_size} "
                             "(taps further back never see a token)")
        for block in model.transformer.h:
            block.attn = ConvFirst(block.attn, MQAR['n_embd'], conv)
    return model


def mqar_recall(model, sets):
    """{(L, N): the share of its validation answers right}."""
    model.eval()
    right = {}
    with torch.no_grad():
        for s, (_, _, val_x, val_y) in sets.items():
            right[s] = [(model(x, y)[0].argmax(-1) == y)[y >= 0].float().mean()
                        for x, y in zip(val_x.split(250), val_y.split(250))]
    model.train()
    return {s: torch.stack(r).mean().item() for s, r in right.items()}


def mqar_run(path, name, lr, seed, max_iters, batch, device, label, conv=1, eval_every=250,
             stop=0.99):
    """One layout trained on every (L, N) set of path at one peak lr and seed, as Zoology does:
    train.py's AdamW (weight decay 0.1) and schedule (warmup, then cosine to 0), a batch of one set
    per step in turn; every eval_every steps its recall, stopping at stop. On one thread as a
    worker of mqar_report's pool: its numbers never depend on the machine's core count."""
    torch.set_num_threads(1)
    sets = {s: [torch.from_numpy(a).to(device) for a in arrays] for s, arrays in load(path).items()}
    vocab = int(json.load(open(os.path.join(os.path.dirname(path), 'mqar.json')))['vocab'])
    torch.manual_seed(seed)
    model = mqar_model(name, vocab, longest(sets), conv).to(device)
    optimizer = adamw(model, lr, 0.1, (0.9, 0.98), 'cuda' if 'cuda' in device else 'cpu')
    g, order = torch.Generator().manual_seed(seed), list(sets)
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
        for group in optimizer.param_groups:
            group['lr'] = cosine_lr(it, lr, max_iters // 20, max_iters, 0.0)
        loss = model(train_x[rows], train_y[rows])[1]
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    means = [(it, statistics.mean(r.values())) for it, r in curve]
    crossed = {p: next((it for it, m in means if m >= p), None) for p in (0.5, 0.9, 0.99)}
    return dict(recall=curve[-1][1], steps=curve[-1][0], crossed=crossed,
                seconds=time.time() - start, curve=means)


def capacity(d_k, pairs, trials=50):
    """No training: N random unit keys and values written into one head's state by three rewrites
    of the chapter's table (model.py's linear_chunked), then every key read back; recall = the read
    is nearest its own value."""
    g, recall = torch.Generator().manual_seed(0), {}
    rules = {'accumulate (linear)': (0.0, False),  # name: (log α, delta)
             'fixed decay (retnet, γ = 1 - 2^-5)': (math.log1p(-2 ** -5), False),
             'delta rule (deltanet), β = 1': (0.0, True)}
    unit = lambda x: torch.nn.functional.normalize(x, dim=-1)
    for n in pairs:
        k, v = (unit(torch.randn(trials, 1, n, d_k, generator=g)) for _ in range(2))
        for name, (log_alpha, delta) in rules.items():
            log_a, beta = torch.full((trials, 1, n), log_alpha), torch.ones(trials, 1, n)
            _, S = linear_chunked(k, k, v, log_a, beta, torch.zeros(trials, 1, d_k, d_k), delta, 64)
            # (trials, 1, n): whose value each read is closest to
            nearest = ((k @ S) @ v.transpose(-2, -1)).argmax(-1)
            recall[name, n] = (nearest == torch.arange(n)).float().mean().item()
    return rules, recall


def reach(window, n_sink, vocab, L, n, count=2000):
    """No training: the shares of a set's queries whose pair one windowed layer sees (its W most
    recent keys or a sink), and two layers do (one relaying a value from W - 1 back), on count
    sequences drawn as data/mqar draws them."""
    x, y = zoology(vocab, L, n, count, np.random.default_rng(0))
    row, q = np.nonzero(y >= 0)  # each query, and the position of its pair among the first n
    j = np.argmax(x[row, :n] // vocab == (x[row, q] // vocab)[:, None], axis=1)
    one = sees(q, j, window, n_sink)
    return one.mean(), (one | (q - j <= 2 * (window - 1))).mean()


# --- the sweep: every layout, lr and seed, on a pool of workers -----------------------------------

def train_all(runs, args, data):
    """{(layout, lr, seed): mqar_run's result}, the runs on a pool of workers (one thread each; on
    CUDA, 4 at a time) over data written to a temporary folder in --out."""
    cuda = args.device.startswith('cuda')
    workers = min(len(runs), 4 if cuda else os.cpu_count() or 1)
    progress(f"mqar: {len(runs)} runs of up to {args.max_iters} steps, {workers} at a time"
             + " on one thread each" * (not cuda))
    # the data deleted and the workers ended on leaving, an error, Ctrl-C or SIGTERM too (spawn:
    # forked torch threads hang). The workers ignore Ctrl-C from their start, imports too: this
    # process ends them
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
        todo = {}
        for k, (name, lr, seed) in enumerate(runs, 1):
            label = f"run {k} of {len(runs)} ({name}, lr {lr:g}, seed {seed})"
            settings = (path, name, lr, seed, args.max_iters, data['batch'], args.device, label,
                        args.conv_size)
            todo[name, lr, seed] = pool.apply_async(mqar_run, settings)
        return {run: result.get() for run, result in todo.items()}


class Sweep:
    """The runs' results, {(layout, lr, seed): mqar_run's result}, told over the seeds."""

    def __init__(self, results, seeds):
        self.results, self.seeds = results, range(seeds)

    def runs(self, name, lr):
        return [self.results[name, lr, seed] for seed in self.seeds]

    def recall(self, name, lr, s=None):
        """The mean over the seeds of set s's recall (None: of the mean over the sets)."""
        return statistics.mean(statistics.mean(r['recall'].values()) if s is None
                               else r['recall'][s] for r in self.runs(name, lr))

    def best(self, name, lrs):
        """The lr of the best mean recall, as Zoology reports its sweep; past 99%: the fastest."""
        steps = lambda lr: statistics.mean(r['steps'] for r in self.runs(name, lr))
        return max(lrs, key=lambda lr: (min(self.recall(name, lr), 0.99), -steps(lr)))

    def crossings(self, name, lr, ps=(0.5, 0.9, 0.99)):
        """Each seed's steps to 50/90/99% recall (—: not reached)."""
        seeds = ('/'.join(str(r['crossed'][p] or '—') for p in ps) for r in self.runs(name, lr))
        return '; '.join(seeds)

    def rising(self, name, lr):
        """What the runs that stopped short of 99% gained in their last evaluation interval."""
        gains = [r['curve'][-1][1] - r['curve'][-2][1] for r in self.runs(name, lr)
                 if r['crossed'][0.99] is None and len(r['curve']) > 1]
        return f"{100 * statistics.mean(gains):+.1f}%" if gains else '—'

    def minutes(self):  # of all the runs together
        return sum(r['seconds'] for r in self.results.values()) / 60


# --- the mqar report ------------------------------------------------------------------------------

def mqar_report(args):
    """Per layout, the 2-layer model trained on MQAR to 99% recall or max_iters at each lr and seed
    (one thread a run, as many at once as there are cores), its best lr kept as Zoology does;
    recall per set; the untrained capacity."""
    data = mqar_data(args)
    # all, or each layout's best
    lrs = {name: args.lrs or [MQAR_LR.get(name, 1e-3)] for name in args.layouts}
    runs = [(name, lr, seed) for name in args.layouts for lr in lrs[name]
            for seed in range(args.seeds)]
    sweep = Sweep(train_all(runs, args, data), args.seeds)
    best = {name: sweep.best(name, lrs[name]) for name in args.layouts}
    sets, L = data['sets'], longest(data['sets'])
    cfg = {name: mqar_model(name, data['vocab'], L, args.conv_size).config for name in args.layouts}
    state = {(name, L_): cfg[name].cache_elements(L_) for name in args.layouts for L_, _ in sets}
    pairs = sorted({n for _, n in sets})
    rules, recall = capacity(HEAD_DIM, pairs)
    plot_recall(args, sets, sweep, best, state, rules, recall)

    set_names = [f"L={L_},N={n}" + " (= d_k)" * (n == HEAD_DIM) for L_, n in sets]
    header = ['layout', 'best lr', f'state at L = {L}', *set_names,
              'steps to 50/90/99%, each seed', 'gained in the last 250 steps, short of 99%']
    per_set = lambda name, lr: [f"{100 * sweep.recall(name, lr, s):.1f}%" for s in sets]
    trained = table(header, [row(name, f"{lr:g}", f"{state[name, L]:,}", *per_set(name, lr),
                                 sweep.crossings(name, lr), sweep.rising(name, lr))
                             for name, lr in best.items()])

    every = sorted({lr for v in lrs.values() for lr in v})
    at = lambda name, lr: (f"{100 * sweep.recall(name, lr):.1f}% (99% at "
                           f"{sweep.crossings(name, lr, [0.99])})")
    every_lr = table(['layout', *[f"lr {lr:g}" for lr in every]], [
        row(name, *(at(name, lr) if lr in lrs[name] else "not run" for lr in every))
        for name in args.layouts])

    untrained = table(['rewrite (one head, no training)', *[f"N={n}" for n in pairs]],
                      [row(r, *(f"{100 * recall[r, n]:.1f}%" for n in pairs)) for r in rules])
    windows = [name for name in args.layouts if cfg[name].window]
    seen = lambda c, L_, n: '{:.1%} / {:.1%}'.format(*reach(c.window, c.n_sink, data['vocab'],
                                                            L_, n))
    reached = "" if not windows else (
        "\n**What a window can see, no training**: the share of the queries whose pair one "
        "windowed layer sees (its W most recent keys, or a sink), and two layers can (a value "
        "relayed once: 2W - 1 back), in 2,000 sequences drawn as the sets are; the pairs open "
        "each sequence, so the sinks hold its first 4:\n\n"
        + table(['layout: one layer / two', *set_names],
                [row(name, *(seen(cfg[name], L_, n) for L_, n in sets)) for name in windows]))

    swept = ','.join(f'{lr:g}' for lr in every)
    return (described(args, data, swept)
            + f" {len(runs)} runs, {sweep.minutes():.0f} run-minutes.\n\n" + trained
            + "\n![MQAR recall vs pairs](mqar.png)\n![MQAR recall vs state](mqar-state.png)\n"
            + MORE + "\n**Mean recall over the sets at each lr** (the runs the table above picks "
            "from):\n\n" + every_lr + "\n**The state's capacity, no training**: N random unit keys "
            f"and values (d_k = {HEAD_DIM}) written into one head's state by model.py's update, "
            "then every key read back; recall = the read is nearest its own value (50 trials):"
            "\n\n" + untrained + reached)


def plot_recall(args, sets, sweep, best, state, rules, recall):
    """mqar.png: recall against the pairs, the trained layouts and the untrained state;
    mqar-state.png: recall on the hardest set against the state, as Zoology's figure."""
    pairs, (hard_L, hard_n) = sorted({n for _, n in sets}), sets[-1]
    # past ten layouts the colours come round again: the windowed ones dashed, in squares
    style = lambda i, name: dict(marker='so'[name not in WINDOWS], color=f'C{i % 10}',
                                 ls='-' if name not in WINDOWS else '--')
    trained = [([n for _, n in sets], [100 * sweep.recall(name, best[name], s) for s in sets],
                name, style(i, name)) for i, name in enumerate(args.layouts)]
    untrained = [(pairs, [100 * recall[r, n] for n in pairs], f'untrained state: {r}',
                  dict(ls=':', color='gray', marker=m)) for r, m in zip(rules, 'x+^')]
    rank = ([HEAD_DIM] * 2, [0, 100], f'head_dim d_k = {HEAD_DIM} (the state\'s rank)',
            dict(color='black', ls='--'))
    percent = 'answers recalled (%)'
    plot(os.path.join(args.out, 'mqar.png'), trained + untrained + [rank], LEGEND_OUTSIDE,
         title='MQAR: recall vs number of pairs (best lr)',
         xlabel='key-value pairs N in the sequence', ylabel=percent, ylim=(0, 102))
    hardest = [([state[name, hard_L]], [100 * sweep.recall(name, best[name], sets[-1])], name,
                style(i, name)) for i, name in enumerate(args.layouts)]
    plot(os.path.join(args.out, 'mqar-state.png'), hardest, LEGEND_OUTSIDE, xscale='log',
         ylim=(0, 102), ylabel=percent,
         title=f'MQAR: recall at L = {hard_L}, N = {hard_n} vs the state (Zoology\'s figure)',
         xlabel=f'state: cache elements a sequence at L = {hard_L} (log)')


def described(args, data, swept):
    """The report's first paragraph: the command, the data, the model, its training, and what
    recall counts."""
    cuda = args.device.startswith('cuda')
    where = machine().rsplit(',', 1)[0] + ', one thread a run' * (not cuda)
    sets = ', '.join(f'({L}, {n})' for L, n in data['sets'])
    data_set = (f"data/mqar/prepare.py's Zoology MQAR (one position a pair; vocabulary "
                f"{data['vocab']}, {data['train']:,} training sequences per set (L, N) = {sets})")
    conv = "no short conv"
    if args.conv_size > 1:
        conv = (f"a short causal conv of {args.conv_size} taps in front of every mixer, softmax "
                "too (the identity at init; the linear rules' own conv off)")
    model = (f"a {MQAR['n_layer']}-layer model per layout ({MQAR['n_head']} heads, n_embd "
             f"{MQAR['n_embd']}, head_dim d_k = {HEAD_DIM}, learned positions, {conv}, the MLP "
             "sized to MHA's parameter count; hybrid = 'gated_deltanet+gqa'; mqa@32: MQA whose "
             "queries see their 32 most recent keys, +sinks: and the first 4)")
    lrs = f"at each layout's best peak lr of {MQAR_SWEPT} (benchmarks/mqar.py's MQAR_LR)"
    if args.lrs:
        lrs = (f"at each peak lr ({swept}), each layout's best kept by mean recall (as Zoology "
               "reports its sweep)")
    seeds = f"{args.seeds} seed{'s' * (args.seeds > 1)}"
    training = (f"AdamW (weight decay 0.1), batches of {data['batch']} from one set in turn, "
                f"warmup then cosine to 0 over {args.max_iters} steps, {lrs}, {seeds} each; "
                "every 250 steps its recall, stopping at 99%")
    chance = data['vocab'] - data['vocab'] // 2
    recall = (f"Recall = answers right on 500 held-out sequences per set, the mean of the seeds "
              f"(chance: a guess among the {chance} values); steps to 50/90/99%: the first "
              "evaluation at or past it, per seed (—: not reached)")
    run = mqar_command(args, data, swept)
    return f"`{run}` on {where}: {data_set}, {model}, {training}. {recall}."


def mqar_command(args, data, swept):
    """The report's command line: --max_iters, and the flags given (--lrs: the lrs swept)."""
    given = dict(lrs=args.lrs and swept, seeds=args.seeds != 2 and args.seeds,
                 conv_size=args.conv_size > 1 and args.conv_size,
                 device=args.device.startswith('cuda') and args.device, vocab=args.vocab,
                 sets=args.sets and ','.join(f'{L}:{n}' for L, n in data['sets']))
    flags = [f'--{k}={v}' for k, v in given.items() if v]
    return command(args, f'--max_iters={args.max_iters}', *flags, every=MQAR_LAYOUTS)
