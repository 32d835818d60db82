"""
train.py's Weights & Biases run, which never stands in training's way: offline without credentials;
a problem at the start is one line before training, a call that fails later one warning, and W&B
logging stops while training and checkpoints go on. A resume continues the same W&B run, as one:
same id and name, the first config kept (with what the resume changed added), the samples table's
rows, and no step sent twice (W&B drops a step below a run's last). That state lives in the
checkpoint, under 'wandb'.
"""
import netrc
import os
import shutil
import sys
import time
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import fields

from configurator import describe, fail
from model import mlp_hidden

KINDS = {'id': str, 'name': str, 'config': dict, 'samples': list, 'step': int}  # of a saved state


class WandB:
    """The W&B run a checkpoint names ({} for a new run) in its 'wandb' dict: id, name, config,
    samples and step, the last step sent (older checkpoints: only 'wandb_id'); an entry of another
    kind is dropped. Every method is a no-op until start(), but sample() keeps its row (for the
    checkpoint's table)."""

    def __init__(self, checkpoint, iter_num):
        state = checkpoint.get('wandb')
        state = state if isinstance(state, dict) else {'id': checkpoint.get('wandb_id')}
        ok = lambda k, v: isinstance(v, KINDS.get(k, object)) and not isinstance(v, bool)
        state = {k: v for k, v in state.items() if ok(k, v)}
        # the table's rows before the resumed iteration: (iteration, layout, text)
        row = lambda r: isinstance(r, list) and len(r) == 3 and type(r[0]) is int
        samples = [r for r in state.get('samples', []) if row(r) and r[0] < iter_num]
        self.state = {**state, 'samples': samples}
        self.sent = state.get('step', -1)  # the last step the resumed run sent: none of them again
        self.api, self.folder = None, None  # the wandb module and the run's folder, once started

    def start(self, train, cfg, summary, resumed_at=None):
        """The W&B run of train.py's config train and its model cfg (a GPTConfig; a conversion's
        too), named after the layout; summary: its params and cache_bytes_per_token. A resume's
        (resumed_at: its iteration) keeps its first config, adding what train changed."""
        attn, source, state = train['attn'], train['init_from'], self.state
        origin = ''
        if source not in ('scratch', 'resume'):  # a conversion: named after its source too
            origin = f"-from-{os.path.basename(os.path.normpath(source))}"
        stamp = time.strftime('%Y%m%d-%H%M%S')
        name = train['wandb_run_name'] or state.get('name') or f"{attn}{origin}-{stamp}"
        state['name'] = name if attn in name else f"{attn}-{name}"
        state['id'] = state.get('id') or os.urandom(4).hex()
        config = run_config(train, cfg, summary)
        first = state['config'] = state.get('config') or config
        if resumed_at is not None:
            changes = {k: v for k, v in config.items() if first.get(k) != v and k != 'init_from'}
            state['config'] = {**first, f'resumed_at_{resumed_at}': changes}
        mode = run_mode(train['wandb_mode'])
        try:
            import wandb  # lazy: slow to import, and needed only with wandb_log=True
        except ImportError as e:
            fail(f"wandb_log=True needs wandb ({describe(e)}): pip install -r requirements.txt, "
                 "or --wandb_log=False")
        try:
            run = wandb.init(project=train['wandb_project'], name=state['name'], id=state['id'],
                             resume='allow', mode=mode, config=state['config'])
            run.summary.update(summary)
        except Exception as e:
            fail(f"W&B could not start ({describe(e)}); train without it (--wandb_log=False)"
                 + " or --wandb_mode=offline" * (mode != 'offline'))
        self.api, self.folder, self.mode = wandb, os.path.dirname(run.dir), mode
        folder = os.path.relpath(self.folder)
        said = f"W&B run {state['name']} ({mode}) in {folder}"
        if mode == 'offline':
            said += f"; upload it later with: wandb sync {folder}"
            said += " (after the folders of the runs it resumes)" * (resumed_at is not None)
        print(said)

    def call(self, fn):
        """fn(wandb) with W&B on; one that fails (network, disk, permissions) stops W&B logging
        with one warning."""
        if self.api is None:
            return
        try:
            fn(self.api)
        except Exception as e:
            self.api = None
            print(f"warning: W&B logging stopped ({describe(e)}); training goes on, metrics.jsonl "
                  "has every row", file=sys.stderr)

    def log(self, row):
        if row['iter'] > self.sent:
            metrics = {k: v for k, v in row.items() if k != 'cache_bytes_per_token'}
            self.call(lambda wandb: wandb.log(metrics, step=row['iter']))

    def sample(self, iter_num, layout, text):
        """One row more in the samples table (iteration, layout, text), sent whole."""
        self.state['samples'].append([iter_num, layout, text])
        if iter_num > self.sent:
            columns, rows = ['iter', 'layout', 'text'], self.state['samples']
            self.call(lambda wandb: wandb.log({'samples': wandb.Table(columns=columns, data=rows)},
                                              step=iter_num))

    def saved(self, iter_num):
        """The state a checkpoint at iter_num keeps: its step, the last one sent."""
        return {**self.state, 'step': iter_num if self.api else self.sent}

    def finish(self, best_val_loss, upload=None):
        """upload: a checkpoint's path (the best weights), as a W&B artifact first."""
        def artifact(wandb):
            metadata = {'best_val_loss': best_val_loss}
            art = wandb.Artifact(f"{self.state['id']}-ckpt", type='model', metadata=metadata)
            art.add_file(upload)
            wandb.log_artifact(art)
        if upload and os.path.isfile(upload):
            self.call(artifact)
        self.call(lambda wandb: wandb.finish())

    def discard(self):
        """A run stopped before its first write: its offline folder (and W&B's links to it)
        removed; what is left of an online run, in words ('' if nothing)."""
        if self.folder is None:
            return ''
        try:  # (api None: a call failed, W&B stopped); its "sync it" lines silenced
            with open(os.devnull, 'w') as null, redirect_stdout(null), redirect_stderr(null):
                self.api and self.api.finish(exit_code=130)
        except Exception:
            pass
        if self.mode != 'offline':
            return f"the W&B run {self.state['name']} was started {self.mode}"
        shutil.rmtree(self.folder, ignore_errors=True)
        parent = os.path.dirname(self.folder)  # latest-run, debug.log: links to the folder
        for link in (os.path.join(parent, f) for f in os.listdir(parent)):
            if os.path.islink(link) and not os.path.exists(link):
                os.remove(link)
        if not os.listdir(parent):
            os.rmdir(parent)
        return ''


def run_config(train, cfg, summary):
    """The W&B config of train.py's config train: its flags, and of the model cfg (a GPTConfig) the
    fields it uses, resolved (not the flags that set them), its MLP's width and its parameters."""
    model_keys = [f.name for f in fields(cfg)]
    flags = {k: v for k, v in train.items() if k not in model_keys or k == 'attn'}
    model = {k: getattr(cfg, k) for k in cfg.used_fields()}
    tokens_per_iter = train['gradient_accumulation_steps'] * train['batch_size'] * cfg.block_size
    return {**flags, 'model': model, 'mlp_hidden': mlp_hidden(cfg), 'params': summary['params'],
            'tokens_per_iter': tokens_per_iter}


def run_mode(asked):
    """wandb_mode: asked, '' = $WANDB_MODE, else online with credentials, offline without; set in
    the environment before init (wandb must never prompt or wait for a network)."""
    mode = asked or os.environ.get('WANDB_MODE') or ('online' if credentials() else 'offline')
    if mode not in ('online', 'offline', 'disabled'):
        fail(f"wandb_mode={mode!r} should be online, offline or disabled")
    if mode == 'online' and not credentials():
        fail("wandb_mode=online needs W&B credentials (`wandb login`, or WANDB_API_KEY); or log "
             "offline with --wandb_mode=offline and `wandb sync` later")
    os.environ['WANDB_MODE'] = mode
    return mode


def credentials():
    """An API key in the environment or from `wandb login` (~/.netrc); without one W&B would
    prompt."""
    if os.environ.get('WANDB_API_KEY'):
        return True
    try:
        return netrc.netrc().authenticators('api.wandb.ai') is not None
    except (OSError, netrc.NetrcParseError):
        return False
