"""torch.compile of the training step, fullgraph=True (one graph, or an error: no silent eager
pieces), for every layout and a hybrid of each softmax kind: the same loss and gradients as eager.
train.py compiles by default on CUDA, not on a CPU unless asked, and says so. Slow: each layout
compiles for 10-40 s on 2 cores."""
import pytest
import torch

from conftest import EVERY, TINY_TRAIN, make_model, run


@pytest.mark.slow
@pytest.mark.parametrize('attn', [*EVERY, 'gated_deltanet*3+gqa'])
def test_compiled_training_step_equals_eager(attn):
    n_layer = 4 if '*3' in attn else 2
    model = make_model(attn, dtype=torch.float32, n_layer=n_layer, dropout=0.0).train()
    x, y = torch.randint(0, 40, (2, 3, 32), generator=torch.Generator().manual_seed(0))

    def step(net):
        model.zero_grad(set_to_none=True)
        loss = net(x, y)[1]
        loss.backward()
        return loss.item(), [p.grad.clone() for p in model.parameters()]
    loss, grads = step(model)
    torch._dynamo.reset()
    compiled_loss, compiled_grads = step(torch.compile(model, fullgraph=True))
    assert abs(compiled_loss - loss) < 1e-5
    for (name, _), a, b in zip(model.named_parameters(), grads, compiled_grads):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4), (name, (a - b).abs().max().item())


@pytest.mark.slow
def test_train_py_compiles_when_asked_and_says_how_long(tmp_path, char_data):
    """On a CPU the default is eager (compiling there takes minutes); --compile=True compiles the
    whole model as one graph and logs that it compiles and how long the first iteration took."""
    base = ['train.py', *TINY_TRAIN[1:], '--device=cpu', '--dtype=float32', '--max_iters=2',
            f'--data_dir={char_data}']
    eager = run(*base, f'--out_dir={tmp_path / "eager"}', timeout=None)
    assert eager.returncode == 0, eager.stderr
    assert 'compiling' not in eager.stdout and 'compiled:' not in eager.stdout
    compiled = run(*base, f'--out_dir={tmp_path / "compiled"}', '--compile=True', timeout=900)
    assert compiled.returncode == 0, compiled.stderr[-2000:]
    assert 'compiling the model (torch.compile, fullgraph)' in compiled.stdout
    assert 'compiled: the first iteration took ' in compiled.stdout


@pytest.mark.slow
@pytest.mark.parametrize('attn', ['mha', 'gqa', 'mqa', 'mla', 'gated_deltanet*3+gqa'])
def test_compiled_static_cache_equals_the_full_forward(attn):
    """The compiled decode path (a static cache, FlexAttention over its filled blocks): a prefill,
    then token by token, gives the full forward's logits."""
    model = make_model(attn, dtype=torch.float32, n_layer=4 if '*3' in attn else 2)
    idx = torch.randint(0, 40, (2, 20), generator=torch.Generator().manual_seed(1))
    torch._dynamo.reset()
    step = torch.compile(model, fullgraph=True, dynamic=False)
    with torch.no_grad():
        full = model(idx, idx)[0]
        cache = model.init_cache(2, static=True)
        steps = [step(idx[:, :8], cache=cache)[0]]
        steps += [step(idx[:, t:t + 1], cache=cache)[0] for t in range(8, 20)]
    assert (torch.cat(steps, 1) - full).abs().max() < 1e-4
