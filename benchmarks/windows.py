"""
Sliding windows, measured for bench.py train's report: what the band costs as the training path
computes it, and StreamingLLM's experiment at our size (a full-attention checkpoint given a window,
no training, on text longer than its block).
"""
import os
import statistics
from dataclasses import replace

import numpy as np
import torch
from torch.nn import functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from benchmarks.common import ROOT, plot, progress, row, table
from benchmarks.timing import take_turns
from model import GPT
from ops.window import band, sees
from run.checkpoint import read_checkpoint, weights


@torch.no_grad()
def band_cost(device='cpu', lengths=(256, 1024, 4096), window=256, batch=4, heads=6, d=64,
              rounds=5):
    """Attention alone, forward, at each length: full causal attention (SDPA's is_causal), the
    band as SDPA's boolean mask (the model's training path: every pair computed, then masked), and
    the band as FlexAttention compiled (only the blocks it touches). A table."""
    flex, rows = torch.compile(flex_attention), []
    for T in lengths:
        progress(f"the band's cost at {T:,} tokens (FlexAttention compiles)")
        q, k, v = (torch.randn(batch, heads, T, d, device=device) for _ in range(3))
        pos = torch.arange(T, device=device)
        mask = band(pos, pos, window)
        blocks = create_block_mask(lambda b, h, i, j: sees(i, j, window), None, None, T, T,
                                   device=device)
        fns = {'causal': lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
               'sdpa': lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
               'flex': lambda: flex(q, k, v, block_mask=blocks)}
        times = take_turns(fns, device, rounds + 1)  # round 0: the warm-up (compilation)
        ms = {name: statistics.median(t[1:]) * 1000 for name, t in times.items()}
        ratio = lambda name: f"{ms[name]:.3g} ({ms[name] / ms['causal']:.2f}x)"
        apart = (fns['flex']() - fns['sdpa']()).abs().max().item()  # the same band both ways
        rows.append(row(f"{T:,}", f"{ms['causal']:.3g}", ratio('sdpa'), ratio('flex'),
                        f"{apart:.0e}"))
    header = ['tokens', 'full causal (SDPA) ms', f'band of {window}, SDPA boolean mask ms',
              f'band of {window}, FlexAttention compiled ms', 'largest difference of the bands']
    return (f"\n**What the band costs**: attention alone, forward, batch {batch}, {heads} heads of "
            f"{d}, float32, on {device}, medians of {rounds} rounds taking turns (the model trains "
            "with SDPA's boolean band: FlexAttention has no backward on a CPU):\n\n"
            + table(header, rows))


@torch.no_grad()
def retrofit(ckpt_path, out, device='cpu', length=1024, segments=64):
    """StreamingLLM's experiment at our size, no training: a full-attention checkpoint (block_size
    B) reads val text `length` tokens long, and each position's loss is measured (a) as sample.py
    generates past B, jumping forward and re-prefilling the last B / 2 tokens, (b) with a window
    of B - 4 keys, (c) with a window of B - 8 keys and 4 sinks (the same cache as (b)). A table by
    position, and its plot into out/retrofit.png. The val text: the run's own data."""
    ckpt, cfg = read_checkpoint(ckpt_path)  # (train.py's: it holds the run's config)
    B, state, run = cfg.block_size, weights(ckpt), ckpt['config']
    data_dir = run['data_dir'] or os.path.join(ROOT, 'data', run['dataset'])
    data = np.memmap(os.path.join(data_dir, 'val.bin'), dtype=np.uint16, mode='r')
    starts = np.linspace(0, len(data) - length - 2, segments).astype(int)
    texts = lambda i: np.stack([data[s + i:s + i + length] for s in starts]).astype(np.int64)
    x, y = (torch.from_numpy(texts(i)).to(device) for i in (0, 1))  # the texts, and their next tokens
    ways = {'(a) jump and re-prefill': (None, 0), f'(b) window of {B - 4}': (B - 4, 0),
            f'(c) window of {B - 8} + 4 sinks': (B - 8, 4)}
    losses = {}
    for name, (window, n_sink) in ways.items():
        progress(f"retrofit: {name}")
        model = GPT(replace(cfg, window=window or 0, n_sink=n_sink)).to(device)
        model.load_state_dict(state)
        logits = jumping(model.eval(), x) if window is None else windowed(model.eval(), x)
        loss = F.cross_entropy(logits.transpose(1, 2).float(), y, reduction='none')  # (texts, length)
        losses[name] = loss.mean(0).cpu()
    doubling = [B * 2 ** i for i in range(length.bit_length()) if B * 2 ** i < length]
    bins = [(0, B)] + [(a, min(length, 2 * a)) for a in doubling]
    mean = lambda name, a, b: f"{losses[name][a:b].mean().item():.4f}"
    rows = [row(name, *(mean(name, a, b) for a, b in bins), mean(name, B, length)) for name in ways]
    header = ['way', *[f"tokens {a:,}-{b - 1:,}" for a, b in bins], f"all past {B}"]
    every = B // 2  # positions a point
    smooth = {name: loss.unfold(0, every, every).mean(1).tolist() for name, loss in losses.items()}
    lines = [(list(range(every // 2, length, every)), smooth[name], name, dict()) for name in ways]
    ends = [min(map(min, smooth.values())), max(map(max, smooth.values()))]
    lines.append(([B, B], ends, f'block_size {B}: trained up to here', dict(color='gray', ls=':')))
    plot(os.path.join(out, 'retrofit.png'), lines, dict(fontsize=8),
         title=f'a full-attention model (block {B}) past its block, no training',
         xlabel='position in the text (tokens)', ylabel=f'val loss (mean of {every} positions)')
    return (f"\n**Retrofit without training** (StreamingLLM's experiment at our size): the MHA "
            f"run's ckpt.pt (trained on blocks of {B}) reads {segments} val texts of {length:,} tokens; "
            "each position's loss, the mean over the texts and over the positions of a column "
            "(positions are absolute: the sinks' distance grows with the text):\n\n"
            + table(header, rows) + "\n![retrofit: loss by position](retrofit.png)\n")


def jumping(model, x):
    """Logits at every position as stream() generates past block_size B: the window starts at 0,
    and once it would hold more than B tokens it jumps to keep the last B // 2, the current token's
    included (positions from 0 again): each stretch between jumps is one forward over its window."""
    B, T, out = model.config.block_size, x.size(1), []
    start, t = 0, 0
    while t < T:
        end = min(T, start + B)  # the window grows to B tokens: positions t .. end - 1 read it
        out.append(model(x[:, start:end], x[:, start:end])[0][:, t - start:])
        t, start = end, end + 1 - B // 2
    return torch.cat(out, dim=1)


def windowed(model, x):
    """Logits at every position of a windowed model fed through its cache a block at a time."""
    B, cache = model.config.block_size, model.init_cache(x.size(0))
    return torch.cat([model(x[:, i:i + B], cache=cache)[0] for i in range(0, x.size(1), B)], 1)
