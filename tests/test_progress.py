"""Long work says where it is and how it ended (#26): train.py's progress, ETA and closing line,
samples at evaluations seeded by the iteration, a refused start that leaves nothing behind (W&B:
test_wandb.py)."""
import os
import re

from conftest import metrics, refused, train


def test_train_lines_say_how_far_and_the_run_ends_on_a_summary(tmp_path, char_data):
    r = train(tmp_path, char_data, '--max_iters=6', '--eval_interval=3', '--log_interval=1')
    lines = r.stdout.splitlines()
    iters = [line for line in lines if line.startswith('iter ')]
    assert [int(re.match(r"iter (\d+)/6: ", line)[1]) for line in iters] == list(range(6)), iters
    # no MFU on a CPU (an A100's peak): an ETA once a step is timed
    said = r"iter \d/6: loss [\d.]+, time [\d.]+ms, [\d,]+ tok/s, ETA [\dhms.]+( s)?"
    assert all(re.fullmatch(said, line) for line in iters[1:]), iters
    assert 'ETA' not in iters[0]  # the first step is the warm-up: no estimate from it
    for it in (0, 3, 6):  # each evaluation says it starts, then what it found and how long it took
        start = lines.index(f"step {it}/6: evaluating (5 batches of train and of val)")
        said = rf"step {it}: train loss [\d.]+, val loss [\d.]+ \(evaluated in [\d.]+ s\)"
        assert re.fullmatch(said, lines[start + 1])
    best = min((m for m in metrics(tmp_path) if 'val/loss' in m), key=lambda m: m['val/loss'])
    assert lines[-1] == (f"done at iteration 6: best val loss {best['val/loss']:.4f} at iteration "
                         f"{best['iter']}; the best weights in {tmp_path / 'ckpt.pt'}; sample them "
                         f"with: python sample.py --out_dir={tmp_path}")
    # a step too large: the untrained weights stay the best
    worse = train(tmp_path / 'worse', char_data, '--max_iters=2', '--eval_interval=2',
                  '--learning_rate=1', '--decay_lr=False').stdout.splitlines()
    # no ckpt.pt
    assert sorted(os.listdir(tmp_path / 'worse')) == ['last.pt', 'metrics.jsonl', 'train.lock']
    # never 'the best weights in last.pt'
    assert re.fullmatch(rf"done at iteration 2: best val loss [\d.]+ at iteration 0; the final "
                        rf"weights in {tmp_path / 'worse' / 'last.pt'} \(not iteration 0's: those "
                        rf"are not saved\); sample them .*", worse[-1]), worse


def test_eval_samples_are_sampled_and_a_resume_logs_the_same_text(tmp_path, char_data):
    """Temperature 0.8 and top-k 200, not greedy (a fresh model's greedy sample is one character
    repeated), with a seed per iteration: the resumed run's sample at the iteration it restarts
    from is the first run's."""
    sample = lambda out, it: re.search(rf"^step {it}: [^\n]*\nsample:\n(.*?)\n---$", out,
                                       re.M | re.S)[1]
    args = ['--eval_interval=2', '--sample_every_eval=True']
    first = train(tmp_path, char_data, '--max_iters=4', *args).stdout
    assert len(set(sample(first, 0))) > 10, sample(first, 0)
    again = train(tmp_path, char_data, '--max_iters=6', *args, '--init_from=resume').stdout
    assert sample(again, 4) == sample(first, 4) and sample(again, 6) != sample(first, 4)


def test_a_start_refused_after_the_lock_leaves_no_lock_and_no_new_out_dir(tmp_path, char_data):
    fresh = tmp_path / 'new' / 'run'
    err = refused(fresh, char_data, '--block_size=10000000')
    assert 'not more than block_size=10000000' in err
    # both made by the run, both gone
    assert not os.path.exists(fresh) and not os.path.exists(fresh.parent)
    train(tmp_path / 'old', char_data, '--max_iters=2', '--eval_interval=2')
    os.remove(tmp_path / 'old' / 'train.lock')  # as a run before this change left it
    assert 'ckpt.pt exists' in refused(tmp_path / 'old', char_data)
    assert sorted(os.listdir(tmp_path / 'old')) == ['ckpt.pt', 'metrics.jsonl']
