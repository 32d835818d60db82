"""
MHA -> GQA / MQA conversion (Ainslie et al. 2023), used by `train.py --init_from=<mha out_dir>`.
"""
import torch


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
