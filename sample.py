"""
Sample from a trained checkpoint, with or without the cache, or both side by side.

    python sample.py                                                         # the newest checkpoint of ./out*/, cached
    python sample.py --out_dir=out-shakespeare-char-gqa                      # (--use_cache is the default)
    python sample.py --out_dir=out-shakespeare-char-mla --use_cache=False    # re-run the window each step
    python sample.py --out_dir=out-shakespeare-char-mla --compare            # both ways: same tokens? speed? bytes?
    python sample.py --start=FILE:prompt.txt --num_samples=1 --temperature=0
"""
from run.interrupts import end_on_lost_output, exit_at_once, exit_on_signals, memory_errors_in_one_line, on_closed_output

exit_at_once()  # first: Ctrl-C (and SIGTERM, SIGHUP) during the slow imports below is one line too
memory_errors_in_one_line()

import glob
import os
import sys
import time
import warnings
from dataclasses import replace

import torch

from run.checkpoint import FileError, checkpoints, newest_out_dir, read_checkpoint, trained_on, weights
from configurator import check_device, check_memory, configure, describe, duration, fail
from data.common import PrepareError, check_meta, tokenizer
from model import GPT, num_params
from benchmarks.timing import generate_in_turns

exit_on_signals()  # imported: Ctrl-C a KeyboardInterrupt again (one line: memory_errors_in_one_line's hook)

# -----------------------------------------------------------------------------
out_dir = ''                # '' = the newest checkpoint under ./out*/
start = "\n"               # the prompt, or FILE:path to read it from a file
num_samples = 10           # samples, one batch row each
max_new_tokens = 500       # tokens generated per sample
temperature = 0.8          # 0 = greedy
top_k = 200                # keep the k most likely tokens (>= vocab_size: no filtering)
top_p = 1.0                # nucleus sampling; 1.0 = off
seed = 1337                # of the sampling (the sample train.py logs at iteration N: its seed + N)
use_cache = True           # KV cache (or the layout's state); False re-runs the window every token
compare = False            # generate with and without the cache and print a comparison table
device = 'cuda' if torch.cuda.is_available() else 'cpu'  # cpu, cuda or cuda:N
dtype = ('bfloat16' if torch.cuda.is_bf16_supported() else 'float16') if torch.cuda.is_available() else 'float32'  # weights, cache
compile = False            # torch.compile the model, with a static cache (on CUDA: CUDA graphs)
linear_kernels = 'fla'     # the linear layouts: fla's Triton kernels on CUDA if installed, or 'torch': ours
# -----------------------------------------------------------------------------
config_keys = [k for k, v in globals().items() if not k.startswith('_') and isinstance(v, (int, float, bool, str))]

on_closed_output(end_on_lost_output)  # `| head`: the reader has what it wanted; a full disk: one line
globals().update(configure({k: globals()[k] for k in config_keys if k != 'config_keys'}, sys.argv[1:], __file__))
# -----------------------------------------------------------------------------

for name, ok, rule in (('max_new_tokens', max_new_tokens >= 0, '>= 0'), ('top_k', top_k >= 1, '>= 1'),
                       ('top_p', 0 < top_p <= 1, 'in (0, 1]'),
                       ('temperature', temperature == 0 or 1e-6 <= temperature <= 1e6, '0 (greedy) or in [1e-6, 1e6]'),
                       ('seed', 0 <= seed < 2 ** 62, 'in [0, 2**62)'),
                       ('num_samples', num_samples >= 1, '>= 1'),
                       ('max_new_tokens', max_new_tokens >= 1 or not compare, '>= 1 with --compare'),
                       ('use_cache', use_cache or not compare, 'True with --compare (it runs both ways)'),
                       ('linear_kernels', linear_kernels in ('fla', 'torch'), "'fla' or 'torch'")):
    if not ok:
        fail(f"{name}={globals()[name]!r} must be {rule}")
check_device(device, dtype)

# ckpt.pt (the best val loss), else last.pt (where an interrupted run stopped); with no out_dir, the newest
# checkpoint of the out*/ folders here, the ones train.py's configs write
found, out_dir = not out_dir, out_dir or newest_out_dir()
if os.path.isfile(out_dir):  # e.g. --out_dir=out/ckpt.pt
    fail(f"out_dir={out_dir!r} is a file: give the folder that holds it, --out_dir={os.path.dirname(out_dir) or '.'}")
ckpt_path = (checkpoints(out_dir) or [None])[0]
if ckpt_path is None:
    fail(f"no checkpoint (ckpt.pt or last.pt) in {out_dir}{' nor any ./out*/' if found else ''}: train one first "
         f"(python train.py config/gqa.py config/cpu.py) or pass --out_dir")
try:
    ckpt, cfg = read_checkpoint(ckpt_path, device)
except FileError as e:  # truncated, corrupted or foreign files all land here
    fail(str(e))
val = ckpt.get('val_loss') if isinstance(ckpt.get('val_loss'), float) else None  # last.pt's were not evaluated
if found or ckpt_path.endswith('last.pt'):  # picked for the user: say what it is
    age = duration(time.time() - os.path.getmtime(ckpt_path))
    print(f"sampling {ckpt_path}: {cfg.attn}, trained on {trained_on(ckpt)}, iteration {ckpt.get('iter_num')}"
          + (f", val loss {val:.4f}" if val is not None else "") + f", saved {age} ago", file=sys.stderr)
if found:  # picked for the user: say so if ./out*/ also holds runs on other data
    others = {}
    for path in (p for d in sorted(glob.glob('out*/')) for p in checkpoints(d)[:1] if p != ckpt_path):
        try:
            with warnings.catch_warnings():  # (torch's about a changed pickle byte, say)
                warnings.simplefilter('ignore')
                others.setdefault(trained_on(torch.load(path, map_location='cpu', weights_only=True, mmap=True)), path)
        except Exception:  # not ours to judge here: only the picked one must load
            pass
    others.pop(trained_on(ckpt), None)
    if others:
        listed = '; '.join(f"{os.path.dirname(p)}: {d}" for d, p in others.items())
        print(f"note: ./out*/ also holds runs on other data ({listed}): pick one with --out_dir", file=sys.stderr)
ptdtype = {'float32': torch.float32, 'bfloat16': torch.bfloat16, 'float16': torch.float16}[dtype]
# sized from its config before anything is built: the weights, and per sample a full cache and a window's activations
check_memory(num_params(cfg) * ptdtype.itemsize + num_samples * (
    cfg.cache_bytes(cfg.block_size, ptdtype) + cfg.block_size * cfg.n_embd * ptdtype.itemsize),
    device, f"{ckpt_path}'s model ({cfg.n_layer} layers, n_embd {cfg.n_embd}) and num_samples={num_samples}: "
            "the weights, caches and activations")
try:
    model = GPT(replace(cfg, linear_kernels=linear_kernels))  # how it computes: this run's choice
    model.load_state_dict(weights(ckpt))
    meta = check_meta(ckpt.get('meta'))
    if meta['vocab_size'] != cfg.vocab_size:
        raise ValueError(f"its vocabulary has {meta['vocab_size']} tokens, its model {cfg.vocab_size}")
except Exception as e:  # weights of another shape, a broken vocabulary
    fail(f"cannot load checkpoint {ckpt_path}: {describe(e)}")
ckpt = None
model.eval().to(device=device, dtype=ptdtype)
if compile:  # in place: stream() calls self(...), which a torch.compile(model) wrapper would not reach; on CUDA
    model.compile(mode='reduce-overhead' if 'cuda' in device else None)  # each decode step one CUDA graph replay
    print("compiling the model (torch.compile): the first token waits for it, minutes on a CPU", file=sys.stderr)
torch.manual_seed(seed)

try:  # the tokenizer the checkpoint was trained with
    encode, decode = tokenizer(meta)
except PrepareError as e:
    fail(str(e))

if start.startswith('FILE:'):
    path = start[5:]
    try:
        with open(path, 'rb') as f:
            start, more = f.read(2 ** 26), f.read(1)  # at most 64 MiB: /dev/zero is not a prompt
        if more:
            fail(f"the prompt file {path!r} holds more than {2 ** 26:,} bytes: the model sees only its last "
                 f"block_size tokens; give a shorter file")
        start = start.decode('utf-8').replace('\r\n', '\n').replace('\r', '\n')  # as text mode reads newlines
    except OSError as e:
        fail(f"cannot read the prompt file {path!r}: {e.strerror}")
    except UnicodeDecodeError as e:
        fail(f"the prompt file {path!r} is not UTF-8 text (byte {e.start})")
try:
    start_ids = encode(start)
except ValueError as e:
    fail(f"the prompt has {e}")
if not start_ids:
    fail("the prompt is empty: give at least one token with --start=... (the default is a newline)")
x = torch.tensor(start_ids, dtype=torch.long, device=device)[None, ...]
options = dict(temperature=temperature, top_k=top_k, top_p=top_p if top_p < 1 else None)


if not compare:
    cache = model.init_cache(num_samples, static=compile) if use_cache else None  # static: the same shapes every step
    t0, new = time.perf_counter(), []
    if num_samples > 1:
        print(f"generating {num_samples} samples of {max_new_tokens} tokens (printed when all are done)",
              file=sys.stderr, flush=True)
    else:  # one sample: streamed as it is generated
        print(start, end='')
    for tok in model.stream(x.expand(num_samples, -1), max_new_tokens, use_cache=use_cache, cache=cache, **options):
        if compile and not new:  # the first token waited for the compilation (said at the end: not inside the text)
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
        print(f"compiled: the first token took {compiled}", file=sys.stderr)
    sys.exit(0)

# --compare: the same samples both ways from the same seed, timed as bench.py times generation (timing.py): a
# short warm-up of each way, then 3 rounds taking turns (one timing alone swings several-fold on a busy machine);
# a line per run on stderr (without the cache the baby GPT takes minutes on a CPU)
said = lambda way, r, seconds: print(f"--compare: {f'round {r} of 3' if r else 'warm-up'}, {way} the cache: "
                                     f"{duration(seconds)}", file=sys.stderr, flush=True)
result = generate_in_turns({'with': (model, 'static' if compile else 'cache'), 'without': (model, None)},
                           x.expand(num_samples, -1), max_new_tokens, device, 3, seed, said, **options)
(with_cache, cache, _), (without, _, _) = result['with'], result['without']  # the cache as generation left it
speed = {way: [num_samples * max_new_tokens / s for s in result[way][2]] for way in result}
median = {k: sorted(v)[1] for k, v in speed.items()}
spread = lambda k: f"{median[k]:,.1f}  (3 rounds: {min(speed[k]):,.1f} to {max(speed[k]):,.1f})"
same = torch.equal(with_cache, without)
diff = (with_cache != without).any(0).nonzero()
per_token = cache.nbytes / num_samples / len(cache)
formula = cfg.cache_bytes(len(cache), next(model.parameters()).dtype) / len(cache)
state = cfg.cache_elements(0) > 0  # the linear layers' fixed state
print(decode(with_cache[0].tolist())[:200].replace('\n', ' ') + ' ...\n')
rows = [('layout', cfg.attn), ('device / dtype', f"{device} / {dtype}"),
        ('tokens identical', 'yes' if same else f"no: first difference at new token {diff[0].item()}" +
         (" (16-bit rounding: the two paths add in different orders; float32 gives the same tokens)"
          if dtype != 'float32' else "")),
        ('tokens/s with cache', spread('with')),
        ('tokens/s without cache', spread('without')),
        ('speedup (medians)', f"{median['with'] / median['without']:.2f}x"),
        (f'cache bytes at the end ({len(cache)} tokens x {num_samples} samples)', f"{cache.nbytes:,}"),
        ('cache bytes / token: measured', f"{per_token:,.1f}"),
        ('cache bytes / token: formula', f"{formula:,.1f}" + ('  (incl. the fixed state / tokens)' if state else ''))]
width = max(len(k) for k, _ in rows)
print('\n'.join(f"{k:<{width}} | {v}" for k, v in rows))
if state:  # bytes that do not grow over tokens that do: the ratio falls as the window fills
    print(f"(the linear layers keep a fixed state: its bytes / token here are over the {len(cache)} tokens the window "
          f"holds now; train.py reports them at block_size={cfg.block_size} tokens)")
if len(x[0]) + max_new_tokens > cfg.block_size:
    print(f"(the cache holds {len(cache)} tokens, not {len(x[0]) + max_new_tokens}: past block_size={cfg.block_size} "
          f"the window slides, and the cache is refilled with the last block_size / 2 tokens)")
