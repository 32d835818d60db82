"""MHA -> GQA / MQA conversion by mean-pooling K/V heads (Ainslie et al. 2023), MHA -> MLA by a
joint SVD of the keys and values, and train.py's --init_from=<an MHA out_dir>."""
import os
import re
import shlex
from dataclasses import replace

import numpy as np
import pytest
import torch

from conftest import (SHAKESPEARE, TINY_TRAIN, full_logits, interrupted, make_model, metrics,
                      one_line, refused, run, train)
from data.shakespeare_char.prepare import prepare
from run.convert import pool_kv_heads, to_mla
from model import GPT


def convert(mha, n_kv_head):
    attn = 'mqa' if n_kv_head == 1 else 'mha' if n_kv_head == mha.config.n_head else 'gqa'
    cfg = replace(mha.config, attn=attn, n_kv_head=n_kv_head)
    model = GPT(cfg).to(torch.float64).eval()
    model.load_state_dict(pool_kv_heads(mha.state_dict(), mha.config, n_kv_head))
    return model


def to_mla_model(mha, **sizes):
    cfg = replace(mha.config, attn='mla', **sizes)
    model = GPT(cfg).to(torch.float64).eval()
    model.load_state_dict(to_mla(mha.state_dict(), mha.config, cfg))
    return model


def shared_rope_keys(mha, nope_zero):
    """The heads' keys on RoPE's kept pairs (every 2nd pair at d_R = d / 2) made equal, so their
    mean (MLA's shared k_R) is exact; nope_zero: the other pairs of q and k zero too (so that losing
    their rotation changes nothing)."""
    H, d, C = mha.config.n_head, mha.config.head_dim, mha.config.n_embd
    kept = torch.zeros(d, dtype=torch.bool)
    kept[torch.arange(0, d, 4)], kept[torch.arange(1, d, 4)] = True, True   # pairs 0, 2, 4, ...
    with torch.no_grad():
        for block in mha.transformer.h:
            w = block.attn.c_attn.weight.view(3, H, d, C)
            w[1][:, kept] = w[1][0, kept]
            if nope_zero:
                w[0][:, ~kept] = w[1][:, ~kept] = 0
    return mha


@pytest.mark.parametrize('pos_emb', ['learned', 'rope'])
def test_mha_to_mla_is_exact_where_nothing_is_truncated(pos_emb):
    """At full rank (d_c = 2 n_embd) with the heads' rope keys shared, the MLA gives the MHA's
    logits but for the latent's RMSNorm (a per-token scale, bypassed here): learned positions with
    every pair, RoPE where only the kept pairs carry q and k (their frequencies must be MLA's)."""
    mha = shared_rope_keys(make_model('mha', pos_emb=pos_emb), nope_zero=pos_emb == 'rope')
    mla = to_mla_model(mha, kv_lora_rank=64, rope_head_dim=4)
    for block in mla.transformer.h:
        block.attn.kv_norm = torch.nn.Identity()
    idx = torch.randint(0, 40, (2, 20))
    torch.testing.assert_close(full_logits(mla, idx), full_logits(mha, idx), atol=1e-10, rtol=0)


def test_mha_to_mla_with_every_pair_rotated():
    """d_R = head_dim: every key through the shared k_R, none through the latent."""
    mha = make_model('mha')
    mla = to_mla_model(mha, kv_lora_rank=16, rope_head_dim=8)
    assert mla.transformer.h[0].attn.k_up.weight.abs().max() == 0
    assert torch.isfinite(full_logits(mla, torch.randint(0, 40, (1, 10)))).all()


def test_mha_to_mla_weights():
    """Biases: V's folded into c_proj's, q's reordered and scaled; the latent's gain is about the
    RMS of the latent of ln_1's outputs."""
    mha = make_model('mha', bias=True, pos_emb='learned')
    with torch.no_grad():  # ln_1's gain, which the latent's RMS follows
        mha.transformer.h[0].ln_1.weight.mul_(3)
    mla = to_mla_model(mha, kv_lora_rank=16, rope_head_dim=4)
    H, d, C, dR = 4, 8, 32, 4
    x = torch.randn(500, C, dtype=torch.float64)
    for src, dst in zip(mha.transformer.h, mla.transformer.h):
        q, k, v = src.attn.c_attn(x).view(500, 3, H, d).unbind(1)
        ours = dst.attn.c_q(x).view(500, H, d + dR) / ((d + dR) / d) ** 0.5
        kept = [0, 1, 4, 5]
        torch.testing.assert_close(ours[..., d:], q[..., kept])
        torch.testing.assert_close(ours[..., :d - dR], q[..., [2, 3, 6, 7]])
        assert ours[..., d - dR:d].abs().max() == 0
        latent = dst.attn.kv_down(x)
        torch.testing.assert_close(latent[:, 16:], k[..., kept].mean(1))
        # a constant V bias leaves the attention's output + c_proj's bias unchanged
        torch.testing.assert_close(dst.attn.c_proj.bias, src.attn.c_proj.bias
                                   + src.attn.c_proj.weight @ src.attn.c_attn.bias.view(3, -1)[2])
        gain = dst.attn.kv_norm.weight
        assert torch.all(gain == gain[0])
        x_ln = src.ln_1(torch.randn(500, C, dtype=torch.float64))
        rms = dst.attn.kv_down(x_ln)[:, :16].square().mean(1).sqrt()
        assert 0.8 < gain[0] / rms.mean() < 1.25


@pytest.mark.parametrize('bias', [False, True])
def test_same_head_count_is_exact(bias):
    mha = make_model('mha', bias=bias)
    idx = torch.randint(0, 40, (2, 20))
    assert torch.equal(full_logits(convert(mha, 4), idx), full_logits(mha, idx))


@pytest.mark.parametrize('n_kv_head', [2, 1])
def test_group_means_and_hand_averaged_reference(n_kv_head):
    mha = make_model('mha', bias=True)
    model = convert(mha, n_kv_head)
    H, hd, C, G = 4, 8, 32, 4 // n_kv_head
    for src, dst in zip(mha.transformer.h, model.transformer.h):
        for part in ('weight', 'bias'):
            w, c = getattr(src.attn.c_attn, part), getattr(dst.attn.c_attn, part)
            for i, off in ((1, C), (2, C + n_kv_head * hd)):  # k, then v
                heads = w[i * C:(i + 1) * C].view(H, hd, *w.shape[1:])
                for g in range(n_kv_head):
                    group = heads[g * G:(g + 1) * G].mean(0)
                    torch.testing.assert_close(c[off + g * hd:off + (g + 1) * hd], group)
    # reference by hand: the MHA model with every head's K/V replaced by its group's mean, run as
    # MHA
    ref = make_model('mha', bias=True)
    with torch.no_grad():
        for blk in ref.transformer.h:
            for p in (blk.attn.c_attn.weight, blk.attn.c_attn.bias):
                for i in (1, 2):
                    heads = p[i * C:(i + 1) * C].view(H, hd, *p.shape[1:])
                    heads.copy_(heads.view(n_kv_head, G, hd, *p.shape[1:]).mean(1, keepdim=True)
                                .expand(-1, G, *heads.shape[1:]).reshape(heads.shape))
    idx = torch.randint(0, 40, (2, 20))
    torch.testing.assert_close(full_logits(model, idx), full_logits(ref, idx), atol=1e-10, rtol=0)
    # it did change
    assert not torch.allclose(full_logits(model, idx), full_logits(mha, idx), atol=1e-3)


@pytest.mark.parametrize('attn', ['mla', 'linear', 'gqa'])
def test_other_layouts_are_refused(attn):
    model = make_model(attn)
    said = f"mean-pools the K/V heads of an 'mha' checkpoint; this one is '{attn}'"
    with pytest.raises(ValueError, match=said):
        pool_kv_heads(model.state_dict(), model.config, 1)


def test_train_py_converts_an_mha_checkpoint(tmp_path, char_data):
    train(tmp_path / 'mha', char_data, '--max_iters=10', '--eval_interval=5')
    r = train(tmp_path / 'gqa', char_data, '--attn=gqa', '--n_kv_head=2',
              f'--init_from={tmp_path / "mha"}', '--max_iters=4', '--eval_interval=2',
              '--match_mha_params=True', '--wandb_log=True', '--wandb_mode=disabled')
    assert 'to gqa with 2 K/V heads by mean-pooling' in r.stdout
    # its own run
    assert re.search(r"W&B run gqa-from-mha-\d{8}-\d{6} \(disabled\)", r.stdout), r.stdout
    ckpt = torch.load(tmp_path / 'gqa' / 'ckpt.pt', weights_only=True)
    assert ckpt['model_args']['attn'] == 'gqa' and ckpt['model_args']['n_kv_head'] == 2
    assert ckpt['model_args']['match_mha_params'] is False  # the MHA checkpoint's MLP is kept
    # starts from the trained model, not scratch
    first = metrics(tmp_path / 'gqa')[0]['val/loss']
    assert first < metrics(tmp_path / 'mha')[0]['val/loss'] - 0.3
    convert_to = lambda *args: run('train.py', *TINY_TRAIN, f'--init_from={tmp_path / "mha"}',
                                   f'--out_dir={tmp_path / "x"}', *args, timeout=None)
    bad = run('train.py', *TINY_TRAIN, '--attn=gqa', f'--init_from={tmp_path / "gqa"}',
              f'--out_dir={tmp_path / "x"}', f'--data_dir={char_data}', timeout=None)
    assert bad.returncode == 2 and "this one is 'gqa'" in bad.stderr
    assert 'Traceback' not in bad.stderr
    text = open(SHAKESPEARE).read()
    (tmp_path / 'lower.txt').write_text(text[:20_000].lower())  # fewer characters
    prepare(str(tmp_path / 'lower'), str(tmp_path / 'lower.txt'))
    (tmp_path / 'greek.txt').write_text(text.replace('Z', 'Ω'))  # as many, not the same
    prepare(str(tmp_path / 'greek'), str(tmp_path / 'greek.txt'))
    greek = f'--data_dir={tmp_path / "greek"}'
    for args, said in (
            ([f'--data_dir={char_data}', '--attn=linear'],
             "attn must be mha, gqa, mqa or mla, not 'linear'"),
            # a hybrid target
            ([f'--data_dir={char_data}', '--attn=deltanet+gqa'], "not 'deltanet+gqa'"),
            ([f'--data_dir={tmp_path / "lower"}', '--attn=gqa'],
             "needs its vocabulary: it has 65 tokens"),
            ([greek, '--attn=gqa'], "the data in " + str(tmp_path / 'greek')),
            ([greek, '--init_from=resume', f'--out_dir={tmp_path / "mha"}'],
             "was trained on another vocabulary (65 tokens)")):
        bad = convert_to(*args)
        assert bad.returncode == 2 and said in bad.stderr, bad.stderr
        assert len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    before = (tmp_path / 'mha' / 'ckpt.pt').read_bytes()
    same = run('train.py', *TINY_TRAIN, '--attn=mqa', f'--init_from={tmp_path / "mha"}',
               f'--out_dir={tmp_path / "mha" / "."}', f'--data_dir={char_data}', timeout=None)
    said = 'holds the checkpoint being converted'
    assert same.returncode == 2 and said in same.stderr, same.stderr
    assert len(same.stderr.strip().splitlines()) == 1
    assert (tmp_path / 'mha' / 'ckpt.pt').read_bytes() == before


def test_a_conversion_drops_out_as_this_run_asks(tmp_path, trained, char_data):
    """Dropout is this run's to choose, as the layout is: never the source run's."""
    source = torch.load(trained / 'ckpt.pt', weights_only=True)['model_args']['dropout']
    asked = source + 0.1
    train(tmp_path, char_data, '--attn=gqa', '--n_kv_head=2', f'--init_from={trained}',
          f'--dropout={asked}', '--max_iters=1', '--eval_interval=1',
          '--always_save_checkpoint=True')
    assert torch.load(tmp_path / 'ckpt.pt', weights_only=True)['model_args']['dropout'] == asked


def test_a_conversion_source_missing_a_weight_or_longer_than_the_data_is_one_line(
        tmp_path, trained, char_data):
    """A conversion source with a weight missing, or a block_size longer than the data, is one
    line."""
    state = torch.load(trained / 'ckpt.pt', weights_only=True)
    (tmp_path / 'missing').mkdir()
    kept = {k: v for k, v in state['model'].items() if 'h.1.mlp.c_fc' not in k}
    torch.save({**state, 'model': kept}, tmp_path / 'missing' / 'ckpt.pt')
    err = refused(tmp_path / 'x', char_data, '--attn=gqa', f'--init_from={tmp_path / "missing"}',
                  '--max_iters=2')
    assert 'cannot convert' in err and 'Missing key' in err
    assert not (tmp_path / 'x' / 'ckpt.pt').exists()
    long_run = ['config/cpu.py', '--n_layer=1', '--n_head=2', '--n_embd=16', '--batch_size=2',
                '--eval_iters=1']
    train(tmp_path / 'long', char_data, '--max_iters=1', '--eval_interval=1', '--block_size=300',
          base=long_run)
    # the same vocabulary, a val.bin of 280 tokens: enough for cpu.py's 64, not 300
    short = tmp_path / 'short'
    short.mkdir()
    (short / 'meta.json').write_bytes(open(os.path.join(char_data, 'meta.json'), 'rb').read())
    (np.arange(2000) % 65).astype(np.uint16).tofile(short / 'train.bin')
    (np.arange(280) % 65).astype(np.uint16).tofile(short / 'val.bin')
    # (cpu.py's block_size=64 would crop the source to 64: asked for whole)
    r = run('train.py', *long_run, '--attn=gqa', f'--init_from={tmp_path / "long"}',
            '--block_size=300', f'--out_dir={tmp_path / "y"}', f'--data_dir={short}',
            '--max_iters=2')
    assert 'val.bin has 280 tokens, not more than block_size=300' in one_line(r)


def test_a_cpu_preset_conversion_takes_the_source_shape_and_resumes_as_printed(tmp_path, char_data):
    """`python train.py config/gqa.py --init_from=<CPU-preset MHA out_dir>` (the README's line): the
    model's shape and block_size come from the checkpoint; a flag asking for another shape is one
    line; the command printed at Ctrl-C carries the shape and works as printed."""
    mha = tmp_path / 'mha'
    # 4 layers, 128 wide, block 64
    train(mha, char_data, '--max_iters=1', '--eval_interval=1',
          base=['config/mha.py', 'config/cpu.py', '--eval_iters=2'])
    quick = ['config/gqa.py', '--device=cpu', '--batch_size=4', '--eval_iters=2',
             '--log_interval=5']
    into = [f'--init_from={mha}', f'--out_dir={tmp_path / "x"}', f'--data_dir={char_data}']
    bad = run('train.py', *quick, '--n_layer=3', *into, timeout=None)
    said = f"error: converting {mha} keeps its shape: drop --n_layer=3 (the checkpoint has 4)"
    assert bad.returncode == 2 and bad.stderr.strip() == said
    # a config file's value, even the one already in effect (6, the default), after a flag: named
    # as the file's
    (tmp_path / 'shape.py').write_text('n_layer = 6\n')
    bad = run('train.py', *quick, '--n_layer=2', str(tmp_path / 'shape.py'), *into, timeout=None)
    said = f"drop n_layer=6 of {tmp_path / 'shape.py'} (the checkpoint has 4)"
    assert bad.stderr.strip().endswith(said), bad.stderr
    out, err = interrupted(tmp_path / 'gqa', char_data, f'--init_from={mha}',
                           '--eval_interval=1000', base=quick)
    said = r"^the shape of .*mha: block_size=64 n_layer=4 n_head=4 n_embd=128 "
    assert re.search(said, out, re.M), out
    assert "tokens per iteration will be: 256\n" in out  # 4 x 64: the checkpoint's block_size
    command = shlex.split(re.search(r"continue with:\n  (.*)", err)[1])
    shape = {'--block_size=64', '--n_layer=4', '--match_mha_params=False', '--init_from=resume'}
    assert shape <= set(command)
    it = torch.load(tmp_path / 'gqa' / 'last.pt', weights_only=True)['iter_num']
    r = run(*command[1:], f'--max_iters={it + 1}')
    assert r.returncode == 0 and f"at iteration {it}" in r.stdout, r.stderr


def test_k_v_heads_are_checked_against_the_sources_heads(tmp_path, char_data):
    """--n_kv_head=4 is a GQA of an 8-head source, whatever n_head the flags left at its default
    (6 allows 2, 3): the converted model's heads are the checkpoint's, and so is the check."""
    train(tmp_path / 'mha8', char_data, '--n_head=8', '--max_iters=1', '--eval_interval=1')
    into = [f'--init_from={tmp_path / "mha8"}', f'--data_dir={char_data}']
    r = run('train.py', '--device=cpu', '--batch_size=4', '--eval_iters=2', '--attn=gqa',
            '--n_kv_head=4', '--max_iters=1', *into, f'--out_dir={tmp_path / "gqa"}', timeout=300)
    assert r.returncode == 0 and 'to gqa with 4 K/V heads by mean-pooling' in r.stdout, r.stderr
    bad = run('train.py', '--device=cpu', '--attn=gqa', '--n_kv_head=3', *into,
              f'--out_dir={tmp_path / "x"}', timeout=300)
    assert bad.returncode == 2 and "n_head=8 allows [2, 4]" in bad.stderr, bad.stderr
    assert len(bad.stderr.splitlines()) == 1, bad.stderr
