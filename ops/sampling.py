"""
Generation: stream() feeds a model its window of tokens, one new token a step, with or without
its cache; sample() picks each token from the logits (greedy, or top-k / nucleus sampling at a
temperature); check_generation() refuses a prompt or settings before a token is sampled.
"""
import math

import torch
from torch.nn import functional as F


def check_generation(idx, vocab_size, max_new_tokens, temperature, top_k, top_p):
    """Refuse a prompt idx that is not token ids (B, T >= 1) below vocab_size, and settings
    sample() cannot honour (below 1e-6, logits / temperature may overflow)."""
    if not torch.is_tensor(idx) or idx.dim() != 2 or idx.size(1) == 0:
        shape = tuple(idx.shape) if torch.is_tensor(idx) else type(idx).__name__
        raise ValueError(f"empty prompt, or not a tensor (B, T): {shape}; "
                         "generation needs a token to start from")
    if idx.is_floating_point() or idx.is_complex() or idx.dtype == torch.bool:
        raise ValueError(f"the prompt must hold token ids (an integer tensor), not {idx.dtype}")
    if idx.numel() and not 0 <= idx.min() <= idx.max() < vocab_size:  # (another tokenizer's?)
        raise ValueError(f"token ids must be in [0, {vocab_size}), the model's vocab_size: the "
                         f"prompt holds {idx.min().item()} to {idx.max().item()}")
    number = lambda x: isinstance(x, (int, float)) and not isinstance(x, bool)
    whole = lambda x: isinstance(x, int) and not isinstance(x, bool)
    ok = (whole(max_new_tokens) and max_new_tokens >= 0
          and number(temperature) and (temperature == 0 or 1e-6 <= temperature <= 1e6)
          and (top_k is None or whole(top_k) and top_k >= 1)
          and (top_p is None or number(top_p) and 0 < top_p <= 1))
    if not ok:
        raise ValueError(f"need max_new_tokens >= 0, temperature 0 or in [1e-6, 1e6], "
                         f"an integer top_k >= 1, 0 < top_p <= 1, "
                         f"not {max_new_tokens!r}, {temperature!r}, {top_k!r}, {top_p!r}")

def sample(logits, temperature=1.0, top_k=None, top_p=None):
    """One token per row of logits (B, vocab): greedy at temperature 0, else top-k / nucleus
    sampling."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None:
        v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
        logits = logits.masked_fill(logits < v[:, [-1]], -float('inf'))
    if top_p is not None:  # keep the smallest set of tokens whose probability reaches top_p
        probs, order = logits.softmax(-1).sort(descending=True)
        drop = probs.cumsum(-1) - probs >= top_p  # mass before this token already reaches top_p
        # the most likely token always stays (a top_p that rounds to 0 would drop them all)
        drop[:, 0] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), -float('inf'))
    return torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)

def stream(model, idx, max_new_tokens, temperature=1.0, top_k=None, top_p=None, use_cache=True,
           cache=None):
    """Yield the new tokens (B, 1) one step at a time. The model sees a window of at most
    block_size tokens; when it is full it slides forward, keeping its last half, positions
    restarting at 0. A model whose softmax layers are all windowed (config.endless) sees every
    token from the first, its cache bounded by the windows (without it: the whole sequence each
    step). With and without the cache the tokens are the same. Pass a cache (model.init_cache) to
    inspect it after. Its arguments are checked here, at the call."""
    check_generation(idx, model.config.vocab_size, max_new_tokens, temperature, top_k, top_p)
    if use_cache and cache is not None:
        batches = {buf.size(0) for layer in cache.layers for buf in layer.buffers.values()}
        if batches != {idx.size(0)} or len(cache.layers) != model.config.n_layer:
            raise ValueError(f"the cache holds {len(cache.layers)} layers of batch {batches}, the "
                             f"model {model.config.n_layer} and the prompt batch {idx.size(0)}: "
                             "make it with model.init_cache(batch)")
    return steps(model, idx, max_new_tokens, temperature, top_k, top_p, use_cache, cache)

@torch.inference_mode()
def steps(model, idx, max_new_tokens, temperature, top_k, top_p, use_cache, cache):
    """stream()'s loop."""
    # never full: the windows bound what the cache keeps, RoPE depends only on the distance
    block_size = math.inf if model.config.endless else model.config.block_size
    # the prompt as the sampled tokens are (an inference tensor, contiguous), else torch.compile
    # makes a graph for its prefill alone
    idx = idx.clone(memory_format=torch.contiguous_format)
    start = max(0, idx.size(1) - block_size)  # idx[:, start:] is the window
    new = idx[:, start:]  # the tokens the cache has not seen: the window, then 1 token a step
    cache = (model.init_cache(idx.size(0)) if cache is None else cache) if use_cache else None
    for _ in range(max_new_tokens):
        if idx.size(1) - start > block_size:  # the window is full: slide it forward
            start = idx.size(1) - max(1, block_size // 2)
            new = idx[:, start:]
        if cache is not None and new.size(1) == idx.size(1) - start:  # a (re-)prefill
            cache.reset()
        logits, _ = model(new, cache=cache) if cache is not None else model(idx[:, start:])
        new = sample(logits[:, -1, :].float(), temperature, top_k, top_p)  # (B, 1)
        idx = torch.cat((idx, new), dim=1)
        yield new
