"""
Conversions of an MHA model, used by `train.py --init_from=SOURCE` (an out_dir with an MHA ckpt.pt,
or GPT-2: run/gpt2.py): to GQA / MQA by mean-pooling K/V heads (Ainslie et al. 2023), to MLA by a
joint low-rank factorisation of the keys and values (as MHA2MLA, Ji et al. 2025).
"""
import math
import os

import torch

from configurator import describe, fail, fail_on
from data.common import PrepareError, open_data
from model import GPTConfig
from run.checkpoint import RESUME, FileError, read_checkpoint, trained_on, weights
from run.gpt2 import gpt2, is_gpt2

SHAPE = ('block_size', 'n_layer', 'n_head', 'n_embd', 'pos_emb', 'bias')  # said as it starts


def pool_kv_heads(state_dict, config, n_kv_head):
    """MHA -> GQA / MQA (Ainslie et al. 2023): the K and V projections (and biases) of each group
    of n_head / n_kv_head heads become their mean; every other weight is copied. Exact for
    n_kv_head = n_head."""
    if set(config.pattern()) != {'mha'}:
        raise ValueError("conversion mean-pools the K/V heads of an 'mha' checkpoint; "
                         f"this one is {config.attn!r}")
    H, hd, C = config.n_head, config.head_dim, config.n_embd
    if n_kv_head < 1 or H % n_kv_head:
        raise ValueError(f"n_kv_head={n_kv_head} must divide n_head={H}")
    pool = lambda t: t.view(n_kv_head, H // n_kv_head, hd, *t.shape[1:]).mean(1).flatten(0, 1)
    out = dict(state_dict)
    for name, t in state_dict.items():
        if name.endswith('attn.c_attn.weight') or name.endswith('attn.c_attn.bias'):
            q, k, v = t.split(C, dim=0)  # rows: [q heads | k heads | v heads], head-major
            out[name] = torch.cat([q, pool(k), pool(v)])
    return out


def to_mla(state_dict, config, mla):
    """MHA (config) -> MLA (mla: its GPTConfig, without q_lora_rank). Per layer, d = head_dim:
    - the decoupled RoPE part: the MHA's pairs whose frequency MLA's d_R-wide RoPE turns at (every
      (d / d_R)-th pair: theta^(-2i/d_R) = theta^(-2 (i d / d_R) / d)) become q_R, and the heads'
      mean of their keys the shared k_R; the other pairs of q and k lose their rotation. (Learned
      positions, GPT-2's, rotate nothing: the same split, the heads' keys there shared.)
    - the rest of the keys and the values: one SVD of [W_K; W_V] truncated to rank d_c: the
      latent c = V_rᵀ x, W_UK and W_UV = U_r Σ_r. The latent's RMSNorm gain is c's expected RMS,
      so that norm(c) ~ c (exact for a token whose c has that RMS).
    - biases: V's moves into c_proj's (attention weights sum to 1); K's is dropped (the same for
      every key of a query: no change to its softmax, but for RoPE's turn of it).
    - q times sqrt((d + d_R) / d): MLA scales scores by 1 / sqrt(d + d_R), MHA by 1 / sqrt(d)."""
    H, d, C = config.n_head, config.head_dim, config.n_embd
    dc, dR = mla.kv_lora_rank, mla.rope_head_dim
    wrong = {f"attn={config.attn!r} (an 'mha' model)": set(config.pattern()) != {'mha'},
             f"q_lora_rank={mla.q_lora_rank} (0: q is not factorised)": mla.q_lora_rank,
             f"rope_head_dim={dR} (one dividing head_dim={d})": d % dR}
    if said := [w for w, bad in wrong.items() if bad]:
        raise ValueError(f"MHA -> MLA needs another {said[0]}")
    pairs = torch.arange(0, d // 2, d // dR)                         # the pairs RoPE keeps
    rope = torch.stack([2 * pairs, 2 * pairs + 1], 1).flatten()      # (dR,) dims of a head
    nope = torch.tensor([i for i in range(d) if i not in rope], dtype=torch.long)  # (d - dR,)
    scale = math.sqrt((d + dR) / d)

    def query(t):  # a head's q rows (H, d, ...) -> (H, d + dR, ...): [nope | zeros | rope], scaled
        q = torch.zeros(H, d + dR, *t.shape[2:], dtype=t.dtype)
        q[:, :d - dR], q[:, d:] = t[:, nope], t[:, rope]
        return scale * q.flatten(0, 1)

    out = {k: v for k, v in state_dict.items() if '.attn.c_attn.' not in k}
    for name in [k for k in state_dict if k.endswith('.attn.c_attn.weight')]:
        attn = name.removesuffix('c_attn.weight')                    # 'transformer.h.N.attn.'
        w = state_dict[name].double().view(3, H, d, C)               # q, k, v heads' rows
        # K without RoPE's pairs, and V: one latent, c = V_rᵀ x
        kv = torch.cat([w[1][:, nope].reshape(-1, C), w[2].reshape(-1, C)])  # (H (2d - dR), C)
        U, S, Vh = torch.linalg.svd(kv, full_matrices=False)
        r = min(dc, len(S))
        down, up = kv.new_zeros(dc, C), kv.new_zeros(len(kv), dc)
        down[:r], up[:, :r] = Vh[:r], U[:, :r] * S[:r]
        k_up = kv.new_zeros(H, d, dc)                                # zero rows: the rope dims
        k_up[:, :d - dR] = up[:H * (d - dR)].view(H, d - dR, dc)
        # the latent's mean square for ln_1's output γ n + β (n: zero mean, unit variance)
        ln = attn.replace('attn.', 'ln_1.')
        power = (down * state_dict[ln + 'weight'].double()).square().sum(1)
        if ln + 'bias' in state_dict:
            power += (down @ state_dict[ln + 'bias'].double()).square()
        out.update({attn + 'c_q.weight': query(w[0]),
                    attn + 'kv_down.weight': torch.cat([down, w[1][:, rope].mean(0)]),
                    attn + 'kv_norm.weight': power.mean().sqrt().expand(dc).clone(),
                    attn + 'k_up.weight': k_up.flatten(0, 1),
                    attn + 'v_up.weight': up[H * (d - dR):]})
        if attn + 'c_attn.bias' in state_dict:
            b = state_dict[attn + 'c_attn.bias'].double().view(3, H, d)
            proj_w, proj_b = (state_dict[attn + f'c_proj.{p}'].double() for p in ('weight', 'bias'))
            out.update({attn + 'c_q.bias': query(b[0]),
                        attn + 'kv_down.bias': torch.cat([kv.new_zeros(dc), b[1][:, rope].mean(0)]),
                        attn + 'c_proj.bias': proj_b + proj_w @ b[2].flatten()})
    dtype = next(iter(state_dict.values())).dtype
    return {k: v.to(dtype) for k, v in out.items()}


def conversion(init_from, device, meta, data_dir, remake, config, given):
    """(GPTConfig, weights) of the model `train.py --init_from=SOURCE` starts from: SOURCE's MHA
    (DIR/ckpt.pt, or GPT-2) re-laid out as this run's attn with its K/V sizes and dropout; its shape
    (MLP and windows too) kept, a flag asking for another refused, but a smaller block_size (learned
    positions: their first rows, as nanoGPT's crop_block_size)."""
    with fail_on(FileError):
        if is_gpt2(init_from):
            cfg, state, source_meta = gpt2(init_from)
            source = {'meta': source_meta}
        else:
            source, cfg = read_checkpoint(os.path.join(init_from, 'ckpt.pt'), device, RESUME)
            state = weights(source)
    attn = config['attn']
    if set(cfg.pattern()) != {'mha'}:
        fail(f"converting {init_from} needs an 'mha' checkpoint; this one is {cfg.attn!r}")
    layouts = {part.partition('*')[0].partition('@')[0] for part in attn.split('+')}
    if len(layouts) > 1 or not layouts <= {'mha', 'gqa', 'mqa', 'mla'}:  # (windows: below)
        fail(f"converting {init_from} re-lays out its keys and values: attn must be mha, gqa, mqa "
             f"or mla, not {attn!r}")
    if source.get('meta') != meta and is_gpt2(init_from) and meta.get('encoding') != 'gpt2':
        fail(f"{init_from} reads GPT-2's BPE tokens: train on --dataset=shakespeare (or a "
             f"--data_dir prepared with tiktoken's 'gpt2'), not {data_dir}")
    if source.get('meta') != meta:  # the same tokens, not only as many
        vocab = meta['vocab_size']
        ours = "as many, other ones" if cfg.vocab_size == vocab else f"{vocab:,}"
        fail(f"converting {init_from} needs its vocabulary: it has {cfg.vocab_size} tokens "
             f"({trained_on(source)}), the data in {data_dir} {ours}")
    # this run's: the layout, its K/V sizes, dropout, a smaller block_size; the source's: the rest
    block_size = cfg.block_size
    if 'block_size' in given:
        block_size = config['block_size'] if cfg.pos_emb == 'rope' else min(config['block_size'],
                                                                             block_size)
    own = dict(attn=attn, n_kv_head=config['n_kv_head'], match_mha_params=False,
               dropout=config['dropout'], block_size=block_size,
               **{k: config[k] for k in ('kv_lora_rank', 'rope_head_dim', 'q_lora_rank')})
    if '@' in attn and 'window' not in given:  # windows spelled per layer: the source's window= too
        own['window'] = 0
    # the data against that block_size (train.py checked it against the flag's)
    if block_size > config['block_size']:
        with fail_on(PrepareError):
            open_data(data_dir, block_size, remake)
    shape = {k: v for k, v in vars(cfg).items() if k != 'vocab_size'}
    def asked(k):  # how this run asked for k: a flag, or a config file's line
        by = given[k]
        return f"--{k}={config[k]}" if by.startswith('--') else f"{k}={config[k]} of {by}"
    # positions it never learned (RoPE's are computed: a longer block_size is the run's to choose)
    longer = config['block_size'] > cfg.block_size and cfg.pos_emb == 'learned'
    conflicts = [f"{asked(k)} (the checkpoint has {v})" for k, v in shape.items() if k in given
                 and (k not in own and config[k] != v or k == 'block_size' and longer)]
    if conflicts:
        fail(f"converting {init_from} keeps its shape: drop {', '.join(conflicts)}")
    print(f"the shape of {init_from}: " + ' '.join(f"{k}={shape[k]}" for k in SHAPE))
    try:
        # this run's K/V sizes, the source's n_head
        gptconf = GPTConfig(vocab_size=meta['vocab_size'], **{**shape, **own})
        if gptconf.windows != cfg.windows:
            windows = f"its windows {cfg.windows}" if any(cfg.windows) else "no window"
            fail(f"converting {init_from} keeps its windows: --attn={attn} has {gptconf.windows}, the "
                 f"checkpoint {windows} (attn={cfg.attn!r}, window={cfg.window})")
        if cfg.pos_emb == 'learned':  # the positions it keeps
            wpe = 'transformer.wpe.weight'
            state = {**state, wpe: state[wpe][:block_size]}
        if gptconf.softmax == 'mla':  # ('mla', or spelled per layer: 'mla@16+mla')
            return gptconf, to_mla(state, cfg, gptconf)
        return gptconf, pool_kv_heads(state, cfg, gptconf.n_kv_head)
    except ValueError as e:
        fail(f"converting {init_from}: {e}")
    except (RuntimeError, KeyError, TypeError, AttributeError) as e:  # (crafted files)
        fail(f"cannot convert {init_from}: {describe(e)}")
