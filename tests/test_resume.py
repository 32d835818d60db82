"""--init_from=resume: it continues bit-exactly (DDP too) from the later of ckpt.pt and last.pt,
with the settings it is given (the optimizer's too, never a file's), names every change, and
refuses another model in one line; an interrupt saves where to continue from."""
import json
import re
import shlex
import shutil
import signal

import pytest
import torch

from conftest import (DDP, digest, interrupted, losses, metrics, one_line, refused, resume, run,
                      same_weights, train, TINY_TRAIN)


@pytest.mark.parametrize('half, args, launcher', [
    (20, ['--eval_interval=10'], ()),
    pytest.param(4, ['--attn=gqa', '--eval_interval=4', '--gradient_accumulation_steps=2',
                     '--log_interval=1'], DDP, marks=pytest.mark.slow, id='ddp'),
], ids=['one process', 'ddp'])
def test_a_resume_is_bit_exact(tmp_path, char_data, half, args, launcher):
    """2 * half iterations in one go == half, stop, resume, half more: the same weights and the
    same logged losses, once each (DDP: 2 CPU processes, both ranks ending equal)."""
    args = [*args, '--always_save_checkpoint=True', '--dropout=0.1']  # dropout draws RNG
    straight, split = tmp_path / 'straight', tmp_path / 'split'
    train(straight, char_data, f'--max_iters={2 * half}', *args, launcher=launcher)
    train(split, char_data, f'--max_iters={half}', *args, launcher=launcher)
    assert torch.load(split / 'ckpt.pt', weights_only=True)['iter_num'] == half
    first = metrics(split)
    r = train(split, char_data, f'--max_iters={2 * half}', '--init_from=resume', *args,
              launcher=launcher)
    assert f'step {half}:' in r.stdout and 'step 0:' not in r.stdout
    said = f"resuming from {split / 'ckpt.pt'} at iteration {half}; " \
           f"changed: max_iters {half} -> {2 * half}\n"
    assert said in r.stdout
    # the eval row at `half` is dropped on resume, then logged again
    resumed = metrics(split)[len(first) - 1:]
    assert resumed[0]['iter'] == half and resumed[-1]['iter'] == 2 * half
    assert losses(split) == losses(straight)  # one log, as if never stopped: no row twice
    a, b = (torch.load(d / 'ckpt.pt', weights_only=True) for d in (straight, split))
    assert same_weights(a, b) and a['iter_num'] == 2 * half
    if launcher:
        digests = dict(re.findall(r"rank (\d): weights sha256 ([0-9a-f]{16})", r.stdout))
        assert set(digests) == {'0', '1'} and digests['0'] == digests['1'], r.stdout


def test_resume_may_change_the_chunk_size(tmp_path, char_data):
    """chunk_size and linear_kernels are how a linear layout computes, not what it learns: a resume
    may change them, and the spelling of the stack ('gated_deltanet*1' is 'gated_deltanet'), not
    the stack."""
    args = ['--attn=gated_deltanet', '--eval_interval=2']
    train(tmp_path, char_data, *args, '--max_iters=4', '--chunk_size=4')
    r = train(tmp_path, char_data, *args, '--max_iters=6', '--chunk_size=3',
              '--linear_kernels=torch', '--init_from=resume')  # nor which kernels run it
    assert 'resuming from' in r.stdout and metrics(tmp_path)[-1]['iter'] == 6
    said = "changed: chunk_size 4 -> 3, linear_kernels 'fla' -> 'torch', max_iters 4 -> 6\n"
    assert said in r.stdout  # all said
    again = ['train.py', *TINY_TRAIN, f'--out_dir={tmp_path}', f'--data_dir={char_data}',
             '--init_from=resume']
    r = run(*again, '--attn=gated_deltanet', '--max_iters=8', '--conv_size=2', timeout=300)
    # the conv's width is a weight
    assert r.returncode != 0 and "is another model (--conv_size=4 in it)" in r.stderr
    r = train(tmp_path, char_data, '--attn=gated_deltanet*1', '--max_iters=8', '--eval_interval=2',
              '--init_from=resume')
    # the same stack, spelled otherwise
    assert 'resuming from' in r.stdout and metrics(tmp_path)[-1]['iter'] == 8
    r = run(*again, '--attn=gated_deltanet+mha', '--max_iters=10', timeout=300)
    # as last saved
    assert r.returncode != 0 and "is another model (--attn=gated_deltanet*1 in it)" in r.stderr
    r = run(*again, '--conv_size=2', '--max_iters=10', timeout=300)  # no --attn: mha's has no conv
    assert one_line(r).startswith("error: GPTConfig.conv_size=2 is inv")
    said = "ckpt.pt is another model (--attn=gated_deltanet*1, --conv_size=4 in it): add those"
    assert said in r.stderr, r.stderr


ANOTHER_MODEL = [  # (flags on a resume of trained's MHA run, what train.py says)
    (['--attn=mla'], "is another model (--attn=mha in it); add those settings"),
    (['--attn=gqa'], "is another model (--attn=mha in it); add"),  # not n_kv_head: mha's own
    (['--attn=gqa', '--n_kv_head=1'], "is another model (--attn=mha, --n_kv_head=4 in it)"),
    (['--rope_head_dim=4'], "rope_head_dim=4 is invalid: no layer of attn='mha' uses it"),
    # it suggested --n_kv_head=4 (MHA's own default, filled in): the flag, and no setting it has
    (['--conv_size=3'], "error: GPTConfig.conv_size=3 is invalid: no layer of attn='mha' uses "
                        "it\n"),
    (['--max_iters=2'], "is at iteration 4, past max_iters=2: nothing to train"),  # hung before
]


@pytest.mark.parametrize('args,message', ANOTHER_MODEL, ids=[' '.join(a) for a, _ in ANOTHER_MODEL])
def test_a_resume_as_another_model_is_one_line(trained, char_data, args, message):
    before = digest(trained / 'ckpt.pt'), digest(trained / 'metrics.jsonl')
    assert message in refused(trained, char_data, '--init_from=resume', *args)
    assert (digest(trained / 'ckpt.pt'), digest(trained / 'metrics.jsonl')) == before


def test_a_resume_applies_changed_optimizer_settings_and_names_every_change(tmp_path, char_data,
                                                                           saved):
    """--weight_decay, --beta1, --beta2 on a resume are the settings it trains with (torch's
    load_state_dict took the file's), and the `changed:` line names them with the other settings
    that differ (--seed, --grad_clip, how a linear layout computes, out_dir: the file was moved),
    not only the schedule's."""
    shutil.copy(saved[0] / 'ckpt.pt', tmp_path)
    r = resume(tmp_path, char_data, '--weight_decay=0.7', '--beta1=0.5', '--beta2=0.6', '--seed=7',
               '--grad_clip=0.5', '--chunk_size=16')
    said = re.search(r"; changed: (.*)\n", r.stdout)[1].split(', ')
    assert sorted(said) == sorted([
        'max_iters 4 -> 6', 'eval_interval 4 -> 6', 'weight_decay 0.1 -> 0.7', 'beta1 0.9 -> 0.5',
        'beta2 0.99 -> 0.6', 'seed 1337 -> 7', 'grad_clip 1.0 -> 0.5', 'chunk_size 64 -> 16',
        f"out_dir {str(saved[0])!r} -> {str(tmp_path)!r}"]), said
    groups = torch.load(tmp_path / 'ckpt.pt', weights_only=True)['optimizer']['param_groups']
    assert [(g['betas'], g['weight_decay']) for g in groups] == [((0.5, 0.6), 0.7),
                                                                 ((0.5, 0.6), 0.0)]


def test_a_crafted_optimizer_group_is_overridden_and_the_resume_is_the_plain_one(tmp_path,
                                                                                  char_data, saved):
    """maximize, a negative eps, betas > 1, amsgrad, capturable, a weight decay in a checkpoint's
    param_groups: the run's own settings train, bit for bit as a resume from the untouched file
    (torch trained as the file said, or failed at the first step)."""
    out, state = saved
    crafted = dict(maximize=True, eps=-1.0, betas=(5.0, 0.99), amsgrad=True, capturable=True,
                   weight_decay=3.0, lr=9.0)
    groups = [{**g, **crafted} for g in state['optimizer']['param_groups']]
    for name in ('plain', 'crafted'):
        (tmp_path / name).mkdir()
    shutil.copy(out / 'ckpt.pt', tmp_path / 'plain')
    torch.save({**state, 'optimizer': {**state['optimizer'], 'param_groups': groups}},
               tmp_path / 'crafted' / 'ckpt.pt')
    for name in ('plain', 'crafted'):
        resume(tmp_path / name, char_data)
    a, b = (torch.load(tmp_path / name / 'ckpt.pt', weights_only=True)
            for name in ('plain', 'crafted'))
    assert same_weights(a, b) and a['iter_num'] == 6


def test_a_resume_rewrites_foreign_non_finite_rows_as_null(tmp_path, char_data, saved):
    """A NaN a user appended to metrics.jsonl was copied as is into the resumed log: not strict
    JSON any more."""
    for name in ('ckpt.pt', 'metrics.jsonl'):
        shutil.copy(saved[0] / name, tmp_path)
    with open(tmp_path / 'metrics.jsonl', 'a') as f:
        f.write('{"iter": 2, "val/loss": NaN, "train/loss": -Infinity}\n')
    resume(tmp_path, char_data)
    strict = lambda name: pytest.fail(f"{name} in metrics.jsonl")
    rows = [json.loads(line, parse_constant=strict) for line in open(tmp_path / 'metrics.jsonl')]
    assert {'iter': 2, 'val/loss': None, 'train/loss': None} in rows and rows[-1]['iter'] == 6


@pytest.mark.parametrize('sig', [signal.SIGINT, signal.SIGTERM], ids=['SIGINT', 'SIGTERM'])
def test_an_interrupt_keeps_the_best_weights_and_resumes_where_it_stopped(tmp_path, char_data, sig):
    """Ctrl-C / SIGTERM: the state goes to last.pt; ckpt.pt keeps the best-val weights, labelled
    with their own val loss; the printed command resumes from last.pt at the interrupted
    iteration."""
    out, err = interrupted(tmp_path, char_data, '--eval_interval=3', '--eval_iters=2', sig=sig)
    # (on stderr, as every stop)
    m = re.search(r"^interrupted before iteration (\d+): its state saved to .*last.pt, the best "
                  r"weights kept in .*ckpt.pt; continue with:\n  (.*)$", err, re.M)
    assert m, err
    best, last = (torch.load(tmp_path / f, weights_only=True) for f in ('ckpt.pt', 'last.pt'))
    assert last['iter_num'] == int(m[1]) >= best['iter_num'] and last['val_loss'] is None
    evals = {row['iter']: row['val/loss'] for row in metrics(tmp_path) if 'val/loss' in row}
    assert best['val_loss'] == evals[best['iter_num']] == min(evals.values())
    assert best['val_loss'] == last['best_val_loss']
    moved = any(not torch.equal(best['model'][k], last['model'][k]) for k in best['model'])
    assert (last['iter_num'] > best['iter_num']) == moved
    if sig == signal.SIGINT:
        return
    before = digest(tmp_path / 'ckpt.pt')
    command = shlex.split(m[2])
    assert command[:2] == ['python', 'train.py'] and '--init_from=resume' in command
    it = last['iter_num']
    r = run(*command[1:], f'--max_iters={it + 1}', '--log_interval=1')
    # (the interrupt may land on a save: the same state)
    source = 'last.pt' if it > best['iter_num'] else 'ckpt.pt'
    said = f"resuming from {tmp_path / source} at iteration {it}"
    assert r.returncode == 0 and said in r.stdout, r.stderr
    assert re.search(rf"^iter {it}/{it + 1}: loss", r.stdout, re.M)
    assert not re.search(rf"^iter {it - 1}/", r.stdout, re.M)
    # the end state is kept: in ckpt.pt if its val loss is the best, else in last.pt
    end = {f.name: torch.load(f, weights_only=True) for f in tmp_path.glob('*.pt')}
    assert max(c['iter_num'] for c in end.values()) == it + 1
    # (an eval at iteration `it` itself may have saved a new best before the end)
    ckpt = end['ckpt.pt']
    assert ('last.pt' in end) == (ckpt['iter_num'] != it + 1)
    assert (digest(tmp_path / 'ckpt.pt') != before) == (ckpt['iter_num'] > best['iter_num'])
    evals = {row['iter']: row['val/loss'] for row in metrics(tmp_path) if 'val/loss' in row}
    assert ckpt['val_loss'] == evals[ckpt['iter_num']] == min(evals.values())


def test_a_resume_from_last_pt_saves_its_first_evaluation(tmp_path, trained, char_data):
    """An interrupt just before an evaluation leaves last.pt unevaluated: the resumed run's first
    evaluation is of weights ckpt.pt does not hold, so it is saved when it is the best (here
    always_save_checkpoint)."""
    out = tmp_path / 'run'
    shutil.copytree(trained, out)
    state = torch.load(trained / 'ckpt.pt', weights_only=True)
    # as an interrupt at 6 leaves it
    torch.save({**state, 'iter_num': 6, 'val_loss': None}, out / 'last.pt')
    r = train(out, char_data, '--init_from=resume', '--max_iters=6',
              '--always_save_checkpoint=True')
    assert f"resuming from {out / 'last.pt'} at iteration 6" in r.stdout
    assert torch.load(out / 'ckpt.pt', weights_only=True)['iter_num'] == 6, r.stdout
    assert not (out / 'last.pt').exists()  # older than ckpt.pt now


def test_eval_only_resume_evaluates_and_writes_nothing(trained, char_data):
    """--init_from=resume --eval_only=True evaluates the checkpoint and stops: no training, no
    save."""
    before = digest(trained / 'ckpt.pt')
    r = train(trained, char_data, '--init_from=resume', '--eval_only=True',
              '--always_save_checkpoint=True', '--max_iters=2')
    said = r"^step 4: train loss [\d.]+, val loss [\d.]+ \(evaluated in [\d.]+ s\)$"
    assert re.search(said, r.stdout, re.M), r.stdout
    assert not re.search(r"^iter \d+/", r.stdout, re.M) and 'saving checkpoint' not in r.stdout
    assert digest(trained / 'ckpt.pt') == before
