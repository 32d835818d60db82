"""
MHA -> GQA / MQA conversion (Ainslie et al. 2023), used by `train.py --init_from=<mha out_dir>`.
"""
import os

import torch

from configurator import describe, fail, fail_on
from data.common import PrepareError, open_data
from model import GPTConfig
from run.checkpoint import RESUME, FileError, read_checkpoint, trained_on, weights

SHAPE = ('block_size', 'n_layer', 'n_head', 'n_embd', 'pos_emb', 'bias')  # said as it starts


def pool_kv_heads(state_dict, config, n_kv_head):
    """MHA -> GQA / MQA (Ainslie et al. 2023): the K and V projections (and biases) of each group
    of n_head / n_kv_head heads become their mean; every other weight is copied. Exact for
    n_kv_head = n_head."""
    if config.attn != 'mha':
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


def conversion(init_from, device, meta, data_dir, remake, config, given):
    """(GPTConfig, weights) of the model `train.py --init_from=DIR` starts from: DIR's MHA ckpt.pt
    with this run's attn, K/V heads and dropout, its K/V heads mean-pooled; its shape (and MLP)
    kept, a flag asking for another refused."""
    with fail_on(FileError):
        source, cfg = read_checkpoint(os.path.join(init_from, 'ckpt.pt'), device, RESUME)
    attn = config['attn']
    if attn not in ('mha', 'gqa', 'mqa'):
        fail(f"converting {init_from} pools K/V heads: attn must be mha, gqa or mqa, not {attn!r}")
    if source.get('meta') != meta:  # the same tokens, not only as many
        vocab = meta['vocab_size']
        ours = "as many, other ones" if cfg.vocab_size == vocab else f"{vocab:,}"
        fail(f"converting {init_from} needs its vocabulary: it has {cfg.vocab_size} tokens "
             f"({trained_on(source)}), the data in {data_dir} {ours}")
    # the data against the source's block_size (train.py checked it against the flag's)
    if cfg.block_size > config['block_size']:
        with fail_on(PrepareError):
            open_data(data_dir, cfg.block_size, remake)
    # this run's: the layout, its K/V heads and dropout; the source's: the rest of its shape
    own = dict(attn=attn, n_kv_head=config['n_kv_head'], match_mha_params=False,
               dropout=config['dropout'])
    shape = {k: v for k, v in vars(cfg).items() if k != 'vocab_size'}
    def asked(k):  # how this run asked for k: a flag, or a config file's line
        by = given[k]
        return f"--{k}={config[k]}" if by.startswith('--') else f"{k}={config[k]} of {by}"
    conflicts = [f"{asked(k)} (the checkpoint has {v})"
                 for k, v in shape.items() if k in given and k not in own and config[k] != v]
    if conflicts:
        fail(f"converting {init_from} keeps its shape: drop {', '.join(conflicts)}")
    print(f"the shape of {init_from}: " + ' '.join(f"{k}={shape[k]}" for k in SHAPE))
    try:
        # this run's K/V heads, the source's n_head
        gptconf = GPTConfig(vocab_size=meta['vocab_size'], **{**shape, **own})
        pooled = pool_kv_heads(weights(source), cfg, gptconf.n_kv_head)
    except ValueError as e:
        fail(f"converting {init_from}: {e}")
    except (RuntimeError, KeyError, TypeError, AttributeError) as e:  # (crafted files)
        fail(f"cannot convert {init_from}: {describe(e)}")
    return gptconf, pooled
