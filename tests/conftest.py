import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from model import GPT, GPTConfig, ATTN_LAYOUTS, LINEAR_RULES  # noqa: E402

if os.environ.get('PYTEST_XDIST_WORKER'):  # pytest -n 2 on 2 cores: one thread per worker and per subprocess,
    os.environ['OMP_NUM_THREADS'] = '1'    # else OpenMP threads oversubscribe the cores and spin (5-30x slower)
    torch.set_num_threads(1)
else:
    torch.set_num_threads(2)

# Tiny but complete: 2 layers, 4 query heads (GQA: 2 K/V heads), head dim 8, MLA d_c 16 / d_R 4.
TINY = dict(block_size=32, vocab_size=40, n_layer=2, n_head=4, n_embd=32, chunk_size=8)


def tiny(attn='mha', **overrides):
    """TINY's GPTConfig for attn; a stack with an MLA layer gets d_c 16 and d_R 4 (the others refuse them)."""
    mla = dict(kv_lora_rank=16, rope_head_dim=4) if 'mla' in str(attn) else {}
    return GPTConfig(**{**TINY, 'attn': attn, **mla, **overrides})


def make_model(attn, dtype=torch.float64, seed=0, **overrides):
    """A tiny model with fan-in-scaled random weights: GPT-2's 0.02 init makes attention almost
    uniform, which would let a wrong mask or scale slip through the checks."""
    torch.manual_seed(seed)
    model = GPT(tiny(attn, **overrides))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 1.0 / p.size(1) ** 0.5 if 'wte' not in name and 'wpe' not in name else 1.0)
            else:
                p.normal_(1.0 if name.endswith('weight') else 0.0, 0.1)
    return model.to(dtype).eval()


def full_logits(model, idx):
    """Logits at every position, computed without a cache (the training path)."""
    return model(idx, targets=idx)[0]


def tol(dtype):
    return dict(atol=1e-10, rtol=0) if dtype == torch.float64 else dict(atol=1e-4, rtol=0)


HYBRIDS = ('gated_deltanet+gqa', 'deltanet+mla')  # per layer: TINY's 2 layers, one linear and one softmax
EVERY = (*ATTN_LAYOUTS, *HYBRIDS)


def is_linear(attn):
    """Every layer a fixed-size state, no K/V cache."""
    return all(a in LINEAR_RULES for a in attn.split('+'))


@pytest.fixture(params=EVERY)
def attn(request):
    return request.param


def find_text(root=ROOT):
    """The tiny Shakespeare text wherever a user has it: $SHAKESPEARE_PATH, else where the README's first command
    left it (data/*/input.txt), else ../shared/data/tinyshakespeare/input.txt, else downloaded as prepare does."""
    from data.common import ENV, PrepareError, read_text
    candidates = [os.environ.get(ENV), os.path.join(root, 'data', 'shakespeare_char', 'input.txt'),
                  os.path.join(root, 'data', 'shakespeare', 'input.txt'),
                  os.path.join(root, '..', 'shared', 'data', 'tinyshakespeare', 'input.txt')]
    found = next((p for p in candidates if p and os.path.isfile(p)), None)
    if found:
        return found
    try:
        read_text(None, download_to=candidates[1])
    except PrepareError as e:
        return f"(not found: {e})"
    return candidates[1]


SHAKESPEARE = find_text()


@pytest.fixture(scope='session')
def char_data(tmp_path_factory):
    """tiny Shakespeare prepared at the char level once per test session, in a temp folder."""
    assert os.path.isfile(SHAKESPEARE), f"tests need the tiny Shakespeare text {SHAKESPEARE}"
    from data.shakespeare_char.prepare import prepare
    out = tmp_path_factory.mktemp('shakespeare_char')
    prepare(str(out), SHAKESPEARE)
    return str(out)


def pytest_configure(config):
    config.addinivalue_line('markers', "slow: a long stress test, run by `pytest -m slow tests` (CI runs it too)")


def pytest_collection_modifyitems(config, items):
    if 'slow' not in (config.getoption('markexpr') or ''):  # the default run leaves them out
        for item in items:
            if 'slow' in item.keywords:
                item.add_marker(pytest.mark.skip(reason="slow: run with pytest -m slow tests"))
