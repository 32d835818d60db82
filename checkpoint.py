"""
The run's files, shared by train.py, sample.py and bench.py:

- every file is written whole or not at all: a temp file NAME.tmpPID next to it, then a rename; a failed write
  (disk full, a size limit) leaves the old file as it was, no temp file, and one line naming why;
- a checkpoint is loaded safely (weights only: a pickle that runs code is refused) and checked, and a model is
  sized from its config before anything is built, so a file asking for more memory than there is is one line.
"""
import errno
import math
import os
import shutil
from dataclasses import replace

import torch

from configurator import describe
from model import GPT, Block, GPTConfig


class FileError(Exception):
    """A file that cannot be read or written, in one line."""


def temp_name(path):
    return f"{path}.tmp{os.getpid()}"  # unique per process; train.py deletes only its own stale ones


def write_atomic(path, data, durable=False):
    """data (str, bytes, or a function that writes into an open binary file) into path via a temp file and a rename.
    durable: flushed to the disk, the rename too (a power cut keeps the old file or the new one)."""
    tmp = temp_name(path)
    try:
        with open(tmp, 'wb') as f:
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
        if os.path.isfile(tmp):
            os.remove(tmp)
        raise FileError(f"cannot write {path}: {why(e, path)}; the old file kept, no partial file left") from None


def why(e, path):
    """An OSError's reason in words, naming a full disk as such (torch.save hides the errno in a RuntimeError)."""
    free = shutil.disk_usage(os.path.dirname(os.path.abspath(path))).free
    if getattr(e, 'errno', None) == errno.ENOSPC or free < 2 ** 20:
        return f"no space left on device (ENOSPC), {free:,} bytes free"
    return e.strerror if isinstance(e, OSError) and e.strerror else describe(e)


RESUME = ('model', 'optimizer', 'model_args', 'iter_num', 'best_val_loss')  # what a resume reads; sampling: 2


def read_checkpoint(path, device='cpu', keys=('model', 'model_args')):
    """(checkpoint dict, its GPTConfig) of a checkpoint train.py wrote, holding keys, or FileError naming what is
    wrong."""
    try:
        ckpt = torch.load(path, map_location=device, weights_only=True)
    except Exception as e:  # truncated, corrupted, not a checkpoint, or a pickle that would run code
        reason = describe(e)
        if 'weights_only' in reason:  # torch's advice to retry unsafely: never for a file we cannot vouch for
            unpickler = ' '.join(str(e).split('Unpickler error:')[-1].split('Check the documentation')[0].split())
            reason = f"not a file of tensors that loads safely ({unpickler[:120]})"
        raise FileError(f"cannot load checkpoint {path}: {reason}") from None
    kinds = {'model': dict, 'optimizer': dict, 'model_args': dict, 'iter_num': int, 'best_val_loss': float}
    wrong = [k for k in keys if not isinstance(ckpt, dict) or not isinstance(ckpt.get(k), kinds[k])]
    if wrong:
        raise FileError(f"cannot load checkpoint {path}: no {', '.join(wrong)} of the right kind in it: "
                        f"not a checkpoint of train.py")
    try:
        return ckpt, GPTConfig(**ckpt['model_args'])
    except (TypeError, ValueError) as e:
        raise FileError(f"cannot load checkpoint {path}: its model_args: {describe(e)}") from None


def num_params(config):
    """GPT(config)'s parameter count, before anything is built: one block of each layout on the meta device, times
    its number of layers, plus the embeddings (any n_layer); inf where a tensor's size would overflow."""
    count = lambda module: sum(p.numel() for p in module.parameters())
    try:
        with torch.device('meta'):
            one = GPT(replace(config, n_layer=1, attn=config.softmax or config.pattern()[0]))  # for its embeddings
            blocks = sum(n * count(Block(config, a)) for a, n in config.layer_counts().items())
            return count(one) - count(one.transformer.h[0]) + blocks
    except RuntimeError:  # "Storage size calculation overflowed"
        return math.inf
