"""
Benchmarks that print numbers measured side by side in one run (never timed tests). Each report
writes its whole text to --out/REPORT.md (default out-bench/); --readme writes results/REPORT.md and
puts its headline into README.md. A report is a module of benchmarks/, with its own flags:
`python bench.py REPORT --help`.

    python bench.py cache                 # cache bytes per token: the formula vs a real cache
    python bench.py train                 # every layout on the CPU preset: losses, speed, curves
    python bench.py train --nanogpt PATH  # ... and the training step next to nanoGPT's model.py
    python bench.py decode                # decode roofline, decode vs context, generation
    python bench.py decode --compile      # ... and the roofline's step compiled (a static cache)
    python bench.py convert               # MHA -> GQA / MQA (mean-pooled), MLA (SVD), uptrained
    python bench.py mqar                  # associative recall: what a fixed state can hold
    python bench.py gpu --nanogpt PATH    # the one GPU report: roofline, generation, step, fla
"""
from run.interrupts import (end_on_lost_output, exit_at_once, exit_on_signals,
                            memory_errors_in_one_line, on_closed_output)

# first: Ctrl-C (and SIGTERM, SIGHUP) during the slow imports below is one line too
if __name__ == '__main__':
    exit_at_once()

import os
import tempfile

import torch

from benchmarks import cache, convert, decode, gpu, mqar, train
from benchmarks.common import HYBRID, MORE, PLOTS, markers, rewrite_readme
from configurator import Parser, fail
from run.checkpoint import FileError, write_atomic

# the flags a --readme run may change: where and on what it runs, and what it sweeps
PUBLISHABLE = ('mode', 'out', 'readme', 'device', 'nanogpt', 'max_iters', 'lrs')
REPORTS = {'cache': cache, 'train': train, 'decode': decode, 'convert': convert, 'mqar': mqar,
           'gpu': gpu}


def parse(argv):
    """The report and its flags; a report's errors: one line that points to its own --help."""
    p = Parser(prog='bench.py', description=__doc__, allow_abbrev=False)  # --seed is not --seeds
    reports = p.add_subparsers(dest='mode', required=True, title='reports')
    for mode, module in REPORTS.items():
        doc = module.__doc__.strip()  # its first line: 'bench.py MODE: what it measures.'
        what = doc.splitlines()[0].split(': ', 1)[1].rstrip('.')
        sub = reports.add_parser(mode, help=what, description=doc, allow_abbrev=False)
        module.add_arguments(sub)
        out = 'results/gpu' if mode == 'gpu' else 'out-bench'
        sub.add_argument('--out', help=f"folder for runs, reports and plots (default: {out}; "
                                       "with --readme: results)")
        sub.add_argument('--readme', action='store_true',
                         help="put the report's headline into README.md")
    args, unknown = p.parse_known_args(argv)
    error = reports.choices[args.mode].error
    if unknown:
        extras = args.mode in ('train', 'convert')
        hint = " (train.py's keys go after --, for train and convert)" * extras
        error(f"unrecognized arguments: {' '.join(unknown)}{hint}")
    # a README table is the report at its defaults, whole: a partial or changed run once rewrote
    # the train table's 85 rows as 76 (--max_iters: at least the default, checked by the report)
    defaults = vars(p.parse_known_args([args.mode])[0])
    changed = [k for k, v in vars(args).items() if k not in PUBLISHABLE and v != defaults[k]]
    if args.readme and changed:
        flag = "train.py's keys after --" if changed[0] == 'extra' else f"--{changed[0]}"
        error(f"{flag}: --readme publishes a report at its defaults (every layout, the README's "
              f"sizes); a run with {flag} writes to --out")
    return args, error


def main(argv=None):
    exit_on_signals()  # SIGTERM, SIGHUP: one line; the with blocks still end mqar's workers
    on_closed_output(end_on_lost_output)  # the report is in --out already when it is printed
    PLOTS.clear()
    args, error = parse(argv)
    memory_errors_in_one_line(f"bench.py {args.mode} --help lists them")  # e.g. --t too large
    report = REPORTS[args.mode]
    if args.out == '':
        error("--out='': give a folder to write the results in")
    if args.readme and args.out is not None and os.path.normpath(args.out) != 'results':
        error(f"--out={args.out!r}: with --readme: the README links to results/, where --readme writes")
    args.out = 'results' if args.readme else args.out or ('results/gpu' if args.mode == 'gpu'
                                                          else 'out-bench')
    path = os.path.join(args.out, f'{args.mode}.md')
    readme = open('README.md').read() if args.readme and os.path.isfile('README.md') else ''
    start, end = markers(args.mode)
    try:  # every flag and file checked before any work
        report.check(args, error)
        if args.readme and end not in readme.partition(start)[2]:  # (both, in this order)
            raise ValueError(f"no README.md here with a '{start}' ... '{end}' section to rewrite")
        os.makedirs(args.out, exist_ok=True)
        tempfile.TemporaryFile(dir=args.out).close()  # writable? (os.access says yes to root)
        if os.path.isdir(path):  # found now, not after the runs
            raise ValueError(f"{path} is a folder, where the report goes: move it, or give another --out")
    except ValueError as e:
        hybrid = " (that is config/hybrid.py's 'hybrid': leave it out with --layouts)"
        error(str(e) + hybrid * (HYBRID in str(e)))
    except OSError as e:
        error(f"--out {args.out!r}: {e.strerror}; give a folder to write the results in")
    torch.manual_seed(0)
    try:  # each file whole or not at all: a full disk leaves the old one
        text = report.report(args)  # (decode and gpu write theirs as they go)
        for save in PLOTS:
            save()
        write_atomic(path, text)
        partial = os.path.join(args.out, f'{args.mode}.partial.md')  # what decode and gpu wrote
        if os.path.isfile(partial):  # as they went: the report is whole now
            os.remove(partial)
        if args.mode != 'gpu':  # (gpu printed each section as it finished)
            print(text.replace(MORE, '\n'))  # (the README's marker is for the file)
        if args.readme:
            rewrite_readme(args.mode, text, args.out)
    except FileError as e:
        fail(str(e))


if __name__ == '__main__':
    main()
