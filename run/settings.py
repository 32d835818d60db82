"""
train.py's settings, checked before any work: each wrong one is one line on stderr and exit 2.

    settle(config, given)                         out_dir normalised; a layout switch drops what a
                                                  file set for another layout
    check_settings(config, previous, data_root)   the model's fields, then each rule below, in order
    check_training_memory(gptconf, batch_size, dtype, device)
    summary(gptconf, ...)                          the model the settings made, in one line
"""
import math
import os
import re
from dataclasses import fields
from types import SimpleNamespace

import torch
import torch.distributed as dist

from configurator import check_memory, fail
from model import LAYER_FIELDS, LINEAR_RULES, Block, GPTConfig
from ops.linear_fla import fla_runs
from run.checkpoint import FileError, in_use, model_flags, read_checkpoint
from run.gpt2 import is_gpt2

# (key, the rule as a test of its value and the config, the rule in words)
RANGES = (
    ('batch_size', lambda v, c: v >= 1, '>= 1'),
    ('max_iters', lambda v, c: v >= 0, '>= 0'),
    # AdamW's lr / (1 - beta1) must fit a float32
    ('learning_rate', lambda v, c: 0 < v <= 1e12, 'in (0, 1e12]'),
    ('min_lr', lambda v, c: 0 <= v <= c['learning_rate'], 'in [0, learning_rate]'),
    ('eval_interval', lambda v, c: v >= 1, '>= 1'),
    ('eval_iters', lambda v, c: v >= 1, '>= 1'),
    ('log_interval', lambda v, c: v >= 1, '>= 1'),
    ('gradient_accumulation_steps', lambda v, c: v >= 1, '>= 1'),
    ('warmup_iters', lambda v, c: v >= 0, '>= 0'),
    ('lr_decay_iters', lambda v, c: v >= 1, '>= 1'),
    ('weight_decay', lambda v, c: v >= 0, '>= 0'),
    ('grad_clip', lambda v, c: v >= 0, '>= 0 (0 = off)'),
    ('beta1', lambda v, c: 0 <= v < 1, 'in [0, 1)'),
    ('beta2', lambda v, c: 0 <= v < 1, 'in [0, 1)'),
    ('seed', lambda v, c: 0 <= v < 2 ** 62, 'in [0, 2**62)'),
)


def settle(config, given):
    """The settings as meant, once all are given: out_dir normalised (A/../B is B: makedirs would
    make an A too; '' stays, refused as not writable), then switch_layouts."""
    if config['out_dir']:
        config['out_dir'] = os.path.normpath(config['out_dir'])
    switch_layouts(config, given)


def switch_layouts(config, given):
    """A layout switch after a config file (config/gqa.py --attn=mla or --attn=mha, config/hybrid.py
    --attn='gated_deltanet*3+mla'): each per-layout field that file set and the new stack refuses
    goes back to its default, as if never set (GQA's n_kv_head=2 under MLA or MHA). A field set
    where attn was set, or by a flag, is kept: then check_model says why it is refused."""
    while True:
        try:
            GPTConfig(**{f.name: config[f.name] for f in fields(GPTConfig) if f.name in config})
            return
        except (ValueError, TypeError) as e:  # 'GPTConfig.NAME=VALUE is invalid: ...'
            name = (re.match(r"GPTConfig\.(\w+)=", str(e)) or [None, None])[1]
        by = given.get(name, '--')
        if name not in LAYER_FIELDS or not by.endswith('.py') or by == given.get('attn') \
                or config[name] == LAYER_FIELDS[name]:
            return
        config[name] = LAYER_FIELDS[name]


def check_settings(config, previous, data_root):
    """config: train.py's settings; previous: out_dir's checkpoints; data_root: data/, whose folders
    with a prepare.py are the datasets (but mqar: bench.py mqar's recall data, not a text)."""
    c = SimpleNamespace(**config)
    converting = c.init_from not in ('scratch', 'resume')
    if not converting:  # a converted model has its source's shape: run/convert.py checks it
        check_model(config, c.init_from == 'resume' and previous)
    for key, ok, rule in RANGES:
        if not ok(config[key], config):
            fail(f"{key}={config[key]!r} must be {rule}")
    for key, value in config.items():
        if type(value) is int and not abs(value) < 2 ** 62:
            fail(f"{key}={value} is out of range (|value| < 2**62)")
    for key, values in choices().items():
        if config[key] not in values:
            fail(f"{key}={config[key]!r} is unknown: give one of {values}")
    if converting:
        check_conversion(c)
    check_processes(c.gradient_accumulation_steps)
    datasets = sorted(d for d in os.listdir(data_root) if d != 'mqar'
                      and os.path.isfile(os.path.join(data_root, d, 'prepare.py')))
    check_run(c, previous, datasets)


def choices():
    """The settings with a fixed set of values, and those values ('' = the default)."""
    backends = [b for b in ('nccl', 'gloo', 'mpi', 'ucc') if getattr(dist, f'is_{b}_available')()]
    return {'backend': ['', *backends], 'wandb_mode': ['', 'online', 'offline', 'disabled']}


def check_model(config, previous):
    """The model's fields; a resume that gives one model flag (--n_kv_head=2) and not the others is
    told which settings its checkpoint holds."""
    try:
        model_args = {f.name: config[f.name] for f in fields(GPTConfig) if f.name != 'vocab_size'}
        GPTConfig(**model_args)
    except ValueError as e:
        try:
            saved = previous and read_checkpoint(previous[0])[1]
        except FileError:
            saved = None
        flags = saved and ', '.join(model_flags(saved, SimpleNamespace(**config)))  # '': no hint
        if flags:
            fail(f"{e}; {previous[0]} is another model ({flags} in it): add those settings to "
                 "resume it")
        fail(str(e))


def check_conversion(c):
    """init_from names an out_dir with an MHA ckpt.pt, or GPT-2; the converted model gets a folder
    of its own."""
    if not (os.path.isfile(os.path.join(c.init_from, 'ckpt.pt')) or is_gpt2(c.init_from)):
        fail(f"init_from={c.init_from!r} should be 'scratch', 'resume', an out_dir with an MHA "
             "ckpt.pt to convert, or GPT-2 (gpt2, gpt2-medium, -large, -xl, or a save_pretrained "
             "folder)")
    if os.path.realpath(c.init_from) == os.path.realpath(c.out_dir):
        fail(f"out_dir={c.out_dir!r} holds the checkpoint being converted; give the converted model "
             "its own out_dir")


def check_processes(gradient_accumulation_steps):
    """Under torchrun, every process takes an equal share of the micro-steps."""
    world = os.environ.get('WORLD_SIZE', '1').strip() if 'RANK' in os.environ else '1'
    if gradient_accumulation_steps % max(1, int(world) if world.isdecimal() else 1):
        fail(f"gradient_accumulation_steps={gradient_accumulation_steps} must be a multiple of the "
             f"{world} DDP processes")


def check_run(c, previous, datasets):
    """What the run reads: a checkpoint to resume or evaluate, a dataset, a W&B project, a data_dir."""
    if c.init_from == 'resume' and not previous:
        busy = " yet: a train.py run is using it (resume once it has saved, or pass another --out_dir)"
        fail("init_from='resume' but there is no checkpoint (ckpt.pt or last.pt) in "
             f"out_dir={c.out_dir!r}" + busy * in_use(c.out_dir))
    if c.eval_only and c.init_from == 'scratch' and previous:
        fail(f"eval_only=True would evaluate a new random model, not {previous[0]}: add "
             "--init_from=resume")
    if not (re.fullmatch(r'\w+', c.dataset) and c.dataset in datasets):  # (its prepare.py is run)
        fail(f"dataset={c.dataset!r} is unknown: give one of {datasets} (a folder of data/); your own "
             "text goes in --data_dir")
    if c.wandb_log and not c.eval_only and not c.wandb_project.strip():  # (eval_only logs nothing)
        fail(f"wandb_project={c.wandb_project!r} must name a W&B project")
    if c.data_dir and not os.path.exists(os.path.join(c.data_dir, 'train.bin')):  # a typo?
        fail(f"no train.bin in data_dir={c.data_dir!r}: make one ({remake(c.dataset, c.data_dir)}), "
             f"or leave data_dir empty for data/{c.dataset}/")


def remake(dataset, data_dir):
    """How the messages that find data_dir's files missing or broken say to make them anew."""
    if data_dir:
        return f"python data/{dataset}/prepare.py --input FILE --out_dir {data_dir}"
    return "delete it and run again"


def num_params(config):
    """GPT(config)'s parameter count before anything is built (n_layer may be 10^9): one block of
    each layout on the meta device times its layers, plus the embeddings and the final norm; inf
    where a tensor's size overflows."""
    try:
        with torch.device('meta'):
            blocks = sum(n * sum(p.numel() for p in Block(config, a).parameters())
                         for a, n in config.layer_counts().items())
    except (RuntimeError, OverflowError):  # "Storage size calculation overflowed", or past int64
        return math.inf
    positions = config.block_size * (config.pos_emb == 'learned')  # (wte, tied to lm_head: once)
    return blocks + (config.vocab_size + positions + 1 + config.bias) * config.n_embd


def check_training_memory(gptconf, batch_size, dtype, device):
    """Memory, counted before anything is built: fp32 weights, gradients and AdamW's two moments (16
    bytes a parameter), and per token at least a dozen n_embd-wide tensors a layer kept for backward,
    fp32 logits and their gradient."""
    n_params = num_params(gptconf)
    activations = 12 * gptconf.n_layer * gptconf.n_embd * (4 if dtype == 'float32' else 2)
    per_token = activations + 8 * gptconf.vocab_size
    params = f'{n_params / 1e6:,.1f}M' if math.isfinite(n_params) else 'over 10^18'
    check_memory(16 * n_params + batch_size * gptconf.block_size * per_token, device,
                 f"{params} parameters and batch_size={batch_size} x block_size={gptconf.block_size}: "
                 "the weights, optimizer and activations")


def summary(gptconf, params, cache_bytes_per_token, block_size, dtype, device):
    """The model train.py trains, in one line: layout, parameters, cache bytes per token, the linear
    layers' kernels, the windowed layers, a hybrid's layers."""
    line = (f"{gptconf.attn}: {params / 1e6:.2f}M parameters, cache {cache_bytes_per_token:,.0f} "
            f"bytes/token at block_size {block_size} ({dtype})")
    if not gptconf.softmax:
        line += " (a fixed state: the bytes shrink as the context grows)"
    if set(gptconf.layouts) & set(LINEAR_RULES):  # which kernels: fla's where they run, else ours
        fla = gptconf.linear_kernels == 'fla' and fla_runs(torch.empty(0, device=device))
        line += "; linear layers on " + ("fla's kernels" if fla else "our kernels")
    windowed = {w: n for (_, w), n in gptconf.layer_counts(windows=True).items() if w}
    if windowed:  # how many layers see how many keys
        sinks = f" + {gptconf.n_sink} sinks" * bool(gptconf.n_sink)
        line += (f"; {sum(windowed.values())} of {gptconf.n_layer} layers windowed "
                 f"({'/'.join(map(str, sorted(windowed)))} keys{sinks})")
        line += ": generation runs past block_size" * gptconf.endless
    layers = gptconf.layer_counts()
    if len(layers) > 1:  # a hybrid: the pattern repeats over n_layer, its counts alone can mislead
        line += f"; layers: {', '.join(f'{a} x{n}' for a, n in layers.items())}"
        line += f", in order {' '.join(gptconf.layouts)}" if gptconf.n_layer <= 16 else ""
        line += " (a fixed state in the linear ones)" if gptconf.softmax else ""
    return line
