"""fla's Triton kernels (requirements-gpu.txt) against ours: each rule's chunked and one-token
kernels, forward and backward, the model's switch, and the compiled op. Where fla is installed: on
CUDA, and on a CPU under Triton's interpreter (slow, small shapes), which must be on before fla is
imported:

    TRITON_INTERPRET=1 python -m pytest tests/test_fla.py -m 'slow or not slow'

Skipped where fla is not installed, as in CI, and on a CPU without the interpreter."""
import builtins
import os
import sys

import pytest
import torch

from conftest import LINEAR_RULES, make_model
from ops.linear import linear_chunked, linear_step
from ops.linear_fla import linear_fla

pytest.importorskip('fla')
DEVICE = 'cuda' if torch.cuda.is_available() else 'cpu'
if DEVICE == 'cpu' and os.environ.get('TRITON_INTERPRET') != '1':
    pytest.skip("no CUDA: run with TRITON_INTERPRET=1 (Triton's interpreter)",
                allow_module_level=True)


@pytest.fixture(autouse=True)
def triton_runs(monkeypatch):
    """On a CPU, Triton's interpreter, with two things it lacks: no driver to autotune with (keep
    the first config), and no tensor loop index from a Python range() in a kernel (fla calls .to()
    on it)."""
    if DEVICE == 'cuda':
        return
    # (the scripts run fla on CUDA only)
    for where in ('ops.linear_fla', 'model', 'benchmarks.gpu'):
        monkeypatch.setattr(f'{where}.fla_runs', lambda x: True)
    import triton.language as tl
    import triton.runtime.autotuner as autotuner
    prune = autotuner.Autotuner.prune_configs
    monkeypatch.setattr(autotuner.Autotuner, 'prune_configs',
                        lambda self, kwargs: prune(self, kwargs)[:1])

    def tensor_range(*args):
        bounds = [int(a.handle.data.item()) if hasattr(a, 'handle') else int(a) for a in args]
        for i in builtins.range(*bounds):
            yield tl.full((), i, tl.int32)
    for name in [n for n in sys.modules if n.startswith('fla.ops')]:
        monkeypatch.setattr(sys.modules[name], 'range', tensor_range, raising=False)


def inputs(layout, B=2, H=2, L=21, d=16, seed=0):
    """q, k, v, g, beta (B, nh, L, .) as LinearAttention makes them, with a gradient; 'linear' gets
    phi's positive q, k and v's extra channel of ones."""
    gen = torch.Generator().manual_seed(seed)
    forget, delta = LINEAR_RULES[layout]
    rand = lambda *s: torch.randn(*s, generator=gen)
    q, k = rand(B, H, L, d), rand(B, H, L, d)
    if layout == 'linear':
        q, k, v = (q.sigmoid(), k.sigmoid(),
                   torch.cat([rand(B, H, L, d), torch.ones(B, H, L, 1)], -1))
    else:
        q, k, v = (torch.nn.functional.normalize(q, dim=-1) * d ** -0.5,
                   torch.nn.functional.normalize(k, dim=-1),
                   rand(B, H, L, d))
    g = -torch.rand(B, H, L, generator=gen) * 2 if forget else None
    beta = torch.rand(B, H, L, generator=gen) if delta else torch.ones(B, H, L)
    return [x if x is None else x.to(DEVICE).requires_grad_() for x in (q, k, v, g, beta)]


def grads(out, xs):
    loss = sum((o * torch.randn(o.shape, generator=torch.Generator().manual_seed(1)).to(o.device))
               .sum() for o in out)
    # β: the delta rule's
    return torch.autograd.grad(loss, [x for x in xs if x is not None], allow_unused=True)


@pytest.mark.parametrize('layout', list(LINEAR_RULES))
def test_fla_kernels_equal_ours_forward_and_backward(layout):
    """Training (no state in, none out), and a prefill from a state that keeps the last: output,
    state, gradients."""
    q, k, v, g, beta = xs = inputs(layout)
    delta = LINEAR_RULES[layout][1]
    ours, _ = linear_chunked(q, k, v, g, beta, None, delta, 8, keep_state=False)
    theirs, none = linear_fla(q, k, v, g, beta, None, delta, keep_state=False)
    assert none is None and (ours - theirs).abs().max() < 1e-4
    for a, b in zip(grads([ours], xs), grads([theirs], xs)):
        assert (a is None) == (b is None) and (
            a is None or (a - b).abs().max() < 1e-4 * (1 + a.abs().max()))
    S0 = torch.randn(2, 2, 16, v.size(-1),
                     generator=torch.Generator().manual_seed(2)).to(DEVICE) * 0.3
    (ours, S), (theirs, S_fla) = (f(q, k, v, g, beta, S0, delta, 8, True) if f is linear_chunked
                                  else f(q, k, v, g, beta, S0, delta, True)
                                  for f in (linear_chunked, linear_fla))
    assert (ours - theirs).abs().max() < 1e-4 and (S - S_fla).abs().max() < 1e-4


@pytest.mark.parametrize('layout', list(LINEAR_RULES))
def test_fla_one_token_kernel_equals_linear_step(layout):
    q, k, v, g, beta = (x if x is None else x.detach()[:, :, :1]
                        for x in inputs(layout, seed=3))
    S = torch.randn(2, 2, 16, v.size(-1),
                    generator=torch.Generator().manual_seed(4)).to(DEVICE) * 0.3
    (o, S1), (o_fla, S1_fla) = (linear_step(q, k, v, g, beta, S, LINEAR_RULES[layout][1]),
                                linear_fla(q, k, v, g, beta, S, LINEAR_RULES[layout][1]))
    assert (o - o_fla).abs().max() < 1e-5 and (S1 - S1_fla).abs().max() < 1e-5


def test_model_switch_and_cache(monkeypatch):
    """A hybrid with every linear rule: linear_kernels='fla' runs fla (its kernels are called) and
    equals 'torch', full forward and token by token through the cache; where fla cannot run,
    ours."""
    attn = 'linear+retnet+mamba2+deltanet+gated_deltanet+mha'
    ours, theirs = (make_model(attn, torch.float32, n_layer=6, linear_kernels=kind).to(DEVICE)
                    for kind in ('torch', 'fla'))
    idx = torch.randint(0, 40, (2, 19), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    calls = []
    monkeypatch.setattr('model.linear_fla', lambda *a: calls.append(1) or linear_fla(*a))
    with torch.no_grad():
        full = ours(idx, idx)[0]
        assert (theirs(idx, idx)[0] - full).abs().max() < 1e-4 and len(calls) == 5
        cache = theirs.init_cache(2)
        steps = torch.cat([theirs(idx[:, :7], cache=cache)[0]]
                          + [theirs(idx[:, t:t + 1], cache=cache)[0] for t in range(7, 19)], 1)
        assert (steps - full).abs().max() < 1e-4 and len(calls) == 5 + 5 * 13
        monkeypatch.setattr('model.fla_runs', lambda x: False)
        assert (theirs(idx, idx)[0] - full).abs().max() < 1e-5 and len(calls) == 70


@pytest.mark.slow
def test_compiled_training_step_on_fla_equals_eager_ours():
    """torch.compile(fullgraph=True) over fla's kernels (one opaque op, its backward by fla): loss
    and gradients."""
    attn = 'gated_deltanet+deltanet+retnet+linear'
    ours, theirs = (make_model(attn, torch.float32, n_layer=4, linear_kernels=kind)
                    .to(DEVICE).train() for kind in ('torch', 'fla'))
    x, y = torch.randint(0, 40, (2, 2, 24), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    loss = ours(x, y)[1]
    loss.backward()
    compiled_loss = torch.compile(theirs, fullgraph=True)(x, y)[1]
    compiled_loss.backward()
    assert abs(compiled_loss.item() - loss.item()) < 1e-5
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
        assert (a.grad - b.grad).abs().max() < 1e-4 * (1 + a.grad.abs().max()), name


def test_bench_times_fla_against_ours():
    """bench.py gpu's section: a row per linear layout (none for softmax ones), with a difference
    that is small."""
    from benchmarks.gpu import fla_vs_ours
    report = fla_vs_ours(['mha', *LINEAR_RULES], dict(n_head=2, n_embd=32), 2, DEVICE,
                         T=20, rounds=1)
    rows = [r for r in report.splitlines() if r.startswith('| ') and 'layout' not in r]
    assert [r.split(' | ')[0][2:] for r in rows] == list(LINEAR_RULES)
    assert all(float(r.split(' | ')[-1].rstrip(' |')) < 1e-3 for r in rows), report
