"""MHA -> GQA / MQA conversion by mean-pooling K/V heads (Ainslie et al. 2023)."""
import re
from dataclasses import replace

import pytest
import torch

from conftest import make_model, full_logits
from run.convert import pool_kv_heads
from model import GPT


def convert(mha, n_kv_head):
    attn = 'mqa' if n_kv_head == 1 else 'mha' if n_kv_head == mha.config.n_head else 'gqa'
    cfg = replace(mha.config, attn=attn, n_kv_head=n_kv_head)
    model = GPT(cfg).to(torch.float64).eval()
    model.load_state_dict(pool_kv_heads(mha.state_dict(), mha.config, n_kv_head))
    return model


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
                    torch.testing.assert_close(c[off + g * hd:off + (g + 1) * hd], heads[g * G:(g + 1) * G].mean(0))
    # reference by hand: the MHA model with every head's K/V replaced by its group's mean, run as MHA
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
    assert not torch.allclose(full_logits(model, idx), full_logits(mha, idx), atol=1e-3)  # it did change


@pytest.mark.parametrize('attn', ['mla', 'linear', 'gqa'])
def test_other_layouts_are_refused(attn):
    model = make_model(attn)
    with pytest.raises(ValueError, match=f"mean-pools the K/V heads of an 'mha' checkpoint; this one is '{attn}'"):
        pool_kv_heads(model.state_dict(), model.config, 1)


def test_train_py_converts_an_mha_checkpoint(tmp_path, char_data):
    from test_train import train, metrics
    train(tmp_path / 'mha', char_data, '--max_iters=10', '--eval_interval=5')
    r = train(tmp_path / 'gqa', char_data, '--attn=gqa', '--n_kv_head=2', f'--init_from={tmp_path / "mha"}',
              '--max_iters=4', '--eval_interval=2', '--match_mha_params=True', '--wandb_log=True',
              '--wandb_mode=disabled')
    assert 'to gqa with 2 K/V heads by mean-pooling' in r.stdout
    assert re.search(r"W&B run gqa-from-mha-\d{8}-\d{6} \(disabled\)", r.stdout), r.stdout  # its own run
    ckpt = torch.load(tmp_path / 'gqa' / 'ckpt.pt', weights_only=True)
    assert ckpt['model_args']['attn'] == 'gqa' and ckpt['model_args']['n_kv_head'] == 2
    assert ckpt['model_args']['match_mha_params'] is False  # the MHA checkpoint's MLP is kept
    first = metrics(tmp_path / 'gqa')[0]['val/loss']
    assert first < metrics(tmp_path / 'mha')[0]['val/loss'] - 0.3  # starts from the trained model, not scratch
    import subprocess, sys
    from conftest import ROOT
    from test_train import TINY
    bad = subprocess.run([sys.executable, 'train.py', *TINY, '--attn=gqa', f'--init_from={tmp_path / "gqa"}',
                          f'--out_dir={tmp_path / "x"}', f'--data_dir={char_data}'], cwd=ROOT,
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "this one is 'gqa'" in bad.stderr and 'Traceback' not in bad.stderr
    from conftest import SHAKESPEARE
    from data.shakespeare_char.prepare import prepare
    (tmp_path / 'lower.txt').write_text(open(SHAKESPEARE).read()[:20_000].lower())  # fewer characters
    prepare(str(tmp_path / 'lower'), str(tmp_path / 'lower.txt'))
    (tmp_path / 'greek.txt').write_text(open(SHAKESPEARE).read().replace('Z', 'Ω'))  # as many, not the same
    prepare(str(tmp_path / 'greek'), str(tmp_path / 'greek.txt'))
    for args, said in (([f'--data_dir={char_data}', '--attn=mla'], "attn must be mha, gqa or mqa, not 'mla'"),
                       ([f'--data_dir={char_data}', '--attn=deltanet+gqa'], "not 'deltanet+gqa'"),  # a hybrid target
                       ([f'--data_dir={tmp_path / "lower"}', '--attn=gqa'], "needs its vocabulary: it has 65 tokens"),
                       ([f'--data_dir={tmp_path / "greek"}', '--attn=gqa'], "the data in " + str(tmp_path / 'greek')),
                       ([f'--data_dir={tmp_path / "greek"}', '--init_from=resume', f'--out_dir={tmp_path / "mha"}'],
                        "was trained on another vocabulary (65 tokens)")):
        bad = subprocess.run([sys.executable, 'train.py', *TINY, f'--init_from={tmp_path / "mha"}',
                              f'--out_dir={tmp_path / "x"}', *args], cwd=ROOT, capture_output=True, text=True)
        assert bad.returncode == 2 and said in bad.stderr and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    before = (tmp_path / 'mha' / 'ckpt.pt').read_bytes()
    same = subprocess.run([sys.executable, 'train.py', *TINY, '--attn=mqa', f'--init_from={tmp_path / "mha"}',
                           f'--out_dir={tmp_path / "mha" / "."}', f'--data_dir={char_data}'], cwd=ROOT,
                          capture_output=True, text=True)
    assert same.returncode == 2 and 'holds the checkpoint being converted' in same.stderr, same.stderr
    assert len(same.stderr.strip().splitlines()) == 1 and (tmp_path / 'mha' / 'ckpt.pt').read_bytes() == before


def test_a_cpu_preset_conversion_takes_the_source_shape_and_resumes_as_printed(tmp_path, char_data):
    """`python train.py config/gqa.py --init_from=<CPU-preset MHA out_dir>` (the README's line): the model's shape
    and block_size come from the checkpoint; a flag asking for another shape is one line; the command printed at
    Ctrl-C carries the shape and works as printed."""
    import shlex, subprocess, sys
    from conftest import ROOT
    from test_train import train, interrupted
    train(tmp_path / 'mha', char_data, '--max_iters=1', '--eval_interval=1', launcher=(sys.executable,),
          base=['config/mha.py', 'config/cpu.py', '--eval_iters=2'])  # 4 layers, 128 wide, block 64
    quick = ['config/gqa.py', '--device=cpu', '--batch_size=4', '--eval_iters=2', '--log_interval=5']
    bad = subprocess.run([sys.executable, 'train.py', *quick, '--n_layer=3', f'--init_from={tmp_path / "mha"}',
                          f'--out_dir={tmp_path / "x"}', f'--data_dir={char_data}'], cwd=ROOT, capture_output=True,
                         text=True)
    assert bad.returncode == 2 and bad.stderr.strip() == \
        f"error: converting {tmp_path / 'mha'} keeps its shape: drop --n_layer=3 (the checkpoint has 4)"
    # a config file's value, even the one already in effect (6, the default), after a flag: named as the file's
    (tmp_path / 'shape.py').write_text('n_layer = 6\n')
    bad = subprocess.run([sys.executable, 'train.py', *quick, '--n_layer=2', str(tmp_path / 'shape.py'),
                          f'--init_from={tmp_path / "mha"}', f'--out_dir={tmp_path / "x"}', f'--data_dir={char_data}'],
                         cwd=ROOT, capture_output=True, text=True)
    assert bad.stderr.strip().endswith(f"drop n_layer=6 of {tmp_path / 'shape.py'} (the checkpoint has 4)"), bad.stderr
    out, err = interrupted(tmp_path / 'gqa', char_data, f'--init_from={tmp_path / "mha"}', '--eval_interval=1000', base=quick)
    assert re.search(r"^the shape of .*mha: block_size=64 n_layer=4 n_head=4 n_embd=128 ", out, re.M), out
    assert "tokens per iteration will be: 256\n" in out  # 4 x 64: the checkpoint's block_size
    command = shlex.split(re.search(r"continue with:\n  (.*)", err).group(1))
    assert {'--block_size=64', '--n_layer=4', '--match_mha_params=False', '--init_from=resume'} <= set(command)
    it = torch.load(tmp_path / 'gqa' / 'last.pt', weights_only=True)['iter_num']
    r = subprocess.run([sys.executable, *command[1:], f'--max_iters={it + 1}'], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and f"at iteration {it}" in r.stdout, r.stderr


def test_k_v_heads_are_checked_against_the_sources_heads(tmp_path, char_data):
    """--n_kv_head=4 is a GQA of an 8-head source, whatever n_head the flags left at its default (6 allows 2, 3):
    the converted model's heads are the checkpoint's, and so is the check."""
    import subprocess, sys
    from conftest import ROOT
    from test_train import train
    train(tmp_path / 'mha8', char_data, '--n_head=8', '--max_iters=1', '--eval_interval=1')
    r = subprocess.run([sys.executable, 'train.py', '--device=cpu', '--batch_size=4', '--eval_iters=2', '--attn=gqa',
                        '--n_kv_head=4', '--max_iters=1', f'--init_from={tmp_path / "mha8"}',
                        f'--out_dir={tmp_path / "gqa"}', f'--data_dir={char_data}'], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0 and 'to gqa with 4 K/V heads by mean-pooling' in r.stdout, r.stderr
    bad = subprocess.run([sys.executable, 'train.py', '--device=cpu', '--attn=gqa', '--n_kv_head=3',
                          f'--init_from={tmp_path / "mha8"}', f'--out_dir={tmp_path / "x"}', f'--data_dir={char_data}'],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "n_head=8 allows [2, 4]" in bad.stderr and len(bad.stderr.splitlines()) == 1, bad.stderr
