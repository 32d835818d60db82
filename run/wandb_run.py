"""
train.py's Weights & Biases run, which never stands in training's way: offline without credentials; a problem at
the start is one line before training, a call that fails later one warning, and W&B logging stops while training
and checkpoints go on. A resume continues the same W&B run, as one: same id and name, the first config kept (with
what the resume changed added), the samples table's rows, and no step sent twice (W&B drops a step below a run's
last). That state lives in the checkpoint, under 'wandb'.
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


class WandB:
    """The W&B run a checkpoint names ({} for a new run) in its 'wandb' dict: id, name, config, samples and step, the
    last step sent (older checkpoints: only 'wandb_id'). Every method is a no-op until start(), but sample()
    keeps its row (for the checkpoint's table)."""

    def __init__(self, checkpoint, iter_num):
        state = checkpoint.get('wandb')
        state = state if isinstance(state, dict) else {'id': checkpoint.get('wandb_id')}
        kinds = {'id': str, 'name': str, 'config': dict, 'samples': list, 'step': int}  # another kind: dropped
        state = {k: v for k, v in state.items() if isinstance(v, kinds.get(k, object)) and not isinstance(v, bool)}
        self.state = {**state, 'samples': [row for row in state.get('samples', []) if isinstance(row, list)
                                           and len(row) == 3 and type(row[0]) is int and row[0] < iter_num]}
        self.sent = state.get('step', -1)  # the last step the resumed run sent: none of them again
        self.api, self.folder = None, None  # the wandb module and the run's folder, once started

    def start(self, train, cfg, summary, resumed_at=None):
        """The W&B run of train.py's config train and its model cfg (a GPTConfig; a conversion's too), named after the
        layout; summary: its params and cache_bytes_per_token. A resume's (resumed_at: its iteration) keeps its first
        config, adding what train changed. wandb_mode '' = $WANDB_MODE, else online with credentials, offline
        without."""
        model_keys, attn, source = [f.name for f in fields(cfg)], train['attn'], train['init_from']
        origin = f"-from-{os.path.basename(os.path.normpath(source))}" if source not in ('scratch', 'resume') else ''
        name = train['wandb_run_name'] or self.state.get('name') or f"{attn}{origin}-{time.strftime('%Y%m%d-%H%M%S')}"
        config = {**{k: v for k, v in train.items() if k not in model_keys or k == 'attn'},  # the model: what it uses,
                  'model': {k: getattr(cfg, k) for k in cfg.used_fields()}, 'mlp_hidden': mlp_hidden(cfg),  # resolved
                  'params': summary['params'],
                  'tokens_per_iter': train['gradient_accumulation_steps'] * train['batch_size'] * cfg.block_size}
        state, mode = self.state, train['wandb_mode']
        state.update(name=name if attn in name else f"{attn}-{name}", id=state.get('id') or os.urandom(4).hex())
        first = state.get('config') or config
        state['config'] = first if resumed_at is None else {**first, f'resumed_at_{resumed_at}': {
            k: v for k, v in config.items() if first.get(k) != v and k != 'init_from'}}
        mode = mode or os.environ.get('WANDB_MODE') or ('online' if credentials() else 'offline')
        if mode not in ('online', 'offline', 'disabled'):
            fail(f"wandb_mode={mode!r} should be online, offline or disabled")
        if mode == 'online' and not credentials():
            fail("wandb_mode=online needs W&B credentials (`wandb login`, or WANDB_API_KEY); or log offline with "
                 "--wandb_mode=offline and `wandb sync` later")
        os.environ['WANDB_MODE'] = mode  # decided before init: wandb must never prompt or wait for a network
        try:
            import wandb  # lazy: slow to import, and needed only with wandb_log=True
        except ImportError as e:
            fail(f"wandb_log=True needs wandb ({describe(e)}): pip install -r requirements.txt, or --wandb_log=False")
        try:
            run = wandb.init(project=train['wandb_project'], name=state['name'], id=state['id'], resume='allow',
                             mode=mode, config=state['config'])
            run.summary.update(summary)
        except Exception as e:
            fail(f"W&B could not start ({describe(e)}); train without it (--wandb_log=False)"
                 + " or --wandb_mode=offline" * (mode != 'offline'))
        self.api, self.folder, self.mode = wandb, os.path.dirname(run.dir), mode
        folder = os.path.relpath(self.folder)
        print(f"W&B run {state['name']} ({mode}) in {folder}" + (f"; upload it later with: wandb sync {folder}"
              + " (after the folders of the runs it resumes)" * (resumed_at is not None) if mode == 'offline' else ''))

    def call(self, fn):
        """fn(wandb) with W&B on; one that fails (network, disk, permissions) stops W&B logging with one warning."""
        if self.api is None:
            return
        try:
            fn(self.api)
        except Exception as e:
            self.api = None
            print(f"warning: W&B logging stopped ({describe(e)}); training goes on, metrics.jsonl has every row",
                  file=sys.stderr)

    def log(self, row):
        if row['iter'] > self.sent:
            self.call(lambda wandb: wandb.log({k: v for k, v in row.items() if k != 'cache_bytes_per_token'},
                                              step=row['iter']))

    def sample(self, iter_num, layout, text):
        """One row more in the samples table (iteration, layout, text), sent whole."""
        self.state['samples'].append([iter_num, layout, text])
        if iter_num > self.sent:
            self.call(lambda wandb: wandb.log({'samples': wandb.Table(columns=['iter', 'layout', 'text'],
                                                                      data=self.state['samples'])}, step=iter_num))

    def saved(self, iter_num):
        """The state a checkpoint at iter_num keeps: its step, the last one sent."""
        return {**self.state, 'step': iter_num if self.api else self.sent}

    def finish(self, best_val_loss, upload=None):
        """upload: a checkpoint's path (the best weights), as a W&B artifact first."""
        def artifact(wandb):
            art = wandb.Artifact(f"{self.state['id']}-ckpt", type='model', metadata={'best_val_loss': best_val_loss})
            art.add_file(upload)
            wandb.log_artifact(art)
        if upload and os.path.isfile(upload):
            self.call(artifact)
        self.call(lambda wandb: wandb.finish())

    def discard(self):
        """A run stopped before its first write: its offline folder (and W&B's links to it) removed; what is left
        of an online run, in words ('' if nothing)."""
        if self.folder is None:
            return ''
        try:  # (api None: a call failed, W&B stopped)
            with open(os.devnull, 'w') as null, redirect_stdout(null), redirect_stderr(null):  # its "sync it" lines
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


def credentials():
    """An API key in the environment or from `wandb login` (~/.netrc); without one W&B would prompt."""
    if os.environ.get('WANDB_API_KEY'):
        return True
    try:
        return netrc.netrc().authenticators('api.wandb.ai') is not None
    except (OSError, netrc.NetrcParseError):
        return False
