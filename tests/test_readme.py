"""The README's tables are bench.py's output: the cache table recomputed here, the measured ones exactly as
committed in results/ (not typed by hand)."""
import os
import re
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
    assert section.group(1) == bench.cache_table(), "README table is stale: run `python bench.py cache --readme`"


def test_bench_cache_rejects_unknown_layout():
    r = subprocess.run([sys.executable, 'bench.py', 'cache', '--layouts', 'mha,flash'], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode != 0
    assert "unknown layout(s) ['flash']" in r.stderr and 'Traceback' not in r.stderr


@pytest.mark.parametrize('mode', ['train', 'decode', 'convert'])
def test_readme_tables_are_the_committed_bench_output(mode):
    """README's measured tables are exactly what `python bench.py MODE` last wrote to results/MODE.md."""
    with open(os.path.join(ROOT, 'README.md')) as f:
        section = re.search(f"<!-- {mode}-table -->\n(.*?)<!-- /{mode}-table -->", f.read(), re.S)
    with open(os.path.join(ROOT, 'results', f'{mode}.md')) as f:
        assert section and section.group(1) == f.read(), f"run `python bench.py {mode} --readme` (or restore results/{mode}.md)"
