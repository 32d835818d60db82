r"""
Train one attention layout on tiny Shakespeare (nanoGPT's train.py, one layout switch more).

    python train.py config/gqa.py                  # baby GPT, GQA (~20 s an iteration, 2 CPU cores)
    python train.py config/mla.py config/cpu.py    # nanoGPT's CPU recipe, any layout
    python train.py config/mha.py --batch_size=32 --wandb_log=True
    torchrun --standalone --nproc_per_node=2 train.py config/gqa.py config/cpu.py \
        --gradient_accumulation_steps=2

Every key below can be set by a config file or --key=value (see configurator.py). What is written to
out_dir, and what is promised about it after an error, a kill, an interrupt or a divergence:
run/checkpoint.py.
"""
# first: Ctrl-C, SIGTERM or SIGHUP during the slow imports below is one line, exit 130
from run.interrupts import Interrupts

interrupts = Interrupts()

import math
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, fields
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from configurator import check_device, configure, default_dtype, defaults, duration, fail
from data.common import PrepareError, open_data, sample_prompt
from model import GPT, GPTConfig
from run.checkpoint import (Run, checkpoints, earlier_run, kept, load_weights, model_flags, resume,
                            resume_command)
from run.convert import conversion
from run.ddp import any_rank, join, leave
from run.interrupts import memory_errors_in_one_line, on_closed_output
from run.optim import adamw, cosine_lr
from run.settings import (check_settings, check_training_memory, remake as remake_hint, settle,
                          summary)
from run.wandb_run import WandB

# -----------------------------------------------------------------------------
# defaults: nanoGPT's baby GPT on shakespeare_char
# I/O
out_dir = 'out'                 # ckpt.pt (best val loss), last.pt (resume state), metrics.jsonl
eval_interval = 250             # evaluate (and save if best) this often, and at the end
log_interval = 10               # print and log the training loss every this many iterations
eval_iters = 200                # batches per split in an evaluation
eval_only = False               # evaluate once (--init_from=resume: the checkpoint), write nothing
always_save_checkpoint = False  # else only when val loss improves
init_from = 'scratch'           # scratch, resume, an MHA out_dir, or GPT-2 (gpt2[-medium..], a dir)
overwrite = False               # a new run may replace out_dir's checkpoints (else it is refused)
sample_every_eval = False       # print a short sample at each evaluation (W&B: always, a table)
# logging
wandb_log = False               # log to Weights & Biases too (metrics.jsonl always)
wandb_project = 'attention-layouts'
wandb_run_name = ''             # '' = <attn>-<time>; the layout is always in the name
wandb_mode = ''                 # online/offline/disabled; '' = $WANDB_MODE, or offline if no login
wandb_log_checkpoint = False    # with wandb_log: ckpt.pt as a W&B artifact when the run ends
# model: GPTConfig's fields and defaults (model.py says what each is), and the baby GPT's dropout
globals().update({f.name: f.default for f in fields(GPTConfig) if f.name != 'vocab_size'})
dropout = 0.2                   # dropout probability (embeddings, attention, residuals)
# data
dataset = 'shakespeare_char'    # shakespeare_char (65 characters) or shakespeare (GPT-2 BPE)
data_dir = ''                   # '' = data/<dataset>, prepared on first use; else holds train.bin
gradient_accumulation_steps = 1  # in total, over all DDP processes
batch_size = 64                 # sequences per micro-batch
block_size = 256                # context length
# AdamW and the learning-rate schedule (linear warmup, cosine decay to min_lr)
learning_rate = 1e-3            # peak learning rate
max_iters = 5000                # training iterations in all (a resume continues up to it)
weight_decay = 1e-1             # AdamW decay of 2-D weights (not biases, norms)
beta1 = 0.9                     # AdamW betas
beta2 = 0.99                    # (0.99: small batches, as nanoGPT's shakespeare_char)
grad_clip = 1.0                 # 0 = off
decay_lr = True                 # False = a constant learning_rate (no warmup either)
warmup_iters = 100              # linear warmup from 0 to learning_rate
lr_decay_iters = 5000           # cosine decay reaches min_lr here (~max_iters)
min_lr = 1e-4                   # the learning rate at and after lr_decay_iters
# system
device = 'cuda' if torch.cuda.is_available() else 'cpu'  # cpu, cuda or cuda:N
dtype = default_dtype()         # autocast: float32 (CPU), bfloat16 or float16
compile = True                  # torch.compile the model, one graph (a CPU: only if given)
backend = ''                    # '' = nccl on CUDA, gloo on CPU
seed = 1337                     # every random draw is a function of (seed, rank, iteration)
# -----------------------------------------------------------------------------
memory_errors_in_one_line()
# `| head`, a closed terminal: an interrupt; a full disk: a stop as one
on_closed_output(interrupts.output_lost)
given = {}  # the keys a config file or flag set: what set each last
config = configure(defaults(globals()), sys.argv[1:], __file__, given)
settle(config, given)  # out_dir A/../B is B; config/gqa.py --attn=mla drops GQA's n_kv_head=2
if 'compile' not in given and not device.startswith('cuda'):  # compiling on a CPU takes minutes
    config['compile'] = False
globals().update(config)
# -----------------------------------------------------------------------------
# every setting checked before any work (a resume, a conversion once read): one line, exit 2
resuming = init_from == 'resume'
converting = init_from not in ('scratch', 'resume')  # an MHA out_dir
previous = checkpoints(out_dir)
DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'data')
check_device(device, dtype)
check_settings(config, previous, DATA)
remake = remake_hint(dataset, data_dir)

# DDP: one process per device, launched by torchrun
ddp = int(os.environ.get('RANK', -1)) != -1
ddp_rank, ddp_local_rank, ddp_world_size = 0, 0, 1
if ddp:
    ddp_rank, ddp_local_rank, ddp_world_size, device = join(device, backend)
    gradient_accumulation_steps //= ddp_world_size  # per process from here on (a multiple: checked)
master_process = ddp_rank == 0  # logs and checkpoints
# out_dir's files, on rank 0 (eval_only writes nothing): locked now, written from the first step on
run = Run(out_dir, resuming, writes=master_process and not eval_only)
interrupts.discard = run.discard  # an interrupt before the first step removes what the run made
torch.manual_seed(seed + ddp_rank)
torch.backends.cuda.matmul.allow_tf32 = True
torch.backends.cudnn.allow_tf32 = True
device_type = 'cuda' if 'cuda' in device else 'cpu'
ptdtype = getattr(torch, dtype)
# 16-bit autocast on CPU too: --dtype=bfloat16 must not train float32 and log a 16-bit cache
ctx = nullcontext() if dtype == 'float32' else torch.autocast(device_type, dtype=ptdtype)

# data: uint16 token ids, prepared by rank 0 on first use; the files held open from here on (a
# prepare meanwhile replaces them, as another vocabulary, for the next run), a memmap per batch
data_dir = data_dir or os.path.join(DATA, dataset)
if ddp and not master_process:
    dist.barrier()  # wait for rank 0 to lock out_dir and prepare the data
try:
    with interrupts.deferred():  # preparing writes files
        prepare = master_process and os.path.join(DATA, dataset, 'prepare.py')
        meta = open_data(data_dir, block_size, remake, prepare)
except PrepareError as e:
    fail(str(e))
if ddp and master_process:
    dist.barrier()
data_files = {s: open(os.path.join(data_dir, f'{s}.bin'), 'rb') for s in ('train', 'val')}
if not (resuming or eval_only or overwrite) and (earlier := earlier_run(out_dir)):  # (data first)
    fail(earlier)


def rng(*key):
    """A generator seeded by (seed, rank, *key): every random draw of training is a function of the
    iteration, so a resumed run (DDP too) draws what the uninterrupted one would: no RNG state saved."""
    return torch.Generator().manual_seed(hash((seed, ddp_rank) + key) % 2 ** 63)


def get_batch(split, generator):
    data = np.memmap(data_files[split], dtype=np.uint16, mode='r')
    ix = torch.randint(len(data) - block_size, (batch_size,), generator=generator)
    x = torch.stack([torch.from_numpy(data[i:i + block_size].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + block_size].astype(np.int64)) for i in ix])
    if device_type == 'cuda':  # pinned: the copy overlaps the GPU's work
        x, y = x.pin_memory(), y.pin_memory()
    return x.to(device, non_blocking=True), y.to(device, non_blocking=True)


# model: from scratch, resumed (the later of ckpt.pt and last.pt), or converted from MHA
iter_num, best_val_loss, checkpoint, converted, shape_flags = 0, 1e9, {}, None, []
if converting:  # MHA -> GQA/MQA: mean-pool the K/V heads of init_from/ckpt.pt, then train on
    gptconf, converted = conversion(init_from, device, meta, data_dir, remake, config, given)
    shape_flags = model_flags(gptconf, SimpleNamespace(**config))  # its shape: a resume must say it
else:
    model_args = {f.name: config[f.name] for f in fields(GPTConfig) if f.name in config}
    gptconf = GPTConfig(**{**model_args, 'vocab_size': meta['vocab_size']})
if resuming:  # the model the flags ask for, which the checkpoint must be
    resume_path, checkpoint = resume(out_dir, device, meta, gptconf, data_dir, config, eval_only)
    iter_num, best_val_loss = checkpoint['iter_num'], checkpoint['best_val_loss']
block_size = gptconf.block_size  # (a converted model: its source's)
tokens_per_iter = gradient_accumulation_steps * ddp_world_size * batch_size * block_size
check_training_memory(gptconf, batch_size, dtype, device)
model = GPT(gptconf)
model.to(device)
scaler = torch.amp.GradScaler(device_type, enabled=(dtype == 'float16' and device_type == 'cuda'))
optimizer = adamw(model, learning_rate, weight_decay, (beta1, beta2), device_type)
load_weights(model, optimizer, checkpoint, converted, resuming and resume_path or init_from)
wandb_run = run.wandb = WandB(checkpoint, iter_num)  # a resume continues its W&B run
checkpoint = converted = None  # free up memory
raw_model = model
if compile:  # fullgraph: one graph for every layout, or an error (never a silent eager fallback)
    print("compiling the model (torch.compile, fullgraph): the first iteration waits for it",
          flush=True)
    model = torch.compile(model, fullgraph=True)
if ddp:  # no buffers to sync at each forward (RoPE is computed per forward): DDP's defaults
    device_ids = [ddp_local_rank] if device_type == 'cuda' else None
    model = DDP(model, device_ids=device_ids)  # (2.13's forward_sync_buffers: not in 2.11)
n_params = raw_model.get_num_params()
cache_bytes_per_token = gptconf.cache_bytes(block_size, ptdtype) / block_size  # inference dtype
# model FLOPs utilization vs an A100's bf16 peak (312 TFLOPS): PaLM's 6N + 12 L H Q T FLOPs a token
flops_per_token = 6 * n_params + 12 * gptconf.n_layer * gptconf.n_embd * block_size
if master_process:
    print(f"tokens per iteration will be: {tokens_per_iter:,}")
    print(summary(gptconf, n_params, cache_bytes_per_token, block_size, dtype, device))


@torch.no_grad()
def estimate_loss():
    """Mean loss over eval_iters batches of each split; the same batches at every evaluation."""
    out = {}
    net = model.module if ddp else model  # rank 0 alone: no DDP collectives in evaluation
    net.eval()
    for split in ('train', 'val'):
        gen = torch.Generator().manual_seed(seed + 1000 * (split == 'val'))  # the same every time
        losses = []
        for k in range(eval_iters):
            if interrupts.flag:  # checked between batches: not only at the end of a long evaluation
                net.train()
                return None
            X, Y = get_batch(split, gen)
            with ctx:
                _, loss = net(X, Y)
            losses.append(loss.item())
        out[split] = sum(losses) / len(losses)
    net.train()
    return out


def save(path, val_loss=None):
    """val_loss: of these weights (None: not evaluated); best_val_loss: the lowest evaluated."""
    run.save(path, {'model': raw_model.state_dict(), 'optimizer': optimizer.state_dict(),
                    'model_args': asdict(gptconf), 'iter_num': iter_num, 'val_loss': val_loss,
                    'best_val_loss': best_val_loss, 'config': config, 'meta': meta,
                    'wandb': wandb_run.saved(iter_num),
                    'wandb_id': wandb_run.state.get('id')},  # (wandb_id: what older train.py reads)
             iter_num)


def sample_text():
    """200 tokens after the prompt at temperature 0.8, top-k 200: as sample.py --seed=SEED+ITER."""
    raw_model.eval()
    with ctx:
        torch.manual_seed(seed + iter_num)  # a resumed run logs the same text (training reseeds)
        tokens = raw_model.generate(prompt, 200, temperature=0.8, top_k=200)[0, prompt.size(1):]
    text = decode(tokens.tolist())
    raw_model.train()
    return text


prompt, decode = sample_prompt(meta)  # the samples at evaluations start from it
prompt = torch.tensor([prompt], device=device)
if wandb_log and run.writes:
    with interrupts.deferred():  # W&B writes files
        numbers = {'params': n_params, 'cache_bytes_per_token': cache_bytes_per_token}
        wandb_run.start(config, gptconf, numbers, resumed_at=iter_num if resuming else None)

interrupts.immediate = False  # from here on an interrupt is a flag, checked at every iteration

# training loop: each iteration sets the lr; evaluates (every eval_interval and at the end), saved
# if best; stops if interrupted or max_iters steps are done (then evaluated); else steps and logs
X, Y = get_batch('train', rng(iter_num, 0))  # micro-batch 0 of iteration iter_num
t0 = time.time()
local_iter_num, running_mfu, stop = 0, -1.0, False
step_time, eval_time = None, 0.0  # recent seconds a step and an evaluation (its sample, save)
ckpt_stale = resuming and os.path.basename(resume_path) == 'last.pt'  # ckpt.pt lacks these weights
while True:
    lr = learning_rate
    if decay_lr:
        lr = cosine_lr(iter_num, learning_rate, warmup_iters, lr_decay_iters, min_lr)
    for param_group in optimizer.param_groups:
        param_group['lr'] = lr

    losses, t_eval = None, time.time()
    if (iter_num % eval_interval == 0 or iter_num >= max_iters or eval_only) and master_process:
        print(f"step {iter_num}/{max_iters}: evaluating ({eval_iters} batches of train and of val)",
              flush=True)
        losses = estimate_loss()  # None if interrupted: dropped, the interrupt is handled below
        if losses is None and eval_only:
            print(f"error: {interrupts.why} during the evaluation; nothing was written",
                  file=sys.stderr)
            sys.exit(interrupts.code)
    if losses:
        train_loss, val_loss = losses['train'], losses['val']
        print(f"step {iter_num}: train loss {train_loss:.4f}, val loss {val_loss:.4f} "
              f"(evaluated in {duration(time.time() - t_eval)})")
        run.log({'iter': iter_num, 'train/loss': train_loss, 'val/loss': val_loss, 'lr': lr,
                 'cache_bytes_per_token': cache_bytes_per_token})
        if not (math.isfinite(train_loss) and math.isfinite(val_loss)):  # never saved
            fail(f"the evaluation at iteration {iter_num} gave a non-finite loss (train {train_loss}, "
                 f"val {val_loss}); stopped, {kept(out_dir)} (try a lower learning_rate)")
        if (sample_every_eval or wandb_run.api) and decode:
            text = sample_text()
            if sample_every_eval:
                print(f"sample:\n{text}\n---")
            wandb_run.sample(iter_num, gptconf.attn, text)
        if (val_loss < best_val_loss or always_save_checkpoint) and not eval_only:
            best_val_loss = min(best_val_loss, val_loss)
            wandb_run.call(lambda api: api.run.summary.update({'best_val_loss': best_val_loss}))
            if ckpt_stale:
                save(run.ckpt, val_loss)
                ckpt_stale = False
        eval_time = time.time() - t_eval
        t0 += eval_time  # dt: the step's time without the evaluation (nanoGPT's includes it)
    if eval_only:
        break
    stop = any_rank(interrupts.flag, device) if ddp else interrupts.flag  # all stop at one iteration
    if stop or iter_num >= max_iters:  # interrupted, or max_iters steps done and evaluated
        if master_process and local_iter_num > 0 and (stop or ckpt_stale):
            save(run.last)
        if stop:
            command = resume_command(ddp_world_size if ddp else 0, shape_flags)
            run.interrupted(iter_num, command, interrupts.why)
        else:  # a finished run writes its log, even one with nothing to train (max_iters=0)
            run.first_write(iter_num)
        break

    torch.manual_seed(rng(iter_num).initial_seed())  # dropout: a function of the iteration too
    for micro_step in range(gradient_accumulation_steps):
        if ddp:  # sync gradients only at the last micro step
            model.require_backward_grad_sync = (micro_step == gradient_accumulation_steps - 1)
        with ctx:
            logits, loss = model(X, Y)
            loss = loss / gradient_accumulation_steps
        # prefetch the next micro-batch (of this iteration, or the next's first) while the GPU works
        ahead, micro = divmod(micro_step + 1, gradient_accumulation_steps)
        X, Y = get_batch('train', rng(iter_num + ahead, micro))
        scaler.scale(loss).backward()
    if grad_clip != 0.0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    ckpt_stale = True
    run.first_write(iter_num)  # a step done: this run now writes its files

    t1 = time.time()
    dt, t0 = t1 - t0, t1
    if compile and local_iter_num == 0 and master_process:
        print(f"compiled: the first iteration took {duration(dt)}")
    if local_iter_num:  # (not the warm-up)
        step_time = 0.9 * step_time + 0.1 * dt if step_time else dt
    if iter_num % log_interval == 0 and master_process:
        lossf = loss.item() * gradient_accumulation_steps  # the last micro-batch's; a GPU wait
        if not math.isfinite(lossf):  # diverged weights are never saved nor evaluated as finite
            fail(f"loss is {lossf} at iteration {iter_num}; stopped, {kept(out_dir)} "
                 "(try a lower learning_rate)")
        if local_iter_num >= 5 and device_type == 'cuda':  # settled; an A100's peak: not a CPU's
            mfu = flops_per_token * tokens_per_iter / ddp_world_size / dt / 312e12
            running_mfu = mfu if running_mfu == -1.0 else 0.9 * running_mfu + 0.1 * mfu
        measured = {'mfu': running_mfu * 100} if running_mfu >= 0 else {}  # none until measured
        evals_left = max_iters // eval_interval - iter_num // eval_interval
        evals_left += max_iters % eval_interval > 0  # and the last one
        eta = step_time and (max_iters - iter_num - 1) * step_time + evals_left * eval_time
        line = f"iter {iter_num}/{max_iters}: loss {lossf:.4f}, time {dt * 1000:.2f}ms, "
        line += f"{tokens_per_iter / dt:,.0f} tok/s"
        line += f", mfu {measured['mfu']:.2f}%" if measured else ""
        print(line + (f", ETA {duration(eta)}" if step_time else ""))
        run.log({'iter': iter_num, 'train/batch_loss': lossf, 'lr': lr, 'ms_per_iter': dt * 1000,
                 'tokens_per_sec': tokens_per_iter / dt, **measured})
    iter_num += 1
    local_iter_num += 1

wandb_run.finish(best_val_loss, upload=wandb_log_checkpoint and run.ckpt)
if not stop:
    run.done(iter_num, 'the latest evaluated' if always_save_checkpoint else 'the best')
if ddp:  # each rank's weights hash: they must match
    leave(raw_model, ddp_rank, interrupts.code if stop else 0)
if stop:
    sys.exit(interrupts.code)  # interrupted, its state saved: not a finished run (`&& sample.py`)
