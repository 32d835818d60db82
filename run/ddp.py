"""
DDP: one train.py process per device, launched by torchrun.

    rank, local_rank, world_size, device = join(device, backend)
    stop = any_rank(stop, device)          a collective: every rank stops at the same iteration
    leave(model, rank, code)               its weights' hash, then exit
"""
import hashlib
import os
import re
import sys

import torch
import torch.distributed as dist

from configurator import describe, fail


def join(device, backend=''):
    """Join torchrun's process group; on CUDA each process takes its own device."""
    try:
        dist.init_process_group(backend or ('nccl' if device.startswith('cuda') else 'gloo'))
    except (ValueError, RuntimeError) as e:  # RANK set outside torchrun: no WORLD_SIZE, peers
        fail(f"RANK={os.environ['RANK']} is set but no DDP group can be joined ({describe(e)}): "
             "use torchrun or unset it")
    rank, local_rank = dist.get_rank(), int(os.environ['LOCAL_RANK'])
    if device.startswith('cuda'):
        device = f'cuda:{local_rank}'
        torch.cuda.set_device(device)
    lost_peer_in_one_line(rank)
    return rank, local_rank, dist.get_world_size(), device


def lost_peer_in_one_line(rank):
    """A rank that stops (killed, or its own line says why) fails the others' next collective: one
    line each. Every error of ranks > 0, and a lost peer on rank 0; a bug there keeps its traceback."""
    hook = sys.excepthook

    def one_line(kind, e, tb):
        lost = isinstance(e, RuntimeError) and re.search(r'peer|gloo|NCCL', str(e))
        if not (rank or lost):
            return hook(kind, e, tb)
        print(f"error: rank {rank}: {describe(e)} (another rank stopped: killed, or its own error "
              "says why)", file=sys.stderr)
    sys.excepthook = one_line


def any_rank(flag, device):
    """Whether any rank's flag is set (a collective: every rank gets the same answer)."""
    flag = torch.tensor([float(flag)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def leave(model, rank, code):
    """Each rank's weights hash (they must match), then exit. DDP keeps gloo's worker threads alive
    past destroy_process_group; one that frees a tensor while Python shuts down aborts the run
    (SIGABRT). All is saved by now, so leave without that shutdown."""
    weight_bytes = b''.join(p.detach().cpu().numpy().tobytes() for p in model.parameters())
    sys.stdout.flush()  # then the line in one write: the ranks share one stdout
    digest = hashlib.sha256(weight_bytes).hexdigest()[:16]
    print(f"rank {rank}: weights sha256 {digest}", flush=True)
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
