"""bench.py runs on tiny configs and writes its tables and plots (no timing is asserted)."""
import os
import re
import subprocess
import sys

from conftest import ROOT


def bench(*args):
    r = subprocess.run([sys.executable, 'bench.py', *args], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def test_decode_report_on_a_tiny_model(tmp_path):
    out = bench('decode', '--n_layer=1', '--n_head=4', '--n_embd=16', '--contexts=8,32', '--gen_tokens=12', '--step_T=32',
                f'--out={tmp_path}')
    assert out.startswith((tmp_path / 'decode.md').read_text())
    assert (tmp_path / 'decode.png').stat().st_size > 10_000
    ratios = re.findall(r"\| (mha|gqa|mqa|mla|linear) \| (\d+) \| [\d,]+ \| [\d,]+ \| [\d.,]+ \| ([\d.]+) \|", out)
    assert len(ratios) == 10 and all(r == '1.000' for _, _, r in ratios)  # measured / formula, every layout
    assert out.count('| yes |') == 10  # identical greedy tokens with and without the cache, batch 1 and 8
    assert '| MHA (h_kv = 32) | 512.00 | 4.00 |' in out and '| GQA (h_kv = 8) | 128.00 | 1.00 |' in out
    assert '| MQA (h_kv = 1) | 16.00 | 0.12 |' in out and '| MLA (d_c = 512, d_R = 64) | 36.00 | 0.28 |' in out
    assert '| weights: 7e9 parameters at fp16 | | 13.0 |' in out
    assert re.search(r"outputs agree to \d\.\de-\d\d", out)


def test_train_report_on_a_tiny_model(tmp_path, char_data):
    out = bench('train', '--layouts=mha,linear', '--max_iters=4', f'--out={tmp_path}', '--',
                '--n_layer=1', '--n_embd=32', '--eval_iters=2', f'--data_dir={char_data}')
    assert (tmp_path / 'train_val_loss.png').stat().st_size > 10_000
    rows = re.findall(r"\| (mha|linear) \| [\d.]+M \| [\d,]+ \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d,]+ \|", out)
    assert rows == ['mha', 'linear']
    assert os.path.isfile(tmp_path / 'train' / 'mha' / 'metrics.jsonl')


def test_bad_arguments_are_one_line():
    for args, msg in ((['decode', '--contexts=8,x'], "--contexts '8,x': give comma-separated integers"),
                      (['train', '--max_iters=0'], "--max_iters=0 must be >= 1"),
                      (['decode', '--layouts=mha,flash'], "unknown layout(s) ['flash']")):
        r = subprocess.run([sys.executable, 'bench.py', *args], cwd=ROOT, capture_output=True, text=True)
        assert r.returncode == 2 and msg in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
