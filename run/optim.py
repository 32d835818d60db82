"""
AdamW and its learning-rate schedule: what train.py trains with (nanoGPT's), bench.py mqar too.
"""
import math

import torch


def adamw(model, learning_rate, weight_decay, betas, device_type='cpu'):
    """nanoGPT's AdamW: matmul weights and embeddings decay, biases and norms do not."""
    params = list(model.parameters())
    groups = [{'params': [p for p in params if p.dim() >= 2], 'weight_decay': weight_decay},
              {'params': [p for p in params if p.dim() < 2], 'weight_decay': 0.0}]
    return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=device_type == 'cuda')


def cosine_lr(it, learning_rate, warmup_iters, lr_decay_iters, min_lr):
    """Linear warmup to learning_rate over warmup_iters, cosine decay to min_lr at lr_decay_iters,
    then min_lr."""
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    decay_ratio = (it - warmup_iters) / max(1, lr_decay_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * decay_ratio)) * (learning_rate - min_lr)
