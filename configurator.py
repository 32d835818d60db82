"""
nanoGPT-style configuration, with checks (and the one-line errors every script shares: fail, argparse's Parser,
the device and memory checks, a model's flags and size):

    python train.py config/gqa.py config/cpu.py --batch_size=32 --attn=mla

Config files (plain Python assignments) run in order over the script's defaults, then --key=value
overrides. Every key must be one of the defaults and every value must have the default's type
(an int is accepted for a float). Any mistake: one line on stderr naming it, exit code 2.
"""
import argparse
import ast
import difflib
import errno
import math
import os
import re
import signal
import sys
import types
from dataclasses import fields, replace


def fail(msg):
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(2)


class Parser(argparse.ArgumentParser):
    """argparse (bench.py, the prepare scripts) with its errors as one line, not its usage block, and exit code 2;
    --help keeps the description's lines (its usage examples)."""
    def __init__(self, **kwargs):
        super().__init__(formatter_class=argparse.RawDescriptionHelpFormatter, **kwargs)

    def error(self, message):
        fail(f"{message} (see: python {self.prog} --help)")


def checked(kind, ok, rule):
    """An argparse type: kind(text) if it passes ok, else the one-line error 'argument --NAME: TEXT: rule'."""
    def parse(text):
        try:
            if ok(value := kind(text)):
                return value
        except (ValueError, OSError):
            pass
        raise argparse.ArgumentTypeError(f"{text!r}: {rule}")
    return parse


def describe(e):
    """An exception in one short line: its type and its message, whitespace folded, cut at 240 characters."""
    return f"{type(e).__name__}: {' '.join(str(e).split())[:240] or '(no message)'}"


def duration(seconds):
    """A time span in short words: 42 s, 3m05s, 2h07m."""
    s = round(seconds)
    return f"{seconds:.1f} s" if seconds < 10 else f"{s} s" if s < 60 else \
        f"{s // 60}m{s % 60:02d}s" if s < 3600 else f"{s // 3600}h{s % 3600 // 60:02d}m"


def check_device(device, dtype):
    """--device and --dtype: one line and exit 2 for a name this machine cannot use."""
    import torch
    if dtype not in ('float32', 'bfloat16', 'float16'):
        fail(f"dtype={dtype!r} should be one of float32, bfloat16, float16")
    if not re.fullmatch(r'cpu|cuda(:\d+)?', device):
        fail(f"device={device!r} should be cpu, cuda or cuda:N")
    if device.startswith('cuda') and not torch.cuda.is_available():
        fail(f"device={device!r} but CUDA is not available here; use --device=cpu")


def check_train(config, data, previous, remake):
    """train.py's values, before any work: one line and exit 2 for the first that is wrong, the model's fields first
    (GPTConfig's own table). data: the data/ folder; previous: out_dir's checkpoints; remake: how to make data_dir."""
    from checkpoint import FileError, in_use, read_checkpoint
    from model import GPTConfig
    c = types.SimpleNamespace(**config)
    converting = c.init_from not in ('scratch', 'resume')  # init_from is an MHA out_dir to convert
    world = os.environ.get('WORLD_SIZE', '1').strip() if 'RANK' in os.environ else '1'  # torchrun's processes
    try:  # (a conversion's model has its source's shape: convert.py checks it once the source is read)
        converting or GPTConfig(**{f.name: config[f.name] for f in fields(GPTConfig) if f.name != 'vocab_size'})
    except ValueError as e:
        try:  # a resume that gives one model flag (--n_kv_head=2) but not the others: name the checkpoint's
            saved = c.init_from == 'resume' and previous and read_checkpoint(previous[0])[1]
        except FileError:
            saved = None
        fail(str(e) + (f"; {previous[0]} is another model ({', '.join(model_flags(saved, c))} in it): add those "
                       f"settings to resume it" if saved else ''))
    datasets = sorted(d for d in os.listdir(data) if os.path.isfile(os.path.join(data, d, 'prepare.py'))
                      and d != 'mqar')  # (mqar: bench.py mqar's synthetic recall sequences, not a text to train on)
    for ok, message in (
            (not converting or os.path.isfile(os.path.join(c.init_from, 'ckpt.pt')),
             f"init_from={c.init_from!r} should be 'scratch', 'resume', or an out_dir with an MHA ckpt.pt to convert"),
            (not converting or os.path.realpath(c.init_from) != os.path.realpath(c.out_dir),
             f"out_dir={c.out_dir!r} holds the checkpoint being converted; give the converted model its own out_dir"),
            *[(ok, f"{key}={getattr(c, key)!r} must be {rule}") for key, ok, rule in (
                ('batch_size', c.batch_size >= 1, '>= 1'), ('max_iters', c.max_iters >= 0, '>= 0'),
                ('learning_rate', c.learning_rate > 0, '> 0'),
                ('min_lr', 0 <= c.min_lr <= c.learning_rate, 'in [0, learning_rate]'),
                ('eval_interval', c.eval_interval >= 1, '>= 1'), ('eval_iters', c.eval_iters >= 1, '>= 1'),
                ('log_interval', c.log_interval >= 1, '>= 1'),
                ('gradient_accumulation_steps', c.gradient_accumulation_steps >= 1, '>= 1'),
                ('warmup_iters', c.warmup_iters >= 0, '>= 0'), ('lr_decay_iters', c.lr_decay_iters >= 1, '>= 1'),
                ('weight_decay', c.weight_decay >= 0, '>= 0'), ('grad_clip', c.grad_clip >= 0, '>= 0 (0 = off)'),
                ('beta1', 0 <= c.beta1 < 1, 'in [0, 1)'), ('beta2', 0 <= c.beta2 < 1, 'in [0, 1)'),
                ('seed', 0 <= c.seed < 2 ** 62, 'in [0, 2**62)'))],
            *[(abs(v) < 2 ** 62, f"{k}={v} is out of range (|value| < 2**62)")
              for k, v in config.items() if type(v) is int],
            (c.gradient_accumulation_steps % max(1, int(world) if world.isdecimal() else 1) == 0,  # the steps of all
             f"gradient_accumulation_steps={c.gradient_accumulation_steps} must be a multiple of the {world} DDP "
             "processes"),  # processes together, split among them
            (c.init_from != 'resume' or previous,
             f"init_from='resume' but there is no checkpoint (ckpt.pt or last.pt) in out_dir={c.out_dir!r}" +
             " yet: a train.py run is using it (resume once it has saved, or pass another --out_dir)" * in_use(c.out_dir)),
            (not (c.eval_only and c.init_from == 'scratch' and previous),
             f"eval_only=True would evaluate a new random model, not {(previous or [''])[0]}: add --init_from=resume"),
            (re.fullmatch(r'\w+', c.dataset) and c.dataset in datasets,  # (its prepare.py is run: none from elsewhere)
             f"dataset={c.dataset!r} is unknown: give one of {datasets} (a folder of data/); your own text goes in "
             "--data_dir"),
            (not c.wandb_log or c.eval_only or c.wandb_project.strip(),  # (eval_only logs nothing)
             f"wandb_project={c.wandb_project!r} must name a W&B project"),
            (not c.data_dir or os.path.exists(os.path.join(c.data_dir, 'train.bin')),  # a typo: not another text
             f"no train.bin in data_dir={c.data_dir!r}: make one ({remake}), or leave data_dir empty for "
             f"data/{c.dataset}/")):
        if not ok:
            fail(message)


def check_memory(need, device, what):
    """One line and exit 2 when a size's lower bound of memory, need bytes, exceeds the device's: past it Linux kills
    the process with no error to catch (a GPU fails deep inside a step)."""
    import torch
    if device.startswith('cuda'):
        have = torch.cuda.get_device_properties(torch.device(device)).total_memory
    elif hasattr(os, 'sysconf'):
        have = os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES')
    else:
        return
    try:
        need = float(need)
    except OverflowError:  # an integer past a float's range
        need = math.inf
    if need > have:  # (need is inf for a size whose byte count overflows)
        amount = f"at least {need / 1e9:,.1f} GB" if math.isfinite(need) else "more bytes than a 64-bit count holds"
        fail(f"{what} need {amount}; this {device.split(':')[0].upper()} has {have / 1e9:,.1f} GB")


def check_train_memory(cfg, batch_size, dtype, device):
    """Training's memory, counted before anything is built: fp32 weights, gradients and AdamW's two moments (16 bytes a
    parameter), and per token at least a dozen n_embd-wide tensors a layer kept for backward, fp32 logits and grad."""
    n = num_params(cfg)
    per_token = 12 * cfg.n_layer * cfg.n_embd * (4 if dtype == 'float32' else 2) + 8 * cfg.vocab_size
    size = f'{n / 1e6:,.1f}M' if math.isfinite(n) else 'over 10^18'
    check_memory(16 * n + batch_size * cfg.block_size * per_token, device, f"{size} parameters and batch_size="
                 f"{batch_size} x block_size={cfg.block_size}: the weights, optimizer and activations")


def used_fields(cfg):
    """The fields of GPTConfig cfg that its layouts use (the others keep 0 or a default nothing reads)."""
    linear = [a for a in cfg.layer_counts() if a not in ('mha', 'gqa', 'mqa', 'mla')]
    unused = {'n_kv_head': cfg.softmax in (None, 'mla'), 'kv_lora_rank': cfg.softmax != 'mla', 'chunk_size': not linear,
              'rope_head_dim': cfg.softmax != 'mla', 'q_lora_rank': cfg.softmax != 'mla', 'conv_size': linear in ([], ['linear']),
              'rope_base': cfg.pos_emb != 'rope' or not cfg.softmax}
    return [f.name for f in fields(cfg) if not unused.get(f.name)]


def model_flags(a, b):
    """The --key=value settings of GPTConfig a that differ from b, of the fields a uses."""
    return [f"--{k}={getattr(a, k)}" for k in used_fields(a) if k != 'vocab_size' and getattr(a, k) != getattr(b, k)]


def num_params(config):
    """GPT(config)'s parameter count, before anything is built: one block of each layout on the meta device, times
    its number of layers, plus the embeddings (any n_layer); inf where a tensor's size would overflow."""
    import torch
    from model import GPT, Block, GPTConfig
    count = lambda module: sum(p.numel() for p in module.parameters())
    try:
        with torch.device('meta'):
            one = GPT(replace(config, n_layer=1, attn=config.softmax or config.pattern()[0],  # for its embeddings
                              conv_size=GPTConfig.conv_size))
            blocks = sum(n * count(Block(config, a)) for a, n in config.layer_counts().items())
            return count(one) - count(one.transformer.h[0]) + blocks
    except (RuntimeError, OverflowError, TypeError):  # "Storage size calculation overflowed", or past int64
        return math.inf


def summary(cfg, params, dtype):
    """The model in one line: layout, parameters, cache bytes per token at block_size, the layers of a hybrid."""
    import torch
    per_token, layers = cfg.cache_bytes(cfg.block_size, getattr(torch, dtype)) / cfg.block_size, cfg.layer_counts()
    line = (f"{cfg.attn}: {params / 1e6:.2f}M parameters, cache {per_token:,.0f} bytes/token at block_size "
            f"{cfg.block_size} ({dtype})")
    if not cfg.softmax:
        line += " (a fixed state: the bytes shrink as the context grows)"
    if len(layers) > 1:  # a hybrid: the pattern repeats over n_layer, so its counts alone can mislead
        line += f"; layers: {', '.join(f'{a} x{n}' for a, n in layers.items())}"
        line += f", in order {' '.join(cfg.layouts)}" if cfg.n_layer <= 16 else ""
        line += " (a fixed state in the linear ones)" if cfg.softmax else ""
    return line


def memory_errors_in_one_line(sizes='batch_size, block_size, the model'):
    """Out of memory (a size too large for this machine) and Ctrl-C are one line on stderr, not a traceback."""
    default = sys.excepthook

    def hook(kind, e, tb):
        if issubclass(kind, KeyboardInterrupt):
            print("error: interrupted", file=sys.stderr, flush=True)
            os._exit(130)
        if issubclass(kind, MemoryError) or re.search(r"out of memory|can't allocate memory", str(e)):
            print(f"error: out of memory ({describe(e)}); try smaller sizes ({sizes})",
                  file=sys.stderr, flush=True)
            os._exit(2)  # as every other bad input
        else:
            default(kind, e, tb)
    sys.excepthook = hook


class Output:
    """sys.stdout or sys.stderr whose reader may go away (`| head` closed the pipe, the terminal hung up): the
    output then goes to /dev/null and gone() is called once, instead of a BrokenPipeError at the next print."""

    def __init__(self, stream, gone):
        self.stream, self.gone, self.closed_out = stream, gone, False

    def write(self, text):
        return self.guard(self.stream.write, text) or len(text)

    def flush(self):
        self.guard(self.stream.flush)

    def guard(self, call, *args):
        try:
            return call(*args)
        except OSError as e:
            if e.errno not in (errno.EPIPE, errno.EIO) or self.closed_out:
                raise
            self.closed_out = True  # the buffered bytes too: its file descriptor now writes to /dev/null
            os.dup2(os.open(os.devnull, os.O_WRONLY), self.stream.fileno())
            self.gone()

    def __getattr__(self, name):
        return getattr(self.stream, name)


def exit_on_signals():
    """SIGTERM and SIGHUP end the process as a SystemExit (exit 128 + N): finally blocks still remove temp files."""
    for name in ('SIGTERM', 'SIGHUP'):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), lambda signum, frame: sys.exit(128 + signum))


def on_closed_output(gone):
    """Call gone() (once per stream) when stdout or stderr loses its reader; later output is dropped."""
    sys.stdout, sys.stderr = Output(sys.stdout, gone), Output(sys.stderr, gone)


def check(key, value, config, where):
    """The value, converted to the default's type, or fail naming the key and the expected type."""
    if key not in config:
        close = difflib.get_close_matches(key, list(config), n=1)
        fail(f"unknown config key {key!r} in {where}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    default = config[key]
    kind = type(default)
    if kind is float and type(value) is int:
        value = float(value)
    if type(value) is not kind:
        fail(f"{where}: {key}={value!r} should be {kind.__name__} like the default {default!r}, "
             f"not {type(value).__name__}")
    if kind is float and not math.isfinite(value):
        fail(f"{where}: {key}={value!r} should be a finite number")
    return value


def parse_value(text, default):
    if isinstance(default, str):
        return text  # strings need no quotes: --attn=mla
    if isinstance(default, bool) and text.lower() in ('true', 'false'):
        return text.lower() == 'true'
    if isinstance(default, float) and text.lower().lstrip('+-') in ('nan', 'inf', 'infinity'):
        return float(text)  # then refused by check() as not finite, not as a string
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text  # reported as a wrong type by check()


def usage(config, script):
    """--help: the script's docstring, then every key with its default and the comment on its line in the
    script's defaults (the lines the defaults come from), section comments kept."""
    source = open(script, encoding='utf-8').read()
    lines = [ast.get_docstring(ast.parse(source)) or '', 'keys (config files, then --key=value):']
    block = source.split('\n# ---')[1]  # the defaults: between the first two dashed lines
    for line in block.splitlines()[1:]:
        key = re.match(r"(\w+) = ", line)
        if key and key.group(1) in config:
            comment = line.partition('  #')[2].strip()
            value = config[key.group(1)]
            value = repr(value) if isinstance(value, str) and not value.isprintable() else value
            lines.append(f"  --{key.group(1)}={value}".ljust(34) + comment)
        elif line.startswith('# '):
            lines.append(line)
    return '\n'.join(lines)


class Assignments(dict):
    """A config file's namespace: the names it assigns, in order, even to the value they already hold."""

    def __init__(self, config):
        super().__init__(config)
        self.assigned = {}

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        self.assigned[key] = None


def configure(config, argv, script=None, given=None):
    """config: {key: default}. Returns a new dict with config files and overrides applied, in order; given (a dict)
    gets each key they set and what set it last: the config file's path or '--key'. -h / --help prints the keys of `script` and exits."""
    config = dict(config)
    if script and ({'-h', '--help'} & set(argv)):
        print(usage(config, script))
        sys.exit(0)
    for arg in argv:
        if not arg.startswith('--'):
            if not arg.endswith('.py'):
                fail(f"unexpected argument {arg!r}: give config files (*.py) and --key=value overrides")
            if not os.path.isfile(arg):
                fail(f"config file {arg!r} not found")
            scope = Assignments(config)
            try:
                with open(arg) as f:
                    exec(compile(f.read(), arg, 'exec'), {}, scope)
            except Exception as e:
                fail(f"config file {arg!r} failed: {type(e).__name__}: {e}")
            for key in scope.assigned:
                if key.startswith('_') or isinstance(scope[key], types.ModuleType):
                    continue  # helpers a config file may import
                config[key] = check(key, scope[key], config, arg)
                if given is not None:
                    given[key] = arg
        else:
            key, eq, text = arg[2:].partition('=')
            if not eq:
                if isinstance(config.get(key), bool):
                    text = 'True'  # --flag alone means True
                else:
                    fail(f"{arg!r} needs a value: write --{key}=VALUE" if key in config else
                         f"unknown config key {key!r}")
            config[key] = check(key, parse_value(text, config.get(key)), config, f"--{key}")
            if given is not None:
                given[key] = f"--{key}"
    return config
