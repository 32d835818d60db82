"""
nanoGPT-style configuration, with checks: config files, --key=value, types, --help, and the one-line
errors every script shares (fail, describe, argparse's Parser, the device and memory checks of
--device and sizes). Imports no module of ours.

    python train.py config/gqa.py config/cpu.py --batch_size=32 --attn=mla

Config files (plain Python assignments) run in order over the script's defaults, then --key=value
overrides. Every key must be one of the defaults and every value must have the default's type
(an int is accepted for a float). Any mistake: one line on stderr naming it, exit code 2.
"""
import argparse
import ast
import difflib
import math
import os
import re
import sys
import types
from contextlib import contextmanager

import torch


def fail(msg):
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(2)


@contextmanager
def fail_on(*errors):
    """Errors of these kinds (their message says what the user can fix) end the script as fail()
    does: one line, exit 2."""
    try:
        yield
    except errors as e:
        fail(str(e))


class Parser(argparse.ArgumentParser):
    """argparse (bench.py, the prepare scripts) with its errors as one line, not its usage block,
    and exit code 2; --help keeps the description's lines (its usage examples)."""
    def __init__(self, **kwargs):
        super().__init__(formatter_class=argparse.RawDescriptionHelpFormatter, **kwargs)

    def error(self, message):
        fail(f"{message} (see: python {self.prog} --help)")


def checked(kind, ok, rule):
    """An argparse type: kind(text) if it passes ok, else the one-line error 'argument --NAME:
    TEXT: rule'."""
    def parse(text):
        try:
            if ok(value := kind(text)):
                return value
        except (ValueError, OSError):
            pass
        raise argparse.ArgumentTypeError(f"{text!r}: {rule}")
    return parse


def describe(e):
    """An exception in one short line: its type and its message, whitespace folded, cut at 240
    characters."""
    return f"{type(e).__name__}: {' '.join(str(e).split())[:240] or '(no message)'}"


def duration(seconds):
    """A time span in short words: 42 s, 3m05s, 2h07m."""
    s = round(seconds)
    return f"{seconds:.1f} s" if seconds < 10 else f"{s} s" if s < 60 else \
        f"{s // 60}m{s % 60:02d}s" if s < 3600 else f"{s // 3600}h{s % 3600 // 60:02d}m"


def default_dtype():
    """--dtype's default: bfloat16 on a CUDA GPU that runs it, else float16; float32 on a CPU."""
    if not torch.cuda.is_available():
        return 'float32'
    return 'bfloat16' if torch.cuda.is_bf16_supported() else 'float16'


def check_device(device, dtype):
    """--device and --dtype: one line and exit 2 for a name this machine cannot use."""
    if dtype not in ('float32', 'bfloat16', 'float16'):
        fail(f"dtype={dtype!r} should be one of float32, bfloat16, float16")
    if not re.fullmatch(r'cpu|cuda(:\d+)?', device):
        fail(f"device={device!r} should be cpu, cuda or cuda:N")
    if device.startswith('cuda') and not torch.cuda.is_available():
        fail(f"device={device!r} but CUDA is not available here; use --device=cpu")


def check_memory(need, device, what):
    """One line and exit 2 when a size's lower bound of memory, need bytes, exceeds the device's:
    past it Linux kills the process with no error to catch (a GPU fails deep inside a step)."""
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
    if need > have:
        amount = f"at least {need / 1e9:,.1f} GB"
        if not math.isfinite(need):  # a size whose byte count overflows
            amount = "more bytes than a 64-bit count holds"
        fail(f"{what} need {amount}; this {device.split(':')[0].upper()} has {have / 1e9:,.1f} GB")


def check(key, value, config, where):
    """The value, converted to the default's type, or fail naming the key and the expected type."""
    if key not in config:
        close = difflib.get_close_matches(key, list(config), n=1)
        hint = [f"did you mean {close[0]!r}?"] if close else []
        hint += [f"a helper of the file: name it _{key}"] * where.endswith('.py')
        fail(f"unknown config key {key!r} in {where}" + (f" ({' '.join(hint)})" if hint else ""))
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
    """--help: the script's docstring, then every key with its default and the comment on its line
    in the script's defaults (the lines the defaults come from), section comments kept; train.py's
    model fields (its `globals().update(` line) with their comments in model.py's GPTConfig."""
    source = open(script, encoding='utf-8').read()
    lines = [ast.get_docstring(ast.parse(source)) or '', 'keys (config files, then --key=value):']
    block = source.split('\n# ---')[1]  # the defaults: between the first two dashed lines
    own = re.findall(r"^(\w+) = ", block, re.M)
    for line in block.splitlines()[1:]:
        key = re.match(r"(\w+) = ", line)
        if key and key.group(1) in config:
            comment = line.partition('  #')[2].strip()
            lines.append(key_line(key.group(1), config[key.group(1)], comment))
        elif line.startswith('# '):
            lines.append(line)
        elif line.startswith('globals().update('):
            model = os.path.join(os.path.dirname(os.path.abspath(script)), 'model.py')
            fields = [(key, comment) for key, comment in dataclass_comments(model)
                      if key in config and key not in own]
            lines += [key_line(key, config[key], comment) for key, comment in fields]
    return '\n'.join(lines)


def key_line(key, value, comment):
    value = repr(value) if isinstance(value, str) and not value.isprintable() else value
    return f"  --{key}={value}".ljust(34) + comment


def dataclass_comments(path):
    """[(field, the comment on its line)] of the `name: type = default  # comment` lines in path."""
    source = open(path, encoding='utf-8').read()
    return re.findall(r"^    (\w+): \w+ = .*?(?:  # (.*))?$", source, re.M)


def defaults(namespace):
    """A script's settings, from its globals once its defaults are assigned: each int, float, bool
    or str not named _private (nanoGPT's config_keys)."""
    setting = lambda k, v: not k.startswith('_') and isinstance(v, (int, float, bool, str))
    return {k: v for k, v in namespace.items() if setting(k, v)}


class Assignments(dict):
    """A config file's namespace: the names it assigns, in order, even to the value they already
    hold."""

    def __init__(self, config):
        super().__init__(config)
        self.assigned = {}

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        self.assigned[key] = None

    def __delitem__(self, key):  # `del name`: as if never assigned (a helper's scratch)
        super().__delitem__(key)
        self.assigned.pop(key, None)


def configure(config, argv, script=None, given=None):
    """config: {key: default}. Returns a new dict with config files and overrides applied, in
    order; given (a dict) gets each key they set and what set it last: the config file's path or
    '--key'. -h / --help prints the keys of `script` and exits."""
    config = dict(config)
    if script and ({'-h', '--help'} & set(argv)):
        print(usage(config, script))
        sys.exit(0)
    for arg in argv:
        if not arg.startswith('--'):
            if not arg.endswith('.py'):
                fail(f"unexpected argument {arg!r}: give config files (*.py) and --key=value "
                     "overrides")
            if not os.path.isfile(arg):
                fail(f"config file {arg!r} not found")
            scope = Assignments(config)
            try:
                with open(arg) as f:  # one namespace: a generator or lambda sees the file's names
                    exec(compile(f.read(), arg, 'exec'), scope, scope)
            except SystemExit as e:  # never a silent stop, nor its code for ours
                code = '' if e.code is None else repr(e.code)
                fail(f"config file {arg!r} called sys.exit({code}): a config file sets keys")
            except Exception as e:
                fail(f"config file {arg!r} failed: {type(e).__name__}: {e}")
            for key in scope.assigned:
                imported = isinstance(scope[key], types.ModuleType) or callable(scope[key])
                if key.startswith('_') or key not in config and imported:
                    continue  # helpers: _names, and the modules and functions it imports or defines
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
