"""
Train one attention layout on tiny Shakespeare (nanoGPT's train.py, one layout switch more).

    python train.py config/gqa.py                                # baby GPT, GQA
    python train.py config/mla.py config/cpu.py                  # nanoGPT's CPU recipe, any layout
    python train.py config/mha.py --batch_size=32 --wandb_log=True
    torchrun --standalone --nproc_per_node=2 train.py config/gqa.py config/cpu.py --gradient_accumulation_steps=2

Every key below can be set by a config file or --key=value (see configurator.py).
"""

import glob
import hashlib
import importlib.util
import json
import math
import netrc
import os
import re
import shlex
import signal
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, fields, replace

# Ctrl-C, SIGTERM (what `kill` and schedulers send), SIGHUP (the terminal closed) and an output whose reader went
# away (`| head`) are interrupts. During start-up nothing is written yet: they stop the process at once, even in a slow
# build. From the first write on they only set a flag (raising inside a save could break a file): checked at every
# iteration (save, then exit 130) and between evaluation batches (the evaluation is dropped).
_interrupted, _at_once = False, True  # (not config keys: names starting with _ are not)


def on_interrupt(signum=None, frame=None):
    global _interrupted
    _interrupted = True
    if _at_once:
        stop_before_training()


def stop_before_training():
    try:  # os.write, not print: a handler may run inside a print
        os.write(2, b"error: interrupted before training started; nothing was written\n")
    except OSError:
        pass
    os._exit(130)


for _sig in ('SIGINT', 'SIGTERM', 'SIGHUP'):  # before the slow imports (Windows has no SIGHUP)
    if hasattr(signal, _sig):
        signal.signal(getattr(signal, _sig), on_interrupt)

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from checkpoint import RESUME, FileError, num_params, read_checkpoint, why, write_atomic
from configurator import check_device, check_memory, configure, describe, fail, memory_errors_in_one_line, on_closed_output
from convert import pool_kv_heads
from data.common import PrepareError, check_meta, run_prepare, tokenizer
from model import GPT, GPTConfig, mlp_hidden

# -----------------------------------------------------------------------------
# defaults: nanoGPT's baby GPT on shakespeare_char
# I/O
out_dir = 'out'                 # where ckpt.pt (best val loss), last.pt (resume state) and metrics.jsonl go
eval_interval = 250             # evaluate (and save if best) every this many iterations, and at the end
log_interval = 10               # print and log the training loss every this many iterations
eval_iters = 200                # batches per split in an evaluation
eval_only = False               # evaluate once (the resumed checkpoint with --init_from=resume) and stop; writes nothing
always_save_checkpoint = False  # else only when val loss improves
init_from = 'scratch'           # 'scratch', 'resume' (out_dir's newest state), or an MHA out_dir to convert
overwrite = False               # a new run may replace out_dir's checkpoints (else it is refused)
sample_every_eval = False       # print a short greedy sample at each evaluation (with wandb_log, always: a W&B table)
# logging
wandb_log = False               # log to Weights & Biases too (metrics.jsonl always)
wandb_project = 'attention-layouts'
wandb_run_name = ''             # '' = <attn>-<time>; the layout is always in the name
wandb_mode = ''                 # online / offline / disabled; '' = $WANDB_MODE, else offline without credentials
wandb_log_checkpoint = False    # with wandb_log: ckpt.pt (the best weights) as a W&B artifact at the end
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
attn = 'mha'                    # mha, gqa, mqa, mla, linear, retnet, mamba2, deltanet, gated_deltanet; or a hybrid 'gated_deltanet*3+gqa'
n_kv_head = 0                   # K/V heads; 0 = mha n_head, gqa n_head's smallest divisor > 1, mqa 1
pos_emb = 'rope'                # rope, or learned absolute positions (nanoGPT's)
rope_base = 10000.0             # RoPE theta base
kv_lora_rank = 0                # MLA d_c; 0 = 4 * head_dim (DeepSeek-V2's ratio)
rope_head_dim = 0               # MLA d_R; 0 = head_dim / 2
q_lora_rank = 0                 # MLA query compression; 0 = off
chunk_size = 64                 # the linear layouts: chunk of the chunkwise training form
conv_size = 4                   # the linear layouts but 'linear': the short causal conv's width on q, k, v
match_mha_params = False        # widen/narrow the MLP to MHA's parameter count
# AdamW and the learning-rate schedule (linear warmup, cosine decay to min_lr)
learning_rate = 1e-3            # peak learning rate
max_iters = 5000                # training iterations in all (a resume continues up to it)
weight_decay = 1e-1             # AdamW decay of 2-D weights (not biases, norms)
beta1 = 0.9                     # AdamW betas
beta2 = 0.99                    # (0.99: small batches, as nanoGPT's shakespeare_char)
grad_clip = 1.0                 # 0 = off
decay_lr = True                 # False = constant learning_rate after the warmup
warmup_iters = 100              # linear warmup from 0 to learning_rate
lr_decay_iters = 5000           # cosine decay reaches min_lr here (~max_iters)
min_lr = 1e-4                   # the learning rate at and after lr_decay_iters
# system
device = 'cuda' if torch.cuda.is_available() else 'cpu'  # cpu, cuda or cuda:N
dtype = 'bfloat16' if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else 'float16' if torch.cuda.is_available() else 'float32'  # autocast dtype
compile = False                 # torch.compile the model
backend = ''                    # '' = nccl on CUDA, gloo on CPU
seed = 1337                     # every random draw of training is a function of (seed, rank, iteration)
# -----------------------------------------------------------------------------
config_keys = [k for k, v in globals().items() if not k.startswith('_') and isinstance(v, (int, float, bool, str))
               and k not in ('config_keys',)]
memory_errors_in_one_line()
on_closed_output(on_interrupt)
given = set()  # the keys a config file or flag set
config = configure({k: globals()[k] for k in config_keys}, sys.argv[1:], __file__, given)
globals().update(config)
model_keys = [f.name for f in fields(GPTConfig) if f.name != 'vocab_size']
# -----------------------------------------------------------------------------

converting = init_from not in ('scratch', 'resume')  # init_from is an MHA out_dir to convert
if converting and not os.path.isfile(os.path.join(init_from, 'ckpt.pt')):
    fail(f"init_from={init_from!r} should be 'scratch', 'resume', or an out_dir with an MHA ckpt.pt to convert")
if converting and os.path.realpath(init_from) == os.path.realpath(out_dir):
    fail(f"out_dir={out_dir!r} holds the checkpoint being converted; give the converted model its own out_dir")
check_device(device, dtype)
for key, ok, rule in (('batch_size', batch_size >= 1, '>= 1'), ('max_iters', max_iters >= 0, '>= 0'),
                      ('learning_rate', learning_rate > 0, '> 0'), ('min_lr', 0 <= min_lr <= learning_rate,
                      'in [0, learning_rate]'), ('eval_interval', eval_interval >= 1, '>= 1'),
                      ('eval_iters', eval_iters >= 1, '>= 1'), ('log_interval', log_interval >= 1, '>= 1'),
                      ('gradient_accumulation_steps', gradient_accumulation_steps >= 1, '>= 1'),
                      ('warmup_iters', warmup_iters >= 0, '>= 0'), ('lr_decay_iters', lr_decay_iters >= 1, '>= 1'),
                      ('weight_decay', weight_decay >= 0, '>= 0'), ('grad_clip', grad_clip >= 0, '>= 0 (0 = off)'),
                      ('beta1', 0 <= beta1 < 1, 'in [0, 1)'), ('beta2', 0 <= beta2 < 1, 'in [0, 1)'),
                      ('seed', 0 <= seed < 2 ** 62, 'in [0, 2**62)')):
    if not ok:
        fail(f"{key}={config[key]!r} must be {rule}")
try:
    GPTConfig(**{k: config[k] for k in model_keys})  # check the model's fields before any work
except ValueError as e:
    fail(str(e))
ckpt_path, last_path = os.path.join(out_dir, 'ckpt.pt'), os.path.join(out_dir, 'last.pt')
previous = [p for p in (ckpt_path, last_path) if os.path.isfile(p)]
if init_from == 'resume' and not previous:
    fail(f"init_from='resume' but there is no checkpoint at {ckpt_path}")
if eval_only and init_from == 'scratch' and previous:
    fail(f"eval_only=True would evaluate a new random model, not {previous[0]}: add --init_from=resume")
DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'data')
if not (re.fullmatch(r'\w+', dataset) and os.path.isfile(os.path.join(DATA, dataset, 'prepare.py'))):  # runs it
    known = sorted(d for d in os.listdir(DATA) if os.path.isfile(os.path.join(DATA, d, 'prepare.py')))
    fail(f"dataset={dataset!r} is unknown: give one of {known} (a folder of data/); your own text goes in --data_dir")
remake = f"python data/{dataset}/prepare.py --input FILE --out_dir {data_dir}" if data_dir else "delete it and run again"
if data_dir and not os.path.exists(os.path.join(data_dir, 'train.bin')):  # a typo must not train on another text
    fail(f"no train.bin in data_dir={data_dir!r}: make one ({remake}), or leave data_dir empty for data/{dataset}/")

# DDP: one process per device, launched by torchrun
ddp = int(os.environ.get('RANK', -1)) != -1
if ddp:
    dist.init_process_group(backend=backend or ('nccl' if device.startswith('cuda') else 'gloo'))
    ddp_rank, ddp_local_rank, ddp_world_size = dist.get_rank(), int(os.environ['LOCAL_RANK']), dist.get_world_size()
    if device.startswith('cuda'):
        device = f'cuda:{ddp_local_rank}'
        torch.cuda.set_device(device)
    master_process = ddp_rank == 0  # logs and checkpoints
    if not master_process:  # when rank 0 stops (its own line says why), the others' next collective fails: one line
        sys.excepthook = lambda kind, e, tb: print(f"error: rank {ddp_rank}: {describe(e)} (if rank 0 stopped first, "
                                                   "its error says why)", file=sys.stderr)
    if gradient_accumulation_steps % ddp_world_size:
        fail(f"gradient_accumulation_steps={gradient_accumulation_steps} must be a multiple of the "
             f"{ddp_world_size} DDP processes")
    gradient_accumulation_steps //= ddp_world_size
else:
    ddp_rank, ddp_world_size, master_process = 0, 1, True
tokens_per_iter = gradient_accumulation_steps * ddp_world_size * batch_size * block_size
if master_process and not eval_only:  # (eval_only writes nothing: no lock)
    try:
        os.makedirs(out_dir, exist_ok=True)
        lock = open(os.path.join(out_dir, 'train.lock'), 'a')  # held while this process lives; the OS drops it at death
    except OSError as e:
        fail(f"out_dir={out_dir!r} is not writable ({e.strerror}); pass --out_dir=DIR")
    try:
        import fcntl
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except ImportError:
        pass  # no fcntl (Windows): no guard against a second run
    except OSError:
        fail(f"out_dir={out_dir!r} is in use by another train.py run; wait for it to end or pass another --out_dir")
torch.manual_seed(seed + ddp_rank)
torch.backends.cuda.matmul.allow_tf32 = True
torch.backends.cudnn.allow_tf32 = True
device_type = 'cuda' if 'cuda' in device else 'cpu'
ptdtype = {'float32': torch.float32, 'bfloat16': torch.bfloat16, 'float16': torch.float16}[dtype]
# 16-bit autocast on CPU too: --dtype=bfloat16 must not train float32 while the log reports a 16-bit cache
ctx = nullcontext() if dtype == 'float32' else torch.autocast(device_type=device_type, dtype=ptdtype)

# data: uint16 token ids; the memmap is re-opened for every batch (a kept one grows memory)
data_dir = data_dir or os.path.join(DATA, dataset)
if not os.path.exists(os.path.join(data_dir, 'train.bin')) and master_process:
    script = os.path.join(DATA, dataset, 'prepare.py')
    print(f"preparing {dataset} into {data_dir} from " + (os.environ.get('SHAKESPEARE_PATH') or
          "a download (offline? set SHAKESPEARE_PATH=/path/to/input.txt)"))
    spec = importlib.util.spec_from_file_location('prepare', script)
    prepare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prepare)
    _at_once = False  # it writes files: an interrupt waits for it
    try:
        run_prepare(prepare.prepare, data_dir)
    except PrepareError as e:
        fail(str(e))
    _at_once = True
    if _interrupted:
        stop_before_training()
if ddp:
    dist.barrier()  # the other ranks wait for rank 0 to lock out_dir and prepare the data
try:
    with open(os.path.join(data_dir, 'meta.json'), encoding='utf-8') as f:
        meta = check_meta(json.load(f))
    for split in ('train', 'val'):
        size = os.path.getsize(os.path.join(data_dir, f'{split}.bin'))
        if size % 2:
            raise ValueError(f"{split}.bin has {size} bytes, an odd number: truncated")
        if size // 2 <= block_size:
            fail(f"{data_dir}/{split}.bin has {size // 2:,} tokens, not more than block_size={block_size}: lower it")
        top = int(np.memmap(os.path.join(data_dir, f'{split}.bin'), dtype=np.uint16, mode='r').max())
        if top >= meta['vocab_size']:  # an embedding lookup would fail at the first batch that holds it
            raise ValueError(f"{split}.bin holds token id {top}, outside meta.json's vocab_size {meta['vocab_size']}")
except (OSError, ValueError) as e:
    fail(f"dataset in {data_dir} is missing or broken ({e}); prepare it anew: {remake}")
if previous and init_from != 'resume' and not eval_only and not overwrite:
    fail(f"{previous[0]} exists: continue that run with --init_from=resume, replace it with --overwrite=True, "
         f"or pass another --out_dir")


def draw(*key):
    """A generator seeded by (seed, rank, *key): every random draw of training is a pure function of the
    iteration, so a resumed run (DDP too) draws exactly what the uninterrupted run would have; no RNG
    state needs saving. Integer tuples hash the same in every process."""
    return torch.Generator().manual_seed(hash((seed, ddp_rank) + key) % 2 ** 63)


def get_batch(split, generator):
    data = np.memmap(os.path.join(data_dir, f'{split}.bin'), dtype=np.uint16, mode='r')
    ix = torch.randint(len(data) - block_size, (batch_size,), generator=generator)
    x = torch.stack([torch.from_numpy(data[i:i + block_size].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + block_size].astype(np.int64)) for i in ix])
    if device_type == 'cuda':
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)


# model. out_dir/ckpt.pt holds the best weights by val loss (what sample.py reads); out_dir/last.pt the state an
# interrupt stopped at. A resume continues from the later of the two, so an interrupt never replaces the best weights.
iter_num, best_val_loss, wandb_id = 0, 1e9, None
best_at = None  # the iteration of the weights in ckpt.pt
model_args = {k: config[k] for k in model_keys}
asked = GPTConfig(vocab_size=meta['vocab_size'], **model_args)


def load_checkpoint(path):
    """A checkpoint train.py wrote, with its config checked, or one line naming what is wrong with it."""
    try:
        return read_checkpoint(path, device, RESUME)
    except FileError as e:
        fail(str(e))


def flags(a, b):
    """The --key=value settings of GPTConfig a that differ from b (MLA's sizes only if a has MLA: else 0, implied)."""
    return [f"--{k}={getattr(a, k)}" for k in model_keys if getattr(a, k) != getattr(b, k)
            and (a.softmax == 'mla' or k not in ('kv_lora_rank', 'rope_head_dim'))]


if init_from == 'resume':
    loaded, broken = [], []
    for p in previous:
        try:
            loaded.append((p, *read_checkpoint(p, device, RESUME)))
        except FileError as e:
            broken.append((p, str(e)))
    if broken:  # never resumed from the other one silently: the broken one may be the later state
        fail(broken[0][1] + (f"; {loaded[0][0]} (iteration {loaded[0][1]['iter_num']}) loads: move {broken[0][0]} "
                             f"away to resume from it" if loaded else ""))
    resume_path, checkpoint, saved = max(loaded, key=lambda c: c[1]['iter_num'])  # the first of equals: ckpt.pt
    best_at = next((c['iter_num'] for p, c, _ in loaded if p == ckpt_path), None)
    loaded = None
    iter_num, best_val_loss = checkpoint['iter_num'], checkpoint['best_val_loss']
    wandb_id = checkpoint.get('wandb_id')  # a resumed run continues its W&B run
    if checkpoint.get('meta') != meta:  # the same tokens, not only as many
        fail(f"{resume_path} was trained on another vocabulary ({saved.vocab_size} tokens) than the data in {data_dir} "
             f"({asked.vocab_size}); resume with its --dataset / --data_dir or change out_dir")
    saved = replace(saved, chunk_size=asked.chunk_size)  # the same weights, computed in chunks of any size
    if flags(saved, asked):
        fail(f"{resume_path} is another model ({', '.join(flags(saved, asked))} in it); add those settings to "
             f"resume it, or change out_dir")
    if iter_num > max_iters and not eval_only:
        fail(f"{resume_path} is at iteration {iter_num}, past max_iters={max_iters}: nothing to train "
             f"(raise max_iters to continue, or --eval_only=True to evaluate it)")
    print(f"resuming from {resume_path} at iteration {iter_num}")
elif converting:  # MHA -> GQA/MQA: mean-pool the K/V heads of init_from/ckpt.pt, then train on
    source, source_cfg = load_checkpoint(os.path.join(init_from, 'ckpt.pt'))
    if attn not in ('mha', 'gqa', 'mqa'):
        fail(f"converting {init_from} pools K/V heads: attn must be mha, gqa or mqa, not {attn!r}")
    if source.get('meta') != meta:  # the same tokens, not only as many
        fail(f"converting {init_from} needs its vocabulary: it has {source_cfg.vocab_size} tokens, the data in "
             f"{data_dir} another ({meta['vocab_size']})")
    # the source's shape (and MLP), this run's K/V heads and dropout; a flag asking for another shape is a mistake
    conflicts = [f"--{k}={config[k]} (the checkpoint has {getattr(source_cfg, k)})" for k in model_keys
                 if k in given and k not in ('attn', 'n_kv_head', 'dropout', 'match_mha_params')
                 and config[k] != getattr(source_cfg, k)]
    if conflicts:
        fail(f"converting {init_from} keeps its shape: drop {', '.join(conflicts)}")
    model_args = {**{k: getattr(source_cfg, k) for k in model_keys}, 'attn': attn, 'n_kv_head': n_kv_head,
                  'match_mha_params': False, 'dropout': dropout}
    print(f"the shape of {init_from}: " + ' '.join(f"{k}={getattr(source_cfg, k)}" for k in
                                                   ('block_size', 'n_layer', 'n_head', 'n_embd', 'pos_emb', 'bias')))
try:
    gptconf = GPTConfig(vocab_size=meta['vocab_size'], **model_args)
except ValueError as e:  # this run's K/V heads for the source's n_head
    fail(f"converting {init_from}: {e}")
block_size, tokens_per_iter = gptconf.block_size, tokens_per_iter // block_size * gptconf.block_size  # (converted)
n_params = num_params(gptconf)  # counted, nothing built: fp32 weights, gradients and AdamW's two moments, 16 bytes each
# and per token, at least: a dozen n_embd-wide tensors a layer kept for backward, fp32 logits and their gradient
per_token = 12 * gptconf.n_layer * gptconf.n_embd * (4 if dtype == 'float32' else 2) + 8 * gptconf.vocab_size
check_memory(16 * n_params + batch_size * block_size * per_token, device, f"{f'{n_params / 1e6:,.1f}M' if math.isfinite(n_params) else 'over 10^18'} parameters and "
             f"batch_size={batch_size} x block_size={block_size}: the weights, optimizer and activations")
model = GPT(gptconf)
if converting:
    try:
        model.load_state_dict(pool_kv_heads({k.removeprefix('_orig_mod.'): v for k, v in source['model'].items()},
                                            source_cfg, gptconf.n_kv_head))
    except ValueError as e:
        fail(f"cannot convert {init_from}: {e}")
    print(f"converted {init_from} ({source_cfg.attn}, {source_cfg.n_head} K/V heads) to {attn} with "
          f"{gptconf.n_kv_head} K/V heads by mean-pooling")
model.to(device)
scaler = torch.amp.GradScaler(device_type, enabled=(dtype == 'float16' and device_type == 'cuda'))
decay = [p for p in model.parameters() if p.dim() >= 2]  # nanoGPT's AdamW: matmul weights and embeddings decay,
nodecay = [p for p in model.parameters() if p.dim() < 2]  # biases and norms do not
optimizer = torch.optim.AdamW([{'params': decay, 'weight_decay': weight_decay}, {'params': nodecay, 'weight_decay': 0.0}],
                              lr=learning_rate, betas=(beta1, beta2), fused=device_type == 'cuda')
if init_from == 'resume':
    try:
        model.load_state_dict({k.removeprefix('_orig_mod.'): v for k, v in checkpoint['model'].items()})
        optimizer.load_state_dict(checkpoint['optimizer'])
    except (RuntimeError, ValueError, KeyError) as e:  # weights or optimizer state of another shape
        fail(f"cannot resume from {resume_path}: {describe(e)}")
    checkpoint = None
raw_model = model
if compile:
    model = torch.compile(model)
if ddp:
    # no buffer sync at each forward: the model has no buffers (RoPE is computed per forward)
    model = DDP(model, device_ids=[ddp_local_rank] if device_type == 'cuda' else None, forward_sync_buffers=False)
cache_bytes_per_token = gptconf.cache_bytes(block_size, ptdtype) / block_size  # at block_size, inference dtype
# model FLOPs utilization vs an A100's bf16 peak (312 TFLOPS): PaLM's 6N + 12 L H Q T FLOPs per token, as nanoGPT
flops_per_token = 6 * raw_model.get_num_params() + 12 * gptconf.n_layer * gptconf.n_embd * block_size
if master_process:
    print(f"tokens per iteration will be: {tokens_per_iter:,}")
    print(f"{gptconf.attn}: {raw_model.get_num_params() / 1e6:.2f}M parameters, "
          f"cache {cache_bytes_per_token:,.0f} bytes/token at block_size {block_size} ({dtype})"
          + (" (a fixed state: the bytes shrink as the context grows)" if not gptconf.softmax else "")
          + (f"; layers: {', '.join(f'{a} x{n}' for a, n in gptconf.layer_counts().items())} (a fixed state in the "
             f"linear ones)" if len(gptconf.layer_counts()) > 1 else ""))


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
            if _interrupted:  # stop within a batch, not at the end of a long evaluation
                net.train()
                return None
            X, Y = get_batch(split, gen)
            with ctx:
                _, loss = net(X, Y)
            losses.append(loss.item())
        out[split] = sum(losses) / len(losses)
    net.train()
    return out


try:  # for the samples at evaluations
    encode, decode = tokenizer(meta)
except PrepareError:  # a BPE whose encoding cannot be downloaded: no samples
    encode = decode = None
samples = []


@torch.no_grad()
def sample_text(n=200):
    """n greedy, cached tokens after a newline (nanoGPT's default prompt) from the current weights."""
    raw_model.eval()
    try:
        prompt = encode('\n')
    except ValueError:  # a vocabulary without a newline
        prompt = [0]
    with ctx:
        out = raw_model.generate(torch.tensor([prompt], device=device), n, temperature=0)
    raw_model.train()
    return decode(out[0, len(prompt):].tolist())


def get_lr(it):
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    decay_ratio = (it - warmup_iters) / max(1, lr_decay_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * decay_ratio)) * (learning_rate - min_lr)


def save_checkpoint(path, val_loss=None):
    """Written to a temp file in out_dir, flushed to disk, then renamed: a crash never leaves half a file.
    val_loss: of these weights (None: not evaluated); best_val_loss: of the best weights so far, in ckpt.pt."""
    if not all(torch.isfinite(p).all() for p in raw_model.parameters()):  # never save a diverged model
        fail(f"the weights at iteration {iter_num} are not finite: not saved, {kept()} (try a lower learning_rate)")
    start_run()
    ckpt = {'model': raw_model.state_dict(), 'optimizer': optimizer.state_dict(), 'model_args': asdict(gptconf),
            'iter_num': iter_num, 'val_loss': val_loss, 'best_val_loss': best_val_loss, 'config': config, 'meta': meta,
            'wandb_id': wandb_id}
    try:
        write_atomic(path, lambda f: torch.save(ckpt, f), durable=True)
    except FileError as e:
        fail(f"{e}; {kept()}, no partial file left")
    print(f"saving checkpoint to {path}")


def kept():
    """What a stopped run leaves behind, said truthfully."""
    names = [os.path.basename(p) for p in (ckpt_path, last_path) if os.path.isfile(p)]
    return f"{' and '.join(names)} in {out_dir} kept" if names else "no checkpoint was written"


def resume_command():
    """This run's command with --init_from=resume, plus the model settings that differ from its arguments
    (a converted model has its source's shape)."""
    args = [a for a in sys.argv[1:] if not a.startswith(('--init_from', '--overwrite'))] + ['--init_from=resume']
    launcher = ['torchrun', '--standalone', f'--nproc_per_node={ddp_world_size}'] if ddp else ['python']
    return shlex.join(launcher + [sys.argv[0]] + args + flags(gptconf, asked))


def rows_before(path, it):
    """The lines of a metrics log with iteration < it; a line cut short by a kill is dropped too."""
    keep = []
    with open(path, errors='replace') as f:  # a line with broken bytes is dropped too
        for line in f:
            try:
                if json.loads(line)['iter'] < it:
                    keep.append(line)
            except (ValueError, KeyError, TypeError):
                pass
    return keep


metrics_path = os.path.join(out_dir, 'metrics.jsonl')


def log(row):
    """One row to out_dir/metrics.jsonl (strict JSON: a non-finite number is null) and, with wandb_log, to Weights &
    Biases; eval_only writes nothing. A failed write (disk full) stops the run, the log as it was before the row."""
    if eval_only:
        return
    line = json.dumps({k: v if not isinstance(v, float) or math.isfinite(v) else None for k, v in row.items()}) + '\n'
    if not started:
        pending.append(line)
    else:
        size = os.path.getsize(metrics_path) if os.path.isfile(metrics_path) else 0
        try:
            with open(metrics_path, 'a') as f:
                f.write(line)
        except OSError as e:
            with open(metrics_path, 'r+') as f:  # the row's written part cut off again
                f.truncate(size)
            fail(f"cannot write {metrics_path}: {why(e, metrics_path)}; stopped, {kept()}, the log's last "
                 f"row whole")
    to_wandb(lambda: wandb.log({k: v for k, v in row.items() if k != 'cache_bytes_per_token'}, step=row['iter']))


def to_wandb(call):
    """A W&B call, with wandb_log; one that fails (network, disk, permissions) stops W&B logging with one warning,
    never the run: training, checkpoints and metrics.jsonl go on."""
    global wandb_log
    if not (wandb_log and master_process):
        return
    try:
        call()
    except Exception as e:
        wandb_log = False
        print(f"warning: W&B logging stopped ({describe(e)}); training goes on, metrics.jsonl has every row",
              file=sys.stderr)


def wandb_credentials():
    """An API key in the environment or from `wandb login` (~/.netrc); without one W&B would prompt."""
    if os.environ.get('WANDB_API_KEY'):
        return True
    try:
        return netrc.netrc().authenticators('api.wandb.ai') is not None
    except (OSError, netrc.NetrcParseError):
        return False


if wandb_log and master_process:
    mode = wandb_mode or os.environ.get('WANDB_MODE') or ('online' if wandb_credentials() else 'offline')
    if mode not in ('online', 'offline', 'disabled'):
        fail(f"wandb_mode={mode!r} should be online, offline or disabled")
    if mode == 'online' and not wandb_credentials():
        fail("wandb_mode=online needs W&B credentials (`wandb login`, or WANDB_API_KEY); or log offline with "
             "--wandb_mode=offline and `wandb sync` later")
    os.environ['WANDB_MODE'] = mode  # decided before init: wandb must never prompt or wait for a network
    _at_once = False  # it writes files: an interrupt waits for it
    try:
        import wandb
    except ImportError as e:
        fail(f"wandb_log=True needs wandb ({describe(e)}): pip install -r requirements.txt, or --wandb_log=False")
    origin = f"-from-{os.path.basename(os.path.normpath(init_from))}" if converting else ''
    name = wandb_run_name or f"{attn}{origin}-{time.strftime('%Y%m%d-%H%M%S')}"
    name = name if attn in name else f"{attn}-{name}"
    wandb_id = wandb_id or os.urandom(4).hex()  # kept in the checkpoint: a resume continues this run
    model_info = {'model': asdict(gptconf), 'params': raw_model.get_num_params(), 'mlp_hidden': mlp_hidden(gptconf),
                  'tokens_per_iter': tokens_per_iter}  # the resolved shape (n_kv_head, MLA d_c / d_R, ...)
    try:  # a W&B problem is one line before training starts (later, a warning: see to_wandb)
        run = wandb.init(project=wandb_project, name=name, id=wandb_id, resume='allow', mode=mode,
                         config={**config, **model_info})
        run.summary.update({'params': model_info['params'], 'cache_bytes_per_token': cache_bytes_per_token})
    except Exception as e:
        fail(f"W&B could not start ({describe(e)}); train without it (--wandb_log=False) or --wandb_mode=offline")
    print(f"W&B run {name} ({mode}) in {os.path.relpath(os.path.dirname(run.dir))}" +
          (f"; upload it later with: wandb sync {os.path.relpath(os.path.dirname(run.dir))}" if mode == 'offline' else ''))


def stop_requested():  # Ctrl-C on any rank: every DDP rank stops at the same iteration
    if not ddp:
        return _interrupted
    flag = torch.tensor([float(_interrupted)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


_at_once = False  # from here on an interrupt is a flag, checked at every iteration
if stop_requested():
    stop_before_training()
started, pending = False, []  # the rows logged before the run's first write


def start_run():
    """The run's first write (a checkpoint, or the end of its first step): only now may the files of an earlier
    run change, so a run stopped before it, by an error or an interrupt, leaves them as they were."""
    global started
    if started or not master_process or eval_only:
        return
    started = True
    for name in ('ckpt.pt', 'last.pt', 'metrics.jsonl'):  # the temp files of killed runs (none is alive: the lock);
        for stale in glob.glob(os.path.join(glob.escape(out_dir), f'{name}.tmp[0-9]*')):  # only ours: NAME.tmpPID
            if re.fullmatch(rf'{re.escape(name)}\.tmp\d+', os.path.basename(stale)) and os.path.isfile(stale):
                os.remove(stale)
    if init_from != 'resume':
        for old in previous:  # --overwrite=True (checked at start-up)
            os.remove(old)
            print(f"removed {old} (--overwrite=True)")
    # a new run (or conversion) starts a new log; a resume redoes what was logged past its checkpoint
    rows = rows_before(metrics_path, iter_num) if init_from == 'resume' and os.path.isfile(metrics_path) else []
    try:
        write_atomic(metrics_path, ''.join(rows + pending))  # one iteration column, never going back
    except FileError as e:
        fail(f"{e}; stopped, {kept()}")


# training loop
X, Y = get_batch('train', draw(iter_num, 0))  # micro-batch 0 of iteration iter_num
t0 = time.time()
local_iter_num, running_mfu, stop = 0, -1.0, False
while True:
    lr = get_lr(iter_num) if decay_lr else learning_rate
    for param_group in optimizer.param_groups:
        param_group['lr'] = lr

    losses = None
    if (iter_num % eval_interval == 0 or iter_num >= max_iters or eval_only) and master_process:  # and at the end
        losses = estimate_loss()  # None if interrupted during it: dropped, the interrupt is handled below
        if losses is None and eval_only:
            print("error: interrupted during the evaluation; nothing was written", file=sys.stderr)
            sys.exit(130)
    if losses:
        print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
        if (sample_every_eval or wandb_log) and decode:
            text = sample_text()
            if sample_every_eval:
                print(f"sample:\n{text}\n---")
            samples.append([iter_num, attn, text])
            to_wandb(lambda: wandb.log({'samples': wandb.Table(columns=['iter', 'layout', 'text'], data=samples)},
                                       step=iter_num))
        log({'iter': iter_num, 'train/loss': losses['train'], 'val/loss': losses['val'], 'lr': lr,
             'cache_bytes_per_token': cache_bytes_per_token})
        if not (math.isfinite(losses['train']) and math.isfinite(losses['val'])):  # never saved, whatever the flags
            fail(f"the evaluation at iteration {iter_num} gave a non-finite loss (train {losses['train']}, val "
                 f"{losses['val']}); stopped, {kept()} (try a lower learning_rate)")
        if (losses['val'] < best_val_loss or always_save_checkpoint) and not eval_only:
            best_val_loss = min(best_val_loss, losses['val'])
            to_wandb(lambda: run.summary.update({'best_val_loss': best_val_loss}))
            if iter_num != best_at and (local_iter_num > 0 or init_from == 'resume'):  # not yet in ckpt.pt
                save_checkpoint(ckpt_path, losses['val'])
                best_at = iter_num
                if os.path.isfile(last_path):
                    os.remove(last_path)  # an older state than this checkpoint
    if eval_only:
        break
    stop = stop_requested()  # once per iteration on every rank: a collective under DDP
    if stop or iter_num >= max_iters:  # interrupted, or max_iters steps done and evaluated (saved if best)
        if not stop:
            start_run()  # a finished run writes its log, even one with nothing to train (max_iters=0)
        if master_process and local_iter_num > 0 and (stop or best_at != iter_num):  # a state not in ckpt.pt
            save_checkpoint(last_path)
        if master_process and stop and not started:
            print("error: interrupted before the first training step; nothing was written", file=sys.stderr)
        elif master_process and stop:  # (on stderr if stdout has lost its reader: `| head`)
            print(f"interrupted before iteration {iter_num}: its state saved to "
                  f"{last_path if os.path.isfile(last_path) else ckpt_path}"
                  f"{', the best weights kept in ' + ckpt_path if os.path.isfile(ckpt_path) else ''}; continue with:\n"
                  f"  {resume_command()}", file=sys.stderr if sys.stdout.closed_out else sys.stdout)
        break

    torch.manual_seed(hash((seed, ddp_rank, iter_num)) % 2 ** 63)  # dropout masks: a function of the iteration
    for micro_step in range(gradient_accumulation_steps):
        if ddp:  # sync gradients only at the last micro step
            model.require_backward_grad_sync = (micro_step == gradient_accumulation_steps - 1)
        with ctx:
            logits, loss = model(X, Y)
            loss = loss / gradient_accumulation_steps
        if not torch.isfinite(loss):
            fail(f"loss is {loss.item()} at iteration {iter_num}; stopped, {kept()} (try a lower learning_rate)")
        nxt = micro_step + 1  # prefetch the next micro-batch while the GPU works
        X, Y = get_batch('train', draw(iter_num + nxt // gradient_accumulation_steps, nxt % gradient_accumulation_steps))
        scaler.scale(loss).backward()
    if grad_clip != 0.0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    start_run()  # a step done: this run now writes its files

    t1 = time.time()
    dt, t0 = t1 - t0, t1
    if iter_num % log_interval == 0 and master_process:
        lossf = loss.item() * gradient_accumulation_steps
        if local_iter_num >= 5:  # let the loop settle before measuring
            mfu = flops_per_token * batch_size * gradient_accumulation_steps * block_size / dt / 312e12
            running_mfu = mfu if running_mfu == -1.0 else 0.9 * running_mfu + 0.1 * mfu
        measured = {'mfu': running_mfu * 100} if running_mfu >= 0 else {}  # nothing until it is measured
        print(f"iter {iter_num}: loss {lossf:.4f}, time {dt * 1000:.2f}ms, {tokens_per_iter / dt:,.0f} tok/s" +
              (f", mfu {running_mfu * 100:.2f}%" if measured else ""))
        log({'iter': iter_num, 'train/batch_loss': lossf, 'lr': lr, 'ms_per_iter': dt * 1000,
             'tokens_per_sec': tokens_per_iter / dt, **measured})
    iter_num += 1
    local_iter_num += 1

if ddp:  # every rank must end with the same weights
    digest = hashlib.sha256(b''.join(p.detach().cpu().numpy().tobytes() for p in raw_model.parameters()))
    sys.stdout.flush()  # then the line in one write: the ranks share one stdout
    print(f"rank {ddp_rank}: weights sha256 {digest.hexdigest()[:16]}", flush=True)
    dist.destroy_process_group()


def upload_checkpoint():  # ckpt.pt, the best weights, as a W&B artifact
    artifact = wandb.Artifact(f"{wandb_id}-ckpt", type='model', metadata={'best_val_loss': best_val_loss})
    artifact.add_file(ckpt_path)
    wandb.log_artifact(artifact)


if wandb_log_checkpoint and os.path.isfile(ckpt_path):
    to_wandb(upload_checkpoint)
to_wandb(lambda: wandb.finish())
if ddp:  # DDP keeps gloo's worker threads alive past destroy_process_group; one that frees a tensor while
    sys.stdout.flush(), sys.stderr.flush()  # Python shuts down aborts the run (SIGABRT). All is saved by now,
    os._exit(130 if stop else 0)  # so leave without that shutdown
if stop:
    sys.exit(130)  # interrupted (its state saved): not a finished run, for `train.py && sample.py`
