"""The README's tables are bench.py's output: the cache table recomputed here, the measured ones exactly as
committed in results/ (not typed by hand)."""
import os
import re
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT

import bench


def test_readme_cache_table_matches_the_code():
    with open(os.path.join(ROOT, 'README.md')) as f:
        readme = f.read()
    section = re.search(r"<!-- cache-table -->\n(.*?)<!-- /cache-table -->", readme, re.S)
    assert section, "README.md lost its cache-table section"
    assert section.group(1) == bench.readme_section('cache', bench.cache_report()), \
        "README table is stale: run `python bench.py cache --readme`"


def test_bench_cache_rejects_unknown_layout():
    r = subprocess.run([sys.executable, 'bench.py', 'cache', '--layouts', 'mha,flash'], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode != 0
    assert "'mha,flash': choose from mha,gqa,mqa,mla,linear" in r.stderr and 'Traceback' not in r.stderr


@pytest.mark.parametrize('mode', ['train', 'decode', 'convert', 'mqar'])
def test_readme_tables_are_the_committed_bench_output(mode):
    """README's measured tables are exactly the headline of what `python bench.py MODE` last wrote to results/MODE.md."""
    with open(os.path.join(ROOT, 'README.md')) as f:
        section = re.search(f"<!-- {mode}-table -->\n(.*?)<!-- /{mode}-table -->", f.read(), re.S)
    with open(os.path.join(ROOT, 'results', f'{mode}.md')) as f:
        assert section and section.group(1) == bench.readme_section(mode, f.read()), \
            f"run `python bench.py {mode} --readme` (or restore results/{mode}.md)"


@pytest.mark.slow
def test_first_success_as_typed_in_a_fresh_copy(tmp_path):
    """The README's first-success path in a copy of the repo (no data, no out*/): train, sample with and without
    the cache as typed, --help, convert a CPU-preset MHA checkpoint with the README's line, and an offline W&B
    run that `wandb sync` finds from the repo root. Training runs are shortened by trailing flags only."""
    from conftest import SHAKESPEARE
    readme = open(os.path.join(ROOT, 'README.md')).read()
    files = subprocess.run(['git', 'ls-files'], cwd=ROOT, capture_output=True, text=True).stdout.split()
    for f in files:
        os.makedirs(os.path.dirname(tmp_path / f) or tmp_path, exist_ok=True)
        if os.path.isfile(os.path.join(ROOT, f)):
            shutil.copy(os.path.join(ROOT, f), tmp_path / f)
    env = {k: v for k, v in os.environ.items() if not k.startswith('WANDB')}
    env.update(SHAKESPEARE_PATH=SHAKESPEARE, HOME=str(tmp_path))
    short = ' --max_iters=3 --eval_iters=2 --batch_size=8'
    for typed, extra in (('python train.py config/gqa.py config/cpu.py', short), ('python sample.py --use_cache', ''),
                         ('python sample.py --compare', ''), ('python train.py --help', ''),
                         ('python train.py config/mha.py config/cpu.py', short),
                         ('python train.py config/gqa.py config/cpu.py --init_from', ''),
                         ('python train.py config/mha.py --batch_size=32 --wandb_log=True --out_dir=out-wandb', short),
                         ('python -m wandb sync --dry-run', '')):
        command = typed
        if 'init_from' in typed:  # the README's conversion line, as written there
            command = re.search(r"(python train.py config/gqa.py config/cpu.py \\\s*--init_from=\S+ --out_dir=\S+ "
                                r"--max_iters=\d+ --lr_decay_iters=\d+)", readme).group(1).replace('\\\n', ' ') + short
        else:
            assert typed in readme or typed.startswith('python -m wandb'), typed
        r = subprocess.run(command.replace('python', sys.executable, 1) + extra, shell=True, cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0 and 'Traceback' not in r.stderr, (command, r.stdout[-2000:], r.stderr[-2000:])
        if typed.startswith('python sample.py'):
            assert 'sampling out-shakespeare-char-gqa/ckpt.pt' in r.stderr, r.stderr
        if 'compare' in typed:
            assert 'tokens identical' in r.stdout and 'yes' in r.stdout
        if 'sync' in typed:
            assert re.search(r"Would sync 1 run\(s\):\s*wandb: +wandb/", r.stdout + r.stderr), r.stdout + r.stderr
