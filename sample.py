"""
Sample from a trained checkpoint, with or without the cache, or both side by side.

    python sample.py                                     # the newest checkpoint of ./out*/, cached
    python sample.py --out_dir=out-shakespeare-char-gqa  # (--use_cache is the default)
    python sample.py --use_cache=False                   # re-run the window each step
    python sample.py --compare                           # both ways: same tokens? speed? bytes?
    python sample.py --start=FILE:prompt.txt --num_samples=1 --temperature=0
    python sample.py --init_from=gpt2-xl --start="What is"  # pip install -r requirements-hf.txt
"""
from run.interrupts import exit_at_once, memory_errors_in_one_line

exit_at_once()  # first: Ctrl-C (and SIGTERM, SIGHUP) during the slow imports below is one line too
memory_errors_in_one_line()

import sys
import time
from dataclasses import replace

import torch

from benchmarks.timing import generate_in_turns
from configurator import check_device, check_memory, configure, default_dtype, defaults, describe
from configurator import duration, fail, fail_on
from data.common import PrepareError, check_meta, prompt, tokenizer
from model import GPT
from ops.sampling import stream
from run.checkpoint import FileError, to_sample, weights
from run.gpt2 import gpt2
from run.interrupts import end_on_lost_output, exit_on_signals, on_closed_output
from run.settings import num_params

exit_on_signals()  # imported: Ctrl-C a KeyboardInterrupt again (said in one line all the same)

# -----------------------------------------------------------------------------
out_dir = ''                # '' = the newest checkpoint under ./out*/
init_from = ''              # GPT-2 instead: gpt2, gpt2-medium/-large/-xl, a save_pretrained dir
start = "\n"               # the prompt, or FILE:path to read it from a file
num_samples = 10           # samples, one batch row each
max_new_tokens = 500       # tokens generated per sample
temperature = 0.8          # 0 = greedy
top_k = 200                # keep the k most likely tokens (>= vocab_size: no filtering)
top_p = 1.0                # nucleus sampling; 1.0 = off
seed = 1337                # of the sampling (the sample train.py logs at iteration N: its seed + N)
use_cache = True           # KV cache (or the layout's state); False re-runs the window every token
                           # (every softmax layer windowed: the whole text)
compare = False            # generate with and without the cache and print a comparison table
device = 'cuda' if torch.cuda.is_available() else 'cpu'  # cpu, cuda or cuda:N
dtype = default_dtype()    # weights, cache
compile = False            # torch.compile the model, with a static cache (on CUDA: CUDA graphs)
linear_kernels = 'fla'     # linear layouts: fla's Triton kernels (CUDA, if installed), or 'torch': ours
# -----------------------------------------------------------------------------
on_closed_output(end_on_lost_output)  # `| head` has what it wanted; a full disk: one line
globals().update(configure(defaults(globals()), sys.argv[1:], __file__))
# -----------------------------------------------------------------------------
say = lambda text: print(text, file=sys.stderr, flush=True)  # stdout: the samples (or the table)

greedy_or_in_range = temperature == 0 or 1e-6 <= temperature <= 1e6
rules = [('max_new_tokens', max_new_tokens >= 0, '>= 0'), ('top_k', top_k >= 1, '>= 1'),
         ('top_p', 0 < top_p <= 1, 'in (0, 1]'),
         ('temperature', greedy_or_in_range, '0 (greedy) or in [1e-6, 1e6]'),
         ('seed', 0 <= seed < 2 ** 62, 'in [0, 2**62)'), ('num_samples', num_samples >= 1, '>= 1'),
         ('max_new_tokens', max_new_tokens >= 1 or not compare, '>= 1 with --compare'),
         ('use_cache', use_cache or not compare, 'True with --compare (it runs both ways)'),
         ('linear_kernels', linear_kernels in ('fla', 'torch'), "'fla' or 'torch'"),
         ('init_from', not (init_from and out_dir), "'' with an --out_dir (one model or another)")]
for name, ok, rule in rules:
    if not ok:
        fail(f"{name}={globals()[name]!r} must be {rule}")
check_device(device, dtype)

if init_from:  # GPT-2, through transformers
    with fail_on(FileError):
        cfg, state, meta = gpt2(init_from)
    ckpt_path, ckpt = init_from, {'model': state, 'meta': meta}
else:  # with no out_dir, the newest of ./out*/, named
    ckpt_path, ckpt, cfg = to_sample(out_dir, device)

ptdtype = getattr(torch, dtype)  # (checked: float32, bfloat16 or float16)
# sized before it is built: the weights; per sample, a full cache and a window's activations
activations = cfg.block_size * cfg.n_embd * ptdtype.itemsize
per_sample = cfg.cache_bytes(cfg.block_size, ptdtype) + activations
check_memory(num_params(cfg) * ptdtype.itemsize + num_samples * per_sample, device,
             f"{ckpt_path}'s model ({cfg.n_layer} layers, n_embd {cfg.n_embd}) and "
             f"num_samples={num_samples}: the weights, caches and activations")
try:
    model = GPT(replace(cfg, linear_kernels=linear_kernels))  # how it computes: this run's choice
    model.load_state_dict(weights(ckpt))
    meta = check_meta(ckpt.get('meta'))
    if meta['vocab_size'] != cfg.vocab_size:
        vocab = meta['vocab_size']
        raise ValueError(f"its vocabulary has {vocab} tokens, its model {cfg.vocab_size}")
except Exception as e:  # weights of another shape, a broken vocabulary
    fail(f"cannot load checkpoint {ckpt_path}: {describe(e)}")
ckpt = None  # free up memory
model.eval().to(device=device, dtype=ptdtype)
if compile:  # in place: stream() calls model(...), not a torch.compile(model) wrapper's forward
    model.compile(mode='reduce-overhead' if 'cuda' in device else None)  # CUDA: CUDA graphs
    say("compiling the model (torch.compile): the first token waits for it, minutes on a CPU")
torch.manual_seed(seed)

with fail_on(PrepareError):  # the tokenizer the checkpoint was trained with, and the prompt
    encode, decode = tokenizer(meta)
    start, start_ids = prompt(start, encode)
x = torch.tensor(start_ids, dtype=torch.long, device=device)[None, ...].expand(num_samples, -1)
options = dict(temperature=temperature, top_k=top_k, top_p=top_p if top_p < 1 else None)

if not compare:
    cache = model.init_cache(num_samples, static=compile) if use_cache else None  # static: fixed
    t0, new = time.perf_counter(), []
    if num_samples > 1:
        say(f"generating {num_samples} samples of {max_new_tokens} tokens (printed when all are done)")
    else:  # one sample: streamed as it is generated
        print(start, end='')
    for tok in stream(model, x, max_new_tokens, use_cache=use_cache, cache=cache, **options):
        if compile and not new:  # the first token waited for the compilation (said after the text)
            compiled = duration(time.perf_counter() - t0)
        new.append(tok)
        if num_samples == 1:
            print(decode(tok[0].tolist()), end='', flush=True)
    for row in torch.cat(new, dim=1).tolist() if num_samples > 1 and new else []:
        print(start + decode(row))
        print('---------------')
    if num_samples == 1:
        print()
    if compile and new:
        say(f"compiled: the first token took {compiled}")
    sys.exit(0)

# --compare: the same samples both ways from the same seed, timed as bench.py times generation: a
# warm-up, then 3 rounds taking turns (one timing alone swings several-fold on a busy machine); a
# line per run on stderr (without the cache the baby GPT takes minutes on a CPU)
ways = {'with': (model, 'static' if compile else 'cache'), 'without': (model, None)}
when = lambda r: f'round {r} of 3' if r else 'warm-up'
said = lambda way, r, seconds: say(f"--compare: {when(r)}, {way} the cache: {duration(seconds)}")
result = generate_in_turns(ways, x, max_new_tokens, device, 3, seed, said, **options)
(with_cache, cache, _), (without, _, _) = result['with'], result['without']  # the cache as left
speed = {way: sorted(num_samples * max_new_tokens / s for s in result[way][2]) for way in result}
spread = lambda w: f"{speed[w][1]:,.1f}  (3 rounds: {speed[w][0]:,.1f} to {speed[w][2]:,.1f})"
identical = 'yes'
if not torch.equal(with_cache, without):
    first = (with_cache != without).any(0).nonzero()[0].item()
    rounding = " (16-bit rounding: the two paths add in different orders; float32 gives the same tokens)"
    identical = f"no: first difference at new token {first}" + rounding * (dtype != 'float32')
held = len(cache)  # tokens: past block_size the window slides, and the cache is refilled
state = cfg.cache_elements(0) > 0  # the linear layers' fixed state
formula = f"{cfg.cache_bytes(held, ptdtype) / held:,.1f}"
table = {'layout': cfg.stack, 'device / dtype': f"{device} / {dtype}", 'tokens identical': identical,
         'tokens/s with cache': spread('with'), 'tokens/s without cache': spread('without'),
         'speedup (medians)': f"{speed['with'][1] / speed['without'][1]:.2f}x",
         f'cache bytes at the end ({held} tokens x {num_samples} samples)': f"{cache.nbytes:,}",
         'cache bytes / token: measured': f"{cache.nbytes / num_samples / held:,.1f}",
         'cache bytes / token: formula': formula + "  (incl. the fixed state / tokens)" * state}
print(decode(with_cache[0].tolist())[:200].replace('\n', ' ') + ' ...\n')
width = max(map(len, table))
print('\n'.join(f"{k:<{width}} | {v}" for k, v in table.items()))
if state:  # bytes that do not grow over tokens that do: the ratio falls as the window fills
    print(f"(the linear layers keep a fixed state: its bytes / token here are over the {held} "
          f"tokens the cache has seen; train.py reports them at block_size={cfg.block_size} "
          "tokens)")
if cfg.endless:  # every softmax layer windowed: the cache stops growing, nothing is refilled
    print(f"(every softmax layer keeps its last {max(cfg.windows)} keys at most"
          + f" and the first {cfg.n_sink}" * bool(cfg.n_sink) + ": generation runs past "
          f"block_size={cfg.block_size} with no re-prefill)")
elif len(start_ids) + max_new_tokens > cfg.block_size:
    print(f"(the cache holds {held} tokens, not {len(start_ids) + max_new_tokens}: past "
          f"block_size={cfg.block_size} the window slides, and the cache is refilled with the last "
          "block_size / 2 tokens)")
