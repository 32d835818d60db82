"""
Train one attention layout on tiny Shakespeare (nanoGPT's train.py, one layout switch more).

    python train.py config/gqa.py                                # baby GPT, GQA (~20 s an iteration on 2 CPU cores)
    python train.py config/mla.py config/cpu.py                  # nanoGPT's CPU recipe, any layout
    python train.py config/mha.py --batch_size=32 --wandb_log=True
    torchrun --standalone --nproc_per_node=2 train.py config/gqa.py config/cpu.py --gradient_accumulation_steps=2

Every key below can be set by a config file or --key=value (see configurator.py). What is written to out_dir, and
what is promised about it after an error, a kill, an interrupt or a divergence: checkpoint.py.
"""
from run.interrupts import Interrupts  # first: Ctrl-C, SIGTERM or SIGHUP during the slow imports below: one line, exit 130

interrupts = Interrupts()

import hashlib
import math
import os
import re
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, fields
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from run.checkpoint import (FileError, Run, changed, checkpoints, in_use, kept, load_optimizer, model_flags,
                        read_checkpoint, resume_command, resume_state, weights)
from configurator import check_device, check_memory, configure, describe, duration, fail
from run.convert import conversion
from data.common import PrepareError, open_data, sample_prompt
from run.interrupts import memory_errors_in_one_line, on_closed_output
from ops.linear_fla import fla_runs
from model import GPT, GPTConfig, LINEAR_RULES, num_params
from run.wandb_run import WandB

# -----------------------------------------------------------------------------
# defaults: nanoGPT's baby GPT on shakespeare_char
# I/O
out_dir = 'out'                 # where ckpt.pt (best val loss), last.pt (resume state) and metrics.jsonl go
eval_interval = 250             # evaluate (and save if best) every this many iterations, and at the end
log_interval = 10               # print and log the training loss every this many iterations
eval_iters = 200                # batches per split in an evaluation
eval_only = False               # evaluate once (with --init_from=resume: the checkpoint) and stop; writes nothing
always_save_checkpoint = False  # else only when val loss improves
init_from = 'scratch'           # 'scratch', 'resume' (out_dir's newest state), or an MHA out_dir to convert
overwrite = False               # a new run may replace out_dir's checkpoints (else it is refused)
sample_every_eval = False       # print a short sample at each evaluation (with wandb_log, always: a W&B table)
# logging
wandb_log = False               # log to Weights & Biases too (metrics.jsonl always)
wandb_project = 'attention-layouts'
wandb_run_name = ''             # '' = <attn>-<time>; the layout is always in the name
wandb_mode = ''                 # online / offline / disabled; '' = $WANDB_MODE, else offline without credentials
wandb_log_checkpoint = False    # with wandb_log: ckpt.pt as a W&B artifact when the run ends
# data
dataset = 'shakespeare_char'    # shakespeare_char (65 characters) or shakespeare (GPT-2 BPE)
data_dir = ''                   # '' = data/<dataset>, prepared on first use; a folder given must hold train.bin
gradient_accumulation_steps = 1  # in total, over all DDP processes
batch_size = 64                 # sequences per micro-batch
block_size = 256                # context length
# model (GPTConfig's fields)
n_layer = 6                     # transformer blocks
n_head = 6                      # query heads
n_embd = 384                    # model width
dropout = 0.2                   # dropout probability (embeddings, attention, residuals)
bias = False                    # biases in Linears and LayerNorms (GPT-2 had them)
attn = 'mha'                    # mha gqa mqa mla linear retnet mamba2 deltanet gated_deltanet, or 'deltanet*3+gqa'
n_kv_head = 0                   # K/V heads; 0 = mha n_head, gqa n_head's smallest divisor > 1, mqa 1
pos_emb = 'rope'                # rope, or learned absolute positions (nanoGPT's)
rope_base = 10000.0             # RoPE theta base
kv_lora_rank = 0                # MLA d_c; 0 = 4 * head_dim (DeepSeek-V2's ratio)
rope_head_dim = 0               # MLA d_R; 0 = head_dim / 2
q_lora_rank = 0                 # MLA query compression; 0 = off
chunk_size = 64                 # the linear layouts: chunk of the chunkwise training form
linear_kernels = 'fla'          # the linear layouts: fla's Triton kernels on CUDA if installed, or 'torch': ours
conv_size = 4                   # the linear layouts but 'linear': the short causal conv's width on q, k, v
match_mha_params = False        # widen/narrow the MLP to MHA's parameter count
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
dtype = ('bfloat16' if torch.cuda.is_bf16_supported() else 'float16') if torch.cuda.is_available() else 'float32'  # autocast
compile = True                  # torch.compile the model, one graph (on a CPU only if given: minutes there)
backend = ''                    # '' = nccl on CUDA, gloo on CPU
seed = 1337                     # every random draw of training is a function of (seed, rank, iteration)
# -----------------------------------------------------------------------------
config_keys = [k for k, v in globals().items() if not k.startswith('_') and isinstance(v, (int, float, bool, str))]
memory_errors_in_one_line()
on_closed_output(interrupts.output_lost)  # `| head`, a closed terminal: an interrupt; a full disk: a stop as one
given = {}  # the keys a config file or flag set: what set each last
config = configure({k: globals()[k] for k in config_keys}, sys.argv[1:], __file__, given)
if 'compile' not in given and not device.startswith('cuda'):  # as nanoGPT on a GPU; compiling on a CPU takes minutes
    config['compile'] = False
globals().update(config)
# -----------------------------------------------------------------------------
# the flags checked before any work (the data, a resume, a conversion: once read): one line and exit 2
resuming, converting = init_from == 'resume', init_from not in ('scratch', 'resume')  # else an MHA out_dir to convert
previous = checkpoints(out_dir)
DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'data')
remake = f"python data/{dataset}/prepare.py --input FILE --out_dir {data_dir}" if data_dir else \
    "delete it and run again"
# (remake: how the messages that find data_dir's files missing or broken say to make them anew)
check_device(device, dtype)
model_args = {f.name: config[f.name] for f in fields(GPTConfig) if f.name in config and f.name != 'vocab_size'}
try:  # the model's fields first (a conversion's model has its source's shape: convert.py checks it once read)
    converting or GPTConfig(**model_args)
except ValueError as e:
    try:  # a resume that gives one model flag (--n_kv_head=2) but not the others: name the checkpoint's
        saved = resuming and previous and read_checkpoint(previous[0])[1]
    except FileError:
        saved = None
    flags = saved and ', '.join(model_flags(saved, SimpleNamespace(**config)))  # ('' if it says none: no hint)
    fail(str(e) + (f"; {previous[0]} is another model ({flags} in it): add those settings to resume it"
                   if flags else ''))
world = os.environ.get('WORLD_SIZE', '1').strip() if 'RANK' in os.environ else '1'  # torchrun's processes
datasets = sorted(d for d in os.listdir(DATA) if os.path.isfile(os.path.join(DATA, d, 'prepare.py'))
                  and d != 'mqar')  # (mqar: bench.py mqar's synthetic recall sequences, not a text to train on)
for ok, message in (
        *[(ok, f"{key}={config[key]!r} must be {rule}") for key, ok, rule in (
            ('batch_size', batch_size >= 1, '>= 1'), ('max_iters', max_iters >= 0, '>= 0'),
            ('learning_rate', 0 < learning_rate <= 1e12, 'in (0, 1e12]'),  # (AdamW's lr / (1 - beta1) fits float32)
            ('min_lr', 0 <= min_lr <= learning_rate, 'in [0, learning_rate]'),
            ('eval_interval', eval_interval >= 1, '>= 1'), ('eval_iters', eval_iters >= 1, '>= 1'),
            ('log_interval', log_interval >= 1, '>= 1'),
            ('gradient_accumulation_steps', gradient_accumulation_steps >= 1, '>= 1'),
            ('warmup_iters', warmup_iters >= 0, '>= 0'), ('lr_decay_iters', lr_decay_iters >= 1, '>= 1'),
            ('weight_decay', weight_decay >= 0, '>= 0'), ('grad_clip', grad_clip >= 0, '>= 0 (0 = off)'),
            ('beta1', 0 <= beta1 < 1, 'in [0, 1)'), ('beta2', 0 <= beta2 < 1, 'in [0, 1)'),
            ('seed', 0 <= seed < 2 ** 62, 'in [0, 2**62)'))],
        *[(abs(v) < 2 ** 62, f"{k}={v} is out of range (|value| < 2**62)")
          for k, v in config.items() if type(v) is int],
        (not converting or os.path.isfile(os.path.join(init_from, 'ckpt.pt')),
         f"init_from={init_from!r} should be 'scratch', 'resume', or an out_dir with an MHA ckpt.pt to convert"),
        (not converting or os.path.realpath(init_from) != os.path.realpath(out_dir),
         f"out_dir={out_dir!r} holds the checkpoint being converted; give the converted model its own out_dir"),
        (gradient_accumulation_steps % max(1, int(world) if world.isdecimal() else 1) == 0,  # all processes' steps
         f"gradient_accumulation_steps={gradient_accumulation_steps} must be a multiple of the {world} DDP processes"),
        (not resuming or previous,
         f"init_from='resume' but there is no checkpoint (ckpt.pt or last.pt) in out_dir={out_dir!r}" +
         " yet: a train.py run is using it (resume once it has saved, or pass another --out_dir)" * in_use(out_dir)),
        (not (eval_only and init_from == 'scratch' and previous),
         f"eval_only=True would evaluate a new random model, not {(previous or [''])[0]}: add --init_from=resume"),
        (re.fullmatch(r'\w+', dataset) and dataset in datasets,  # (its prepare.py is run: none from elsewhere)
         f"dataset={dataset!r} is unknown: give one of {datasets} (a folder of data/); your own text goes in "
         "--data_dir"),
        (not wandb_log or eval_only or wandb_project.strip(),  # (eval_only logs nothing)
         f"wandb_project={wandb_project!r} must name a W&B project"),
        (not data_dir or os.path.exists(os.path.join(data_dir, 'train.bin')),  # a typo: not another text
         f"no train.bin in data_dir={data_dir!r}: make one ({remake}), or leave data_dir empty for data/{dataset}/")):
    if not ok:
        fail(message)

# DDP: one process per device, launched by torchrun
ddp = int(os.environ.get('RANK', -1)) != -1
if ddp:
    try:
        dist.init_process_group(backend=backend or ('nccl' if device.startswith('cuda') else 'gloo'))
    except (ValueError, RuntimeError) as e:  # RANK set outside torchrun: no WORLD_SIZE, MASTER_ADDR, peers
        fail(f"RANK={os.environ['RANK']} is set but no DDP group can be joined ({describe(e)}): use torchrun or "
             "unset it")
    ddp_rank, ddp_local_rank, ddp_world_size = dist.get_rank(), int(os.environ['LOCAL_RANK']), dist.get_world_size()
    if device.startswith('cuda'):
        device = f'cuda:{ddp_local_rank}'
        torch.cuda.set_device(device)
    master_process = ddp_rank == 0  # logs and checkpoints
    # a rank that stops (killed, or its own line says why) fails the others' next collective: one line each; every
    # error of ranks > 0 (rank 0's own say why), a lost peer on rank 0 (a bug there keeps its traceback)
    hook, lost = sys.excepthook, lambda e: isinstance(e, RuntimeError) and re.search(r'peer|gloo|NCCL', str(e))
    sys.excepthook = lambda kind, e, tb: print(f"error: rank {ddp_rank}: {describe(e)} (another rank stopped: killed, "
                                               "or its own error says why)", file=sys.stderr) \
        if ddp_rank or lost(e) else hook(kind, e, tb)
    gradient_accumulation_steps //= ddp_world_size  # per process from here on (a multiple: checked above)
else:
    ddp_rank, ddp_world_size, master_process = 0, 1, True
# out_dir's files, on rank 0 (eval_only writes nothing): locked from here on, written from the first step or save on
run = Run(out_dir, resuming, writes=master_process and not eval_only)
interrupts.discard = run.discard  # an interrupt before the first step removes what the run made (lock, W&B folder)
torch.manual_seed(seed + ddp_rank)
torch.backends.cuda.matmul.allow_tf32 = True
torch.backends.cudnn.allow_tf32 = True
device_type = 'cuda' if 'cuda' in device else 'cpu'
ptdtype = {'float32': torch.float32, 'bfloat16': torch.bfloat16, 'float16': torch.float16}[dtype]
# 16-bit autocast on CPU too: --dtype=bfloat16 must not train float32 while the log reports a 16-bit cache
ctx = nullcontext() if dtype == 'float32' else torch.autocast(device_type=device_type, dtype=ptdtype)

# data: uint16 token ids, prepared by rank 0 on first use; the memmap is re-opened for every batch (one kept grows)
data_dir = data_dir or os.path.join(DATA, dataset)
if ddp and not master_process:
    dist.barrier()  # wait for rank 0 to lock out_dir and prepare the data
try:
    with interrupts.deferred():  # preparing writes files
        meta = open_data(data_dir, block_size, remake, master_process and os.path.join(DATA, dataset, 'prepare.py'))
except PrepareError as e:
    fail(str(e))
if ddp and master_process:
    dist.barrier()
if previous and not resuming and not eval_only and not overwrite:  # (after the data: a broken data set is named first)
    fail(f"{previous[0]} exists: continue that run with --init_from=resume, replace it with --overwrite=True, "
         f"or pass another --out_dir")


def rng(*key):
    """A generator seeded by (seed, rank, *key): every random draw of training is a function of the iteration, so
    a resumed run (DDP too) draws what the uninterrupted one would, no RNG state saved (int tuples hash alike)."""
    return torch.Generator().manual_seed(hash((seed, ddp_rank) + key) % 2 ** 63)


def get_batch(split, generator):
    data = np.memmap(os.path.join(data_dir, f'{split}.bin'), dtype=np.uint16, mode='r')
    ix = torch.randint(len(data) - block_size, (batch_size,), generator=generator)
    x = torch.stack([torch.from_numpy(data[i:i + block_size].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + block_size].astype(np.int64)) for i in ix])
    if device_type == 'cuda':
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)


# model: from scratch, resumed (from the later of ckpt.pt and last.pt), or converted from an MHA checkpoint
iter_num, best_val_loss, checkpoint, shape_flags = 0, 1e9, {}, []
if converting:  # MHA -> GQA/MQA: mean-pool the K/V heads of init_from/ckpt.pt, then train on
    gptconf, converted = conversion(init_from, device, meta, data_dir, remake, config, given)
    shape_flags = model_flags(gptconf, SimpleNamespace(**config))  # its source's shape: a resume must say it
else:  # the model the flags ask for: a resume must match it
    gptconf = GPTConfig(vocab_size=meta['vocab_size'], **{f.name: config[f.name] for f in fields(GPTConfig)
                                                          if f.name in config})
if resuming:
    resume_path, checkpoint = resume_state(out_dir, device, meta, gptconf, data_dir)
    iter_num, best_val_loss = checkpoint['iter_num'], checkpoint['best_val_loss']
    if iter_num > max_iters and not eval_only:
        fail(f"{resume_path} is at iteration {iter_num}, past max_iters={max_iters}: nothing to train "
             f"(raise max_iters to continue, or --eval_only=True to evaluate it)")
    changes = changed(checkpoint, config)  # e.g. max_iters 200 -> 2000: a resume follows its own command line
    print(f"resuming from {resume_path} at iteration {iter_num}"
          + (f"; changed: {', '.join(changes)}" if changes else ""))
block_size = gptconf.block_size  # (a converted model: its source's)
tokens_per_iter = gradient_accumulation_steps * ddp_world_size * batch_size * block_size
# memory, counted before anything is built: fp32 weights, gradients and AdamW's two moments (16 bytes a parameter),
# and per token at least a dozen n_embd-wide tensors a layer kept for backward, fp32 logits and their gradient
n_params = num_params(gptconf)
per_token = 12 * gptconf.n_layer * gptconf.n_embd * (4 if dtype == 'float32' else 2) + 8 * gptconf.vocab_size
check_memory(16 * n_params + batch_size * block_size * per_token, device,
             f"{f'{n_params / 1e6:,.1f}M' if math.isfinite(n_params) else 'over 10^18'} parameters and batch_size="
             f"{batch_size} x block_size={block_size}: the weights, optimizer and activations")
model = GPT(gptconf)
model.to(device)
scaler = torch.amp.GradScaler(device_type, enabled=(dtype == 'float16' and device_type == 'cuda'))
decay = [p for p in model.parameters() if p.dim() >= 2]  # nanoGPT's AdamW: matmul weights and embeddings decay,
nodecay = [p for p in model.parameters() if p.dim() < 2]  # biases and norms do not
groups = [{'params': decay, 'weight_decay': weight_decay}, {'params': nodecay, 'weight_decay': 0.0}]
optimizer = torch.optim.AdamW(groups, lr=learning_rate, betas=(beta1, beta2), fused=device_type == 'cuda')
try:  # weights or an optimizer state of another shape: one line
    if resuming:
        model.load_state_dict(weights(checkpoint))
        load_optimizer(optimizer, checkpoint['optimizer'])
    if converting:
        model.load_state_dict(converted)
        print(f"converted {init_from} (mha, {gptconf.n_head} K/V heads) to {attn} with {gptconf.n_kv_head} K/V heads "
              f"by mean-pooling")
except (RuntimeError, ValueError, KeyError, TypeError, AttributeError) as e:  # (crafted files too)
    fail(f"cannot {f'resume from {resume_path}' if resuming else f'convert {init_from}'}: {describe(e)}")
wandb_run = run.wandb = WandB(checkpoint, iter_num)  # a resume continues its W&B run; run.log forwards rows to it
checkpoint = converted = None  # free up memory
raw_model = model
if compile:  # fullgraph: one graph for every layout, or an error (never a silent fallback to eager pieces)
    print("compiling the model (torch.compile, fullgraph): the first iteration waits for it", flush=True)
    model = torch.compile(model, fullgraph=True)
if ddp:
    # no buffer sync at each forward: the model has no buffers (RoPE is computed per forward)
    model = DDP(model, device_ids=[ddp_local_rank] if device_type == 'cuda' else None, forward_sync_buffers=False)
cache_bytes_per_token = gptconf.cache_bytes(block_size, ptdtype) / block_size  # at block_size, inference dtype
# model FLOPs utilization vs an A100's bf16 peak (312 TFLOPS): PaLM's 6N + 12 L H Q T FLOPs per token, as nanoGPT
flops_per_token = 6 * raw_model.get_num_params() + 12 * gptconf.n_layer * gptconf.n_embd * block_size
if master_process:  # the model in one line: layout, parameters, cache bytes per token, a hybrid's layers
    line = (f"{gptconf.attn}: {raw_model.get_num_params() / 1e6:.2f}M parameters, cache {cache_bytes_per_token:,.0f} "
            f"bytes/token at block_size {block_size} ({dtype})")
    if not gptconf.softmax:
        line += " (a fixed state: the bytes shrink as the context grows)"
    if set(gptconf.layouts) & set(LINEAR_RULES):  # which kernels: fla's where they run, else ours
        fla = gptconf.linear_kernels == 'fla' and fla_runs(torch.empty(0, device=device))
        line += "; linear layers on " + ("fla's kernels" if fla else "our kernels")
    layers = gptconf.layer_counts()
    if len(layers) > 1:  # a hybrid: the pattern repeats over n_layer, so its counts alone can mislead
        line += f"; layers: {', '.join(f'{a} x{n}' for a, n in layers.items())}"
        line += f", in order {' '.join(gptconf.layouts)}" if gptconf.n_layer <= 16 else ""
        line += " (a fixed state in the linear ones)" if gptconf.softmax else ""
    print(f"tokens per iteration will be: {tokens_per_iter:,}\n{line}")


@torch.no_grad()
def estimate_loss():
    """Mean loss over eval_iters batches of each split; the same batches at every evaluation."""
    out = {}
    net = model.module if ddp else model  # rank 0 alone: no DDP collectives in evaluation
    net.eval()
    for split in ('train', 'val'):
        gen = torch.Generator().manual_seed(seed + 1000 * (split == 'val'))  # the same batches every time
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


def get_lr(it):
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    decay_ratio = (it - warmup_iters) / max(1, lr_decay_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * decay_ratio)) * (learning_rate - min_lr)


def save(path, val_loss=None):  # val_loss: of these weights (None: not evaluated); best_val_loss: the lowest evaluated
    run.save(path, {'model': raw_model.state_dict(), 'optimizer': optimizer.state_dict(), 'model_args': asdict(gptconf),
                    'iter_num': iter_num, 'val_loss': val_loss, 'best_val_loss': best_val_loss, 'config': config,
                    'meta': meta, 'wandb': wandb_run.saved(iter_num),
                    'wandb_id': wandb_run.state.get('id')},  # (wandb_id: what older train.py reads)
             iter_num)


prompt, decode = sample_prompt(meta)  # the samples at evaluations: 200 tokens after it, temperature 0.8, top-k 200
prompt = torch.tensor([prompt], device=device)
if wandb_log and run.writes:
    with interrupts.deferred():  # W&B writes files
        wandb_run.start(config, gptconf, {'params': raw_model.get_num_params(), 'cache_bytes_per_token':
                        cache_bytes_per_token}, resumed_at=iter_num if resuming else None)

interrupts.immediate = False  # from here on an interrupt is a flag, checked at every iteration (before: an exit)

# training loop
X, Y = get_batch('train', rng(iter_num, 0))  # micro-batch 0 of iteration iter_num
t0 = time.time()
local_iter_num, running_mfu, stop = 0, -1.0, False
step_time, eval_time = None, 0.0  # recent seconds per step and per evaluation (with its sample and save): the ETA
ckpt_stale = resuming and os.path.basename(resume_path) == 'last.pt'  # ckpt.pt lacks the current weights
# each iteration: the lr; an evaluation (every eval_interval and at the end), saved if best; a stop if interrupted or
# max_iters steps are done (max_iters steps in all, then a last evaluation); else one step and its log line
while True:
    lr = get_lr(iter_num) if decay_lr else learning_rate
    for param_group in optimizer.param_groups:
        param_group['lr'] = lr

    losses, t_eval = None, time.time()
    if (iter_num % eval_interval == 0 or iter_num >= max_iters or eval_only) and master_process:  # and at the end
        print(f"step {iter_num}/{max_iters}: evaluating ({eval_iters} batches of train and of val)", flush=True)
        losses = estimate_loss()  # None if interrupted during it: dropped, the interrupt is handled below
        if losses is None and eval_only:
            print(f"error: {interrupts.why} during the evaluation; nothing was written", file=sys.stderr)
            sys.exit(130)
    if losses:
        print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f} "
              f"(evaluated in {duration(time.time() - t_eval)})")
        run.log({'iter': iter_num, 'train/loss': losses['train'], 'val/loss': losses['val'], 'lr': lr,
                 'cache_bytes_per_token': cache_bytes_per_token})
        if not (math.isfinite(losses['train']) and math.isfinite(losses['val'])):  # never saved, whatever the flags
            fail(f"the evaluation at iteration {iter_num} gave a non-finite loss (train {losses['train']}, val "
                 f"{losses['val']}); stopped, {kept(out_dir)} (try a lower learning_rate)")
        if (sample_every_eval or wandb_run.api) and decode:  # as `sample.py --seed=<seed + iteration>` samples
            raw_model.eval()
            with ctx:
                torch.manual_seed(seed + iter_num)  # a resumed run logs the same text (training reseeds below)
                text = decode(raw_model.generate(prompt, 200, temperature=0.8, top_k=200)[0, prompt.size(1):].tolist())
            raw_model.train()
            if sample_every_eval:
                print(f"sample:\n{text}\n---")
            wandb_run.sample(iter_num, attn, text)
        if (losses['val'] < best_val_loss or always_save_checkpoint) and not eval_only:
            best_val_loss = min(best_val_loss, losses['val'])
            wandb_run.call(lambda api: api.run.summary.update({'best_val_loss': best_val_loss}))
            if ckpt_stale:
                save(run.ckpt, losses['val'])
                ckpt_stale = False
        eval_time = time.time() - t_eval
        t0 += eval_time  # dt: the step's time without the evaluation (nanoGPT's includes it)
    if eval_only:
        break
    stop = interrupts.flag  # under DDP agreed by every rank (a collective): all of them stop at the same iteration
    if ddp:
        flag = torch.tensor([float(stop)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        stop = bool(flag.item())
    if stop or iter_num >= max_iters:  # interrupted, or max_iters steps done and evaluated (saved if best)
        if master_process and local_iter_num > 0 and (stop or ckpt_stale):
            save(run.last)
        if stop:
            run.interrupted(iter_num, resume_command(ddp_world_size if ddp else 0, shape_flags), interrupts.why)
        else:
            run.first_write(iter_num)  # a finished run writes its log, even one with nothing to train (max_iters=0)
        break

    torch.manual_seed(rng(iter_num).initial_seed())  # dropout masks: a function of the iteration too
    for micro_step in range(gradient_accumulation_steps):
        if ddp:  # sync gradients only at the last micro step
            model.require_backward_grad_sync = (micro_step == gradient_accumulation_steps - 1)
        with ctx:
            logits, loss = model(X, Y)
            loss = loss / gradient_accumulation_steps
        ahead, micro = divmod(micro_step + 1, gradient_accumulation_steps)  # the next micro-batch: of this iteration
        X, Y = get_batch('train', rng(iter_num + ahead, micro))  # or the next's first, prefetched while the GPU works
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
    step_time = (0.9 * step_time + 0.1 * dt if step_time else dt) if local_iter_num else None  # (not the warm-up)
    if iter_num % log_interval == 0 and master_process:
        lossf = loss.item() * gradient_accumulation_steps  # the last micro-batch's; read only here (a GPU wait)
        if not math.isfinite(lossf):  # seen at log lines; diverged weights are never saved nor evaluated as finite
            fail(f"loss is {lossf} at iteration {iter_num}; stopped, {kept(out_dir)} (try a lower learning_rate)")
        if local_iter_num >= 5 and device_type == 'cuda':  # let the loop settle; the A100 peak means nothing on a CPU
            mfu = flops_per_token * batch_size * gradient_accumulation_steps * block_size / dt / 312e12
            running_mfu = mfu if running_mfu == -1.0 else 0.9 * running_mfu + 0.1 * mfu
        measured = {'mfu': running_mfu * 100} if running_mfu >= 0 else {}  # nothing until it is measured
        evals_left = max_iters // eval_interval - iter_num // eval_interval + (max_iters % eval_interval > 0)
        eta = step_time and (max_iters - iter_num - 1) * step_time + evals_left * eval_time
        print(f"iter {iter_num}/{max_iters}: loss {lossf:.4f}, time {dt * 1000:.2f}ms, "
              f"{tokens_per_iter / dt:,.0f} tok/s" + (f", mfu {measured['mfu']:.2f}%" if measured else "")
              + (f", ETA {duration(eta)}" if step_time else ""))
        run.log({'iter': iter_num, 'train/batch_loss': lossf, 'lr': lr, 'ms_per_iter': dt * 1000,
                 'tokens_per_sec': tokens_per_iter / dt, **measured})
    iter_num += 1
    local_iter_num += 1

if ddp:  # each rank's weights hash: they must match
    digest = hashlib.sha256(b''.join(p.detach().cpu().numpy().tobytes() for p in raw_model.parameters()))
    sys.stdout.flush()  # then the line in one write: the ranks share one stdout
    print(f"rank {ddp_rank}: weights sha256 {digest.hexdigest()[:16]}", flush=True)
    dist.destroy_process_group()
wandb_run.finish(best_val_loss, upload=wandb_log_checkpoint and run.ckpt)
if not stop:
    run.done(iter_num, 'the latest evaluated' if always_save_checkpoint else 'the best')
# DDP keeps gloo's worker threads alive past destroy_process_group; one that frees a tensor while Python shuts down
# aborts the run (SIGABRT). All is saved by now, so leave without that shutdown
if ddp:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(130 if stop else 0)
if stop:
    sys.exit(130)  # interrupted (its state saved): not a finished run, for `train.py && sample.py`
