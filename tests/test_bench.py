"""bench.py runs on tiny configs and writes its tables and plots (no timing is asserted)."""
import argparse
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from bench import main as bench_main
import ops.softmax
from benchmarks import cache as bench_cache, decode, models as bench_models, mqar, train
from benchmarks.common import LAYOUTS, MORE, readme_section
from benchmarks.models import CHAPTER, from_sizes, read_config
from benchmarks.timing import take_turns
from data.mqar.prepare import zoology
from conftest import ROOT, digest, one_line, run
from model import GPT, GPTConfig


def bench(*args):
    r = subprocess.run([sys.executable, 'bench.py', *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    # progress, never silent
    assert args[0] == 'cache' or re.search(r"^\[ *\d+ s\] \S", r.stderr, re.M), r.stderr
    # every plot: a file in --out, linked relative to the report (it sits in --out too)
    out = next((a.split('=', 1)[1] for a in args if a.startswith('--out=')), 'out-bench')
    links = re.findall(r"!\[[^]]*\]\(([^)]+)\)", r.stdout)
    assert all(os.path.isfile(os.path.join(out, link)) and '/' not in link
               for link in links), r.stdout
    assert MORE not in r.stdout  # the README's marker is for the file, not the terminal
    return r.stdout


def saved(path):
    """The report bench.py wrote, as it prints it (without the README's marker)."""
    return path.read_text().replace(MORE, '\n')


NAMES = ['mha', 'gqa', 'mqa', 'mla', 'linear', 'gated_deltanet', 'hybrid']


def test_decode_report_on_a_tiny_model(tmp_path):
    out = bench('decode', '--n_layer=4', '--n_head=4', '--n_embd=16', '--contexts=8,32',
                '--gen_tokens=12', '--batch=3', '--t=40', f'--out={tmp_path}',
                f'--layouts={",".join(NAMES)}')
    assert out.startswith(saved(tmp_path / 'decode.md'))
    assert not (tmp_path / 'decode.partial.md').exists()  # (written as it went, gone once whole)
    assert (tmp_path / 'decode.png').stat().st_size > 10_000
    assert (tmp_path / 'roofline.png').stat().st_size > 10_000
    roof = re.findall(r"\| (\w+) \| ([\d.,e+]+) MB \| ([\d.e+-]+) \| ([\d.e+-]+) \| ([\d.e+-]+) \| "
                      r"(bytes|FLOPs) \| ([\d.e+-]+) \| \*\*([\d.e+-]+)%\*\* \|", out)
    assert [r[0] for r in roof] == NAMES
    # bytes read = every weight + the filled cache
    for attn, mb, gflop, bytes_ms, flop_ms, binds, ms, pct in roof:
        cfg = GPTConfig(**LAYOUTS[attn], n_layer=4, n_head=4, n_embd=16, block_size=41,
                        kv_lora_rank=16, rope_head_dim=2)
        # MLA at d_c = 4 head_dim, d_R = head_dim / 2
        weights = sum(p.numel() for p in GPT(cfg).parameters()) * 4
        # t + 1 keys
        assert float(mb) == pytest.approx((weights + 3 * cfg.cache_bytes(41)) / 1e6, rel=5e-3)
        assert float(gflop) > 0
        assert binds == ('bytes' if float(bytes_ms) >= float(flop_ms) else 'FLOPs')
        floor_ms = max(float(bytes_ms), float(flop_ms))
        # 3 digits
        assert float(pct) == pytest.approx(100 * floor_ms / float(ms), rel=0.02)
    flops = {r[0]: float(r[2]) for r in roof}
    # absorbed MLA: per head, d_c + d_R per key for the score and d_c for the value
    assert flops['mla'] > flops['mha']
    # (anchored: a profile row whose step prints as an integer must not match)
    costs = re.findall(r"^\| ([a-z_]+) \| ([\d.e-]+) / ([\d.,]+) \| ([\d.e-]+) / ([\d.,]+) \|", out,
                       re.M)
    assert [c[0] for c in costs] == NAMES
    gen = re.findall(r"\| (\w+) \| (1|8) \| [\d.,]+ \| [\d.,]+ \| [\d.]+x \| yes \|", out)
    # identical greedy tokens with and without the cache, batch 1 and 8
    assert len(gen) == 2 * len(NAMES)
    # where each step's time goes: its parts next to their floors, its busiest aten ops, and what
    # the named ones do
    num = r"([\d.e+-]+)"
    parts = re.findall(rf"^\| (\w+) \| {num} \| {num} / {num} \| {num} / {num} \| {num} \| \d+ "
                       r"\| `aten::", out, re.M)
    assert [p[0] for p in parts] == NAMES
    for attn, step, attention, _, weights, _, rest in parts:  # the parts add up to the step
        total = float(attention) + float(weights) + float(rest)
        assert total == pytest.approx(float(step), rel=0.02)
        assert min(float(step), float(rest)) > 0 and min(float(attention), float(weights)) >= 0
    assert all(float(p[2]) > 0 for p in parts)  # every layout's (a linear one's: its state's)
    assert "- `aten::mm`: the weights" in out
    headline = readme_section('decode', (tmp_path / 'decode.md').read_text(), str(tmp_path))
    assert '**Roofline' in headline and 'Decode cost vs context' not in headline
    assert f'{tmp_path}/decode.md' in headline


def test_take_turns_shuffles_the_order():
    """Every measurement takes turns: each fn once a round, in an order that changes (so neighbours
    change too)."""
    calls = []
    times = take_turns({k: lambda k=k: calls.append(k) for k in 'abcdef'}, 'cpu', rounds=5)
    rounds = [''.join(calls[i:i + 6]) for i in range(0, 30, 6)]
    assert all(sorted(r) == list('abcdef') for r in rounds) and len(set(rounds)) == 5
    # what runs just before 'a' changes
    assert len({r[r.index('a') - 1] for r in rounds if r[0] != 'a'}) > 1
    assert {k: len(v) for k, v in times.items()} == dict.fromkeys('abcdef', 5)
    assert min(min(times.values())) >= 0


def test_roofline_times_a_compiled_step(monkeypatch):
    """The compiled column is a real torch.compile(fullgraph=True) of the step over a static cache
    (a graph break would raise)."""
    uncompiled, flex = [], ops.softmax.flex_attention

    def counted_flex(*args, **kwargs):
        uncompiled.extend([1] * (not torch.compiler.is_compiling()))
        return flex(*args, **kwargs)
    monkeypatch.setattr(ops.softmax, 'flex_attention', counted_flex)
    runs = decode.roofline(['mqa'], dict(n_layer=1, n_head=4, n_embd=16), 2, [16], 'cpu',
                           torch.float32, compile=True, rounds=2)
    run = runs['mqa', 16]
    assert set(run['ms']) == {'eager', 'compiled'} and all(v > 0 for v in run['ms'].values())
    assert run['bandwidth'] > 1e8 and run['rate'] > 1e8
    # its static cache is filled by a copy, never by FlexAttention run uncompiled (slow, a warning)
    assert uncompiled == []


def test_a_static_copy_holds_what_the_cache_holds():
    model = GPT(GPTConfig(attn='mla', n_layer=2, n_head=4, n_embd=16, block_size=24)).eval()
    idx = torch.randint(0, 65, (2, 11))
    cache = model.init_cache(2)
    with torch.no_grad():
        model(idx[:, :10], cache=cache)
        static = decode.static_copy(model, cache, 2)
        assert torch.is_tensor(static.pos) and len(static) == len(cache) == 10
        torch.testing.assert_close(model(idx[:, 10:], cache=static)[0],
                                   model(idx[:, 10:], cache=cache)[0])


def test_a_long_prefill_says_where_it_is(capsys):
    """Prefilling a long context (hours at 2^20 tokens on a CPU) prints a progress line every 64
    chunks."""
    decode.roofline(['linear'], dict(n_layer=1, n_head=2, n_embd=8), 1, [130], 'cpu', torch.float32,
                    rounds=1, chunk=1)
    said = [line.split('] ', 1)[1] for line in capsys.readouterr().err.splitlines()]
    assert said == ['decode steps at batch 1: linear', 'linear, eager: prefilled 64 of 130 tokens',
                    'linear, eager: prefilled 128 of 130 tokens']


@pytest.mark.slow
def test_generation_compiled_over_a_static_cache_gives_the_same_tokens():
    table = decode.generation(['gqa', 'linear'], dict(n_layer=1, n_head=4, n_embd=16), 'cpu',
                              torch.float32, compile=True, new=40, batches=(1, 2))
    assert 'tokens/s, cache, compiled' in table
    # each way against no cache
    assert 'identical tokens, cache | identical tokens, cache, compiled' in table
    assert len(re.findall(r"\| (gqa|linear) \| (1|2) \| [\d.,]+ \| [\d.,]+ \| [\d.,]+ \| [\d.]+x "
                          r"\| yes \| yes \|", table)) == 4


def test_cache_report(tmp_path):
    out = bench('cache', '--layouts=mha,mqa', f'--out={tmp_path}')
    assert out.startswith(saved(tmp_path / 'cache.md'))
    # 2 * n_layer * h_kv * d_k
    per_token = dict(re.findall(r"^\| (mha|mqa) \| \d+ \| ([\d,]+) \|", out, re.M))
    assert per_token == {'mha': f"{2 * 6 * 6 * 64:,}", 'mqa': f"{2 * 6 * 1 * 64:,}"}
    toy = out.split('**')[0]  # (then the published models)
    ratios = re.findall(r"^\| (mha|gqa|mqa|mla|linear) \| .* \| ([\d.]+) \|$", toy, re.M)
    assert ratios == [('mha', '1.000'), ('mqa', '1.000')]  # measured / formula
    # then the chapter's model and the published ones, each re-laid out
    # at each context (8,192 and 131,072 tokens), and next to the weights at the longest
    assert "| mla | 32 x MLA, d_c 512 + d_R 64 | 36 | 0.28 | 4.50 | 0.35 |" in out
    assert re.search(r"^\*\*qwen3-next-80b-a3b\*\*: 79.7B parameters", out, re.M)


def test_train_report_on_a_tiny_model(tmp_path, char_data):
    out = bench('train', '--layouts=mha,linear', '--max_iters=4', f'--out={tmp_path}', '--',
                '--n_layer=1', '--n_embd=32', '--eval_iters=2', f'--data_dir={char_data}')
    assert (tmp_path / 'train_val_loss.png').stat().st_size > 10_000
    rows = re.findall(r"\| (mha|linear) \| [\d.]+M \| [\d,]+ \| [\d.]+ \| ([\d.]+) \| ([\d.]+) "
                      r"\((\d+)\) \| [\d.]+ \| [\d,]+ \|", out)
    assert [r[0] for r in rows] == ['mha', 'linear']
    # final val, best val and its iteration, from the run's own log
    for attn, final, best, at in rows:
        evals = [json.loads(line) for line in open(tmp_path / 'train' / attn / 'metrics.jsonl')
                 if 'val/loss' in line]
        low = min(evals, key=lambda r: r['val/loss'])
        assert (float(final), float(best), int(at)) == (round(evals[-1]['val/loss'], 4),
                                                       round(low['val/loss'], 4), low['iter'])
    assert os.path.isfile(tmp_path / 'train' / 'mha' / 'metrics.jsonl')
    # the MHA run past its block of 64, no training: three ways, a loss per span of positions
    ways = re.findall(r"^\| \((a|b|c)\) .* \| ([\d.]+) \|$", out, re.M)
    assert [w for w, _ in ways] == ['a', 'b', 'c'] and all(0 < float(v) < 10 for _, v in ways)
    assert (tmp_path / 'retrofit.png').stat().st_size > 10_000


@pytest.mark.slow
def test_convert_experiment_on_a_tiny_model(tmp_path, char_data):
    out = bench('convert', '--max_iters=4', '--fractions=0,0.5', f'--out={tmp_path}', '--',
                '--n_layer=1', '--n_embd=32', '--eval_iters=2', f'--data_dir={char_data}')
    headline, every = out.split('**Every run**')
    assert out.startswith('`python bench.py convert --max_iters=4 --lr=0.001 --fractions=0,0.5 '
                          '-- --n_layer=1 ')
    # the summary: 5%, or the nearest run
    assert 'no uptraining' in headline and 'uptrained 50.0%' in headline
    assert re.search(r"^Share of the gap .* that 50% uptraining closes: "
                     r"GQA, 2 K/V heads (\d+%|: no gap), MQA", headline, re.M), headline
    rows = re.findall(r"\| (MHA|GQA, 2 K/V heads|MQA|MLA) \| ([^|]+) \| ([\d +]+) \| ([\d.]+)M "
                      r"\| ([\d,]+) \| ([\d.]+) \| ", every)
    assert [(r[0], r[1], r[2]) for r in rows] == [
        ('MHA', 'trained from scratch', '4'),
        ('GQA, 2 K/V heads', 'trained from scratch', '4'),
        ('GQA, 2 K/V heads', 'MHA mean-pooled, no uptraining', '4 + 0'),
        ('GQA, 2 K/V heads', 'MHA mean-pooled, uptrained 50.0%', '4 + 2'),
        ('MQA', 'trained from scratch', '4'),
        ('MQA', 'MHA mean-pooled, no uptraining', '4 + 0'),
        ('MQA', 'MHA mean-pooled, uptrained 50.0%', '4 + 2'),
        ('MLA', 'trained from scratch', '4'),
        ('MLA', 'MHA factorised (joint SVD), no uptraining', '4 + 0'),
        ('MLA', 'MHA factorised (joint SVD), uptrained 50.0%', '4 + 2')]
    cache = [int(r[4].replace(',', '')) for r in rows]
    # 1 layer, 4 heads of 8: MHA 2 * 4 * 8, MLA d_c 32 + d_R 4 elements, 4 bytes each
    assert (cache[0] == 2 * cache[1] == 4 * cache[4] == 2 * 4 * 8 * 4
            and len(set(cache[1:4])) == len(set(cache[4:7])) == 1 and set(cache[7:]) == {36 * 4})
    # from scratch in the converted models' shape
    assert rows[1][3] == rows[2][3] and rows[4][3] == rows[5][3]
    assert rows[2][5] != rows[0][5]  # pooling 4 heads into 2 changes the model
    assert (tmp_path / 'convert.png').stat().st_size > 10_000

    def evals(name):
        with open(tmp_path / 'convert' / name / 'metrics.jsonl') as f:
            return [(r['iter'], r['val/loss']) for r in map(json.loads, f) if 'val/loss' in r]
    for attn in ('gqa', 'mqa', 'mla'):
        (it0, pooled), = evals(f'{attn}-uptrain-0')
        start, end = evals(f'{attn}-uptrain-2')  # a fresh log that starts from the pooled weights
        assert it0 == start[0] == 0 and start[1] == pooled and end[0] == 2


@pytest.mark.slow
def test_convert_report_from_a_source(tmp_path, char_data):
    """--source: an MHA out_dir of ours, uptrained as long as its conversions are; no model from
    scratch. GPT-2 (a save_pretrained folder) the same way, where transformers is installed."""
    mha = tmp_path / 'mha'
    r = subprocess.run([sys.executable, 'train.py', 'config/cpu.py', '--n_layer=1', '--n_embd=32',
                        '--max_iters=20', '--eval_interval=10', '--eval_iters=2',
                        f'--out_dir={mha}', f'--data_dir={char_data}'],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    out = bench('convert', f'--source={mha}', '--max_iters=4', '--fractions=0,0.5',
                f'--out={tmp_path / "r"}', '--', '--eval_iters=2', f'--data_dir={char_data}')
    rows = re.findall(r"^\| (MHA|GQA, 2 K/V heads|MQA|MLA) \| ([^|]+) \| ([\d,]+) \| .* "
                      r"\| ([\d.]+) \| [-+][\d.]+ \|$", out.split('**Every run**')[1], re.M)
    assert [r[:3] for r in rows] == [
        ('MHA', f'{mha}, no uptraining', '0'),
        ('MHA', f'{mha}, uptrained 50.0%', '2'),
        ('GQA, 2 K/V heads', 'MHA mean-pooled, no uptraining', '0'),
        ('GQA, 2 K/V heads', 'MHA mean-pooled, uptrained 50.0%', '2'),
        ('MQA', 'MHA mean-pooled, no uptraining', '0'),
        ('MQA', 'MHA mean-pooled, uptrained 50.0%', '2'),
        ('MLA', 'MHA factorised (joint SVD), no uptraining', '0'),
        ('MLA', 'MHA factorised (joint SVD), uptrained 50.0%', '2')]
    # the source as it is: the val loss its own run measured on the same batches
    logged = map(json.loads, open(mha / 'metrics.jsonl'))
    best = min(m['val/loss'] for m in logged if 'val/loss' in m)
    assert float(rows[0][3]) == pytest.approx(best, abs=1e-4)
    transformers = pytest.importorskip('transformers')
    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=1, n_embd=32, n_head=4, n_positions=64, vocab_size=50257))
    gpt2.save_pretrained(tmp_path / 'gpt2')
    bpe = tmp_path / 'bpe'
    bpe.mkdir()
    for split, n in (('train', 3000), ('val', 1000)):
        ids = np.random.default_rng(0).integers(0, 50257, n)
        ids.astype(np.uint16).tofile(bpe / f'{split}.bin')
    meta = {'kind': 'tiktoken', 'encoding': 'gpt2', 'vocab_size': 50257}
    (bpe / 'meta.json').write_text(json.dumps(meta))
    out = bench('convert', f'--source={tmp_path / "gpt2"}', '--max_iters=2', '--fractions=0,1',
                f'--out={tmp_path / "g"}', '--', '--eval_iters=1', f'--data_dir={bpe}')
    assert 'MHA factorised (joint SVD), uptrained 100.0%' in out


def test_bad_arguments_are_one_line(tmp_path, capsys, monkeypatch):
    (tmp_path / 'a-file').write_text('results go in a folder')
    (tmp_path / 'md' / 'mqar.md').mkdir(parents=True)  # a folder where the report goes
    # runs, but is not nanoGPT's model.py
    (tmp_path / 'fake.py').write_text('class GPTConfig: pass')
    (tmp_path / 'quits.py').write_text('import sys; sys.exit(0)')
    for args, msg in (
        (['decode', f'--out={tmp_path / "a-file"}'],
         "File exists; give a folder to write the results in"),
        (['train', f'--out={tmp_path / "a-file" / "sub"}'], "Not a directory; give a folder"),
        (['mqar', f'--out={tmp_path / "a-file"}'], "File exists; give a folder"),
        # found before any run
        (['mqar', f'--out={tmp_path / "md"}'], "mqar.md is a folder, where the report goes"),
        (['mqar', '--conv_size=17', '--sets=16:4'],
         "--conv_size=17 is invalid: must be <= block_size=16"),
        (['mqar', '--lrs=1e-3,2'], "--lrs: '1e-3,2': give numbers in (0, 1]"),
        (['mqar', '--vocab=100000'], "--vocab: '100000': give an integer from 4 to 65,536"),
        (['mqar', '--vocab=8', '--sets=64:4'], "holds at most 3 distinct keys"),
        (['decode', '--contexts=8,x'], "--contexts: '8,x': give integers from 1 to 1,048,576"),
        (['train', '--max_iters=0'], "--max_iters: '0': give an integer >= 1"),
        (['train', '--device=cuda'], "device='cuda' but CUDA is not available here"),
        (['decode', '--device=tpu'], "device='tpu' should be cpu, cuda or cuda:N"),
        (['convert', '--fractions=0,x'], "--fractions: '0,x': give numbers in [0, 1]"),
        (['convert', '--lr=0'], "--lr: '0': give a number > 0"),
        (['convert', '--max_iters=0'], "--max_iters: '0': give an integer >= 1"),
        (['convert', '--lr=nan', f'--out={tmp_path / "new"}'], "--lr: 'nan': give a number > 0"),
        (['convert', '--fractions=0,inf', f'--out={tmp_path / "new"}'], "give numbers in [0, 1]"),
        (['train', f'--nanogpt={tmp_path / "none.py"}'],
         "none.py: not nanoGPT's model.py? FileNotFound"),
        (['train', f'--nanogpt={tmp_path / "fake.py"}'],
         "fake.py: not nanoGPT's model.py? KeyError: 'GPT'"),
        (['decode', '--layouts=mha,flash'],
         "--layouts: 'mha,flash': choose from mha,gqa,mqa,mla,linear"),
        (['decode', '--n_head=5'],
         "GPTConfig.n_embd=384 is invalid: must be divisible by n_head=5"),
        (['flash'], "argument mode: invalid choice: 'flash'"),
        (['mqar', '--seed=3'], "unrecognized arguments: --seed=3"),  # not --seeds=3
        (['decode', '--gen_tokens=241'], "--gen_tokens: '241': give 1 to 240"),
        (['cache', 'foo'], "unrecognized arguments: foo"),
        (['train', '--n_layer=1'],
         "unrecognized arguments: --n_layer=1 (train.py's keys go after --"),
        (['decode', '--', '--n_layer=1'], "unrecognized arguments: -- --n_layer=1"),
        (['decode', '--n_layer=2'],
         "more than n_layer=2 (that is config/hybrid.py's 'hybrid': leave it "
         "out with --layouts)"),
        (['convert', '--nanogpt=bench.py'], "unrecognized arguments: --nanogpt=bench.py"),
        (['convert', '--layouts=mha'], "unrecognized arguments: --layouts=mha"),
        (['train', '--', '--out_dir=x'], "--out_dir=x: bench.py sets that itself"),
        (['train', '--', '--attn=linear'], "--attn=linear: bench.py sets that itself"),
        (['convert', '--', '--learning_rate=1'], "--learning_rate=1: bench.py sets that itself"),
        (['convert', '--device=cuda'], "unrecognized arguments: --device=cuda"),
        ([], "the following arguments are required: mode"),
        (['decode', '--batch=0'], "--batch: '0': give an integer >= 1"),
        # past what a float holds: an OverflowError's traceback
        (['cache', '--layouts=mha', '--context=1' + '0' * 400], "give integers from 1 to 2^50"),
        (['cache', '--layouts=mha', '--batch=1' + '0' * 320], "give an integer from 1 to 2^30"),
        (['decode', '--t=1048576'],
         "--t=1048576, --batch=16, --contexts, the sizes: weights and caches need"),
        (['decode', '--layouts=linear', '--t=100000000'],
         "--t: '100000000': give an integer from 1 to 1,048,576"),
        (['decode', '--contexts=1048576', '--n_layer=100'], "weights and caches need at least"),
        (['decode', '--contexts=8,99999999999'], "give integers from 1 to 1,048,576"),
        # scores
        (['decode', '--layouts=mla', '--contexts=100000'], "weights and caches need at least"),
        # token ids
        (['decode', '--layouts=linear', '--t=1048576', '--batch=100000'],
         "weights and caches need"),
        (['train', '--', 'config/mqa.py'],
         "config/mqa.py: not a --key=value (the extras are train.py's"),
        (['train', '--', '--batch_size', '12'], "12: not a --key=value"),
        (['decode', '--n_head=5', '--n_embd=40'],
         "GPTConfig.n_head=5 is invalid: attn='gqa' with n_head=5"),
        (['train', '--', '--eval_only=True'], "--eval_only=True: bench.py sets that itself"),
        (['train', '--nanogpt=README.md'], "README.md: not nanoGPT's model.py? SyntaxError"),
        (['train', f'--nanogpt={tmp_path / "quits.py"}'],
         "quits.py: not nanoGPT's model.py? SystemExit"),
        (['train', '--nanogpt='], "--nanogpt=: not nanoGPT's model.py?"),
        (['cache', '--out='], "--out='': give a folder to write the results in"),
        # counted at once
        (['decode', '--n_layer=1000000000'], "weights and caches need at least"),
        (['cache', '--readme', f'--out={tmp_path}'], "with --readme: the README links to results/"),
    ):
        # in process: main() checks every argument before any work
        with pytest.raises(SystemExit) as e:
            bench_main(args)
        err = capsys.readouterr().err
        assert e.value.code == 2 and msg in err and len(err.strip().splitlines()) == 1, err
    (tmp_path / 't' / 'train' / 'mha').mkdir(parents=True)
    (tmp_path / 't' / 'train' / 'mha' / 'ckpt.pt').write_text('an earlier run')
    # bench.py wrote it
    (tmp_path / 't' / 'train' / 'mha' / 'metrics.jsonl').write_text('{"iter": 0}\n')
    # a model the extras break: one line before any run, exit 2
    with pytest.raises(SystemExit) as e:
        bench_main(['train', '--layouts=mha', f'--out={tmp_path / "t"}', '--', '--n_layer=0'])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and re.fullmatch(r"error: layout mha with --n_layer=0: "
                                              r"GPTConfig.n_layer=0 is invalid.*", err[-1])
    # not lost to the failed run
    assert (tmp_path / 't' / 'train' / 'mha' / 'ckpt.pt').read_text() == 'an earlier run'
    # a folder no one can write in, root included (os.access says yes to root)
    if os.path.isdir('/proc/self'):
        with pytest.raises(SystemExit) as e:
            bench_main(['cache', '--out=/proc/self'])
        assert e.value.code == 2 and "--out '/proc/self'" in capsys.readouterr().err
    # no README.md to rewrite here (or its markers swapped), nor train.py to run: refused before
    # any work
    monkeypatch.chdir(tmp_path)
    (tmp_path / 'README.md').write_text('<!-- /mqar-table -->\n<!-- mqar-table -->\n')
    for args, msg in (
        (['cache', '--readme'], "no README.md here with a '<!-- cache-table -->'"),
        (['mqar', '--readme'], "no README.md here with a '<!-- mqar-table -->'"),  # ends swapped
        (['convert'],
         "convert runs train.py and config/ from here: run bench.py in its own folder"),
    ):
        with pytest.raises(SystemExit) as e:
            bench_main(args)
        assert e.value.code == 2 and msg in capsys.readouterr().err
    assert (tmp_path / 'a-file').read_text() == 'results go in a folder'
    assert not (tmp_path / 'new').exists() and not (tmp_path / 'results').exists()


def test_a_failed_run_leaves_the_saved_plots_alone_and_keeps_what_it_measured(tmp_path,
                                                                              monkeypatch, capsys):
    """Plots are saved with the report, once it is all done: a run that fails after drawing them
    leaves the saved ones. Its report so far is written as it goes: each roofline row as it
    finishes, then each section."""
    (tmp_path / 'roofline.png').write_bytes(b'saved')
    (tmp_path / 'decode.md').write_text('an earlier, finished report')
    monkeypatch.setattr(decode, 'generation', lambda *a, **k: 1 / 0)  # fails at the last section
    with pytest.raises(ZeroDivisionError):
        bench_main(['decode', '--n_layer=1', '--n_head=4', '--n_embd=16', '--contexts=8',
                    '--batch=2', '--t=8', f'--out={tmp_path}', '--layouts=mha,linear'])
    assert sorted(os.listdir(tmp_path)) == ['decode.md', 'decode.partial.md', 'roofline.png']
    assert (tmp_path / 'roofline.png').read_bytes() == b'saved'
    assert (tmp_path / 'decode.md').read_text() == 'an earlier, finished report'
    kept = (tmp_path / 'decode.partial.md').read_text()
    assert re.findall(r"^\| (\w+) \| [\d.]+ MB", kept, re.M) == ['mha', 'linear']
    assert 'Decode cost vs context' in kept and 'Generation' not in kept
    assert kept.endswith("_(The run was still going, or was stopped, here.)_\n")
    # each row said as it finished
    assert len(re.findall(r"\] (mha|linear): eager [\d.]+ ms \([\d.]+% of its floor\)$",
                          capsys.readouterr().err, re.M)) == 2


def test_a_stopped_roofline_keeps_the_rows_it_finished(tmp_path, monkeypatch):
    counted = decode.counted
    monkeypatch.setattr(decode, 'counted', lambda step, model, cache: counted(step, model, cache)
                        if model.config.attn == 'mha' else 1 / 0)  # stops in the second layout
    with pytest.raises(ZeroDivisionError):
        bench_main(['decode', '--n_layer=1', '--n_head=4', '--n_embd=16', '--contexts=8',
                    '--batch=2', '--t=8', f'--out={tmp_path}', '--layouts=mha,mqa'])
    kept = (tmp_path / 'decode.partial.md').read_text()
    assert re.findall(r"^\| (\w+) \| [\d.]+ MB", kept, re.M) == ['mha']
    assert 'Where an eager' not in kept and os.listdir(tmp_path) == ['decode.partial.md']


def test_results_only_with_readme(tmp_path, monkeypatch):
    """A plain run writes to out-bench/ (never the committed results/ the README is checked
    against)."""
    monkeypatch.chdir(tmp_path)
    bench_main(['cache', '--layouts=mqa'])
    assert os.listdir(tmp_path) == ['out-bench']
    assert os.listdir(tmp_path / 'out-bench') == ['cache.md']


def test_no_profiler_lines_on_stderr():
    """torch.profiler's 'USDT: ... profiler_start/stop' lines (kineto's log on fd 2: on a GPU
    inductor times kernels with the profiler) are silenced by importing bench; other stderr lines
    pass."""
    code = ("import sys, torch{}\n"
            "with torch.profiler.profile(acc_events=True):\n"  # (as ours: else 2.11 warns)
            "    torch.ones(3) @ torch.ones(3)\n"
            "print('after', file=sys.stderr)\n")
    env = {k: v for k, v in os.environ.items() if k != 'KINETO_LOG_LEVEL'}
    quiet, plain = (subprocess.run([sys.executable, '-c', code.format(imp)], cwd=ROOT,
                                   capture_output=True, text=True, timeout=120, env=env)
                    for imp in (', bench', ''))
    assert quiet.returncode == 0 and quiet.stderr == 'after\n', quiet.stderr
    assert 'USDT:' in plain.stderr  # (the lines this silences)


def test_step_time_vs_nanogpt_times_the_given_model_file():
    """--nanogpt loads GPT and GPTConfig from the file it is given (here our own model.py stands in
    for nanoGPT's) and times its training step in turns with ours."""
    text = train.step_time_vs_nanogpt(os.path.join(ROOT, 'model.py'), ['mha', 'deltanet'],
                                      rounds=3, steps=2)
    rows = re.findall(r"^\| (.+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|$", text, re.M)
    assert [r[0] for r in rows] == ['nanoGPT', "ours, mha, pos_emb='learned'",
                                    'ours, mha, RoPE (default)', 'ours, deltanet']
    assert all(float(ms) > 0 and float(a) > 0 and float(b) > 0 for _, ms, a, b in rows)
    assert rows[0][2] == rows[2][3] == '1.000'  # each against itself
    assert 'medians of 3 rounds x 2 steps' in text
    q1, q3 = map(float, re.search(r"the middle half of the 3 rounds' ratios to our MHA: "
                                  r".*deltanet ([\d.]+)-([\d.]+)\.$", text, re.M).groups())
    assert 0 < q1 <= q3  # the spread around rows[3]'s median


def test_generation_agreement_tells_a_near_tie_from_a_difference():
    """Where greedy runs with and without the cache part, agree() says 'a near-tie' only when the
    reference's top two logits there are within tolerance; a token that was not among them is a real
    difference."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, vocab_size=8, block_size=16)).eval()
    idx, ref = torch.randint(0, 8, (2, 3)), torch.randint(0, 8, (2, 5))
    assert decode.agree(model, idx, ref, ref.clone()) == 'yes'
    top = model(torch.cat([idx[1:], ref[1:, :2]], 1))[0][0, -1].topk(8).indices
    ref[1, 2] = top[0]  # greedy there
    other = ref.clone()
    other[1, 2] = top[1]  # the runner-up where row 1 parts at token 2
    assert decode.agree(model, idx, ref, other, tol=1e9).startswith('a near-tie at token 2')
    assert decode.agree(model, idx, ref, other, tol=0) == 'NO'  # not within tolerance
    other[1, 2] = top[-1]  # the least likely token: never a tie
    assert decode.agree(model, idx, ref, other, tol=1e9) == 'NO'


def test_generation_reports_each_ways_faster_run(monkeypatch):
    """Generation's tokens/s and the cache's speedup are of each way's faster run (the slower is
    the machine's noise), its runs timed here as rounds says."""
    timed, rounds = decode.generate_in_turns, {'no cache': [3.0, 2.0], 'cache': [0.5, 1.0]}

    def retimed(ways, *args, **kwargs):  # the runs' tokens, with rounds' seconds
        return {way: (*out[:2], rounds[way]) for way, out in timed(ways, *args, **kwargs).items()}
    monkeypatch.setattr(decode, 'generate_in_turns', retimed)
    text = decode.generation(['mha'], dict(n_layer=1, n_head=2, n_embd=16), 'cpu',
                             torch.float32, new=6, batches=(2,))
    best = {way: min(seconds) for way, seconds in rounds.items()}
    speed = [f"{2 * 6 / best[way]:,.1f}" for way in ('no cache', 'cache')]
    speedup = f"{best['no cache'] / best['cache']:.1f}x"
    assert f"| mha | 2 | {' | '.join(speed)} | {speedup} | yes |" in text, text


def test_mqar_report_on_a_tiny_run(tmp_path):
    (tmp_path / 'mqar').mkdir()
    # --out=data would hold data/mqar/mqar.npz
    (tmp_path / 'mqar' / 'mqar.npz').write_text('a data set of the user')
    tiny = ['--vocab=16', '--sets=12:2,16:4']
    out = bench('mqar', '--layouts=mha,deltanet,hybrid', '--max_iters=3', '--lrs=3e-3,1e-3', *tiny,
                f'--out={tmp_path}')
    assert out.startswith(saved(tmp_path / 'mqar.md'))
    assert (tmp_path / 'mqar.png').stat().st_size > 10_000
    assert (tmp_path / 'mqar-state.png').stat().st_size > 10_000
    # bench's own data: made, deleted
    assert (tmp_path / 'mqar' / 'mqar.npz').read_text() == 'a data set of the user'
    assert sorted(p.name for p in tmp_path.iterdir()) == ['mqar', 'mqar-state.png', 'mqar.md',
                                                          'mqar.png']
    # best lr, state, recall per set, steps per seed
    rows = re.findall(r"^\| (mha|deltanet|hybrid) \| (0.001|0.003) \| ([\d,]+) \| ([\d.]+)% "
                      r"\| ([\d.]+)% \| (\S+/\S+/\S+); (\S+/\S+/\S+) \| (\S+) \|$", out, re.M)
    assert [r[0] for r in rows] == ['mha', 'deltanet', 'hybrid']
    assert all(0 <= float(p) <= 100 for r in rows for p in r[3:5])
    # the state at the longest set, counted here: K and V per token, or a d_k x d_k matrix a head
    H, d_k, L = 4, 16, 16
    assert [int(r[2].replace(',', '')) for r in rows] == [2 * 2 * H * d_k * L,
                                                          # (GQA: 2 K/V heads)
                                                          2 * H * d_k * d_k,
                                                          H * d_k * d_k + 2 * 2 * d_k * L]
    # the best lr's row: its mean is the larger of the two
    for name, lr, _, *recall, steps0, steps1, gained in rows:
        at = re.search(rf"^\| {name} \| ([\d.]+)% \(99% at (\S+); (\S+)\) "
                       rf"\| ([\d.]+)% \(99% at .*\) \|$", out, re.M)
        means = float(at.group(1)), float(at.group(4))  # at lr 0.001, 0.003
        assert abs(sum(float(p) for p in recall) / 2 - max(means)) < 0.1
        assert lr == ('0.001', '0.003')[means[1] > means[0]]
        # 3 steps: nothing crossed, one evaluation
        assert steps0 == steps1 == '—/—/—' and gained == '—'
    assert '--lrs=0.001,0.003' in out and '--vocab=16 --sets=12:2,16:4' in out and 'L=16,N=4' in out
    default = bench('mqar', '--layouts=mha,deltanet,mha@8', '--max_iters=3', *tiny,
                    f'--out={tmp_path / "default"}')
    # a windowed layout: what its window can see, set by set
    seen = re.search(r"^\| mha@8 \| ([\d.]+)% / ([\d.]+)% \| ([\d.]+)% / ([\d.]+)% \|$", default,
                     re.M).groups()
    reach = [100 * v for L, n in ((12, 2), (16, 4)) for v in mqar.reach(8, 0, 16, L, n)]
    assert [float(p) for p in seen] == pytest.approx(reach, abs=0.051)
    assert 'What a window can see' not in out
    best = re.findall(r"^\| (mha|deltanet) \| (0.00\d+) \| [\d,]+ \| ([\d.]+)% \| ([\d.]+)% \|",
                      default, re.M)
    assert [b[:2] for b in best] == [(name, f"{mqar.MQAR_LR.get(name, 1e-3):g}")
                                     for name in ('mha', 'deltanet')]
    # the same runs as the sweep's at that lr: the same recall
    for name, lr, *recall in best:
        if lr in ('0.001', '0.003'):
            swept = re.search(rf"^\| {name} \| ([\d.]+)% .* \| ([\d.]+)% .* \|$", out,
                              re.M).groups()[lr == '0.003']
            assert abs(sum(float(p) for p in recall) / 2 - float(swept)) < 0.1
    assert default.startswith('`python bench.py mqar --max_iters=3 --vocab=16 --sets=12:2,16:4 '
                              '--layouts=mha,deltanet,mha@8` on ')


def test_mqar_run_stops_at_99_percent_and_records_its_crossings(tmp_path):
    """The protocol on a tiny set: MHA learns the lookup in a few dozen steps, stops at its first
    evaluation past 99% and says when it crossed 50/90/99%; a run that cannot learn (lr 1e-9) stops
    at max_iters with no crossing."""
    from data.mqar.prepare import prepare
    path = prepare(str(tmp_path), vocab=16, sets=((12, 2), (16, 4)), train=2000, val=100)
    r = mqar.mqar_run(path, 'mha', 1e-2, 0, 600, 32, 'cpu', 'tiny', eval_every=25)
    mean_recall = sum(r['recall'].values()) / 2
    assert r['steps'] < 600 and r['curve'][-1] == (r['steps'], pytest.approx(mean_recall))
    # stopped where it crossed 99%
    assert min(r['recall'].values()) > 0.95 and r['crossed'][0.99] == r['steps']
    assert all(m < 0.99 for _, m in r['curve'][:-1]) and list(r['recall']) == [(12, 2), (16, 4)]
    first = lambda p: next(it for it, m in r['curve'] if m >= p)
    assert [r['crossed'][p] for p in (0.5, 0.9)] == [first(0.5), first(0.9)]
    stuck = mqar.mqar_run(path, 'mha', 1e-9, 0, 60, 32, 'cpu', 'stuck', eval_every=25)
    assert stuck['steps'] == 60 and [it for it, _ in stuck['curve']] == [25, 50, 60]
    assert stuck['crossed'] == {0.5: None, 0.9: None, 0.99: None}
    assert max(stuck['recall'].values()) < 0.2


def test_mqar_best_lr_past_99_percent_is_the_fastest():
    """Zoology's pick: the best mean recall over the seeds, capped at 99%; the rates past it told
    apart by their mean steps, the fewest winning (not the highest recall, nor the most steps);
    below 99%, recall wins whatever the steps."""
    runs = {1e-3: ([0.999, 0.997], [800, 900]), 3e-3: ([0.995, 0.993], [300, 500]),
            1e-2: ([0.98, 0.97], [100, 100])}  # lr: (each seed's recall, its steps)
    sweep = mqar.Sweep({('mha', lr, seed): {'recall': {(12, 2): r[seed]}, 'steps': n[seed]}
                        for lr, (r, n) in runs.items() for seed in (0, 1)}, seeds=2)
    assert sweep.best('mha', list(runs)) == 3e-3
    assert sweep.best('mha', [1e-2, 1e-3]) == 1e-3


def test_mqar_recall_counts_the_answers_only_and_the_pair_embedding_adds_key_and_value():
    """Recall: argmax == target at the answers (y >= 0), nowhere else; a model that is right at
    every other answer scores 50%. A position key * vocab + value is embedded as the tied wte's key
    row + value row."""
    y = torch.full((4, 10), -1)
    y[:, [3, 5, 6, 9]] = torch.tensor([9, 10, 11, 12])

    # right at answers 3 and 6, wrong at 5 and 9 and everywhere else
    class HalfRight(torch.nn.Module):
        def forward(self, x, targets):
            answers = torch.isin(torch.arange(10), torch.tensor([3, 6]))
            right = torch.where(answers, targets.clamp(min=0), 0)
            return torch.nn.functional.one_hot(right, 16).float(), None
    sets = {(10, 4): (None, None, torch.zeros(4, 10, dtype=torch.long), y)}
    assert mqar.mqar_recall(HalfRight(), sets) == {(10, 4): 0.5}
    model = mqar.mqar_model('gqa', 16, 10)
    w = model.lm_head.weight
    assert model.transformer.wte(torch.tensor([3 * 16 + 12])).squeeze().equal(w[3] + w[12])
    assert model.transformer.wte.wte.weight is w  # still tied to the output layer
    # --conv_size: the same conv in front of every mixer, the linear layers' own off
    own = lambda name, *conv: [b.attn.mixer.conv.size(0) if conv else b.attn.conv.size(0)
                               for b in mqar.mqar_model(name, 16, 10, *conv).transformer.h
                               if hasattr(b.attn.mixer if conv else b.attn, 'conv')]
    assert own('deltanet') == [1, 1] and own('deltanet', 4) == [1, 1] and own('hybrid', 4) == [1]
    for name in ('mha', 'mla', 'linear', 'hybrid'):
        torch.manual_seed(0)
        plain = mqar.mqar_model(name, 16, 10)
        torch.manual_seed(0)
        conv = mqar.mqar_model(name, 16, 10, 4)
        assert all(isinstance(b.attn, mqar.ConvFirst) for b in conv.transformer.h)
        x = torch.randint(0, 256, (2, 10))
        assert torch.allclose(conv(x)[0], plain(x)[0], atol=1e-6)  # the identity at init
        with torch.no_grad():
            for b in conv.transformer.h:
                b.attn.weight.normal_()
        changed = x.clone()
        changed[:, 6] = (x[:, 6] + 1) % 256
        logits = lambda idx: conv(idx, torch.zeros_like(idx))[0]
        same = (logits(x) - logits(changed)).abs().amax(-1).amax(0) < 1e-6  # (T,)
        assert same[:6].all() and not same[6:].any()  # causal, and it mixes
    assert mqar.mqar_model('hybrid', 16, 10).config.pos_emb == 'learned'


def test_capacity_of_an_untrained_state():
    """Few pairs in a wide state are all recalled; past d_k, pure accumulation blurs (the chapter's
    claim)."""
    rules, recall = mqar.capacity(64, [4])
    assert all(recall[r, 4] > 0.99 for r in rules)
    rules, recall = mqar.capacity(16, [64])
    assert recall['accumulate (linear)', 64] < 0.6


def test_what_a_window_can_see_is_the_rule_written_out():
    """MQAR's reach: the queries whose pair a window of W keys (itself included) or a sink holds,
    and two layers' 2W - 1, counted here query by query."""
    x, y = zoology(16, 20, 4, 50, np.random.default_rng(0))  # reach's draw
    for window, n_sink in [(3, 0), (3, 2), (6, 0)]:
        one, two = [], []
        for s, q in zip(*np.nonzero(y >= 0)):
            j = next(p for p in range(4) if x[s, p] // 16 == x[s, q] // 16)
            one.append(q - j < window or j < n_sink)
            two.append(q - j < 2 * window - 1 or j < n_sink)
        assert mqar.reach(window, n_sink, 16, 20, 4, count=50) == (np.mean(one), np.mean(two))
    assert mqar.reach(1, 4, 16, 20, 4, count=50) == (1, 1)  # the sinks hold every pair


def test_bench_gpu_needs_a_gpu_or_says_so():
    """`python bench.py gpu` is the one command a lent GPU runs: CUDA by default, one line where
    there is none."""
    r = subprocess.run([sys.executable, 'bench.py', 'gpu'], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "error: device='cuda' but CUDA is not available here; use --device=cpu"], r.stderr


@pytest.mark.slow
def test_bench_gpu_report_writes_each_section(tmp_path):
    """The GPU report on a CPU at toy sizes: every section in --out/gpu.md, the compiled columns
    beside eager, the same greedy tokens every way."""
    r = subprocess.run([sys.executable, 'bench.py', 'gpu', '--device=cpu', '--dtype=float32',
                        '--layouts=mha,linear', '--n_layer=1', '--n_head=2', '--n_embd=16',
                        '--batch=1', '--t=8', '--gen_tokens=2', f'--out={tmp_path}',
                        f"--nanogpt={os.path.join(ROOT, 'model.py')}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    report = open(tmp_path / 'gpu.md').read()
    assert not (tmp_path / 'gpu.partial.md').exists()  # (written as it went, gone once whole)
    for title in ('The run', 'Roofline of one decode step', 'Generation at batch 1',
                  'Training step', "Where an eager decode step's time goes", "fla's kernels"):
        # printed as it finished, and kept
        assert f"**{title}" in report and f"**{title}" in r.stdout, title
    assert 'compiled % of floor' in report and '| nanoGPT, compiled |' in report
    assert '| ours, linear, compiled |' in report
    assert re.search(r"^\| linear \| 1 \|.* \| yes \| yes \|$", report, re.M)
    # profile: the step, its attention (or state) products and weights' products next to their
    # floors, the rest, the ops
    num = r"[\d.e+-]+"
    assert all(re.search(rf"^\| {a} \| {num} \| {num} / {num} \| {num} / {num} \| {num} \| \d+ "
                         r"\| `aten::", report, re.M) for a in ('mha', 'linear'))
    assert ('--device=cpu --dtype=float32 --batch=1 --t=8 --n_layer=1 --n_head=2 --n_embd=16 '
            '--gen_tokens=2' in report)
    assert "Not measured: fla is not installed here" in report
    assert os.path.isfile(tmp_path / 'roofline.png')


# ---- bench.py never loses a file it did not write, and stops cleanly ----

def test_a_readme_edited_during_the_run_is_one_line(tmp_path, monkeypatch, capsys):
    """README.md's section gone when the report is done (edited, another branch checked out):
    one line that says where the report is, README.md unchanged."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / 'README.md').write_text('<!-- cache-table -->\nold\n<!-- /cache-table -->\n')
    real = bench_main.__globals__['REPORTS']['cache'].report

    def edited(args):
        (tmp_path / 'README.md').write_text('rewritten meanwhile\n')
        return real(args)
    monkeypatch.setattr(bench_main.__globals__['REPORTS']['cache'], 'report', edited)
    with pytest.raises(SystemExit):
        bench_main(['cache', '--readme'])
    assert "README.md lost its '<!-- cache-table -->'" in capsys.readouterr().err
    assert (tmp_path / 'README.md').read_text() == 'rewritten meanwhile\n'
    assert (tmp_path / 'results' / 'cache.md').is_file()


@pytest.mark.parametrize('args, said', [
    (['train', '--layouts=mha'], "--layouts: --readme publishes a report at its defaults"),
    (['train', '--max_iters=3'], "--max_iters=3: --readme publishes runs of at least 2000"),
    (['train', '--', '--n_layer=1'], "train.py's keys after --: --readme publishes a report"),
    (['mqar', '--max_iters=999'], "--max_iters=999: --readme publishes runs of at least 1000"),
    (['mqar', '--conv_size=4'], "--conv_size: --readme publishes a report at its defaults"),
    (['convert', '--max_iters=10'], "--max_iters=10: --readme publishes runs of at least 2000"),
    (['decode', '--layouts=mla,mha'], "--layouts: --readme publishes a report at its defaults"),
    (['cache', '--layouts=gqa'], "--layouts: --readme publishes a report at its defaults"),
    (['cache', '--dtype=float8'], "--dtype: --readme publishes a report at its defaults")])
def test_a_partial_run_never_rewrites_a_readme_table(tmp_path, args, said):
    """--readme replaces a README table whole: a run of some layouts, of other sizes, or shorter
    than the default, is refused before any work (it once rewrote the train table's 85 rows as
    76)."""
    shutil.copy(os.path.join(ROOT, 'README.md'), tmp_path)
    for folder in ('config', 'data'):  # (convert and train run train.py from here)
        os.symlink(os.path.join(ROOT, folder), tmp_path / folder)
    shutil.copy(os.path.join(ROOT, 'train.py'), tmp_path)
    before = digest(tmp_path / 'README.md')
    r = run(os.path.join(ROOT, 'bench.py'), args[0], '--readme', *args[1:], cwd=tmp_path)
    assert said in one_line(r) and digest(tmp_path / 'README.md') == before
    assert not (tmp_path / 'results').exists()


def test_bench_readme_is_rewritten_whole_or_not_at_all(tmp_path):
    """bench.py --readme under a file-size limit below README.md's size (above its report's):
    one line, README.md unchanged."""
    shutil.copy(os.path.join(ROOT, 'README.md'), tmp_path)
    before = digest(tmp_path / 'README.md')
    limit = os.path.getsize(tmp_path / 'README.md') - 1000
    assert os.path.getsize(os.path.join(ROOT, 'results', 'cache.md')) < limit
    r = run(os.path.join(ROOT, 'bench.py'), 'cache', '--readme', cwd=tmp_path, limit=limit)
    assert "cannot write README.md: " in one_line(r)
    assert digest(tmp_path / 'README.md') == before
    assert not [p for p in os.listdir(tmp_path) if '.tmp' in p]


def test_bench_never_replaces_a_folder_it_did_not_write_or_a_live_run(tmp_path):
    """bench.py train replaces OUT/train/LAYOUT with a new run: not when that folder holds someone
    else's files, nor while a live train.py writes it (the live run then overwrote bench's ckpt.pt
    and mixed its iterations into metrics.jsonl): the lock is checked and taken first."""
    (tmp_path / 'train' / 'mha').mkdir(parents=True)
    (tmp_path / 'train' / 'mha' / 'thesis.tex').write_text('precious')
    r = run('bench.py', 'train', '--layouts=mha', '--max_iters=1', f'--out={tmp_path}')
    assert "holds files bench.py did not write" in one_line(r)
    assert (tmp_path / 'train' / 'mha' / 'thesis.tex').read_text() == 'precious'
    for folder in ('mha', 'mha.new'):
        run_dir = tmp_path / folder / 'train' / folder
        run_dir.mkdir(parents=True)
        (run_dir / 'metrics.jsonl').write_text('{"iter": 0}\n')
        with open(run_dir / 'train.lock', 'a') as lock:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a live train.py holds it
            r = run('bench.py', 'train', '--layouts=mha', '--max_iters=1',
                    f'--out={tmp_path / folder}')
            assert f"{run_dir} is in use by a live train.py run" in one_line(r)
        assert (run_dir / 'metrics.jsonl').read_text() == '{"iter": 0}\n'


def test_bench_keeps_its_earlier_run_when_train_py_ran_none(tmp_path):
    """`bench.py train -- --help`: train.py exits 0 without a run; bench.py deleted its earlier run,
    then crashed. And decode in float16 on a CPU (fp16 matmuls ~500x slower, an 18-minute floor) is
    refused at once."""
    earlier = tmp_path / 'train' / 'mha'
    earlier.mkdir(parents=True)
    # a folder bench.py wrote
    (earlier / 'metrics.jsonl').write_text(json.dumps({'iter': 0}) + '\n')
    r = run('bench.py', 'train', '--layouts=mha', '--max_iters=1', f'--out={tmp_path}', '--',
            '--help')
    assert r.returncode == 2 and 'Traceback' not in r.stderr
    # (bench.py's progress lines go to stderr too)
    assert "ended without a run" in r.stderr.splitlines()[-1]
    assert (earlier / 'metrics.jsonl').read_text() == '{"iter": 0}\n'
    # (gpu on a CPU in float16 ran its roofline's fp16 products for minutes)
    for mode in ('decode', 'gpu'):
        r = run('bench.py', mode, '--layouts=mha', '--dtype=float16', '--device=cpu',
                f'--out={tmp_path}')
        assert "--dtype=float16 on CPU" in one_line(r)


def test_bench_builds_every_layout_before_the_first_run(tmp_path):
    """bench.py builds every layout's model with the extras before the first run (a hybrid that
    does not fit --n_layer failed after the other layouts had trained)."""
    r = run('bench.py', 'train', '--max_iters=2', '--layouts=gated_deltanet,hybrid',
            f'--out={tmp_path / "bench"}', '--', '--n_layer=2')
    said = "layout hybrid with --n_layer=2: GPTConfig.attn='gated_deltanet*3+gqa' is invalid: " \
           "has 4 layers"
    assert said in one_line(r)
    assert not (tmp_path / 'bench' / 'train').exists()  # no run started


def test_bench_mqar_data_on_a_full_disk_is_one_line(tmp_path):
    """Its data set past the file-size limit: one line after its progress line, no data left."""
    r = run('bench.py', 'mqar', '--layouts=mha', '--seeds=1', '--vocab=16', '--sets=12:2,16:4',
            '--max_iters=5', f'--out={tmp_path}', limit=2 ** 16)
    assert r.returncode == 2 and 'Traceback' not in r.stderr, r.stderr
    said = f"error: cannot write the MQAR data in {tmp_path}: File too large"
    assert r.stderr.splitlines()[-1] == said
    assert not [f for f in os.listdir(tmp_path) if f.startswith('.mqar-data-')]


def children(pid):
    """The live (not zombie) processes whose parent is pid."""
    found = []
    for p in filter(str.isdigit, os.listdir('/proc')):
        try:
            stat = open(f'/proc/{p}/stat').read().rsplit(')', 1)[1].split()
        except OSError:
            continue
        if int(stat[1]) == pid and stat[0] != 'Z':
            found.append(int(p))
    return found


def alive(pid):
    try:
        return open(f'/proc/{pid}/stat').read().rsplit(')', 1)[1].split()[0] != 'Z'
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.parametrize('wait', [0, 3])
@pytest.mark.parametrize('sig', ['SIGINT', 'SIGTERM'])
def test_bench_mqar_stopped_ends_its_workers_and_deletes_its_data(tmp_path, sig, wait):
    """Ctrl-C left .mqar-data-XXXX/ in --out; SIGTERM died silently, left it, and orphaned the
    training workers (still running 40 s later); Ctrl-C while the workers imported torch printed
    their tracebacks. Now: one line, the folder gone, no worker left."""
    p = subprocess.Popen([sys.executable, 'bench.py', 'mqar', '--layouts=mha,linear', '--seeds=1',
                          '--vocab=16', '--sets=12:2,16:4', '--max_iters=100000',
                          f'--out={tmp_path}'],
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    deadline = time.time() + 120
    data = lambda: [f.name for f in tmp_path.iterdir() if f.name.startswith('.mqar-data-')]
    workers = lambda: [c for c in children(p.pid)
                       if b'spawn_main' in open(f'/proc/{c}/cmdline', 'rb').read()]
    # (the workers start first, then the data is written)
    while len(workers()) < 2 or not data():
        ended = p.poll() is not None
        assert time.time() < deadline and not ended, p.stderr.read() if ended else 'slow'
        time.sleep(0.05)
    started = workers()
    time.sleep(wait)  # the workers importing torch, or training
    if sig == 'SIGINT':
        os.killpg(p.pid, signal.SIGINT)  # (a terminal's: to all)
    else:
        p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert p.returncode == (130 if sig == 'SIGINT' else 128 + signal.SIGTERM), err
    said = 'error: interrupted' if sig == 'SIGINT' else 'error: stopped by SIGTERM'
    assert err.splitlines()[-1] == said, err
    assert 'Traceback' not in err and 'KeyboardInterrupt' not in err and 'leaked' not in err, err
    assert not data()
    time.sleep(1)
    assert not [w for w in started if alive(w)]


def test_the_chapters_cache_table():
    """The founding chapter's table (7B-class: 32 layers, 32 query heads, d_k 128, 16 bits, 8,192
    tokens; weights 13.0 GiB), as bench.py cache prints it."""
    args = argparse.Namespace(context=[8192], batch=1, dtype=torch.bfloat16, models='')
    model = from_sizes(CHAPTER)
    rows = {name.split(',')[0]: (bench_cache.kib(per_token), f"{totals[0] / 2 ** 30:.2f}")
            for name, _, per_token, totals in bench_cache.model_rows(model, args)}
    chapter = {'mha': ('512', '4.00'), 'gqa': ('128', '1.00'), 'mqa': ('16', '0.12'),
               'mla': ('36', '0.28')}
    assert {k: rows[k] for k in chapter} == chapter
    assert '13.0 GiB of weights at 16 bits' in bench_cache.model_section(model, args)


def test_published_models_caches():
    """What each published config keeps, from its own fields."""
    read = lambda name: read_config(os.path.join(ROOT, 'models', f'{name}.json'))
    size = 2  # 16 bits
    assert read('llama-3-8b').cache_bytes(1, size) == 32 * 2 * 8 * 128 * size
    assert read('falcon-7b').cache_bytes(1, size) == 32 * 2 * 1 * 64 * size  # multi_query
    # a 4,096-token window: no more past it
    mistral = read('mistral-7b-v0.1')
    window = 4096 * 32 * 2 * 8 * 128 * size
    assert mistral.cache_bytes(8192, size) == mistral.cache_bytes(4096, size) == window
    # MLA: [c | k_R] per layer, never K and V per head
    assert read('deepseek-v3').cache_bytes(1, size) == 61 * (512 + 64) * size
    # 12 softmax layers (2 K/V heads of 256) and 36 Gated DeltaNet layers: a float32 state of 32
    # heads of 128 x 128, and the conv's last 3 inputs of q, k (16 heads) and v (32 heads)
    qwen = read('qwen3-next-80b-a3b')
    state = 36 * (32 * 128 * 128 + (2 * 16 * 128 + 32 * 128) * 3) * 4
    assert qwen.cache_bytes(0, size) == state
    assert qwen.cache_bytes(10, size) == state + 10 * 12 * 2 * 2 * 256 * size
    # a context past a model's max_position_embeddings is no cache of that model: '—'
    args = argparse.Namespace(context=[4096, 8192], batch=1, dtype=torch.bfloat16, models='models')
    llama2 = bench_cache.model_section(read('llama-2-7b'), args)
    assert "| as published | 32 x softmax, 32 K/V heads of 128 | 512 | 2.00 | — | — |" in llama2
    assert "— past its max_position_embeddings, 4,096 tokens" in llama2
    # windows: Gemma 2 alternates 4,096-token local layers and global ones; Gemma 3's 1B has 5
    # local layers of 512 to 1 global (4 of 26); gpt-oss 128-token local layers every other layer
    kv = lambda layers, heads, d, T: layers * 2 * heads * d * T * size
    T = 131072
    assert read('gemma-2-9b').cache_bytes(T, size) == kv(21, 8, 256, T) + kv(21, 8, 256, 4096)
    assert read('gemma-3-1b-it').cache_bytes(T, size) == kv(4, 1, 256, T) + kv(22, 1, 256, 512)
    assert read('gpt-oss-20b').cache_bytes(T, size) == kv(12, 8, 64, T) + kv(12, 8, 64, 128)
    assert read('gpt-oss-20b').cache_bytes(T, size, windows=False) == kv(24, 8, 64, T)
    # a sliding_window where transformers reads none: Llama's, and Qwen2's without use_sliding_window
    llama = json.load(open(os.path.join(ROOT, 'models', 'llama-3-8b.json')))
    for kind in ('llama', 'qwen2', 'mistral'):
        model = bench_models.llama(dict(llama, model_type=kind, sliding_window=4096))
        assert model.windowed == (kind == 'mistral')
    # Gemma 3's global layers are every 6th, from its sliding_window_pattern or its layer_types
    gemma = json.load(open(os.path.join(ROOT, 'models', 'gemma-3-1b-it.json')))
    types = ['full_attention' if i % 6 == 5 else 'sliding_attention' for i in range(26)]
    typed = {k: v for k, v in gemma.items() if k != 'sliding_window_pattern'} | {'layer_types': types}
    assert bench_models.gemma(typed).groups[0][0] == bench_models.gemma(gemma).groups[0][0] == 4


def test_published_models_weights_as_transformers_counts_them(tmp_path):
    """Every shipped config, and Qwen2's and Qwen3's (their config classes' defaults, with biases
    on and grouped heads) counted as transformers' models hold them."""
    transformers = pytest.importorskip('transformers')
    folder = os.path.join(ROOT, 'models')
    paths = [os.path.join(folder, f) for f in sorted(os.listdir(folder)) if f.endswith('.json')]
    for kind in ('Qwen2', 'Qwen3'):
        config = getattr(transformers, f'{kind}Config')(num_key_value_heads=8, attention_bias=True)
        (tmp_path / f'{kind}.json').write_text(json.dumps(config.to_dict()))
        paths.append(tmp_path / f'{kind}.json')
    for path in paths:
        config = json.load(open(path))
        config.pop('quantization_config', None)
        hf = transformers.AutoConfig.for_model(config.pop('model_type'), **config)
        with torch.device('meta'):
            model = transformers.AutoModelForCausalLM.from_config(hf)
        assert read_config(path).params == sum(p.numel() for p in model.parameters()), path


def test_sizes_without_weights_and_an_8_bit_cache(tmp_path):
    bench_main(['cache', '--layouts=mha', '--models=', '--dtype=float8', f'--out={tmp_path}',
                '--sizes=n_layer=80,n_head=64,n_kv_head=8,head_dim=128', '--context=8192'])
    report = (tmp_path / 'cache.md').read_text()
    # 2 x 80 x 8 x 128 bytes; no weights given: no weights' column
    assert '| as given | 80 x softmax, 8 K/V heads of 128 | 160 | 1.25 |\n' in report
    # a linear layer's state stays float32: 80 x 64 heads x 128 x 128 (+ the conv's inputs) x 4
    state = 80 * (64 * 128 * 128 + 3 * 64 * 128 * 3) * 4
    assert (f"| gated_deltanet | 80 x Gated DeltaNet, 64 heads of 128 x 128 | 0 | "
            f"{state / 2 ** 30:.2f} |") in report


def test_a_model_folder_is_read_by_its_config_json(tmp_path):
    """A folder save_pretrained wrote holds more .json files: its config.json is the model's, named
    after the folder."""
    folder = tmp_path / 'Meta-Llama-3-8B'
    folder.mkdir()
    shutil.copy(os.path.join(ROOT, 'models', 'llama-3-8b.json'), folder / 'config.json')
    (folder / 'generation_config.json').write_text('{"bos_token_id": 128000}')
    bench_main(['cache', '--layouts=mha', f'--models={folder}', '--sizes=', f'--out={tmp_path}'])
    report = (tmp_path / 'cache.md').read_text()
    assert '**Meta-Llama-3-8B**: 8.0B parameters' in report and 'generation_config' not in report


def test_a_config_the_calculator_cannot_read_is_one_line(tmp_path, capsys):
    llama, gemma, oss = (json.load(open(os.path.join(ROOT, 'models', f'{name}.json')))
                         for name in ('llama-3-8b', 'gemma-3-1b-it', 'gpt-oss-20b'))
    cases = {
        'bert.json': (dict(llama, model_type='bert'), "model_type 'bert' is not one"),
        'chunked.json': (dict(llama, attention_chunk_size=8192),
                         "'attention_chunk_size' changes what a layer caches"),
        'vlm.json': (dict(llama, text_config={}), "'text_config' changes what a layer caches"),
        'short.json': ({k: v for k, v in llama.items() if k != 'num_hidden_layers'},
                       "a llama config needs 'num_hidden_layers'"),
        'zero.json': (dict(llama, head_dim=-1), "head_dim=-1 is not a whole number >= 0"),
        'bool.json': (dict(llama, num_hidden_layers=True), "num_hidden_layers=True is not a whole"),
        'heads.json': (dict(llama, num_key_value_heads=7), "7 K/V heads for 32 query heads"),
        'few.json': (dict(llama, layer_types=['full_attention'] * 3),
                     "other than 32 full_attention"),
        'list.json': ([], "not a config.json"),
        'types.json': (dict(llama, layer_types=['full_attention', 'chunked_attention'] * 16),
                       "layer_types other than 32 full_attention / sliding_attention"),
        # a window field a family does not read, or cannot
        'pattern.json': (dict(llama, sliding_window_pattern=6),
                         "'sliding_window_pattern' changes what a layer caches"),
        'gemma.json': (dict(gemma, sliding_window=None), "sliding_attention layers without a sliding_window"),
        'encoder.json': (dict(gemma, use_bidirectional_attention=True), "use_bidirectional_attention"),
        'every.json': (dict(gemma, sliding_window_pattern=0), "sliding_window_pattern=0: every Nth"),
        'oss.json': ({k: v for k, v in oss.items() if k != 'num_local_experts'},
                     "a gpt_oss config needs 'num_local_experts'"),
    }
    for name, (config, msg) in cases.items():
        (tmp_path / name).write_text(json.dumps(config))
    (tmp_path / 'broken.json').write_text('{"model_type": "llama",')
    cases['broken.json'] = (None, 'cannot read')
    # what is no config.json: read to its end, or nested past Python's recursion, or blocking
    (tmp_path / 'deep.json').write_text('[' * 200_000 + ']' * 200_000)
    (tmp_path / 'digits.json').write_text('{"hidden_size": ' + '9' * 5000 + '}')
    with open(tmp_path / 'sparse.json', 'wb') as f:
        f.truncate(1 << 30)
    os.mkfifo(tmp_path / 'fifo.json')
    os.symlink('/dev/zero', tmp_path / 'dev-zero.json')
    cases |= {'deep.json': (None, 'cannot read'), 'digits.json': (None, 'Exceeds the limit'),
              'sparse.json': (None, 'not a config.json (a few kilobytes)'),
              'fifo.json': (None, 'not a file'), 'dev-zero.json': (None, 'not a file')}
    for name, (_, msg) in cases.items():
        with pytest.raises(SystemExit) as e:
            bench_main(['cache', f'--models={tmp_path / name}', f'--out={tmp_path}'])
        err = capsys.readouterr().err
        assert e.value.code == 2 and msg in err and len(err.strip().splitlines()) == 1, err
        assert str(tmp_path / name) in err  # which of the files given
    for sizes, msg in [('n_layer=32,n_head=32', "head_dim=N"),
                       ('n_layer=32,n_head=32,head_dim=x', "sizes are numbers"),
                       ('n_layer=2,n_head=6,head_dim=8,n_kv_head=4', "dividing")]:
        # (no params: the weights' column is left out)
        with pytest.raises(SystemExit):
            bench_main(['cache', '--models=', f'--sizes={sizes}', f'--out={tmp_path}'])
        err = capsys.readouterr().err
        assert msg in err and len(err.strip().splitlines()) == 1, err
    assert not list(tmp_path.glob('*.md'))  # nothing written
