"""The README's tables are bench.py's output: the cache table recomputed here, the measured ones
exactly as committed in results/ (not typed by hand)."""
import os
import re
import shutil
import subprocess
import sys

import pytest

from bench import parse
from benchmarks import cache
from benchmarks.common import readme_section
from conftest import ROOT


def test_readme_cache_table_matches_the_code():
    with open(os.path.join(ROOT, 'README.md')) as f:
        readme = f.read()
    section = re.search(r"<!-- cache-table -->\n(.*?)<!-- /cache-table -->", readme, re.S)
    assert section, "README.md lost its cache-table section"
    args, error = parse(['cache'])  # its defaults: the models/ folder, the chapter's sizes
    cache.check(args, error)
    assert section.group(1) == readme_section('cache', cache.report(args)), \
        "README table is stale: run `python bench.py cache --readme`"


def test_bench_cache_rejects_unknown_layout():
    r = subprocess.run([sys.executable, 'bench.py', 'cache', '--layouts', 'mha,flash'], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode != 0
    assert ("'mha,flash': choose from mha,gqa,mqa,mla,linear" in r.stderr
            and 'Traceback' not in r.stderr)


@pytest.mark.parametrize('mode', ['train', 'decode', 'convert', 'mqar'])
def test_readme_tables_are_the_committed_bench_output(mode):
    """README's measured tables are exactly the headline of what `python bench.py MODE` last wrote
    to results/MODE.md."""
    with open(os.path.join(ROOT, 'README.md')) as f:
        section = re.search(f"<!-- {mode}-table -->\n(.*?)<!-- /{mode}-table -->", f.read(),
                            re.S)
    with open(os.path.join(ROOT, 'results', f'{mode}.md')) as f:
        assert section and section.group(1) == readme_section(mode, f.read()), \
            f"run `python bench.py {mode} --readme` (or restore results/{mode}.md)"


# (what a command runs, trailing flags that shorten it): appended as a user could,
# the command as typed
SHORTER = [
    ('bench.py decode', ' --layouts=mha,gated_deltanet --n_layer=1 --n_head=2 --n_embd=32 --batch=1'
                        ' --t=16 --contexts=8,16 --gen_tokens=4'),
    ('bench.py mqar', ' --layouts=mha,gated_deltanet --max_iters=5'),
    ('train.py --help', ''),
    ('train.py', ' --max_iters=3 --eval_iters=2 --batch_size=8'),
    ('sample.py --compile', ' --max_new_tokens=4 --num_samples=1'),
    ('sample.py', ' --max_new_tokens=40 --num_samples=2'),
]


def readme_commands(readme):
    """Every command of the README's sh blocks, in order (a line continued with a backslash joined,
    comments cut)."""
    blocks = re.findall(r"```sh\n(.*?)```", readme, re.S)
    return [line.split('  #')[0].strip()
            for block in blocks for line in block.replace('\\\n', ' ').splitlines()
            if line.split('  #')[0].strip()]


@pytest.mark.slow
def test_every_readme_command_works_as_typed_in_order(tmp_path):
    """Each command of the README in a fresh copy of the repo (no data, no out*/), in the README's
    order, as a new user types them: shortened by trailing flags only; the first line's install and
    the test suite itself not run. Then what the README promises of them: sample.py says what it
    picked, --compare finds the same tokens, the offline W&B run is one that `wandb sync` finds."""
    from conftest import SHAKESPEARE
    files = subprocess.run(['git', 'ls-files'], cwd=ROOT,
                           capture_output=True, text=True).stdout.split()
    for f in files:
        os.makedirs(os.path.dirname(tmp_path / f) or tmp_path, exist_ok=True)
        if os.path.isfile(os.path.join(ROOT, f)):
            shutil.copy(os.path.join(ROOT, f), tmp_path / f)
    shutil.copy(SHAKESPEARE, tmp_path / 'my.txt')  # "your own text"
    env = {k: v for k, v in os.environ.items() if not k.startswith('WANDB')}
    env.update(SHAKESPEARE_PATH=SHAKESPEARE, HOME=str(tmp_path))
    # (its placeholder path: env above sets the real one)
    commands = [c for c in readme_commands(open(os.path.join(ROOT, 'README.md')).read())
                if not c.startswith('export SHAKESPEARE_PATH=')]
    assert (commands[0].startswith('pip install -r requirements.txt && python train.py')
            and len(commands) >= 15)
    ran = []
    for typed in commands + ['python -m wandb sync --dry-run']:
        if typed.startswith('python -m pytest'):
            continue
        parts = [p.strip() for p in typed.split('&&') if not p.strip().startswith('pip install')]
        command = ' && '.join(
            p + next((more for what, more in SHORTER if what in p), '')
            for p in (q.replace('python', sys.executable, 1) if q.startswith('python') else q
                      for q in parts))
        r = subprocess.run(command, shell=True, cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=900)
        # GPT-2's BPE and weights need a download (and its weights transformers): offline, one line
        offline = ('tiktoken', 'cannot load GPT-2 from gpt2', 'requirements-hf.txt')
        if (('--dataset=shakespeare ' in typed + ' ' or '--init_from=gpt2' in typed)
                and r.returncode and any(s in r.stderr for s in offline)):
            assert len(r.stderr.strip().splitlines()) == 1, r.stderr
            continue
        assert r.returncode == 0 and 'Traceback' not in r.stderr, \
            (command, r.stdout[-2000:], r.stderr[-2000:])
        ran.append(typed)
        if typed == 'python sample.py':
            assert re.match(r"sampling out-shakespeare-char-gqa/ckpt.pt: gqa, trained on "
                            r"shakespeare_char \(65 tokens\), iteration 3, val loss [\d.]+, saved ",
                            r.stderr), r.stderr
        if typed == 'python sample.py --compare':
            assert 'tokens identical' in r.stdout and 'yes' in r.stdout
        if 'sync' in typed:
            said = r.stdout + r.stderr
            assert re.search(r"Would sync 1 run\(s\):\s*wandb: +wandb/", said), said
        if typed.startswith('python train.py config/'):
            # its closing line
            assert re.search(r"^done at iteration 3: best val loss [\d.]+ at iteration \d; "
                             r"the best weights in ", r.stdout, re.M), r.stdout
    # all but the suite (and offline, the BPE run and GPT-2's two)
    assert len(ran) >= len(commands) - 4
