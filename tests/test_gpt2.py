"""GPT-2's weights in our GPT (run/gpt2.py, --init_from=gpt2 or a save_pretrained folder), against
Hugging Face transformers' own GPT2LMHeadModel; skipped where transformers is not installed."""
import json
import os

import numpy as np
import pytest
import torch

from conftest import TINY_TRAIN, metrics, one_line, run, train
from model import GPT
from run.checkpoint import FileError
from run.gpt2 import gpt2


def saved_gpt2(folder, activation='gelu_new', vocab=100, **sizes):
    """A random GPT-2 written by save_pretrained: (transformers' model, the folder)."""
    transformers = pytest.importorskip('transformers')
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=48, n_head=4, n_positions=64,
                                     vocab_size=vocab, activation_function=activation,
                                     bos_token_id=0, eos_token_id=0, **sizes)
    hf = transformers.GPT2LMHeadModel(config).eval()
    hf.save_pretrained(folder)
    return hf, str(folder)


@pytest.mark.parametrize('activation', ['gelu_new', 'gelu'])
def test_gpt2_from_a_folder_gives_transformers_logits(tmp_path, activation):
    hf, folder = saved_gpt2(tmp_path, activation)
    config, state, meta = gpt2(folder)
    model = GPT(config)
    model.load_state_dict(state)  # every weight, by name
    model, hf = model.double().eval(), hf.double()
    idx = torch.randint(0, 100, (3, 40))
    with torch.no_grad():
        ours, theirs = model(idx, targets=idx)[0], hf(idx).logits
    torch.testing.assert_close(ours, theirs, atol=1e-10, rtol=0)
    assert meta == {'kind': 'tiktoken', 'encoding': 'gpt2', 'vocab_size': 100}


def test_greedy_generation_with_our_cache_gives_transformers_tokens(tmp_path):
    hf, folder = saved_gpt2(tmp_path)
    config, state, _ = gpt2(folder)
    model = GPT(config).double().eval()
    model.load_state_dict(state)
    idx = torch.randint(0, 100, (2, 7))
    with torch.no_grad():
        ours = model.generate(idx, 30, temperature=0)
        theirs = hf.double().generate(idx, max_new_tokens=30, do_sample=False, min_new_tokens=30,
                                      attention_mask=torch.ones_like(idx), pad_token_id=0)
    assert torch.equal(ours, theirs)


def test_a_gpt2_folder_it_cannot_read_is_one_line(tmp_path):
    _, folder = saved_gpt2(tmp_path / 'ok')
    (tmp_path / 'no_weights').mkdir()
    config = open(os.path.join(folder, 'config.json')).read()
    (tmp_path / 'no_weights' / 'config.json').write_text(config)
    _, other = saved_gpt2(tmp_path / 'inner', n_inner=100)
    # another model's folder: transformers would load it as a GPT-2 with random weights
    transformers = pytest.importorskip('transformers')
    llama = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=4, vocab_size=100)
    transformers.LlamaForCausalLM(llama).save_pretrained(tmp_path / 'llama')
    # a config that its weights do not fill, and an untied head (ours is tied)
    _, bigger = saved_gpt2(tmp_path / 'bigger')
    config = json.load(open(os.path.join(bigger, 'config.json')))
    json.dump(dict(config, n_layer=3), open(os.path.join(bigger, 'config.json'), 'w'))
    _, untied = saved_gpt2(tmp_path / 'untied', tie_word_embeddings=False)
    for source, said in [(tmp_path / 'no_weights', 'cannot load GPT-2 from'),
                         (bigger, "is not GPT-2's weights \\(no transformer.h.2"),
                         (untied, "tie_word_embeddings=False is not GPT-2's"),
                         (other, "n_inner=100 is not GPT-2's"),
                         (tmp_path / 'llama', "is not GPT-2's weights \\(model_type 'llama'\\)")]:
        with pytest.raises(FileError, match=said) as e:
            gpt2(str(source))
        assert '\n' not in str(e.value)


def bpe_data(folder, vocab):
    """A data folder of GPT-2 token ids (random: the test reads losses, not text)."""
    os.makedirs(folder)
    rng = np.random.default_rng(0)
    rng.integers(0, vocab, 4000).astype(np.uint16).tofile(os.path.join(folder, 'train.bin'))
    rng.integers(0, vocab, 1000).astype(np.uint16).tofile(os.path.join(folder, 'val.bin'))
    json.dump({'kind': 'tiktoken', 'encoding': 'gpt2', 'vocab_size': vocab},
              open(os.path.join(folder, 'meta.json'), 'w'))
    return str(folder)


def test_train_py_fine_tunes_and_converts_gpt2(tmp_path, char_data):
    """--init_from=<save_pretrained folder>: its val loss at iteration 0 is GPT-2's own (cropped to
    the run's block_size), then it trains; --attn=mla converts it first."""
    hf, folder = saved_gpt2(tmp_path / 'gpt2', vocab=50257)
    data = bpe_data(tmp_path / 'bpe', 50257)
    args = ['--eval_iters=2', '--log_interval=1', '--eval_interval=2', '--max_iters=2',
            '--batch_size=4', '--block_size=32', f'--init_from={folder}', '--dropout=0.0']
    r = train(tmp_path / 'tuned', data, *args, base=[])
    assert 'the shape of' in r.stdout and 'n_layer=2 n_head=4 n_embd=48' in r.stdout
    ckpt = torch.load(tmp_path / 'tuned' / 'last.pt', weights_only=True)
    assert ckpt['model_args']['block_size'] == 32 and ckpt['model_args']['gelu_tanh'] is True
    assert ckpt['model']['transformer.wpe.weight'].shape == (32, 48)
    # iteration 0's val loss: random weights, ~log(50257); the exact match is the logits test's
    first = metrics(tmp_path / 'tuned')[0]['val/loss']
    assert abs(first - np.log(50257)) < 0.1
    r = train(tmp_path / 'mla', data, *args, '--attn=mla', base=[])
    assert 'to mla (d_c 48 + d_R 6) by a joint SVD' in r.stdout
    # asking for positions GPT-2 never learned
    r = run('train.py', *args, '--block_size=128', f'--data_dir={data}',
            f'--out_dir={tmp_path / "long"}')
    assert '--block_size=128 (the checkpoint has 64)' in one_line(r)
    # GPT-2 on characters
    r = run('train.py', *args, f'--data_dir={char_data}', f'--out_dir={tmp_path / "c"}')
    assert "reads GPT-2's BPE tokens: train on --dataset=shakespeare" in one_line(r)


def test_without_transformers_gpt2_is_one_line(tmp_path):
    """Where transformers is missing: train.py and sample.py say how to install it, exit 2."""
    (tmp_path / 'transformers').mkdir()
    (tmp_path / 'transformers' / '__init__.py').write_text("raise ImportError('no transformers')")
    env = {'PYTHONPATH': str(tmp_path)}
    data = bpe_data(tmp_path / 'bpe', 50257)
    for script, *args in [('sample.py', '--init_from=gpt2'),
                          ('train.py', *TINY_TRAIN, '--init_from=gpt2',
                           f'--out_dir={tmp_path / "o"}', f'--data_dir={data}')]:
        r = run(script, *args, env=env)
        assert 'pip install -r requirements-hf.txt' in one_line(r), r.stderr
    assert not (tmp_path / 'o').exists()
    r = run('sample.py', '--init_from=gpt2', '--out_dir=out')
    assert "init_from='gpt2' must be '' with an --out_dir" in one_line(r)
    r = run('sample.py', '--init_from=gpt2-xxl')  # never sent to the Hub
    assert "init_from='gpt2-xxl': give gpt2, gpt2-medium" in one_line(r)
