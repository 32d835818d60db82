"""
What every report shares: the layouts by bench.py's names, the machine, progress lines, markdown
tables, plots saved with the report, the README's copy of a report's headline, and the flags.
"""
import os
import platform
import re
import runpy
import sys
import time

import torch

from configurator import checked
from model import ATTN_LAYOUTS
from run.checkpoint import FileError, write_atomic

# no 'USDT: profiler_start' lines (inductor profiles GPU kernels)
os.environ.setdefault('KINETO_LOG_LEVEL', '6')
START = time.time()
# between a report's headline (what README.md shows) and its details
MORE = "\n<!-- the README shows the report down to here -->\n"
# saved once the whole report is done: a run that fails or is stopped leaves the saved ones alone
PLOTS = []
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def stack(name):
    """config/NAME.py's attention: its attn, window and sinks (GPTConfig's fields)."""
    config = runpy.run_path(os.path.join(ROOT, 'config', f'{name}.py'))
    return {k: config[k] for k in ('attn', 'window', 'n_sink') if k in config}


# bench's names: each layout, and the stacks of config/NAME.py (GPTConfig(**LAYOUTS[name]))
LAYOUTS = {**{a: {'attn': a} for a in ATTN_LAYOUTS},
           **{name: stack(name) for name in ('hybrid', 'sliding', 'local_global')}}
HYBRID = LAYOUTS['hybrid']['attn']

# --- the machine, progress, tables and plots ------------------------------------------------------

def machine():
    cpu = platform.processor() or platform.machine()
    if os.path.isfile('/proc/cpuinfo'):  # Linux: the CPU's model name
        names = (ln.split(':', 1)[1].strip() for ln in open('/proc/cpuinfo')
                 if ln.startswith('model name'))
        cpu = next(names, cpu)
    threads = torch.get_num_threads()
    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, {threads} threads"


def progress(what):
    """One line on stderr per run or layout of a long benchmark: never silent for minutes."""
    print(f"[{time.time() - START:5.0f} s] {what}", file=sys.stderr, flush=True)


def compile_options(device):
    """fullgraph=True: one graph or an error, never a silent eager fallback; on CUDA, CUDA graphs
    too. dynamic=False: every model its own static graph (the same step code serves ten layouts:
    automatic dynamic shapes made a K/V head count symbolic, and SDPA refused it), and room for them
    all before the recompile limit fails the run."""
    torch._dynamo.reset()
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    mode = 'reduce-overhead' if device.startswith('cuda') else None
    return dict(fullgraph=True, dynamic=False, mode=mode)


def table(header, rows):  # markdown
    return "\n".join([f"| {' | '.join(header)} |", "|---" * len(header) + "|", *rows]) + "\n"


def row(*cells):  # a markdown table's row
    return "| " + " | ".join(str(c) for c in cells) + " |"


LEGEND_OUTSIDE = dict(fontsize=7, loc='upper left', bbox_to_anchor=(1.01, 1))  # right of the axes


def plot(path, lines, legend, **axes):
    """One figure for path, saved with the report (PLOTS): lines are (xs, ys, label, matplotlib
    style); axes: title, labels, scales."""
    # lazy: only the reports that plot load it; no pyplot, no backend to choose
    from matplotlib.figure import Figure
    fig = Figure(figsize=(7, 4.5), layout='tight')
    ax = fig.subplots()
    for xs, ys, label, style in lines:
        ax.plot(xs, ys, label=label, **style)
    ax.set(**axes)
    ax.grid(alpha=0.3, which='both')
    ax.legend(**legend)
    PLOTS.append(lambda: write_atomic(path, lambda f: fig.savefig(f, dpi=110, format='png')))


# --- a report's command line, and README.md's copy of its headline --------------------------------

def command(args, *options, every=LAYOUTS):
    """A report's command line: the report, its options, --layouts if not all of every, the
    extras."""
    layouts = getattr(args, 'layouts', list(every))
    words = ['python bench.py', args.mode, *options]
    if layouts != list(every):
        words.append(f"--layouts={','.join(layouts)}")
    if getattr(args, 'extra', []):  # train.py's flags
        words += ['--', *args.extra]
    return ' '.join(words)


def markers(mode):
    """The lines around README.md's copy of a report's headline."""
    return f"<!-- {mode}-table -->", f"<!-- /{mode}-table -->"


def readme_section(mode, report, out='results'):
    """What README.md shows of a report: its headline, its plots' links relative to the README."""
    headline = re.sub(r"(!\[[^]]*\]\()", rf"\g<1>{out}/", report.split(MORE)[0])
    return headline + f"\nThe whole report: [{out}/{mode}.md]({out}/{mode}.md).\n"


def rewrite_readme(mode, report, out):
    """README.md's section of the report replaced by its headline, written whole or not at all."""
    start, end = markers(mode)
    # read again: it may have been edited meanwhile
    readme = open('README.md').read() if os.path.isfile('README.md') else ''
    if not (start in readme and end in readme.split(start, 1)[-1]):
        raise FileError(f"README.md lost its '{start}' ... '{end}' section while this ran: the "
                        f"report is in {out}/{mode}.md, README.md is unchanged")
    head, rest = readme.split(start, 1)
    section = readme_section(mode, report, out)
    write_atomic('README.md', head + start + "\n" + section + end + rest.split(end, 1)[1])


# --- the flags ------------------------------------------------------------------------------------

count = checked(int, lambda v: v >= 1, "give an integer >= 1")


def listed(kind, ok, rule):
    """An argparse type: a comma-separated list, each item once, sorted, that passes ok."""
    return checked(lambda text: sorted({kind(x) for x in text.split(',')}), ok, rule)


def layout_list(names):
    """An argparse type: a comma-separated subset of names, in names' order."""
    def in_order(text):
        named = set(text.split(','))
        return [a for a in names if a in named] if named <= set(names) else []
    return checked(in_order, bool, "choose from " + ','.join(names))


def flag(p, name, default, kind, what):
    """--name on parser p, its help ending in its default (a string default is parsed by kind)."""
    default_is = f" (default: {default})" * bool(default)
    p.add_argument(f'--{name}', default=default, type=kind, help=what + default_is)


def add_layouts(p, default=None, names=LAYOUTS):
    flag(p, 'layouts', default or ','.join(names), layout_list(names),
         'a comma-separated subset of the layouts')


def iterations(args, error, default):
    """--max_iters, default if not given; with --readme no fewer (a 3-step run is no result)."""
    max_iters = args.max_iters or default
    if args.readme and max_iters < default:
        error(f"--max_iters={max_iters}: --readme publishes runs of at least {default} iterations, "
              "the default; a shorter run writes to --out")
    return max_iters


def add_device(p, what, default='cpu'):
    flag(p, 'device', default, str, 'cpu or cuda[:N]' + what)
