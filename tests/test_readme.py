"""The README's cache table is the output of `python bench.py cache`, not typed by hand."""
import os
import re
import subprocess
import sys

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
