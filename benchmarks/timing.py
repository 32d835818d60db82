"""
Timing that bench.py's reports and sample.py --compare share: functions run in turns, the device
synchronized around each, and generation timed the same way with and without the cache.
"""
import random
import time

import torch

from ops.sampling import stream


def take_turns(fns, device, rounds, said=lambda name, r, seconds: None):
    """{name: [seconds, one a round]}: each fn once a round, the device synchronized around it, in
    a new order each round (seeded), so that no fn always runs first or after the same neighbour
    (which may leave the caches cold); said(name, round, seconds) after each."""
    sync = torch.cuda.synchronize if device.startswith('cuda') else (lambda: None)
    names, times = list(fns), {name: [] for name in fns}
    for r in range(rounds):
        for name in random.Random(r).sample(names, len(names)):
            sync()
            t0 = time.perf_counter()
            fns[name]()
            sync()
            times[name].append(time.perf_counter() - t0)
            said(name, r, times[name][-1])
    return times


def generate_in_turns(ways, idx, new, device, rounds, seed=0, said=lambda way, r, seconds: None,
                      **sampling):
    """Generation timed, for bench.py decode and sample.py --compare alike. ways: {name: (model,
    cache)}, cache None (the window re-run every token), 'cache' or 'static' (fixed shapes: a
    compiled model's). Each way generates new tokens after idx (B, T) from the same seed, once
    short (round 0: the warm-up, a compilation), then rounds times taking turns; said(way, round,
    seconds) after each run. Returns {way: (tokens, its cache, [seconds a round])}."""
    out = {}

    def run(way, n):
        model, kind = ways[way]
        torch.manual_seed(seed)
        cache = model.init_cache(idx.size(0), static=kind == 'static') if kind else None
        tokens = stream(model, idx, n, use_cache=cache is not None, cache=cache, **sampling)
        out[way] = torch.cat([idx[:, :0], *tokens], 1), cache
    take_turns({way: lambda way=way: run(way, min(8, new)) for way in ways}, device, 1, said)
    times = take_turns({way: lambda way=way: run(way, new) for way in ways}, device, rounds,
                       lambda way, r, seconds: said(way, r + 1, seconds))
    return {way: (*out[way], times[way]) for way in ways}
