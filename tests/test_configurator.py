"""Config files in order, then --key=value, type-checked; mistakes are one line and exit 2, before
anything is built or written; --help lists every key."""
import os
import re
import time

import pytest
import torch

from conftest import ROOT, TINY_TRAIN, digest, refused, run, train
from configurator import configure
from model import GPTConfig
from run.settings import num_params

DEFAULTS = {'batch_size': 64, 'learning_rate': 1e-3, 'attn': 'mha', 'compile': False,
            'n_kv_head': 0}


def test_files_in_order_then_overrides(tmp_path):
    a, b = tmp_path / 'a.py', tmp_path / 'b.py'
    a.write_text("import math\nbatch_size = 8\nattn = 'gqa'\n")
    b.write_text("batch_size = batch_size * 2\nlearning_rate = 3e-4\n")  # sees a.py's values
    cfg = configure(DEFAULTS, [str(a), str(b), '--attn=mla', '--learning_rate=1', '--compile'])
    assert cfg == {**DEFAULTS, 'batch_size': 16, 'learning_rate': 1.0, 'attn': 'mla',
                   'compile': True}
    assert configure(DEFAULTS, ['--compile=false'])['compile'] is False
    assert DEFAULTS['batch_size'] == 64  # the defaults are not modified


@pytest.mark.parametrize('text,value', [('true', True), ('TRUE', True), ('false', False),
                                        ('FaLsE', False)])
def test_a_bool_in_any_case(text, value):
    """--compile=true is True as --compile=True is (and false False), from either default; 'yes'
    stays refused (test_mistakes_are_one_clear_line)."""
    config = configure({**DEFAULTS, 'compile': not value}, [f'--compile={text}'])
    assert config['compile'] is value


@pytest.mark.parametrize('argv,message', [
    (['--batchsize=3'], "unknown config key 'batchsize' in --batchsize (did you mean "
                        "'batch_size'?)"),
    (['--batch_size=3.5'], "--batch_size: batch_size=3.5 should be int like the default 64, not "
                           "float"),
    (['--batch_size', '32'], "'--batch_size' needs a value: write --batch_size=VALUE"),
    (['--learning_rate=fast'], "--learning_rate: learning_rate='fast' should be float like the "
                               "default 0.001, not str"),
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
    said = (f"error: unknown config key 'atn' in {f} (did you mean 'attn'? a helper of the file: "
            "name it _atn)\n")
    assert capsys.readouterr().err == said


def test_a_config_file_is_python_with_helpers(tmp_path, capsys):
    """A generator or lambda sees the file's names (it ran with separate globals and locals: a
    NameError); the modules and functions it imports or defines are helpers, not keys; any other
    unknown name is refused, saying how to name a helper (a mistyped setting is never dropped)."""
    f = tmp_path / 'c.py'
    f.write_text("from math import isqrt\nimport os\n_sizes = {'small': 2}\n"
                 "n_layer = _sizes['small'] * 2\nwide = lambda: n_layer * 32\nn_embd = wide()\n"
                 "attn = '+'.join('gqa' if i % 2 else 'mha' for i in range(n_layer))\n")
    config = configure({**DEFAULTS, 'n_layer': 1, 'n_embd': 1}, [str(f)])
    assert (config['attn'], config['n_layer'], config['n_embd']) == ('mha+gqa+mha+gqa', 4, 128)
    for line, name in (("ratio = 3", 'ratio'), ("sizes = {'small': 2}", 'sizes'),
                       ("betas = (0.9, 0.95)", 'betas')):
        f.write_text(line + "\n")
        with pytest.raises(SystemExit):
            configure(DEFAULTS, [str(f)])
        said = f"unknown config key {name!r} in {f} (a helper of the file: name it _{name})"
        assert capsys.readouterr().err == f"error: {said}\n"


def test_a_config_file_that_exits_or_deletes_a_name(tmp_path, capsys):
    """sys.exit() in a config file is one line, not a silent stop with its code; a name it
    deletes is as if never assigned (it was a KeyError's traceback)."""
    f = tmp_path / 'c.py'
    for code in ('', '3'):
        f.write_text(f"import sys\nsys.exit({code})\n")
        with pytest.raises(SystemExit) as e:
            configure(DEFAULTS, [str(f)])
        assert e.value.code == 2
        said = f"error: config file {str(f)!r} called sys.exit({code}): a config file sets keys\n"
        assert capsys.readouterr().err == said
    f.write_text("attn = 'gqa'\n_scratch = 1\ndel attn, _scratch\nbatch_size = 3\n")
    config = configure(DEFAULTS, [str(f)])
    assert config['attn'] == DEFAULTS['attn'] and config['batch_size'] == 3


LAYOUTS = "('mha', 'gqa', 'mqa', 'mla', 'linear', 'retnet', 'mamba2', 'deltanet', 'gated_deltanet')"
TRAIN_REFUSALS = [  # (train.py's flags, what it says)
    (['--n_layr=2'], "unknown config key 'n_layr' in --n_layr (did you mean 'n_layer'?)"),
    (['--attn=flash'], f"GPTConfig.attn='flash' is invalid: must be one of {LAYOUTS}, or a "
                      "hybrid of them"),
    (['--attn=deltanet*5+gqa'], "GPTConfig.attn='deltanet*5+gqa' is invalid: has 6 layers, more "
                                "than n_layer=2"),
    (['--n_kv_head=4', '--attn=gqa'], "GPTConfig.n_kv_head=4 is invalid"),
    (['--init_from=gpt3'], "init_from='gpt3' should be 'scratch', 'resume', an out_dir with an "
                           "MHA ckpt.pt to convert, or GPT-2"),
    (['--learning_rate=0'], "learning_rate=0.0 must be in (0, 1e12]"),
    # was a traceback from AdamW's step
    (['--learning_rate=1e308'], "learning_rate=1e+308 must be in (0, 1e12]"),
    (['--learning_rate=nan'], "learning_rate=nan should be a finite number"),
    (['--learning_rate=1e999'], "learning_rate=inf should be a finite number"),
    (['--batch_size=0'], "batch_size=0 must be >= 1"),
    (['--batch_size=1000000000', '--overwrite=True'],
     "the weights, optimizer and activations need at least"),
    # was killed by Linux's OOM
    (['--n_layer=50', '--n_embd=20000', '--n_head=4', '--batch_size=1', '--block_size=8',
      '--overwrite=True'], "M parameters and batch_size=1 x block_size=8: the weights, optimizer "
                           "and activations need at least"),
    # a width past int64 (a TypeError from torch), a warmup of 10^400 (an OverflowError in get_lr)
    (['--n_embd=10000000000000000000', '--n_head=1', '--overwrite=True'],
     "is out of range (|value| < 2**62)"),
    ([f"--warmup_iters=1{'0' * 400}", '--overwrite=True'], "is out of range"),
    (['--block_size=0'], "GPTConfig.block_size=0 is invalid"),
    (['--n_layer=-2'], "GPTConfig.n_layer=-2 is invalid"),
    (['--n_head=3'], "GPTConfig.n_embd=64 is invalid: must be divisible by n_head=3"),
    (['--max_iters=-1'], "max_iters=-1 must be >= 0"),
    (['--eval_iters=0'], "eval_iters=0 must be >= 1"),
    (['--dropout=1.5'], "GPTConfig.dropout=1.5 is invalid"),
    # not ignored
    (['--attn=gqa', '--kv_lora_rank=48'], "GPTConfig.kv_lora_rank=48 is invalid: no layer of "
                                          "attn='gqa' uses it"),
    (['--attn=mla', '--match_mha_params=True', '--kv_lora_rank=256'], "the MLP would need -"),
    (['--device=cuda'], "CUDA is not available here"),
    (['--device=foo'], "device='foo' should be cpu, cuda or cuda:N"),
    (['--seed=99999999999999999999999'], "seed=99999999999999999999999 must be in [0, 2**62)"),
    (['--eval_only=True'], "eval_only=True would evaluate a new random model, not"),
    # a fixed set of values: a typo is not a default
    (['--overwrite=True', '--wandb_log=True', '--wandb_mode=bogus'],
     "wandb_mode='bogus' is unknown: give one of ['', 'online', 'offline', 'disabled']"),
    (['--overwrite=True', '--wandb_mode=Offline'], "wandb_mode='Offline' is unknown"),
    (['--overwrite=True', '--backend=bogus'], "backend='bogus' is unknown: give one of ['', "),
    (['--out_dir=/proc/forbidden'], "is not writable"),
]


@pytest.mark.parametrize('args,message', TRAIN_REFUSALS,
                         ids=[' '.join(a) for a, _ in TRAIN_REFUSALS])
def test_train_py_bad_input_exits_with_one_line(trained, char_data, args, message):
    """One line, exit 2, and nothing already saved is lost (the run it would replace)."""
    before = digest(trained / 'ckpt.pt'), digest(trained / 'metrics.jsonl')
    assert message in refused(trained, char_data, *args)
    assert (digest(trained / 'ckpt.pt'), digest(trained / 'metrics.jsonl')) == before


def test_huge_sizes_are_refused_before_anything_is_built(tmp_path, char_data):
    """A billion layers, or a width whose byte count overflows: one line in seconds (it built for
    600 s, then a traceback), before anything is written."""
    for args, message in ((['--n_layer=1000000000'], "the weights, optimizer and activations need "
                                                     "at least"),
                          (['--n_embd=1000000000', '--n_head=1'], "need more bytes than a 64-bit "
                                                                  "count holds")):
        t0 = time.time()
        assert message in refused(tmp_path / 'out', char_data, *args, timeout=60)
        assert time.time() - t0 < 30 and not (tmp_path / 'out' / 'metrics.jsonl').exists()


def test_a_stray_rank_or_an_unshareable_accumulation_is_one_line(tmp_path, char_data):
    """A RANK left in the environment outside torchrun, and a gradient_accumulation_steps that
    torchrun's processes cannot share (checked before any work): one line each."""
    out = tmp_path / 'z'
    assert 'use torchrun or unset it' in refused(out, char_data, env={'RANK': '0'})
    # torchrun's 2 processes
    err = refused(out, char_data, '--gradient_accumulation_steps=3',
                  env={'RANK': '0', 'WORLD_SIZE': '2'})
    assert 'gradient_accumulation_steps=3 must be a multiple of the 2 DDP processes' in err
    # a superscript 2 (isdigit, but not int's), spaces (int's, not isdigit's)
    for world in ('\u00b2', ' 2 '):
        r = run('train.py', *TINY_TRAIN, f'--out_dir={out}', f'--data_dir={char_data}',
                '--gradient_accumulation_steps=3', env={'RANK': '0', 'WORLD_SIZE': world})
        assert r.returncode == 2 and 'Traceback' not in r.stderr, r.stderr
    assert not out.exists()


@pytest.mark.parametrize('script,flag', [('train.py', '--help'), ('sample.py', '-h')])
def test_help_lists_every_key_with_its_default_and_comment(script, flag):
    r = run(script, flag, timeout=60)
    assert r.returncode == 0 and r.stderr == '', r.stderr
    listed = re.findall(r"^  --(\w+)=", r.stdout, re.M)
    source = open(os.path.join(ROOT, script)).read().split('\n# ---')[1]
    # [(key, its comment)]
    keys = re.findall(r"^(\w+) = [^\n]*?(?:  # (.*))?$", source, re.M)
    if script == 'train.py':  # and the model's: GPTConfig's fields, commented in model.py
        model = open(os.path.join(ROOT, 'model.py')).read()
        fields = re.findall(r"^    (\w+): \w+ = [^\n]*?(?:  # (.*))?$", model, re.M)
        keys += [(k, c) for k, c in fields if k != 'vocab_size' and k not in dict(keys)]
        assert {'attn', 'n_kv_head', 'kv_lora_rank'} <= set(listed)
    assert sorted(listed) == sorted(k for k, _ in keys) and len(keys) > 10  # every key, once
    for key, comment in filter(lambda pair: pair[1], keys):
        # its own comment
        assert re.search(rf"^  --{key}=\S*\s+{re.escape(comment)}$", r.stdout, re.M), key
    default = r"^  --max_iters=5000 "
    if script == 'sample.py':
        default = r"^  --top_k=200 +keep the k most"
    assert re.search(default, r.stdout, re.M)
    bad = run(script, '--interrupted=True', timeout=None)
    # the signal flag is no key
    assert bad.returncode == 2 and "unknown config key 'interrupted'" in bad.stderr


@pytest.mark.parametrize('raised', [
    "MemoryError('boom')", "RuntimeError(\"DefaultCPUAllocator: can't allocate memory\")",
    "RuntimeError('CUDA out of memory. Tried to allocate')", "ValueError('other')"])
def test_memory_errors_are_one_line(raised):
    """What passes the size checks and still fails to allocate: one line and exit 2; other errors
    keep their traceback."""
    r = run('-c', "from run.interrupts import memory_errors_in_one_line\n"
                  f"memory_errors_in_one_line('--batch_size')\nraise {raised}", timeout=None)
    if 'other' in raised:
        assert r.returncode == 1 and 'Traceback' in r.stderr
    else:
        assert r.returncode == 2 and r.stderr.startswith("error: out of memory (")
        assert r.stderr.count('\n') == 1
        assert r.stderr.rstrip().endswith("try smaller sizes (--batch_size)"), r.stderr


def test_the_models_summary_line(tmp_path, char_data):
    """train.py's line about the model: cache bytes per token from the config at the run's dtype; a
    hybrid's layers counted and, when few, in order (the pattern repeats over n_layer:
    'deltanet*2+mla' on 4 layers is 3 + 1); a fixed state said of what has one."""
    sizes = dict(n_layer=4, n_head=4, n_embd=128, block_size=64)
    hybrid = GPTConfig(attn='deltanet*2+mla', vocab_size=65, **sizes)
    said = lambda attn, *more: train(tmp_path / attn, char_data, f'--attn={attn}', '--max_iters=0',
                                     '--eval_iters=1', *more, base=['config/cpu.py']).stdout
    line = re.search(r"^deltanet\*2\+mla: .*$", said('deltanet*2+mla', '--dtype=bfloat16'), re.M)[0]
    per_token = hybrid.cache_bytes(64, torch.bfloat16) / 64
    assert line.startswith(f"deltanet*2+mla: {num_params(hybrid) / 1e6:.2f}M parameters, cache "
                           f"{per_token:,.0f} bytes/token at block_size 64")
    assert "layers: deltanet x3, mla x1, in order deltanet deltanet mla deltanet (a fixed state " \
           "in the linear ones)" in line
    linear = said('deltanet*1+gated_deltanet')
    assert 'the bytes shrink' in linear and 'in the linear ones' not in linear
    assert 'in order deltanet gated' in linear
    assert 'layers' not in said('gqa')


def test_fla_is_imported_only_where_it_runs(tmp_path, char_data):
    """fla installed on a CPU machine prints "Triton is not supported" on stderr as it is imported,
    which made every one-line error two: a stand-in fla that prints so, and a refusal of train.py
    (as of sample.py, the crafted-checkpoint kind) stays one line."""
    (tmp_path / 'fla').mkdir()
    (tmp_path / 'fla' / '__init__.py').write_text(
        "import sys\nprint('Triton is not supported on current platform', file=sys.stderr)\n")
    env = {'PYTHONPATH': str(tmp_path), 'CUDA_VISIBLE_DEVICES': ''}
    said = refused(tmp_path / 'out', char_data, '--batch_size=0', env=env)
    assert said == "error: batch_size=0 must be >= 1\n"
    r = run('sample.py', f'--out_dir={tmp_path / "none"}', env=env)
    assert 'Triton' not in r.stderr and r.returncode != 0


def test_a_layout_switch_drops_what_a_file_set_for_another(tmp_path, char_data):
    """config/hybrid.py's own suggestion, --attn='gated_deltanet*3+mla', and config/gqa.py
    --attn=mla (or mha) were refused for the file's n_kv_head=2, which the user never typed; it is
    dropped. Typed as a flag, it is still refused."""
    for n, (file, attn, summary) in enumerate((
            ('config/hybrid.py', 'gated_deltanet*3+mla', 'gated_deltanet x3, mla x1'),
            ('config/gqa.py', 'mla', 'mla: '), ('config/gqa.py', 'mha', 'mha: '))):
        r = run('train.py', file, *TINY_TRAIN, f'--attn={attn}', '--n_layer=4', '--max_iters=0',
                f'--out_dir={tmp_path / str(n)}', f'--data_dir={char_data}')
        assert r.returncode == 0 and summary in r.stdout, r.stderr
    said = refused(tmp_path / 'flag', char_data, '--attn=mla', '--n_kv_head=2')
    assert "GPTConfig.n_kv_head=2 is invalid: no layer of attn='mla' uses it" in said
