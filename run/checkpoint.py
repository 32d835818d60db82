"""
A training run's files and what is promised about them. train.py writes out_dir through one Run;
sample.py and bench.py find and read checkpoints here; W&B's run (its folder, resumed as one run) is
wandb_run.py's.

    ckpt.pt        the best weights by val loss (--always_save_checkpoint: the latest evaluated);
                   sample.py reads it, or last.pt when there is none
    last.pt        where an interrupt stopped, or the end when ckpt.pt does not hold it
    metrics.jsonl  one strict-JSON row per log line (non-finite numbers null), iterations never
                   going back
    train.lock     held while a run lives: a second run into the same out_dir is refused

- A file is written whole or not at all (NAME.tmpPID, flushed, renamed): after an error or a full
  disk the old one is there, and one line says why. A SIGKILL loses the steps since the last save
  (and leaves a NAME.tmpPID, which the next run deletes).
- Until the first training step ends, an error, out of memory, Ctrl-C, SIGTERM, SIGHUP or a lost
  stdout (its reader gone, or its disk full) leaves out_dir as it was (--overwrite=True deletes old
  checkpoints only then). After it an interrupt saves last.pt and exits 130; a resume starts from
  the later of ckpt.pt and last.pt, bit-exactly, with the settings it is given (the optimizer's
  too, never a file's). A divergence saves nothing: exit 2, the last good files kept.
- A checkpoint is read as tensors only (a pickle that runs code is refused; weights must be
  floating point, an AdamW state finite and of their shapes), its CRCs checked (a changed byte is
  named, not loaded as another weight), and sized before its model is built. A live run's out_dir
  is never deleted (bench.py takes its lock).
"""
import atexit
import errno
import json
import math
import os
import re
import shlex
import shutil
import stat
import sys
import time
import warnings
import zipfile
from dataclasses import replace
from glob import glob

import torch

from configurator import describe, duration, fail
from model import LAYER_FIELDS, GPTConfig

try:
    import fcntl  # out_dir's lock (Windows has none: there nothing guards against a second run)
except ImportError:
    fcntl = None

NOFOLLOW = getattr(os, 'O_NOFOLLOW', 0)  # open() fails on a link (Windows: no such flag)


class FileError(Exception):
    """A file that cannot be read or written, in one line."""


def temp_name(path):
    """Unique per process: a run deletes only these, and only of its own names."""
    return f"{path}.tmp{os.getpid()}"


def write_atomic(path, data, durable=False):
    """data (str, bytes, or a function that writes into an open binary file) into path, via a temp
    file and a rename. durable: flushed to the disk, the rename too (a power cut keeps the old file
    or the new one). A failed write (disk full, file size limit, I/O error; torch.save says
    RuntimeError): FileError, and no temp file left."""
    tmp = temp_name(path)
    try:
        if os.path.islink(tmp):  # ours by name (this PID), never followed: it would write elsewhere
            os.remove(tmp)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | NOFOLLOW
        with open(os.open(tmp, flags, 0o666), 'wb') as f:
            data(f) if callable(data) else f.write(data.encode() if isinstance(data, str) else data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
        if durable:
            fd = os.open(os.path.dirname(path) or '.', os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
    except (OSError, RuntimeError) as e:
        reason = why(e, path)  # before the temp file goes: the space it took made the disk full
        if os.path.isfile(tmp):
            os.remove(tmp)
        kept = "the old file kept, no partial file left"
        raise FileError(f"cannot write {path}: {reason}; {kept}") from None
    except BaseException:  # an interrupt (a signal's SystemExit): no temp file left either
        if os.path.isfile(tmp):
            os.remove(tmp)
        raise


def why(e, path):
    """An OSError's reason in words, naming a full disk as such (torch.save hides the errno in a
    RuntimeError)."""
    try:
        free = shutil.disk_usage(os.path.dirname(os.path.abspath(path))).free
    except OSError:  # the folder itself is gone
        free = math.inf
    if getattr(e, 'errno', None) == errno.ENOSPC or free < 2 ** 20:
        return f"no space left on device (ENOSPC), {free:,} bytes free"
    return e.strerror if isinstance(e, OSError) and e.strerror else describe(e)


REMOVED = ("it was removed while being read (a live run replaces its checkpoints as it saves); "
           "try again")
# the keys a resume reads (sampling: read_checkpoint's default two)
RESUME = ('model', 'optimizer', 'model_args', 'iter_num', 'best_val_loss')
KINDS = dict(model=dict, optimizer=dict, model_args=dict, iter_num=int, best_val_loss=float)
FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def read_checkpoint(path, device='cpu', keys=('model', 'model_args')):
    """(checkpoint dict, its GPTConfig) of a checkpoint train.py wrote, holding keys, or FileError
    naming what is wrong. torch's warnings about the file (a changed pickle protocol byte) are kept
    back: shown only if it loads."""
    try:
        with warnings.catch_warnings(record=True) as said:
            ckpt = torch.load(path, map_location=device, weights_only=True)
    except Exception as e:  # truncated, corrupted, not a checkpoint, a pickle that would run code
        raise FileError(f"cannot load checkpoint {path}: {unloadable(path, e)}") from None
    if reason := wrong(path, ckpt, keys):
        raise FileError(f"cannot load checkpoint {path}: {reason}")
    try:
        config = GPTConfig(**ckpt['model_args'])
    except (TypeError, ValueError) as e:
        raise FileError(f"cannot load checkpoint {path}: its model_args: {describe(e)}") from None
    for w in said:
        warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    return ckpt, config


def unloadable(path, e):
    """Why torch.load could not read path (e: what it raised), in words."""
    reason = describe(e)
    cut = isinstance(e, (EOFError, UnicodeDecodeError)) or getattr(e, 'errno', None) == errno.EINVAL
    if not os.path.isfile(path):  # listed, then gone: a live run saving ckpt.pt removes last.pt
        return REMOVED
    if damaged(path) or 'zip archive' in reason or cut:  # cut short, or bytes changed
        size = os.stat(path).st_size
        return f"truncated or corrupted, not a whole torch.save file ({size:,} bytes)"
    if open(path, 'rb').read(1) not in (b'P', b'\x80'):  # (torch: a .tar format, or a KeyError)
        return "not a torch.save file: it begins as neither a zip nor a pickle does"
    if 'weights_only' in reason:  # and torch's advice to retry unsafely: never for a file unknown
        advice = ('Weights only', 'Check the')
        said = [p for p in str(e).split('\n\n') if p.strip() and not p.startswith(advice)]
        unpickler = ' '.join(' '.join(said).split('Unpickler error:')[-1].split())  # the reason
        return f"not a file of tensors that loads safely ({unpickler[:160]})"
    return reason


def wrong(path, ckpt, keys):
    """What is wrong with a checkpoint torch.load read from path, in words; None if nothing. Each of
    keys must be of its kind (iter_num >= 0; best_val_loss not NaN, nor -inf), each weight a finite
    floating-point tensor (load_state_dict would cast an int's 3 to 3.0)."""
    if not os.path.isfile(path):  # loaded, then removed: its CRCs can no longer be checked
        return REMOVED
    if what := damaged(path):  # torch.load reads a changed byte as a changed weight
        return f"corrupted: {what}"
    if not zipfile.is_zipfile(path):  # torch.save's format before torch 1.6: a changed byte passes
        return "torch.save's old format, with no CRCs to check it by; re-save it"
    has = lambda k: isinstance(ckpt, dict) and isinstance(ckpt.get(k), KINDS[k])
    missing = [k for k in keys if not has(k)]
    ranges = {'iter_num': lambda v: v >= 0, 'best_val_loss': lambda v: v > -math.inf}
    missing += [k for k, ok in ranges.items() if k in keys and k not in missing
                and (isinstance(ckpt[k], bool) or not ok(ckpt[k]))]
    if missing:
        return f"no {', '.join(missing)} of the right kind in it: not a checkpoint of train.py"
    for k, v in (ckpt['model'].items() if 'model' in keys else ()):
        tensor = torch.is_tensor(v)
        if not (tensor and v.layout == torch.strided and not v.is_meta and v.dtype in FLOATS):
            kind = f"{v.dtype}, {v.layout}, on {v.device}" if tensor else type(v).__name__
            return f"its weight {k!r} is not a floating-point tensor ({kind})"
        if not v.isfinite().all():  # (train.py never saves such: a diverged run's trains on as NaN)
            return f"its weight {k!r} is not finite"
    return None


def damaged(path):
    """What fails in a torch.save file (a zip): a part whose bytes fail their CRC-32, a part
    marked a folder (torch.save marks none; torch.load would read one as a tensor of junk), or
    headers that do not read (torch.load checks none of it, and reads a changed name length as
    weights from shifted bytes); None if whole, or not a zip at all (torch.load says why)."""
    try:
        if not os.path.isfile(path) or not zipfile.is_zipfile(path):
            return None
        marked = lambda i: i.is_dir() or i.external_attr & 0x10  # a folder, by its name or its bits
        with zipfile.ZipFile(path) as z:
            folder = next((i.filename for i in z.infolist() if marked(i)), None)
            part = z.testzip()
    except Exception as e:
        return f"its zip headers do not read ({describe(e)})"
    if folder:
        return f"{folder} is marked a folder in the zip's directory"
    return part and f"{part} fails its CRC check"


def weights(ckpt):
    """The model's state dict, without the prefix torch.compile adds to its names."""
    return {k.removeprefix('_orig_mod.'): v for k, v in ckpt['model'].items()}


def load_optimizer(optimizer, state):
    """A checkpoint's AdamW state into optimizer, checked like the config. Its settings stay
    this run's (a resume's --beta2 or --weight_decay applies; a file's maximize, eps or amsgrad
    never do): torch would take the file's. Every weight needs its state, a whole float step >= 0
    and two finite real moments of its shape, the second >= 0: torch checks only the groups' sizes,
    casts what it gets, and restarts a missing state from zero; anything else fails at the first
    step in a traceback, or trains as the file says. (A step of a small int type wraps around at
    + 1; float32's, torch's own, is exact up to 2^24.)"""
    def adamw(s):
        if not (isinstance(s, dict) and set(s) == {'step', 'exp_avg', 'exp_avg_sq'}
                and all(map(torch.is_tensor, s.values()))):
            return False
        step, moments = s['step'], (s['exp_avg'], s['exp_avg_sq'])
        whole = (step.dtype in (torch.float32, torch.float64) and step.numel() == 1
                 and 0 <= step.item() < 2 ** 24 and step.item() % 1 == 0)
        return (whole and bool((s['exp_avg_sq'] >= 0).all())
                and all(m.is_floating_point() and bool(m.isfinite().all()) for m in moments))
    bad = ValueError("its optimizer state is not AdamW's for these weights (each needs a float "
                     "step >= 0 and two finite real moments of its shape)")
    if not isinstance(state.get('state'), dict) or not all(map(adamw, state['state'].values())):
        raise bad
    ours = [{k: v for k, v in g.items() if k != 'params'} for g in optimizer.param_groups]
    # the file's groups with this run's settings (a crafted list of another length: TypeError)
    groups = [{**g, **o} for g, o in zip(state['param_groups'], ours, strict=True)]
    optimizer.load_state_dict({**state, 'param_groups': groups})
    for p in (p for g in optimizer.param_groups for p in g['params']):
        s = optimizer.state.get(p)
        if s is None or not s['exp_avg'].shape == s['exp_avg_sq'].shape == p.shape:
            raise bad


def load_weights(model, optimizer, ckpt, converted, source):
    """A resume's weights and AdamW state, or a conversion's weights; of another shape (or a crafted
    file): one line."""
    try:
        if ckpt:
            model.load_state_dict(weights(ckpt))
            load_optimizer(optimizer, ckpt['optimizer'])
        if converted:
            model.load_state_dict(converted)
            c = model.config
            how = (f" (d_c {c.kv_lora_rank} + d_R {c.rope_head_dim}) by a joint SVD of its keys and "
                   "values" if c.attn == 'mla' else f" with {c.n_kv_head} K/V heads by mean-pooling")
            print(f"converted {source} (mha, {c.n_head} K/V heads) to {c.attn}{how}" if c.attn != 'mha'
                  else f"starting from {source}'s weights")
    except (RuntimeError, ValueError, KeyError, TypeError, AttributeError) as e:
        fail(f"cannot {f'resume from {source}' if ckpt else f'convert {source}'}: {describe(e)}")


def checkpoints(out_dir):
    """out_dir's checkpoints, best first: ckpt.pt (the best weights), last.pt (where it stopped)."""
    paths = [os.path.join(out_dir, name) for name in ('ckpt.pt', 'last.pt')]
    return [p for p in paths if os.path.isfile(p)]


def in_use(out_dir):
    """Whether a live train.py run holds out_dir's lock (opened without following a link or
    blocking on a FIFO)."""
    try:
        fd = os.open(os.path.join(out_dir, 'train.lock'), os.O_RDONLY | os.O_NONBLOCK | NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl and fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # (released at the close)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)


def remove_run(out_dir):
    """Delete a run's out_dir holding its lock (bench.py replacing its runs), or FileError if a live
    run holds it: a train.py started meanwhile is refused by the lock."""
    if not os.path.isdir(out_dir):
        return
    with appending(os.path.join(out_dir, 'train.lock')) as lock:
        try:
            fcntl and fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise FileError(f"{out_dir} is in use by a live train.py run: wait for it to end, or "
                            "give another --out") from None
        shutil.rmtree(out_dir)


def earlier_run(out_dir):
    """What a new run would replace of an earlier one in out_dir, in one line ('' if nothing): its
    checkpoint, or the log of a run that saved none (diverged, killed, max_iters=0)."""
    log, saved = os.path.join(out_dir, 'metrics.jsonl'), checkpoints(out_dir)
    if saved:
        return (f"{saved[0]} exists: continue that run with --init_from=resume, "
                "replace it with --overwrite=True, or pass another --out_dir")
    if os.path.isfile(log) and os.path.getsize(log):
        return (f"{log} holds an earlier run's log (it saved no checkpoint): replace it with "
                "--overwrite=True, or pass another --out_dir")
    return ''


def kept(out_dir):
    """What a stopped run leaves behind, said truthfully."""
    names = [os.path.basename(p) for p in checkpoints(out_dir)]
    return f"{' and '.join(names)} in {out_dir} kept" if names else "no checkpoint was written"


def newest_out_dir():
    """The out*/ folder here with the newest checkpoint (the folders train.py's configs write), or
    'out'. Only files count (not a folder, nor a dead link), and one gone meanwhile is the oldest (a
    live run deletes last.pt as it saves)."""
    found = [p for p in glob('out*/ckpt.pt') + glob('out*/last.pt') if os.path.isfile(p)]
    mtime = lambda p: os.stat(p).st_mtime if os.path.isfile(p) else 0
    return os.path.dirname(max(found, key=mtime, default='out/'))


def to_sample(out_dir, device):
    """(path, checkpoint, GPTConfig) of sample.py: out_dir's ckpt.pt (the best val loss), else
    its last.pt (where an interrupted run stopped); no out_dir: the newest of ./out*/ (train.py's
    configs write them). What it picked (or a last.pt) is named on stderr; no checkpoint, or a
    broken one: one line."""
    picked, out_dir = not out_dir, out_dir or newest_out_dir()
    if os.path.isfile(out_dir):  # e.g. --out_dir=out/ckpt.pt
        folder = os.path.dirname(out_dir) or '.'
        fail(f"out_dir={out_dir!r} is a file: give the folder that holds it, --out_dir={folder}")
    path = (checkpoints(out_dir) or [None])[0]
    if path is None:
        nor = ' nor any ./out*/' if picked else ''
        fail(f"no checkpoint (ckpt.pt or last.pt) in {out_dir}{nor}: train one first "
             f"(python train.py config/gqa.py config/cpu.py) or pass --out_dir")
    try:
        ckpt, config = read_checkpoint(path, device)
    except FileError as e:  # truncated, corrupted or foreign files all land here
        fail(str(e))
    if picked or path.endswith('last.pt'):  # not the one asked for, or not the best weights
        val_loss = ckpt.get('val_loss')  # (last.pt's were not evaluated)
        val = f", val loss {val_loss:.4f}" if isinstance(val_loss, float) else ""
        age = duration(time.time() - os.path.getmtime(path))
        print(f"sampling {path}: {config.stack}, trained on {trained_on(ckpt)}, "
              f"iteration {ckpt.get('iter_num')}{val}, saved {age} ago", file=sys.stderr)
    if picked and (others := other_data(path, ckpt)):
        print(f"note: ./out*/ also holds runs on other data ({others}): pick one with --out_dir",
              file=sys.stderr)
    return path, ckpt, config


def other_data(picked, ckpt):
    """The runs in ./out*/ on other data than ckpt's (picked's), in words ('' if none): 'out-x:
    shakespeare (50,304 tokens)'. One that does not load is not ours to judge here: only the picked
    one must load."""
    others = {}
    for path in (p for d in sorted(glob('out*/')) for p in checkpoints(d)[:1] if p != picked):
        try:
            with warnings.catch_warnings():  # (torch's about a changed pickle byte, say)
                warnings.simplefilter('ignore')
                other = torch.load(path, map_location='cpu', weights_only=True, mmap=True)
            others.setdefault(trained_on(other), path)
        except Exception:
            pass
    others.pop(trained_on(ckpt), None)
    return '; '.join(f"{os.path.dirname(p)}: {data}" for data, p in others.items())


def trained_on(ckpt):
    """The data a checkpoint was trained on, in words: its data_dir or dataset, and its vocabulary's
    size."""
    config, meta = ckpt.get('config') or {}, ckpt.get('meta') or {}
    data = config.get('data_dir') or config.get('dataset') if isinstance(config, dict) else None
    vocab = meta.get('vocab_size') if isinstance(meta, dict) else None
    return f"{data or 'unknown data'} ({f'{vocab:,}' if isinstance(vocab, int) else '?'} tokens)"


def resume_state(out_dir, device, meta, asked, data_dir):
    """(path, checkpoint) of the later of out_dir's checkpoints, if it is the model asked (a
    GPTConfig) on the data's vocabulary (meta), or one line. A broken one is never skipped silently
    (it may be the later state): it is named, with the one that loads. One that vanished meanwhile
    is older than what replaced it: skipped."""
    loaded, broken = [], []
    for path in checkpoints(out_dir):
        try:
            loaded.append((path, *read_checkpoint(path, device, RESUME)))
        except FileError as e:
            broken += [(path, str(e))] * os.path.exists(path)
    if not loaded and not broken:
        fail(f"the checkpoints in {out_dir} were removed while being read (a live run saving?); "
             "try again")
    if broken and loaded:
        (path, reason), (good, ckpt, _) = broken[0], loaded[0]
        fail(f"{reason}; {good} (iteration {ckpt['iter_num']}) loads: move {path} away to resume "
             "from it")
    if broken:
        fail(broken[0][1])
    path, ckpt, saved = max(loaded, key=lambda c: c[1]['iter_num'])  # the first of equals: ckpt.pt
    if ckpt.get('meta') != meta:  # the same tokens, not only as many
        others = ', other ones' * (saved.vocab_size == asked.vocab_size)
        fail(f"{path} was trained on another vocabulary ({saved.vocab_size} tokens) than the data "
             f"in {data_dir} ({asked.vocab_size}{others}); resume with its --dataset / --data_dir "
             "or change out_dir")
    # how it computes may differ (the same weights), and a stack spelled otherwise ('gqa@8*2' is
    # --attn=gqa --window=8 on 2 layers)
    spelled = saved.layouts == asked.layouts and saved.windows == asked.windows
    stack = dict(attn=asked.attn, window=asked.window) if spelled else {}
    same = dict(chunk_size=asked.chunk_size, linear_kernels=asked.linear_kernels, **stack)
    differ = model_flags(replace(saved, **same), asked)
    if differ:
        fail(f"{path} is another model ({', '.join(differ)} in it); add those settings to resume "
             "it, or change out_dir")
    return path, ckpt


def resume(out_dir, device, meta, asked, data_dir, config, eval_only):
    """train.py --init_from=resume: (path, checkpoint) of the later state, its iteration not past
    max_iters, and a line that says where it resumes and which settings changed (it trains with its
    own command line)."""
    path, ckpt = resume_state(out_dir, device, meta, asked, data_dir)
    if ckpt['iter_num'] > config['max_iters'] and not eval_only:
        fail(f"{path} is at iteration {ckpt['iter_num']}, past max_iters={config['max_iters']}: "
             "nothing to train (raise max_iters to continue, or --eval_only=True to evaluate it)")
    changes = changed(ckpt, config)  # e.g. max_iters 200 -> 2000
    print(f"resuming from {path} at iteration {ckpt['iter_num']}"
          + (f"; changed: {', '.join(changes)}" if changes else ""))
    return path, ckpt


def model_flags(a, b):
    """The --key=value settings of GPTConfig a that differ from b (a GPTConfig, or train.py's
    flags), of the fields a uses; not one that both leave at their layout's default (an MHA's
    n_kv_head = n_head: --attn=mha says it)."""
    def default(c, k):  # as given, or as the layout resolves its default
        if getattr(c, k) == LAYER_FIELDS[k]:
            return True
        resolved = isinstance(c, GPTConfig) and replace(c, **{k: LAYER_FIELDS[k]})
        return resolved and getattr(resolved, k) == getattr(c, k)
    differ = lambda k: k != 'vocab_size' and getattr(a, k) != getattr(b, k)
    return [f"--{k}={getattr(a, k)}" for k in a.used_fields()
            if differ(k) and not (k in LAYER_FIELDS and default(a, k) and default(b, k))]


def changed(ckpt, config):
    """The settings a resume changes from its checkpoint's run ('max_iters 200 -> 2000', 'beta2 0.99
    -> 0.95'): a resume trains with its command line, which may not repeat the run's flags. (The
    model's are checked before.)"""
    old = ckpt.get('config') if isinstance(ckpt.get('config'), dict) else {}
    return [f"{k} {old[k]!r} -> {v!r}" for k, v in config.items()
            if k in old and old[k] != v and k not in ('init_from', 'overwrite')]


def resume_command(world_size, extra):
    """This process's command with --init_from=resume (under torchrun if world_size) and the
    settings in extra (a converted model's shape, which its arguments lack)."""
    args = [a for a in sys.argv[1:] if not a.startswith(('--init_from', '--overwrite'))]
    launcher = ['python']
    if world_size:
        launcher = ['torchrun', '--standalone', f'--nproc_per_node={world_size}']
    return shlex.join(launcher + [sys.argv[0]] + args + ['--init_from=resume'] + extra)


class Run:
    """train.py's out_dir. Written by rank 0 only and not by eval_only (writes=False: every method a
    no-op), locked while the run lives, and changed only from the run's first write on
    (first_write(), at the end of the first step or the first save); the rows logged before it wait
    in .pending, None once they are written."""

    def __init__(self, out_dir, resume, writes=True):
        self.out_dir, self.resume, self.writes = out_dir, resume, writes
        self.pending, self.wandb = [], None
        names = ('ckpt.pt', 'last.pt', 'metrics.jsonl')
        self.ckpt, self.last, self.metrics = (os.path.join(out_dir, n) for n in names)
        self.made = []  # what a run that stops before its first write removes again
        if not writes:
            return
        lock = os.path.join(out_dir, 'train.lock')
        if os.path.islink(out_dir) and not os.path.exists(out_dir):  # (makedirs: 'File exists')
            fail(f"out_dir={out_dir!r} is a link to {os.readlink(out_dir)!r}, which does not exist")
        if os.path.exists(out_dir) and not os.path.isdir(out_dir):
            fail(f"out_dir={out_dir!r} is a file, not a folder; pass --out_dir=DIR")
        for path in (lock, self.ckpt, self.last, self.metrics):  # found now, not at the first save
            if os.path.isdir(path):
                fail(f"{path} is a folder, where this run writes a file: move it, or pass another "
                     "--out_dir")
        try:
            d = os.path.abspath(out_dir)
            while not os.path.isdir(d):  # the folders makedirs adds, outermost first
                self.made, d = [d] + self.made, os.path.dirname(d)
            self.made += [lock] * (not os.path.exists(lock))  # then the lock, if new
            os.makedirs(out_dir, exist_ok=True)
            self.lock = appending(lock)  # the OS drops the lock when the process dies
        except OSError as e:
            fail(f"out_dir={out_dir!r} is not writable ({e.strerror}); pass --out_dir=DIR")
        try:
            fcntl and fcntl.flock(self.lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            fail(f"out_dir={out_dir!r} is in use by another train.py run; wait for it to end or "
                 "pass another --out_dir")
        self.previous = checkpoints(out_dir)  # an earlier run's (for --overwrite or a resume)
        atexit.register(self.discard)

    def discard(self):
        """Before the first write, at any exit: remove what this run made (its lock file, its new
        out_dir if still empty, its offline W&B folder); returns what is left, in words."""
        if self.pending is None or not self.writes:
            return "nothing was written"
        left = self.wandb.discard() if self.wandb else ''  # (.wandb: train.py's WandB, once made)
        for path in reversed(self.made):
            try:
                os.remove(path) if path.endswith('train.lock') else os.rmdir(path)
            except OSError:
                pass
        self.writes = False  # once: every method a no-op from here on
        return "nothing was written" + (f" but {left}" if left else '')

    def first_write(self, iter_num):
        """The run's first write (later calls: nothing): only now may an earlier run's files change.
        Killed runs' temp files go (NAME.tmpPID of our names only, a file or a link, never a folder:
        none is alive, the lock says), a new run's --overwrite removes the old checkpoints, and the
        log is rewritten: a new run's from nothing, a resume's up to its checkpoint."""
        if self.pending is None or not self.writes:
            return
        temp = re.compile(r'(ckpt\.pt|last\.pt|metrics\.jsonl)\.tmp\d+')
        for name in (f for f in os.listdir(self.out_dir) if temp.fullmatch(f)):
            stale = os.path.join(self.out_dir, name)
            if os.path.islink(stale) or os.path.isfile(stale):
                os.remove(stale)
        for old in self.previous if not self.resume else []:
            os.remove(old)
            print(f"removed {old} (--overwrite=True)")
        rows = []
        if self.resume:
            rows = [json.dumps(row) + '\n' for row in self.rows() if row['iter'] < iter_num]
        try:
            write_atomic(self.metrics, ''.join(rows + self.pending))
        except FileError as e:
            self.fail(e)
        self.pending = None

    def rows(self):
        """metrics.jsonl's rows (a line cut short by a kill, with broken bytes or without an
        iteration: dropped)."""
        if not os.path.isfile(self.metrics):
            return []
        with open(self.metrics, errors='replace') as f:
            rows = [loads(line) for line in f if line.endswith('\n')]
        return [row for row in rows if row and isinstance(row.get('iter'), int)]

    def log(self, row):
        """One row to metrics.jsonl (and W&B): a failed write (disk full) stops the run with the
        log's rows whole (the row's written part cut off again)."""
        if not self.writes:
            return
        strict = lambda v: None if isinstance(v, float) and not math.isfinite(v) else v  # (no NaN)
        line = json.dumps({k: strict(v) for k, v in row.items()}) + '\n'
        if self.pending is not None:
            self.pending.append(line)
        else:
            size = os.path.getsize(self.metrics) if os.path.isfile(self.metrics) else 0
            try:
                with appending(self.metrics) as f:
                    f.write(line)
            except OSError as e:
                try:
                    if os.path.isfile(self.metrics) and not os.path.islink(self.metrics):
                        os.truncate(self.metrics, size)
                except OSError:
                    pass
                reason = why(e, self.metrics)
                self.fail(f"cannot write {self.metrics}: {reason}", "the log's last row whole")
        if self.wandb:
            self.wandb.log(row)

    def save(self, path, state, iter_num):
        """A checkpoint, flushed to disk and renamed into place; weights that are not finite are
        never saved."""
        floats = [p for p in state['model'].values() if p.is_floating_point()]
        if not all(torch.isfinite(p).all() for p in floats):
            fail(f"the weights at iteration {iter_num} are not finite: not saved, "
                 f"{kept(self.out_dir)} (try a lower learning_rate)")
        self.first_write(iter_num)
        try:
            write_atomic(path, lambda f: torch.save(state, f), durable=True)
        except FileError as e:
            fail(f"{e}; {kept(self.out_dir)}")
        print(f"saving checkpoint to {path}")
        if path == self.ckpt and os.path.isfile(self.last):
            os.remove(self.last)  # an older state than this checkpoint

    def interrupted(self, iter_num, resume_command, why='interrupted'):
        """What an interrupt left, and the command that continues, on stderr (as every stop); why:
        what stopped it (an output that cannot be written: 'cannot write to stdout (No space left
        on device)')."""
        if not self.writes:
            return
        if self.pending is not None:
            print(f"error: {why} before the first training step; {self.discard()}", file=sys.stderr)
            return
        state = self.last if os.path.isfile(self.last) else self.ckpt
        best = f", the best weights kept in {self.ckpt}" if os.path.isfile(self.ckpt) else ''
        print(f"{why} before iteration {iter_num}: its state saved to {state}{best}; "
              f"continue with:\n  {resume_command}", file=sys.stderr)

    def done(self, iter_num, which):
        """The closing line of a finished run: the best evaluation logged, where the weights are
        (which: ckpt.pt's, in words), how to sample them."""
        if not self.writes:
            return
        evaluated = [r for r in self.rows() if r.get('val/loss') is not None]
        best = min(evaluated, key=lambda r: r['val/loss'], default=None)
        held, note = self.ckpt if os.path.isfile(self.ckpt) else self.last, ''
        if held == self.last:  # no ckpt.pt: no evaluation beat the first, of the untrained weights
            which = 'the final'
            if best and best['iter'] != iter_num:
                note = f" (not iteration {best['iter']}'s: those are not saved)"
        at = f": best val loss {best['val/loss']:.4f} at iteration {best['iter']}" if best else ""
        sample = f"python sample.py --out_dir={shlex.quote(self.out_dir)}"
        where = f"; {which} weights in {held}{note}; sample them with: {sample}"
        saved = where if os.path.isfile(held) else "; no weights saved"
        print(f"done at iteration {iter_num}{at}{saved}")

    def fail(self, reason, *also):
        fail(f"{reason}; stopped, {', '.join([kept(self.out_dir), *also])}")


def appending(path):
    """path opened to append, never blocking (a FIFO put there) nor through a link: only a regular
    file, else OSError."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | NOFOLLOW
    f = open(os.open(path, flags, 0o666), 'a')
    if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
        f.close()
        raise OSError(errno.EINVAL, 'not a regular file')
    return f


def loads(line):
    """A line's JSON object, else None; NaN or Infinity a user put there: null, as ours."""
    try:
        row = json.loads(line, parse_constant=lambda name: None)
        return row if isinstance(row, dict) else None
    except ValueError:
        return None
