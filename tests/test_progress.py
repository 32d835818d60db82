"""Long work says where it is and how it ended (#26): train.py's progress, ETA and closing line, samples at
evaluations seeded by the iteration, an early stop that leaves nothing behind, a resumed W&B run kept as one run."""
import os
import re
import signal
import subprocess
import sys
import time

from test_train import TINY, environ, metrics, train, wandb_records

from conftest import ROOT

WANDB_OFFLINE = {'WANDB_MODE': None, 'WANDB_API_KEY': None, 'WANDB_SILENT': 'true'}  # no credentials: offline


def test_train_lines_say_how_far_and_the_run_ends_on_a_summary(tmp_path, char_data):
    r = train(tmp_path, char_data, '--max_iters=6', '--eval_interval=3', '--log_interval=1')
    lines = r.stdout.splitlines()
    iters = [line for line in lines if line.startswith('iter ')]
    assert [int(re.match(r"iter (\d+)/6: ", line)[1]) for line in iters] == list(range(6)), iters
    assert all(re.fullmatch(r"iter \d/6: loss [\d.]+, time [\d.]+ms, [\d,]+ tok/s, ETA [\dhms.]+( s)?", line)
               for line in iters[1:]), iters  # no MFU on a CPU (an A100's peak): an ETA once a step is timed
    assert 'ETA' not in iters[0]  # the first step is the warm-up: no estimate from it
    for it in (0, 3, 6):  # each evaluation says it starts, then what it found and how long it took
        start = lines.index(f"step {it}/6: evaluating (5 batches of train and of val)")
        assert re.fullmatch(rf"step {it}: train loss [\d.]+, val loss [\d.]+ \(evaluated in [\d.]+ s\)", lines[start + 1])
    best = min((m for m in metrics(tmp_path) if 'val/loss' in m), key=lambda m: m['val/loss'])
    assert lines[-1] == (f"done at iteration 6: best val loss {best['val/loss']:.4f} at iteration {best['iter']}; the "
                         f"best weights in {tmp_path / 'ckpt.pt'}; sample them with: python sample.py --out_dir={tmp_path}")

    worse = train(tmp_path / 'worse', char_data, '--max_iters=2', '--eval_interval=2', '--learning_rate=1',
                  '--decay_lr=False').stdout.splitlines()  # a step too large: the untrained weights stay the best
    assert sorted(os.listdir(tmp_path / 'worse')) == ['last.pt', 'metrics.jsonl', 'train.lock']  # no ckpt.pt
    assert re.fullmatch(rf"done at iteration 2: best val loss [\d.]+ at iteration 0; the final weights in "
                        rf"{tmp_path / 'worse' / 'last.pt'} \(not iteration 0's: those are not saved\); sample them .*",
                        worse[-1]), worse  # never 'the best weights in last.pt'


def test_eval_samples_are_sampled_and_a_resume_logs_the_same_text(tmp_path, char_data):
    """Temperature 0.8 and top-k 200, not greedy (a fresh model's greedy sample is one character repeated), with a
    seed per iteration: the resumed run's sample at the iteration it restarts from is the first run's."""
    sample = lambda out, it: re.search(rf"^step {it}: [^\n]*\nsample:\n(.*?)\n---$", out, re.M | re.S)[1]
    first = train(tmp_path, char_data, '--max_iters=4', '--eval_interval=2', '--sample_every_eval=True').stdout
    assert len(set(sample(first, 0))) > 10, sample(first, 0)
    again = train(tmp_path, char_data, '--max_iters=6', '--eval_interval=2', '--sample_every_eval=True',
                  '--init_from=resume').stdout
    assert sample(again, 4) == sample(first, 4) and sample(again, 6) != sample(first, 4)


def test_a_start_refused_after_the_lock_leaves_no_lock_and_no_new_out_dir(tmp_path, char_data):
    fresh = tmp_path / 'new' / 'run'
    r = subprocess.run([sys.executable, 'train.py', *TINY, f'--out_dir={fresh}', f'--data_dir={char_data}',
                        '--block_size=10000000'], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and 'not more than block_size=10000000' in r.stderr, r.stderr
    assert not os.path.exists(fresh) and not os.path.exists(fresh.parent)  # both made by the run, both gone
    train(tmp_path / 'old', char_data, '--max_iters=2', '--eval_interval=2')
    os.remove(tmp_path / 'old' / 'train.lock')  # as a run before this change left it
    r = subprocess.run([sys.executable, 'train.py', *TINY, f'--out_dir={tmp_path / "old"}', f'--data_dir={char_data}'],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and 'ckpt.pt exists' in r.stderr, r.stderr
    assert sorted(os.listdir(tmp_path / 'old')) == ['ckpt.pt', 'metrics.jsonl']


def test_an_interrupt_before_the_first_step_leaves_no_wandb_run_and_no_out_dir(tmp_path, char_data):
    out = tmp_path / 'out'
    p = subprocess.Popen([sys.executable, 'train.py', *TINY, f'--out_dir={out}', f'--data_dir={char_data}',
                          '--wandb_log=True', '--eval_iters=100000'], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=environ({**WANDB_OFFLINE, 'HOME': str(tmp_path),
                                                                          'WANDB_DIR': str(tmp_path)}))
    said = []
    while not said or not said[-1].startswith('step 0/'):  # W&B started, the first evaluation under way
        said.append(p.stdout.readline())
        assert said[-1], p.stderr.read()
    assert any(line.startswith('W&B run ') for line in said) and os.listdir(tmp_path / 'wandb')
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130 and err.strip().endswith(
        "error: interrupted before the first training step; nothing was written"), err
    assert not os.path.exists(out) and not os.path.exists(tmp_path / 'wandb'), os.listdir(tmp_path)


def test_a_resumed_wandb_run_is_one_run(tmp_path, char_data):
    """The same id and name, the config kept (the resume an added key), no step sent twice, the samples table whole;
    the config holds the model's fields that apply to its layout, resolved, once."""
    env = {**WANDB_OFFLINE, 'HOME': str(tmp_path), 'WANDB_DIR': str(tmp_path)}
    out = tmp_path / 'out'
    train(out, char_data, '--attn=gqa', '--max_iters=4', '--eval_interval=2', '--wandb_log=True', env=env)
    time.sleep(1.1)  # a new run name would differ by its time
    for more in (6, 8):  # resumed twice
        train(out, char_data, '--attn=gqa', f'--max_iters={more}', '--eval_interval=2', '--wandb_log=True',
              '--init_from=resume', env=env)
    folders = sorted(d for d in os.listdir(tmp_path / 'wandb') if d.startswith('offline-run-'))
    first, second, third = [wandb_records(tmp_path / 'wandb' / d, '--summary')[0] for d in folders]
    assert first['name'] == second['name'] == third['name'] and first['name'].startswith('gqa-')
    config = third['config']
    assert {k: v for k, v in config.items() if not k.startswith('resumed_at_')} == first['config']
    assert config['resumed_at_4'] == {'max_iters': 6} and config['resumed_at_6'] == {'max_iters': 8}
    assert config['init_from'] == 'scratch'
    assert config['model']['n_kv_head'] == 2 and 'n_kv_head' not in config  # resolved, once
    assert not {'kv_lora_rank', 'rope_head_dim', 'q_lora_rank', 'conv_size', 'chunk_size'} & set(config['model'])
    steps = [[row['history']['item'] for row in wandb_records(tmp_path / 'wandb' / d) if row.get('type') == 'history']
             for d in folders]
    evals = [h['iter'] for run in steps for h in run if 'val/loss' in h]
    assert evals == [0, 2, 4, 6, 8]  # iterations 4 and 6, evaluated again by the resumes, are sent once
    sent = [sorted({h['iter'] for h in run}) for run in steps]
    assert sent[0][-1] < sent[1][0] and sent[1][-1] < sent[2][0], sent  # no step in two folders: W&B drops them
    tables = [h['samples.nrows'] for run in steps for h in run if 'samples.nrows' in h]
    assert tables == [1, 2, 3, 4, 5]  # the resumed table keeps the earlier rows
