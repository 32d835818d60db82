"""Deliberate one-line bugs in model.py and the files of its maths (ops/: softmax.py, mla.py,
linear.py, window.py, cache.py, sampling.py), and in the scripts' code around it (checkpoints, flags,
conversion, sampling, the schedule, bench), each run against the tests: how many does the suite
catch?

    python tests/mutants.py          # every mutant against the model-level tests (minutes)
    python tests/mutants.py --all    # ... and each survivor against the whole suite
    python tests/mutants.py delta mla  # only the mutants whose name contains 'delta' or 'mla'

Each mutant replaces one exact fragment of those files in a copy of the repo's working tree (never
the tree itself). A fragment that does not occur exactly once in them stops the run: a stale list
must not pass for a caught bug. A mutant may name the tests that catch it, run instead of the
model-level files: those of the scripts (train.py, sample.py, bench) for a bug outside the model,
the one quick test that was written for it for a bug inside.
"""
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILES = ('model.py', 'ops/softmax.py', 'ops/mla.py', 'ops/linear.py', 'ops/window.py', 'ops/cache.py',
         'ops/sampling.py', 'run/checkpoint.py', 'run/convert.py', 'run/optim.py', 'train.py',
         'sample.py', 'configurator.py', 'benchmarks/mqar.py', 'benchmarks/decode.py',
         'benchmarks/models.py')
# no train.py runs; the quick files first, so that -x stops a caught mutant early
MODEL_TESTS = ['test_reference.py', 'test_mla.py', 'test_config.py', 'test_hybrid.py',
               'test_attention.py', 'test_linear.py', 'test_memory.py', 'test_property.py',
               'test_cache.py', 'test_generate.py', 'test_gpt.py']

MUTANTS = [  # (what the bug is, the fragment, its replacement[, the tests that catch it])
    ("RoPE: theta_i = base^(-i/d)",
     "device=positions.device) / dim\n", "device=positions.device) / (2 * dim)\n"),
    ("RoPE: rotates the other way", "% 2 == 0)  # -1, +1, -1", "% 2 == 1)  # -1, +1, -1"),
    ("RoPE: pairs (x[i], x[i + d/2]) in apply_rope only",
     "x32.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)",
     "x32.unflatten(-1, (2, -1)).flip(-2).flatten(-2)"),
    ("RoPE: every chunk rotated from position 0",
     "rope_table(self.rope_dim, positions, self.config.rope_base)",
     "rope_table(self.rope_dim, positions - positions[0], self.config.rope_base)"),
    ("attend: no causal mask in training/prefill",
     "dropout_p=dropout_p, is_causal=True,", "dropout_p=dropout_p, is_causal=False,"),
    ("attend: square (top-left) mask for L != S", ".tril(S - L)", ".tril()"),
    ("attend: decode groups interleaved (h % n_kv)",
     "q.reshape(B, H // G, G * L, D), k, v,",
     "(q if G == 1 else q.reshape(B, G, H // G, D).transpose(1, 2))"
     ".reshape(B, H // G, G * L, D), k, v,"),
    ("softmax layouts: no 1/sqrt(d) scale",
     "attend(q, k, v, dropout_p=self.dropout_p, mask=mask)",
     "attend(q, k, v, 1.0, dropout_p=self.dropout_p, mask=mask)"),
    ("cache: update returns only the new keys",
     "return *[buf[:, :, :pos + L] for buf in bufs], None",
     "return *[buf[:, :, pos:pos + L] for buf in bufs], None"),
    ("static cache: the mask shows the next, unfilled position",
     "j <= pos + i\n", "j <= pos + i + 1\n"),
    ("static cache: every write at position 0",
     "buf.index_copy_(2, positions, x)", "buf.index_copy_(2, positions - pos, x)"),
    ("cache: position advances by 1 per forward",
     "cache.pos += L  # once", "cache.pos += 1  # once"),
    ("cache accounting: h_q for h_kv",
     "kv_elements(T, c.n_kv_head, c.head_dim", "kv_elements(T, c.n_head, c.head_dim"),
    ("MLA: scale 1/sqrt(d_h)",
     "self.scale = 1.0 / math.sqrt(self.dh + self.dR)", "self.scale = 1.0 / math.sqrt(self.dh)"),
    ("MLA: rope key not rotated", "apply_rope(k_rope, rope)], dim=-1)", "k_rope], dim=-1)"),
    ("MLA: rope query not rotated",
     "apply_rope(q[..., dh:], rope)], dim=-1)", "q[..., dh:]], dim=-1)"),
    ("MLA: latent cached before its norm",
     "torch.cat([self.kv_norm(c), apply_rope", "torch.cat([c, apply_rope"),
    ("MLA: decode absorbs W_UK for W_UV",
     "torch.einsum('bhlc,hdc->bhld', y, W_UV)", "torch.einsum('bhlc,hdc->bhld', y, W_UK)"),
    ("MLA: decode value includes k_R",
     "scale, dropout_p, mask)[..., :dc]", "scale, dropout_p, mask)[..., -dc:]"),
    ("linear: phi = elu(x) + 2 below 0",
     "torch.exp(x.clamp(max=0)))", "torch.exp(x.clamp(max=0)) + 1)"),
    ("linear: a chunk's quadratic part excludes step t",
     "device=q.device).tril()", "device=q.device).tril(-1)"),
    ("linear: chunk state not decayed",
     "S = write if S is None else eG[:, :, -1:] * S + write",
     "S = write if S is None else S + write"),
    ("linear: denominator + 1", "(y[..., -1:] + 1e-6)", "(y[..., -1:] + 1.0)"),
    ("linear: state bytes at 16 bits counted at 16 bits",
     "state = max(dtype.itemsize, torch.float32.itemsize)", "state = dtype.itemsize"),
    ("linear: normalizer z not counted",
     "c.head_dim, c.head_dim + 1)", "c.head_dim, c.head_dim)"),
    ("conv inputs not counted",
     "d_v + conv_channels * (conv_size - 1)  #", "d_v  #"),
    ("conv not causal: its cached inputs skipped",
     "seen = torch.cat([before, x], 1)", "seen = torch.cat([x, before], 1)"),
    ("conv: reads the future (taps shifted forward)",
     "c[:, s:].addcmul_(x[:, :-s], w[-1 - s])", "c[:, :-s].addcmul_(x[:, s:], w[-1 - s])"),
    ("conv backward: the input's gradient through the taps reversed",
     "dx[:, :-s].addcmul_(dc[:, s:], w[-1 - s])", "dx[:, :-s].addcmul_(dc[:, s:], w[s])"),
    ("conv backward: the taps' gradient from the first row only",
     "(dc[:, s:] * x[:, :x.size(1) - s]).sum((0, 1))",
     "(dc[:, s:] * x[:, :x.size(1) - s])[0].sum(0)"),
    ("conv backward: the taps' gradients in reverse order",
     "for s in reversed(range(len(w)))", "for s in range(len(w))"),
    ("delta solve backward: A's gradient with its diagonal",
     "(de @ u.mT).neg_().tril_(-1)", "(de @ u.mT).neg_().tril_()"),
    ("delta solve backward: e's gradient through the inverse, not its transpose",
     "de = T.mT @ du", "de = T @ du"),
    ("conv cache: the first inputs kept, not the last",
     "copy_(seen[:, L:])", "copy_(seen[:, :seen.size(1) - L])"),
    ("linear family: decode step forgets nothing", "S = S * g.exp()[..., None]", "S = S * 1.0"),
    ("linear family: no causal mask inside a chunk",
     "device=q.device).tril()", "device=q.device).tril(C)"),
    ("gated rules: no causal mask inside a chunk", ".exp() * causal if gated", ".exp() if gated"),
    ("gated rules: decays floored at e^-8",
     "(G - G.mT).tril().exp()", "(G - G.mT).tril().clamp(min=-8).exp()"),
    ("gated rules: the decay's sign flipped", "(G - G.mT).tril().exp()", "(G.mT - G).tril().exp()"),
    ("gated rules: a gate of 0 (g = -inf) summed unclamped",
     "else g.clamp(min=math.log(", "else g.clamp(min=-math.inf + 0 * ("),
    ("gated rules: a gate floored at -10⁴ (float32's G loses digits)",
     "else g.clamp(min=math.log(", "else g.clamp(min=-1e4 + 0 * math.log("),
    ("no gate: α = e, not 1, in the chunked form",
     "torch.zeros_like(beta) if g is None", "torch.ones_like(beta) if g is None"),
    ("delta rule: the solve's diagonal not unit",
     "upper=False, unitriangular=True)", "upper=False, unitriangular=False)"),
    ("delta rule: S_0's correction dropped", "u - eG * (k @ S))", "u - 0 * (k @ S))"),
    ("delta rule: no erase at decode",
     "v = beta[..., None] * (v - k @ S)", "v = beta[..., None] * v"),
    ("delta rules: no 1/sqrt(d_k) on q", "l2norm(q) * head_dim ** -0.5", "l2norm(q) * 1.0"),
    ("delta rules: q, k normed over time, not d_k",
     "(x * x).sum(-1, keepdim=True)", "(x * x).sum(-2, keepdim=True)"),
    ("retnet: gamma_h = 1 - 2^(-5+h)", "2.0 ** (-5.0 - heads)", "2.0 ** (-5.0 + heads)"),
    ("mamba2: A ~ U[0, 16]",
     "torch.empty(H).uniform_(1, 16).log()", "torch.empty(H).uniform_(0, 16).log()"),
    ("mamba2: dt_bias = dt (no inverse softplus)", "dt + torch.log(-torch.expm1(-dt))", "dt"),
    ("hybrid: pattern shifted by one layer",
     "[pattern[i % len(pattern)]", "[pattern[(i + 1) % len(pattern)]"),
    ("hybrid counts: a partial period counted from its end",
     "p[:rest].count(a)", "p[len(p) - rest:].count(a)"),
    ("hybrid: RoPE only if the first layer is softmax",
     "if config.pos_emb == 'rope' and config.softmax else 0",
     "if config.pos_emb == 'rope' and config.layouts[0] not in LINEAR_RULES else 0"),
    ("MLA: query bottleneck of width d_c",
     "r = config.q_lora_rank  #", "r = config.q_lora_rank and config.kv_lora_rank  #"),
    ("dropout on in eval (the softmax layouts' attention)",
     "return self.dropout if self.training else 0.0", "return self.dropout"),
    ("learned positions keep N(0, 1)",
     "if isinstance(module, (nn.Linear, nn.Embedding)):", "if isinstance(module, nn.Linear):"),
    ("window: slide keeps the last token only",
     "start = idx.size(1) - max(1, block_size // 2)", "start = idx.size(1) - 1"),
    ("sample: top-k keeps ties below the k-th", "logits < v[:, [-1]]", "logits < v[:, [0]]"),
    # issue #56's: each passed the whole suite until the test named with it
    ("split-KV decode: a block's last key lists the next block too",
     ".clamp(max=L) - 1\n", ".clamp(max=L)\n",
     ['test_attention.py::test_static_cache_never_reads_the_blocks_past_its_last_query']),
    ("linear: phi's exp unclamped (NaN gradients past 88)",
     "torch.exp(x.clamp(max=0)))", "torch.exp(x))",
     ['test_linear.py::test_phi_gradient_finite_for_large_inputs']),
    ("checkpoint: a weight with one NaN or inf element loads",
     "if not v.isfinite().all():", "if not v.isfinite().any():",
     [f'test_checkpoint.py::test_a_resume_from_a_broken_checkpoint_is_one_line[{kind}]'
      for kind in ('onenan', 'oneinf')]),
    ("checkpoint: an optimizer state with one negative second moment loads",
     "bool((s['exp_avg_sq'] >= 0).all())", "bool((s['exp_avg_sq'] >= 0).any())",
     ['test_checkpoint.py::test_a_crafted_optimizer_state_is_refused']),
    ("configurator: --flag=true read as False",
     "return text.lower() == 'true'", "return text == 'True'",
     ['test_configurator.py::test_a_bool_in_any_case']),
    ("conversion: the source run's dropout kept",
     "dropout=config['dropout'], block_size", "dropout=cfg.dropout, block_size",
     ['test_convert.py::test_a_conversion_drops_out_as_this_run_asks']),
    ("sample.py: the model left in train mode (its dropout on)",
     "model.eval().to(device=device", "model.to(device=device",
     ['test_sample.py::test_a_model_trained_with_dropout_samples_without_it']),
    ("MQAR: past 99%, the lr of the most steps wins",
     "0.99), -steps(lr))", "0.99), steps(lr))",
     ['test_bench.py::test_mqar_best_lr_past_99_percent_is_the_fastest']),
    ("bench generation: tokens/s of the slower run",
     "secs = {k: min(out[k][2])", "secs = {k: max(out[k][2])",
     ['test_bench.py::test_generation_reports_each_ways_faster_run']),
    ("train.py: one process's logged loss divided by gradient_accumulation_steps",
     "lossf = loss.item() * gradient_accumulation_steps", "lossf = loss.item()",
     ['test_train.py::test_the_logged_loss_is_a_micro_batchs_whatever_the_accumulation']),
    ("cosine_lr: back up to the peak past lr_decay_iters",
     "    if it > lr_decay_iters:\n        return min_lr\n", "",
     ['test_train.py::test_the_learning_rate_decays_to_min_lr_and_stays_there']),
    # issue #63's: the window bugs seen in the wild
    ("window: W + 1 keys (FlashAttention's window_size=(W, 0))",
     "((i - j < window) | (j < n_sink))", "((i - j <= window) | (j < n_sink))",
     ['test_window.py::test_the_band_is_the_convention_written_out', 'test_reference.py']),
    ("window: the sinks seen before their position",
     "(j >= 0) & (j <= i) & ((i - j < window) | (j < n_sink))",
     "(j >= 0) & ((j <= i) & (i - j < window) | (j < n_sink))",
     ['test_window.py::test_the_band_is_the_convention_written_out', 'test_cache.py']),
    ("ring: a chunk written before it attends (its first queries lose keys)",
     "keys = [torch.cat([buf, x], dim=2) for buf, x in zip(keys, xs)]  # (copies)",
     "self.write(pos, xs); keys = [torch.cat([buf, x], dim=2) for buf, x in zip(keys, xs)]",
     ['test_cache.py']),
    ("ring: a decode step's slots read as before its write",
     "k_pos = held(pos + 1, slots, W, n_sink)", "k_pos = held(pos, slots, W, n_sink)",
     ['test_cache.py']),
    ("ring: a static chunk's slots read as after its write",
     "held(pos + (L == 1), j, window, n_sink)", "held(pos + L, j, window, n_sink)",
     ['test_cache.py']),
    ("window: the cache not bounded (block_size slots)",
     "return min(T, n_sink + window) if window else T", "return T",
     ['test_window.py::test_a_windowed_cache_keeps_n_sink_plus_w_slots_whatever_the_length']),
    ("window: the global layers windowed too",
     "zip(config.layouts, config.windows)]",
     "zip(config.layouts, [max(config.windows)] * config.n_layer)]",
     ['test_reference.py::test_a_local_global_stack_windows_only_its_local_layers']),
    ("window: an endless stack re-prefilled at block_size anyway",
     "block_size = math.inf if model.config.endless else model.config.block_size",
     "block_size = model.config.block_size",
     ['test_window.py::test_generation_past_block_size']),
    ("window: a conversion to MLA spelled per layer pooled as GQA",
     "if gptconf.softmax == 'mla':", "if attn == 'mla':",
     ['test_window.py::test_a_conversion_keeps_the_windows_however_they_are_spelled']),
    # issue #64's, planted in the calculator and the config files
    ("calculator: a sliding_window read on every family (Llama's, Qwen's switched off)",
     "bool(window) and c.get('model_type') == 'mistral' and", "bool(window) and",
     ['test_bench.py::test_published_models_caches']),
    ("config file: sys.exit() a silent stop", "except SystemExit as e:", "except ValueError as e:",
     ['test_configurator.py::test_a_config_file_that_exits_or_deletes_a_name']),
]


def tests_of(mutant):
    """The tests a mutant runs against, as paths in the tree: those it names, else the model-level
    files."""
    return [os.path.join('tests', t) for t in (mutant[3] if len(mutant) > 3 else MODEL_TESTS)]


def run(tests, tree):
    """(failed, pytest's last line): whole files on 2 workers; only named tests in one process
    (a few start sooner than 2 workers do)."""
    env = {**os.environ, 'SHAKESPEARE_PATH': os.environ.get('SHAKESPEARE_PATH') or os.path.join(
        os.path.dirname(ROOT), 'shared', 'data', 'tinyshakespeare', 'input.txt')}
    workers = [] if all('::' in t for t in tests) else ['-n', '2']
    pytest = [sys.executable, '-m', 'pytest', '-q', '-x', *workers, '-p', 'no:cacheprovider']
    r = subprocess.run([*pytest, *tests], cwd=tree, capture_output=True, text=True, env=env)
    return r.returncode != 0, (r.stdout.strip().splitlines() or [''])[-1]


def main():
    sources = {}
    for name in FILES:
        with open(os.path.join(ROOT, name)) as f:
            sources[name] = f.read()
    # the working tree's files: tracked (but those deleted), and new ones git does not ignore
    ls = ['git', 'ls-files', '--cached', '--others', '--exclude-standard']
    files = subprocess.run(ls, cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    files = [path for path in files if os.path.isfile(os.path.join(ROOT, path))]
    caught = 0
    with tempfile.TemporaryDirectory() as tree:
        for path in files:
            os.makedirs(os.path.join(tree, os.path.dirname(path)), exist_ok=True)
            shutil.copy(os.path.join(ROOT, path), os.path.join(tree, path))
        names = [a for a in sys.argv[1:] if not a.startswith('-')]
        chosen = [m for m in MUTANTS if not names or any(a in m[0] for a in names)]
        # the unmutated tree first, against every test a chosen mutant runs
        failed, summary = run(list(dict.fromkeys(t for m in chosen for t in tests_of(m))), tree)
        if failed:
            sys.exit(f"error: the tests fail on the unmutated tree: {summary}")
        for mutant in chosen:
            name, old, new = mutant[:3]
            if sum(s.count(old) for s in sources.values()) != 1:
                sys.exit(f"error: mutant {name!r}: its fragment does not occur exactly once in "
                         f"{' and '.join(FILES)}")
            for path, source in sources.items():  # the mutated file, and the others restored
                with open(os.path.join(tree, path), 'w') as f:
                    f.write(source.replace(old, new))
            failed, summary = run(tests_of(mutant), tree)
            if not failed and '--all' in sys.argv:
                failed, summary = run(['tests'], tree)
            caught += failed
            print(f"{'caught  ' if failed else 'SURVIVED'} {name}: {summary}", flush=True)
    print(f"{caught} mutants caught")


if __name__ == '__main__':
    main()
