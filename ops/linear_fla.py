"""
linear.py's update (linear_step, linear_chunked) on flash-linear-attention's Triton kernels
(fla-core, optional: requirements-gpu.txt), on CUDA (and in tests/test_fla.py under Triton's
interpreter, on a CPU).

    gated_deltanet, deltanet   chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
                               (deltanet: g = 0, since fla's chunk_delta_rule refuses float32,
                               where ours runs)
    retnet, mamba2, linear     chunk_simple_gla, fused_recurrent_simple_gla ('linear': no g, on
                               our v + a channel of ones: fla's chunk_linear_attn is that call,
                               but keeps z apart and divides with eps 1e-10; this keeps our
                               normalizer)

Under torch.compile the kernels are one opaque op (Dynamo cannot trace fla's launchers) whose
backward runs fla's forward and backward again. Imports nothing of ours, and fla only on CUDA
(or under Triton's interpreter, for tests/test_fla.py): on a CPU its import prints a "Triton is
not supported" line on stderr, which would make every one-line error two.
"""
import os
from typing import Optional

import torch
from torch import Tensor

FLA = None  # delta: (the chunked kernel, the one-token kernel), where fla is installed and imported
if torch.cuda.is_available() or os.environ.get('TRITON_INTERPRET') == '1':
    try:
        from fla.ops.gated_delta_rule import (chunk_gated_delta_rule,
                                              fused_recurrent_gated_delta_rule)
        from fla.ops.simple_gla import chunk_simple_gla, fused_recurrent_simple_gla
        FLA = {False: (chunk_simple_gla, fused_recurrent_simple_gla),
               True: (chunk_gated_delta_rule, fused_recurrent_gated_delta_rule)}
    except ImportError:
        pass


def fla_runs(x):
    """fla's kernels can run on x: fla is installed and x is on CUDA (tests/test_fla.py adds
    Triton's interpreter)."""
    return FLA is not None and x.is_cuda

def linear_fla(q, k, v, g, beta, S, delta, keep_state=True):
    """linear_step / linear_chunked on fla's kernels: a chunked kernel for L tokens, a fused
    recurrent one for a decode token. fla's conventions: (B, L, nh, d); scale=1.0 (our q is
    scaled); g = log α; β after the sigmoid; the state (d_k, d_v) as ours. Under torch.compile,
    one opaque op (below)."""
    if torch.compiler.is_compiling():
        o, S = torch.ops.gpt.linear_fla(q, k, v, g, beta, S, delta, keep_state)
        return o, S if keep_state else None
    chunked, one_token = FLA[delta]
    kernel = one_token if q.size(2) == 1 and S is not None else chunked
    fla = lambda x: x.transpose(1, 2)  # (B, nh, L, .) <-> (B, L, nh, .)
    g = torch.zeros_like(beta) if delta and g is None else g  # α = 1
    knobs = ({'g': fla(g)} if g is not None else {}) | ({'beta': fla(beta)} if delta else {})
    o, S = kernel(fla(q), fla(k), fla(v), **knobs, scale=1.0, initial_state=S,
                  output_final_state=keep_state)
    return fla(o), S

@torch.library.custom_op('gpt::linear_fla', mutates_args=())
def _linear_fla_op(q: Tensor, k: Tensor, v: Tensor, g: Optional[Tensor], beta: Tensor,
                   S: Optional[Tensor], delta: bool, keep_state: bool) -> tuple[Tensor, Tensor]:
    o, S = linear_fla(q, k, v, g, beta, S, delta, keep_state)
    # an op returns tensors, in the strides of its fake
    return o.contiguous(), S if keep_state else q.new_empty(0)

@_linear_fla_op.register_fake
def _(q, k, v, g, beta, S, delta, keep_state):
    state = (*q.shape[:2], q.size(-1), v.size(-1))
    return v.new_empty(v.shape), q.new_empty(state if keep_state else 0)

@torch.library.custom_op('gpt::linear_fla_backward', mutates_args=())
def _linear_fla_backward(inputs: list[Optional[Tensor]], do: Tensor, dS: Tensor, delta: bool,
                         keep_state: bool) -> list[Tensor]:
    """The gradients of each input (an empty tensor for None), by fla's backward after its forward
    again."""
    inputs = [x if x is None else x.detach().requires_grad_() for x in inputs]
    no_keys_off = torch._C.DispatchKeySet(torch._C.DispatchKey.Undefined)
    included = torch._C._dispatch_tls_local_include_set()
    # an op runs below autograd: back on
    with torch._C._ForceDispatchKeyGuard(included, no_keys_off), torch.enable_grad():
        o, S = linear_fla(*inputs, delta, keep_state)
        given = [x for x in inputs if x is not None]
        outputs, d_outputs = ([o, S], [do, dS]) if keep_state else ([o], [do])
        grads = iter(torch.autograd.grad(outputs, given, d_outputs, allow_unused=True))
    # (β unused: no gradient)
    fill = lambda x, d: torch.zeros_like(x) if d is None else d.contiguous()
    return [do.new_empty(0) if x is None else fill(x, next(grads)) for x in inputs]

@_linear_fla_backward.register_fake
def _(inputs, do, dS, delta, keep_state):
    return [do.new_empty(0) if x is None else x.new_empty(x.shape) for x in inputs]

def _save(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:6])
    ctx.flags = inputs[6:]

def _backward(ctx, do, dS):
    grads = torch.ops.gpt.linear_fla_backward(list(ctx.saved_tensors), do, dS, *ctx.flags)
    return *[None if x is None else d for x, d in zip(ctx.saved_tensors, grads)], None, None

_linear_fla_op.register_autograd(_backward, setup_context=_save)
