"""
Generation: stream() feeds a model its window of tokens, one new token a step, with or without
its cache; sample() picks each token from the logits (greedy, or top-k / nucleus sampling at a
temperature); check_generation() refuses a prompt or settings before a token is sampled.
"""
import torch
from torch.nn import functional as F


def check_generation(idx, max_new_tokens, temperature, top_k, top_p):
    """Refuse a prompt idx that is not (B, T >= 1), and settings sample() cannot honour (below
    1e-6, logits / temperature may overflow)."""
    if idx.dim() != 2 or idx.size(1) == 0:
        raise ValueError(f"empty prompt, or not (B, T): {tuple(idx.shape)}; "
                         "generation needs a token to start from")
    ok = (max_new_tokens >= 0
          and (temperature == 0 or 1e-6 <= temperature <= 1e6)
          and (top_k is None or isinstance(top_k, int) and top_k >= 1)
          and (top_p is None or 0 < top_p <= 1))
    if not ok:
        raise ValueError(f"need max_new_tokens >= 0, temperature 0 or in [1e-6, 1e6], "
                         f"an integer top_k >= 1, 0 < top_p <= 1, "
                         f"not {max_new_tokens}, {temperature}, {top_k}, {top_p}")

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

@torch.inference_mode()
def stream(model, idx, max_new_tokens, temperature=1.0, top_k=None, top_p=None, use_cache=True,
           cache=None):
    """Yield the new tokens (B, 1) one step at a time. The model sees a window of at most
    block_size tokens; when it is full it slides forward, keeping its last half, positions
    restarting at 0: with and without the cache the tokens are the same. Pass a cache
    (model.init_cache) to inspect it after."""
    check_generation(idx, max_new_tokens, temperature, top_k, top_p)
    block_size = model.config.block_size
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
