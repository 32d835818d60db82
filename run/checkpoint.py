"""
A training run's files and what is promised about them. train.py writes out_dir through one Run; sample.py and
bench.py find and read checkpoints here; W&B's run (its folder, resumed as one run) is wandb_run.py's.

    ckpt.pt        the best weights by val loss (--always_save_checkpoint: the latest evaluated); sample.py reads
                   it, or last.pt when there is none
    last.pt        where an interrupt stopped, or the end when ckpt.pt does not hold it
    metrics.jsonl  one strict-JSON row per log line (non-finite numbers null), iterations never going back
    train.lock     held while a run lives: a second run into the same out_dir is refused

- A file is written whole or not at all (NAME.tmpPID, flushed, renamed): after an error or a full disk the old one
  is there, and one line says why. A SIGKILL loses the steps since the last save (and leaves a NAME.tmpPID, which
  the next run deletes).
- Until the first training step ends, an error, out of memory, Ctrl-C, SIGTERM, SIGHUP or a lost stdout (closed,
  or its disk full) leaves out_dir as it was (--overwrite=True deletes old checkpoints only then). After it an
  interrupt saves last.pt and exits 130; a resume starts from the later of ckpt.pt and last.pt, bit-exactly, with
  the settings it is given (the optimizer's too, never a file's). A divergence saves nothing: exit 2, the last good
  files kept. A checkpoint is read as tensors only (a pickle that runs code is refused; weights must be floating
  point, an AdamW state finite and of their shapes), its CRCs checked (a changed byte is named, not loaded as
  another weight), and sized before its model is built. A live run's out_dir is never deleted (bench.py takes its
  lock).
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
import warnings
import zipfile
from dataclasses import replace
from glob import glob

import torch

from configurator import describe, fail
from model import LAYER_FIELDS, GPTConfig

try:
    import fcntl  # the lock of out_dir (Windows has none: there nothing guards against a second run)
except ImportError:
    fcntl = None


class FileError(Exception):
    """A file that cannot be read or written, in one line."""


def temp_name(path):
    return f"{path}.tmp{os.getpid()}"  # unique per process; a run deletes only these, and only its own names


def write_atomic(path, data, durable=False):
    """data (str, bytes, or a function that writes into an open binary file) into path via a temp file and a rename.
    durable: flushed to the disk, the rename too (a power cut keeps the old file or the new one)."""
    tmp = temp_name(path)
    try:
        if os.path.islink(tmp):  # ours by name (this PID), never followed: a link there would write elsewhere
            os.remove(tmp)
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, 'O_NOFOLLOW', 0), 0o666), 'wb') as f:
            data(f) if callable(data) else f.write(data.encode() if isinstance(data, str) else data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
        if durable:
            fd = os.open(os.path.dirname(path) or '.', os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
    except (OSError, RuntimeError) as e:  # disk full, file size limit, I/O error: torch.save says RuntimeError
        reason = why(e, path)  # before the temp file goes: the space it took is why the disk is full
        if os.path.isfile(tmp):
            os.remove(tmp)
        raise FileError(f"cannot write {path}: {reason}; the old file kept, no partial file left") from None


def why(e, path):
    """An OSError's reason in words, naming a full disk as such (torch.save hides the errno in a RuntimeError)."""
    try:
        free = shutil.disk_usage(os.path.dirname(os.path.abspath(path))).free
    except OSError:  # the folder itself is gone
        free = math.inf
    if getattr(e, 'errno', None) == errno.ENOSPC or free < 2 ** 20:
        return f"no space left on device (ENOSPC), {free:,} bytes free"
    return e.strerror if isinstance(e, OSError) and e.strerror else describe(e)


REMOVED = "it was removed while being read (a live run replaces its checkpoints as it saves); try again"
RESUME = ('model', 'optimizer', 'model_args', 'iter_num', 'best_val_loss')  # what a resume reads (sampling: 2)


def read_checkpoint(path, device='cpu', keys=('model', 'model_args')):
    """(checkpoint dict, its GPTConfig) of a checkpoint train.py wrote, holding keys, or FileError naming what is
    wrong."""
    try:  # torch's warnings about a file (a changed pickle protocol byte) kept back: shown only if it loads
        with warnings.catch_warnings(record=True) as said:
            ckpt = torch.load(path, map_location=device, weights_only=True)
    except Exception as e:  # truncated, corrupted, not a checkpoint, or a pickle that would run code
        reason = describe(e)
        if not os.path.isfile(path):  # listed, then gone: a live run saving ckpt.pt removes last.pt
            reason = REMOVED
        elif damaged(path) or 'zip archive' in reason or getattr(e, 'errno', None) == errno.EINVAL or isinstance(
                e, (EOFError, UnicodeDecodeError)):  # cut short, or bytes changed
            reason = f"truncated or corrupted, not a whole torch.save file ({os.stat(path).st_size:,} bytes)"
        elif open(path, 'rb').read(1) not in (b'P', b'\x80'):  # (torch would speak of a .tar format, or a KeyError)
            reason = "not a torch.save file: it begins as neither a zip nor a pickle does"
        elif 'weights_only' in reason:  # torch's advice to retry unsafely: never for a file we cannot vouch for
            said = [p for p in str(e).split('\n\n') if p.strip() and not p.startswith(('Weights only', 'Check the'))]
            unpickler = ' '.join(' '.join(said).split('Unpickler error:')[-1].split())  # (the reason, not the advice)
            reason = f"not a file of tensors that loads safely ({unpickler[:160]})"
        raise FileError(f"cannot load checkpoint {path}: {reason}") from None
    if not os.path.isfile(path):  # loaded, then removed: its CRCs can no longer be checked
        raise FileError(f"cannot load checkpoint {path}: {REMOVED}")
    if what := damaged(path):  # torch.load reads a changed byte as a changed weight
        raise FileError(f"cannot load checkpoint {path}: corrupted: {what}")
    if not zipfile.is_zipfile(path):  # torch.save's format before torch 1.6: a changed byte would load unnoticed
        raise FileError(f"cannot load checkpoint {path}: torch.save's old format, with no CRCs to check it by; "
                        "re-save it")
    kinds = {'model': dict, 'optimizer': dict, 'model_args': dict, 'iter_num': int, 'best_val_loss': float}
    wrong = [k for k in keys if not isinstance(ckpt, dict) or not isinstance(ckpt.get(k), kinds[k])]
    wrong += [k for k, ok in (('iter_num', lambda v: v >= 0), ('best_val_loss', lambda v: v > -math.inf)) if k in keys
              and k not in wrong and (isinstance(ckpt[k], bool) or not ok(ckpt[k]))]  # (>= 0; not NaN, nor -inf)
    if wrong:
        raise FileError(f"cannot load checkpoint {path}: no {', '.join(wrong)} of the right kind in it: "
                        f"not a checkpoint of train.py")
    weight = lambda v: torch.is_tensor(v) and v.layout == torch.strided and not v.is_meta and v.dtype in (
        torch.float32, torch.float64, torch.bfloat16, torch.float16)  # (load_state_dict casts 3 to 3.0)
    for k, v in (ckpt['model'].items() if 'model' in keys else ()):
        if not weight(v):
            raise FileError(f"cannot load checkpoint {path}: its weight {k!r} is not a floating-point tensor (" +
                            (f"{v.dtype}, {v.layout}, on {v.device})" if torch.is_tensor(v) else f"{type(v).__name__})"))
        if not v.isfinite().all():  # (train.py never saves such weights: a diverged run's would train on as NaN)
            raise FileError(f"cannot load checkpoint {path}: its weight {k!r} is not finite")
    try:
        config = GPTConfig(**ckpt['model_args'])
    except (TypeError, ValueError) as e:
        raise FileError(f"cannot load checkpoint {path}: its model_args: {describe(e)}") from None
    for w in said:
        warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    return ckpt, config


def damaged(path):
    """What fails in a torch.save file (a zip): a part whose bytes fail their CRC-32, or headers that do not read
    (torch.load checks neither, and reads a changed name length as weights from shifted bytes); None if whole."""
    try:
        if not os.path.isfile(path) or not zipfile.is_zipfile(path):  # not a zip at all: torch.load says why
            return None
        with zipfile.ZipFile(path) as z:  # torch.save marks no part a folder; torch.load would read one as a tensor
            folder = next((i.filename for i in z.infolist() if i.is_dir() or i.external_attr & 0x10), None)  # of junk
            part = z.testzip()
    except Exception as e:
        return f"its zip headers do not read ({describe(e)})"
    return f"{folder} is marked a folder in the zip's directory" if folder else part and f"{part} fails its CRC check"


def weights(ckpt):
    """The model's state dict, without the prefix torch.compile adds to its names."""
    return {k.removeprefix('_orig_mod.'): v for k, v in ckpt['model'].items()}


def load_optimizer(optimizer, state):
    """A checkpoint's AdamW state into optimizer, checked like the config. Its settings stay this run's (a resume's
    --beta2 or --weight_decay applies; a file's maximize, eps or amsgrad never do): torch would take the file's. Every
    weight needs its state, a whole float step >= 0 and two finite real moments of its shape, the second >= 0: torch
    checks only the groups' sizes, casts what it gets, and restarts a missing state from zero; anything else fails at
    the first step in a traceback, or trains as the file says."""
    def adamw(s):  # (a step of a small int type wraps around at + 1; float32's, torch's own, is exact up to 2^24)
        if not (isinstance(s, dict) and set(s) == {'step', 'exp_avg', 'exp_avg_sq'} and
                all(map(torch.is_tensor, s.values()))):
            return False
        step, moments = s['step'], (s['exp_avg'], s['exp_avg_sq'])
        return (step.dtype in (torch.float32, torch.float64) and step.numel() == 1 and 0 <= step.item() < 2 ** 24
                and step.item() % 1 == 0 and bool((s['exp_avg_sq'] >= 0).all())
                and all(m.is_floating_point() and bool(m.isfinite().all()) for m in moments))
    bad = ValueError("its optimizer state is not AdamW's for these weights (each needs a float step >= 0 and two "
                     "finite real moments of its shape)")
    if not isinstance(state.get('state'), dict) or not all(map(adamw, state['state'].values())):
        raise bad
    ours = [{k: v for k, v in g.items() if k != 'params'} for g in optimizer.param_groups]
    groups = [{**g, **o} for g, o in zip(state['param_groups'], ours, strict=True)]  # (a crafted list: TypeError)
    optimizer.load_state_dict({**state, 'param_groups': groups})
    params = [p for g in optimizer.param_groups for p in g['params']]
    if not all(p in optimizer.state and optimizer.state[p]['exp_avg'].shape == optimizer.state[p]['exp_avg_sq'].shape
               == p.shape for p in params):
        raise bad


def checkpoints(out_dir):
    """out_dir's checkpoints, best first: ckpt.pt (the best weights), last.pt (where the run stopped)."""
    return [p for p in (os.path.join(out_dir, name) for name in ('ckpt.pt', 'last.pt')) if os.path.isfile(p)]


def in_use(out_dir):
    """Whether a live train.py run holds out_dir's lock (opened without following a link or blocking on a FIFO)."""
    try:
        fd = os.open(os.path.join(out_dir, 'train.lock'), os.O_RDONLY | os.O_NONBLOCK | getattr(os, 'O_NOFOLLOW', 0))
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
    """Delete a run's out_dir holding its lock (bench.py replacing its runs), or FileError if a live run holds it: a
    train.py started meanwhile is refused by the lock."""
    if not os.path.isdir(out_dir):
        return
    with appending(os.path.join(out_dir, 'train.lock')) as lock:
        try:
            fcntl and fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise FileError(f"{out_dir} is in use by a live train.py run: wait for it to end, or give another "
                            f"--out") from None
        shutil.rmtree(out_dir)


def kept(out_dir):
    """What a stopped run leaves behind, said truthfully."""
    names = [os.path.basename(p) for p in checkpoints(out_dir)]
    return f"{' and '.join(names)} in {out_dir} kept" if names else "no checkpoint was written"


def newest_out_dir():
    """The out*/ folder here with the newest checkpoint (the folders train.py's configs write), or 'out'."""
    found = [p for p in glob('out*/ckpt.pt') + glob('out*/last.pt') if os.path.isfile(p)]  # (no folder, no dead link)
    mtime = lambda p: os.stat(p).st_mtime if os.path.isfile(p) else 0  # (again: a live run deletes last.pt as it saves)
    return os.path.dirname(max(found, key=mtime, default='out/'))


def trained_on(ckpt):
    """The data a checkpoint was trained on, in words: its data_dir or dataset, and its vocabulary's size."""
    config, meta = ckpt.get('config') or {}, ckpt.get('meta') or {}
    data = config.get('data_dir') or config.get('dataset') if isinstance(config, dict) else None
    vocab = meta.get('vocab_size') if isinstance(meta, dict) else None
    return f"{data or 'unknown data'} ({f'{vocab:,}' if isinstance(vocab, int) else '?'} tokens)"


def resume_state(out_dir, device, meta, asked, data_dir):
    """(path, checkpoint) of the later of out_dir's checkpoints, if it is the model asked (a GPTConfig) on the data's
    vocabulary (meta), or one line. A broken one is never skipped silently (it may be the later state): it is named,
    with the one that loads."""
    loaded, broken = [], []
    for path in checkpoints(out_dir):
        try:
            loaded.append((path, *read_checkpoint(path, device, RESUME)))
        except FileError as e:  # (one that vanished meanwhile is older than what replaced it: skipped)
            broken += [(path, str(e))] * os.path.exists(path)
    if not loaded and not broken:
        fail(f"the checkpoints in {out_dir} were removed while being read (a live run saving?); try again")
    if broken:
        fail(broken[0][1] + (f"; {loaded[0][0]} (iteration {loaded[0][1]['iter_num']}) loads: move {broken[0][0]} "
                             f"away to resume from it" if loaded else ""))
    path, ckpt, saved = max(loaded, key=lambda c: c[1]['iter_num'])  # the first of equals: ckpt.pt
    if ckpt.get('meta') != meta:  # the same tokens, not only as many
        fail(f"{path} was trained on another vocabulary ({saved.vocab_size} tokens) than the data in {data_dir} "
             f"({asked.vocab_size}{', other ones' * (saved.vocab_size == asked.vocab_size)}); resume with its "
             f"--dataset / --data_dir or change out_dir")
    same = dict(chunk_size=asked.chunk_size, linear_kernels=asked.linear_kernels,  # how it computes: same weights
                attn=asked.attn if saved.layouts == asked.layouts else saved.attn)  # (and a stack spelled otherwise)
    differ = model_flags(replace(saved, **same), asked)
    if differ:
        fail(f"{path} is another model ({', '.join(differ)} in it); add those settings to resume it, or change out_dir")
    return path, ckpt


def model_flags(a, b):
    """The --key=value settings of GPTConfig a that differ from b (a GPTConfig, or train.py's flags), of the fields a
    uses; not one that both leave at their layout's default (an MHA's n_kv_head = n_head: --attn=mha says it)."""
    default = lambda c, k: getattr(c, k) == LAYER_FIELDS[k] or isinstance(c, GPTConfig) and getattr(
        replace(c, **{k: LAYER_FIELDS[k]}), k) == getattr(c, k)
    return [f"--{k}={getattr(a, k)}" for k in a.used_fields() if k != 'vocab_size' and getattr(a, k) != getattr(b, k)
            and not (k in LAYER_FIELDS and default(a, k) and default(b, k))]


def changed(ckpt, config):
    """The settings a resume changes from its checkpoint's run ('max_iters 200 -> 2000', 'beta2 0.99 -> 0.95'): a
    resume trains with its command line, which may not repeat the run's flags. (The model's are checked before.)"""
    old = ckpt.get('config') if isinstance(ckpt.get('config'), dict) else {}
    return [f"{k} {old[k]!r} -> {v!r}" for k, v in config.items()
            if k in old and old[k] != v and k not in ('init_from', 'overwrite')]


def resume_command(world_size, extra):
    """This process's command with --init_from=resume (under torchrun if world_size) and the settings in extra (a
    converted model's shape, which its arguments lack)."""
    args = [a for a in sys.argv[1:] if not a.startswith(('--init_from', '--overwrite'))] + ['--init_from=resume']
    launcher = ['torchrun', '--standalone', f'--nproc_per_node={world_size}'] if world_size else ['python']
    return shlex.join(launcher + [sys.argv[0]] + args + extra)


class Run:
    """train.py's out_dir. Written by rank 0 only and not by eval_only (writes=False: every method a no-op), locked
    while the run lives, and changed only from the run's first write on (first_write(), at the end of the first step
    or the first save); the rows logged before it wait in .pending, None once they are written."""

    def __init__(self, out_dir, resume, writes=True):
        self.out_dir, self.resume, self.writes, self.pending, self.wandb = out_dir, resume, writes, [], None
        self.ckpt, self.last, self.metrics = (os.path.join(out_dir, n) for n in ('ckpt.pt', 'last.pt', 'metrics.jsonl'))
        self.made = []  # what a run that stops before its first write removes again
        if not writes:
            return
        try:
            d = os.path.abspath(out_dir)
            while not os.path.isdir(d):  # the folders makedirs adds, outermost first, then the lock if new
                self.made, d = [d] + self.made, os.path.dirname(d)
            lock = os.path.join(out_dir, 'train.lock')
            self.made += [lock] * (not os.path.exists(lock))
            os.makedirs(out_dir, exist_ok=True)
            self.lock = appending(lock)  # the OS drops the lock when the process dies
        except OSError as e:
            fail(f"out_dir={out_dir!r} is not writable ({e.strerror}); pass --out_dir=DIR")
        try:
            fcntl and fcntl.flock(self.lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            fail(f"out_dir={out_dir!r} is in use by another train.py run; wait for it to end or pass another --out_dir")
        self.previous = checkpoints(out_dir)  # an earlier run's (--overwrite or a resume: checked by train.py)
        atexit.register(self.discard)

    def discard(self):
        """Before the first write, at any exit: remove what this run made (its lock file, its new out_dir, its offline
        W&B folder); returns what is left, in words."""
        if self.pending is None or not self.writes:
            return "nothing was written"
        left = self.wandb.discard() if self.wandb else ''  # (.wandb: train.py's WandB, once it is made)
        for path in reversed(self.made):
            try:
                os.remove(path) if path.endswith('train.lock') else os.rmdir(path)  # (rmdir: only if still empty)
            except OSError:
                pass
        self.writes = False  # once: every method a no-op from here on
        return "nothing was written" + (f" but {left}" if left else '')

    def first_write(self, iter_num):
        """The run's first write (later calls: nothing): only now may an earlier run's files change. Killed runs' temp
        files go (only NAME.tmpPID of our names: none is alive, the lock says), a new run's --overwrite removes the old
        checkpoints, and the log is rewritten: a new run's from nothing, a resume's up to its checkpoint."""
        if self.pending is None or not self.writes:
            return
        for name in ('ckpt.pt', 'last.pt', 'metrics.jsonl'):
            for stale in (os.path.join(self.out_dir, f) for f in os.listdir(self.out_dir)
                          if re.fullmatch(rf'{re.escape(name)}\.tmp\d+', f)):
                if os.path.islink(stale) or os.path.isfile(stale):  # a file or a link, never a folder
                    os.remove(stale)
        for old in self.previous if not self.resume else []:
            os.remove(old)
            print(f"removed {old} (--overwrite=True)")
        rows = [json.dumps(row) + '\n' for row in self.rows() if row['iter'] < iter_num] if self.resume else []
        try:
            write_atomic(self.metrics, ''.join(rows + self.pending))
        except FileError as e:
            self.fail(e)
        self.pending = None

    def rows(self):
        """metrics.jsonl's rows (a line cut short by a kill, with broken bytes or without an iteration: dropped)."""
        if not os.path.isfile(self.metrics):
            return []
        with open(self.metrics, errors='replace') as f:
            return [row for line in f
                    if line.endswith('\n') and (row := loads(line)) and isinstance(row.get('iter'), int)]

    def log(self, row):
        """One row to metrics.jsonl (and W&B): a failed write (disk full) stops the run with the log's rows whole."""
        if not self.writes:
            return
        line = json.dumps({k: v if not isinstance(v, float) or math.isfinite(v) else None for k, v in row.items()})
        if self.pending is not None:
            self.pending.append(line + '\n')
        else:
            size = os.path.getsize(self.metrics) if os.path.isfile(self.metrics) else 0
            try:
                with appending(self.metrics) as f:
                    f.write(line + '\n')
            except OSError as e:
                try:
                    if os.path.isfile(self.metrics) and not os.path.islink(self.metrics):
                        os.truncate(self.metrics, size)  # the row's written part cut off again
                except OSError:
                    pass
                self.fail(f"cannot write {self.metrics}: {why(e, self.metrics)}", "the log's last row whole")
        if self.wandb:
            self.wandb.log(row)

    def save(self, path, state, iter_num):
        """A checkpoint, flushed to disk and renamed into place; weights that are not finite are never saved."""
        if not all(torch.isfinite(p).all() for p in state['model'].values() if p.is_floating_point()):
            fail(f"the weights at iteration {iter_num} are not finite: not saved, {kept(self.out_dir)} (try a lower "
                 f"learning_rate)")
        self.first_write(iter_num)
        try:
            write_atomic(path, lambda f: torch.save(state, f), durable=True)
        except FileError as e:
            fail(f"{e}; {kept(self.out_dir)}")
        print(f"saving checkpoint to {path}")
        if path == self.ckpt and os.path.isfile(self.last):
            os.remove(self.last)  # an older state than this checkpoint

    def interrupted(self, iter_num, resume_command, why='interrupted'):
        """What an interrupt left, and the command that continues, on stderr (as every stop); why: what stopped it (an
        output that cannot be written: 'cannot write to stdout (No space left on device)')."""
        if not self.writes:
            return
        if self.pending is not None:
            print(f"error: {why} before the first training step; {self.discard()}", file=sys.stderr)
            return
        print(f"{why} before iteration {iter_num}: its state saved to "
              f"{self.last if os.path.isfile(self.last) else self.ckpt}"
              f"{', the best weights kept in ' + self.ckpt if os.path.isfile(self.ckpt) else ''}; continue with:\n"
              f"  {resume_command}", file=sys.stderr)

    def done(self, iter_num, which):
        """The closing line of a finished run: the best evaluation logged, where the weights are (which: ckpt.pt's,
        in words), how to sample them."""
        if not self.writes:
            return
        best = min((r for r in self.rows() if r.get('val/loss') is not None), key=lambda r: r['val/loss'], default=None)
        held, note = self.ckpt if os.path.isfile(self.ckpt) else self.last, ''
        if held == self.last:  # no ckpt.pt: no evaluation beat the first, of the untrained weights (never saved)
            which = 'the final'
            if best and best['iter'] != iter_num:
                note = f" (not iteration {best['iter']}'s: those are not saved)"
        print(f"done at iteration {iter_num}" + (f": best val loss {best['val/loss']:.4f} at iteration {best['iter']}"
              if best else "") + (f"; {which} weights in {held}{note}; sample them with: python sample.py "
              f"--out_dir={shlex.quote(self.out_dir)}" if os.path.isfile(held) else "; no weights saved"))

    def fail(self, reason, *also):
        fail(f"{reason}; stopped, {', '.join([kept(self.out_dir), *also])}")


def appending(path):
    """path opened to append, never blocking (a FIFO put there) nor through a link: only a regular file, else
    OSError."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | getattr(os, 'O_NOFOLLOW', 0)
    f = open(os.open(path, flags, 0o666), 'a')
    if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
        f.close()
        raise OSError(errno.EINVAL, 'not a regular file')
    return f


def loads(line):
    try:
        row = json.loads(line, parse_constant=lambda name: None)  # (NaN, Infinity a user put there: null, as ours)
        return row if isinstance(row, dict) else None
    except ValueError:
        return None
