"""Config files in order, then --key=value, type-checked; mistakes are one line and exit 2."""
import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT
from configurator import configure
from model import num_params

DEFAULTS = {'batch_size': 64, 'learning_rate': 1e-3, 'attn': 'mha', 'compile': False, 'n_kv_head': 0}


def test_files_in_order_then_overrides(tmp_path):
    a, b = tmp_path / 'a.py', tmp_path / 'b.py'
    a.write_text("import math\nbatch_size = 8\nattn = 'gqa'\n")
    b.write_text("batch_size = batch_size * 2\nlearning_rate = 3e-4\n")  # sees a.py's values
    cfg = configure(DEFAULTS, [str(a), str(b), '--attn=mla', '--learning_rate=1', '--compile'])
    assert cfg == {'batch_size': 16, 'learning_rate': 1.0, 'attn': 'mla', 'compile': True, 'n_kv_head': 0}
    assert configure(DEFAULTS, ['--compile=false'])['compile'] is False
    assert DEFAULTS['batch_size'] == 64  # the defaults are not modified


@pytest.mark.parametrize('argv,message', [
    (['--batchsize=3'], "unknown config key 'batchsize' in --batchsize (did you mean 'batch_size'?)"),
    (['--batch_size=3.5'], "--batch_size: batch_size=3.5 should be int like the default 64, not float"),
    (['--batch_size', '32'], "'--batch_size' needs a value: write --batch_size=VALUE"),
    (['--learning_rate=fast'], "--learning_rate: learning_rate='fast' should be float like the default 0.001, not str"),
    (['--compile=yes'], "--compile: compile='yes' should be bool like the default False, not str"),
    (['config/nope.py'], "config file 'config/nope.py' not found"),
    (['gqa'], "unexpected argument 'gqa': give config files (*.py) and --key=value overrides"),
])
def test_mistakes_are_one_clear_line(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        configure(DEFAULTS, argv)
    assert e.value.code == 2
    assert capsys.readouterr().err == f"error: {message}\n"


def test_unknown_key_in_a_config_file(tmp_path, capsys):
    f = tmp_path / 'c.py'
    f.write_text("atn = 'mla'\n")
    with pytest.raises(SystemExit):
        configure(DEFAULTS, [str(f)])
    assert capsys.readouterr().err == f"error: unknown config key 'atn' in {f} (did you mean 'attn'?)\n"


@pytest.mark.parametrize('args,message', [
    (['--n_layr=2'], "unknown config key 'n_layr' in --n_layr (did you mean 'n_layer'?)"),
    (['--attn=flash'], "GPTConfig.attn='flash' is invalid: must be one of ('mha', 'gqa', 'mqa', 'mla', 'linear', "
                       "'retnet', 'mamba2', 'deltanet', 'gated_deltanet'), or a hybrid of them"),
    (['--attn=deltanet*5+gqa'], "GPTConfig.attn='deltanet*5+gqa' is invalid: has 6 layers, more than n_layer=4"),
    (['--n_kv_head=4', '--attn=gqa'], "GPTConfig.n_kv_head=4 is invalid"),
    (['--init_from=gpt2'], "init_from='gpt2' should be 'scratch', 'resume', or an out_dir with an MHA ckpt.pt"),
])
def test_train_py_bad_input_exits_with_one_line(tmp_path, args, message, char_data):
    r = subprocess.run([sys.executable, 'train.py', 'config/cpu.py', f'--out_dir={tmp_path}/out',
                        f'--data_dir={char_data}', *args], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 2, r.stderr
    assert message in r.stderr and 'Traceback' not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize('script,flag', [('train.py', '--help'), ('sample.py', '-h')])
def test_help_lists_every_key_with_its_default_and_comment(script, flag):
    r = subprocess.run([sys.executable, script, flag], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stderr == '', r.stderr
    listed = re.findall(r"^  --(\w+)=", r.stdout, re.M)
    source = open(os.path.join(ROOT, script)).read().split('\n# ---')[1]
    keys = re.findall(r"^(\w+) = ", source, re.M)
    assert sorted(listed) == sorted(keys) and len(keys) > 10  # every key, once
    for key, comment in re.findall(r"^(\w+) = .*?  # (.*)$", source, re.M):
        assert re.search(rf"^  --{key}=\S*\s+{re.escape(comment)}$", r.stdout, re.M), key  # its own comment
    assert re.search(r"^  --top_k=200 +keep the k most" if script == 'sample.py' else r"^  --max_iters=5000 ", r.stdout, re.M)
    bad = subprocess.run([sys.executable, script, '--interrupted=True'], cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown config key 'interrupted'" in bad.stderr  # the signal flag is no key


@pytest.mark.parametrize('raised', ["MemoryError('boom')", "RuntimeError(\"DefaultCPUAllocator: can't allocate memory\")",
                                    "RuntimeError('CUDA out of memory. Tried to allocate')", "ValueError('other')"])
def test_memory_errors_are_one_line(raised):
    """What passes the size checks and still fails to allocate: one line and exit 2; other errors keep their traceback."""
    r = subprocess.run([sys.executable, '-c', "from run.interrupts import memory_errors_in_one_line\n"
                        f"memory_errors_in_one_line('--batch_size')\nraise {raised}"], cwd=ROOT, capture_output=True,
                       text=True)
    if 'other' in raised:
        assert r.returncode == 1 and 'Traceback' in r.stderr
    else:
        assert r.returncode == 2 and r.stderr.startswith("error: out of memory (") and r.stderr.count('\n') == 1
        assert r.stderr.rstrip().endswith("try smaller sizes (--batch_size)"), r.stderr


def test_the_models_summary_line(tmp_path, char_data):
    """train.py's line about the model: cache bytes per token from the config at the run's dtype; a hybrid's layers
    counted and, when few, in order (the pattern repeats over n_layer: 'deltanet*2+mla' on 4 layers is 3 + 1); a
    fixed state said of what has one."""
    from model import GPTConfig
    from test_train import train
    sizes = dict(n_layer=4, n_head=4, n_embd=128, block_size=64)
    hybrid = GPTConfig(attn='deltanet*2+mla', vocab_size=65, **sizes)
    run = lambda attn, *more: train(tmp_path / attn, char_data, f'--attn={attn}', '--max_iters=0', '--eval_iters=1',
                                    *more, base=['config/cpu.py']).stdout
    line = re.search(r"^deltanet\*2\+mla: .*$", run('deltanet*2+mla', '--dtype=bfloat16'), re.M).group(0)
    assert line.startswith(f"deltanet*2+mla: {num_params(hybrid) / 1e6:.2f}M parameters, cache "
                           f"{hybrid.cache_bytes(64, __import__('torch').bfloat16) / 64:,.0f} bytes/token at block_size 64")
    assert "layers: deltanet x3, mla x1, in order deltanet deltanet mla deltanet (a fixed state in the linear ones)" in line
    linear = run('deltanet*1+gated_deltanet')
    assert 'the bytes shrink' in linear and 'in the linear ones' not in linear and 'in order deltanet gated' in linear
    assert 'layers' not in run('gqa')
