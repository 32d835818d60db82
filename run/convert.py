"""
MHA -> GQA / MQA conversion (Ainslie et al. 2023), used by `train.py --init_from=<mha out_dir>`.
"""
import os

import torch

from run.checkpoint import RESUME, FileError, read_checkpoint, trained_on, weights
from configurator import describe, fail
from data.common import PrepareError, open_data
from model import GPTConfig


def pool_kv_heads(state_dict, config, n_kv_head):
    """MHA -> GQA / MQA (Ainslie et al. 2023): the K and V projections (and biases) of each group of
    n_head / n_kv_head heads become their mean; every other weight is copied. Exact for n_kv_head = n_head."""
    if config.attn != 'mha':
        raise ValueError(f"conversion mean-pools the K/V heads of an 'mha' checkpoint; this one is {config.attn!r}")
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


def conversion(init_from, device, meta, data_dir, remake, config, given):
    """(GPTConfig, weights) of the model `train.py --init_from=DIR` starts from: DIR's MHA ckpt.pt with this run's
    attn, K/V heads and dropout, its K/V heads mean-pooled; its shape (and MLP) kept, a flag asking for another
    refused."""
    try:
        source, cfg = read_checkpoint(os.path.join(init_from, 'ckpt.pt'), device, RESUME)
    except FileError as e:
        fail(str(e))
    if config['attn'] not in ('mha', 'gqa', 'mqa'):
        fail(f"converting {init_from} pools K/V heads: attn must be mha, gqa or mqa, not {config['attn']!r}")
    if source.get('meta') != meta:  # the same tokens, not only as many
        fail(f"converting {init_from} needs its vocabulary: it has {cfg.vocab_size} tokens ({trained_on(source)}), the "
             f"data in {data_dir} " + ("as many, other ones" if cfg.vocab_size == meta['vocab_size'] else
                                       f"{meta['vocab_size']:,}"))
    if cfg.block_size > config['block_size']:  # the data against the source's block_size (train.py checked the flags')
        try:
            open_data(data_dir, cfg.block_size, remake)
        except PrepareError as e:
            fail(str(e))
    own = dict(attn=config['attn'], n_kv_head=config['n_kv_head'], match_mha_params=False, dropout=config['dropout'])
    shape = {k: v for k, v in vars(cfg).items() if k != 'vocab_size'}
    conflicts = [(f"--{k}={config[k]}" if given[k].startswith('--') else f"{k}={config[k]} of {given[k]}") +
                 f" (the checkpoint has {v})"
                 for k, v in shape.items() if k in given and k not in own and config[k] != v]
    if conflicts:
        fail(f"converting {init_from} keeps its shape: drop {', '.join(conflicts)}")
    print(f"the shape of {init_from}: " + ' '.join(f"{k}={shape[k]}" for k in
                                                   ('block_size', 'n_layer', 'n_head', 'n_embd', 'pos_emb', 'bias')))
    try:
        # this run's K/V heads, the source's n_head
        gptconf = GPTConfig(vocab_size=meta['vocab_size'], **{**shape, **own})
        pooled = pool_kv_heads(weights(source), cfg, gptconf.n_kv_head)
    except ValueError as e:
        fail(f"converting {init_from}: {e}")
    except (RuntimeError, KeyError, TypeError, AttributeError) as e:  # (crafted files)
        fail(f"cannot convert {init_from}: {describe(e)}")
    return gptconf, pooled
