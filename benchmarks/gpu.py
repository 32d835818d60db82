"""
bench.py gpu: the one report a lent GPU runs: roofline, generation, training step, profile, fla.

Its own settings unless given (cuda, bfloat16, batch 64, six layouts): the decode roofline eager
and compiled, generation, the training step next to nanoGPT's, where a decode step's time goes
(torch.profiler), and fla's kernels against ours.
"""
import os
import statistics
from importlib.util import find_spec

import torch

from benchmarks.common import add_device, add_layouts, command, machine, row, table
from benchmarks.decode import (add_model_flags, check_device_and_dtype, check_sizes, decode_profile,
                               generation, model_sizes, roofline, roofline_section)
from benchmarks.timing import take_turns
from benchmarks.train import add_nanogpt, check_nanogpt, step_time_vs_nanogpt
from model import LINEAR_RULES
from ops.linear import linear_chunked
from ops.linear_fla import fla_runs, linear_fla
from run.checkpoint import write_atomic

# every softmax kind, the delta rule, the hybrid: ~40 compilations
SIX = 'mha,gqa,mqa,mla,gated_deltanet,hybrid'


def add_arguments(p):
    add_layouts(p, SIX)
    add_device(p, '', default='cuda')
    add_model_flags(p, batch=64, dtype='bfloat16',
                    batch_is='batch of the roofline and of the training step')
    add_nanogpt(p)


def check(args, error):
    check_device_and_dtype(args, error)
    check_nanogpt(args, error)
    what = f"--t={args.t}, --batch={args.batch}, the sizes: weights and caches"
    check_sizes(args, [], True, what)


def report(args):
    return gpu_report(args)


def gpu_report(args):
    """Every section a GPU session needs, each written to --out/gpu.partial.md and printed as it
    finishes (a run stopped at its time limit keeps what it measured, and an earlier gpu.md)."""
    device, dtype, sizes, sections = args.device, getattr(torch, args.dtype), model_sizes(args), []
    layouts, batch, t = args.layouts, args.batch, args.t

    def section(title, text):
        sections.append(f"**{title}**\n\n{text.strip()}\n")
        write_atomic(os.path.join(args.out, 'gpu.partial.md'), '\n'.join(sections))
        print(sections[-1], flush=True)
    settings = ('device', 'dtype', 'batch', 't', 'n_layer', 'n_head', 'n_embd', 'gen_tokens')
    given = [f'--{k}={getattr(args, k)}' for k in settings]  # every setting: the command reruns it
    gpu = torch.cuda.get_device_name(device) if device.startswith('cuda') else 'no GPU'
    fla = 'installed' if find_spec('fla') else 'not installed'  # (FLA: None on a CPU)
    section('The run', f"`{command(args, *given)}` on {machine()}, {gpu}; fla {fla}.")

    runs = roofline(layouts, sizes, batch, [t], device, dtype, compile=True)
    section(f"Roofline of one decode step, batch {batch}, t={t}, eager and compiled",
            roofline_section(runs, batch, t, os.path.join(args.out, 'roofline.png')))

    section(f"Generation at batch 1, {args.gen_tokens} new tokens after 16, block 256, greedy",
            generation(layouts, sizes, device, dtype, compile=True, new=args.gen_tokens,
                       batches=(1,)))

    steps = step_time_vs_nanogpt(args.nanogpt, layouts, rounds=5, steps=5, device=device,
                                 dtype=dtype, sizes={**sizes, 'block_size': 256, 'batch': batch},
                                 compile=True)
    if args.nanogpt is None:
        steps += "\n(no --nanogpt PATH given: nanoGPT's model.py not timed)"
    section(f"Training step, block 256, batch {batch}, {args.dtype} autocast, eager and compiled",
            steps)

    section(f"Where an eager decode step's time goes, batch {batch}, t={t} (torch.profiler, 5 "
            "steps, each read cold)", decode_profile(layouts, sizes, batch, t, device, dtype))

    section(f"fla's kernels against ours, forward + backward, batch {batch}, 256 tokens, float32 "
            "inputs", fla_vs_ours(layouts, sizes, batch, device))
    return '\n'.join(sections)


def fla_vs_ours(layouts, sizes, batch, device, T=256, rounds=10):
    """Each linear rule's update, forward and backward, on fla's kernels (linear_fla) and on ours
    (linear_chunked), taking turns, from the inputs LinearAttention feeds them: ms, and the largest
    difference of output and gradients. Where fla cannot run, one line that says so (the sections
    above then ran ours)."""
    if not fla_runs(torch.empty(0, device=device)):
        why = (f"fla's kernels run on CUDA, not {device}." if find_spec('fla') else
               "fla is not installed here (pip install -r requirements-gpu.txt).")
        return "Not measured: " + why
    H, d, rows = sizes['n_head'], sizes['n_embd'] // sizes['n_head'], []
    kernels = {'ours': linear_chunked, 'fla': linear_fla}
    for layout in (a for a in layouts if a in LINEAR_RULES):
        forget, delta = LINEAR_RULES[layout]
        q, k, v, g, beta, do = rule_inputs(layout, forget, delta, (batch, H, T, d), device)
        xs = [x.requires_grad_() for x in (q, k, v, g, beta) if x is not None]
        out = {}

        def run(name, f):
            chunk = [64] if f is linear_chunked else []
            y = f(q, k, v, g, beta, None, delta, *chunk, keep_state=False)[0]
            out[name] = [y, *torch.autograd.grad(y, xs, do, allow_unused=True)]
        fns = {name: lambda name=name, f=f: run(name, f) for name, f in kernels.items()}
        times = take_turns(fns, device, rounds + 1)
        # round 0: the warm-up
        ms = {name: statistics.median(t[1:]) * 1000 for name, t in times.items()}
        diff = max((a - b).abs().max().item() for a, b in zip(out['ours'], out['fla'])
                   if a is not None)
        rows.append(row(layout, f"{ms['ours']:.2f}", f"{ms['fla']:.2f}",
                        f"{ms['ours'] / ms['fla']:.1f}x", f"{diff:.1e}"))
    header = ['layout', 'ours, ms', 'fla, ms', 'fla faster by',
              'largest difference (output, gradients)']
    return table(header, rows)


def rule_inputs(layout, forget, delta, shape, device):
    """What LinearAttention feeds a rule's update, random (seeded): q, k, v, the log decay g,
    beta, and a gradient for the output."""
    B, H, T, d = shape
    gen = torch.Generator(device).manual_seed(0)
    rand = lambda *size: torch.randn(*size, device=device, generator=gen)
    unit = lambda x: torch.nn.functional.normalize(x, dim=-1)
    if layout == 'linear':  # phi's features: > 0; v's last channel of ones sums the normalizer
        q, k = rand(*shape).sigmoid(), rand(*shape).sigmoid()
        v = torch.cat([rand(*shape), torch.ones(B, H, T, 1, device=device)], -1)
    else:
        q, k = unit(rand(*shape)) * d ** -0.5, unit(rand(*shape))
        v = rand(*shape)
    g = -rand(B, H, T).abs() if forget else None
    beta = rand(B, H, T).sigmoid() if delta else torch.ones(B, H, T, device=device)
    return q, k, v, g, beta, rand(*v.shape)
