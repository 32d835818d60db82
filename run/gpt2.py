"""
GPT-2's published weights in our GPT, as nanoGPT's from_pretrained: `--init_from=gpt2` (or
gpt2-medium, gpt2-large, gpt2-xl: downloaded once by Hugging Face transformers, an optional
dependency: requirements-hf.txt), or a folder that transformers' save_pretrained wrote (no network).
"""
import os

from configurator import describe
from model import GPTConfig
from run.checkpoint import FileError, checkpoints

NAMES = ('gpt2', 'gpt2-medium', 'gpt2-large', 'gpt2-xl')
# GPT-2's BPE, as data/shakespeare/prepare.py writes it to meta.json
META = {'kind': 'tiktoken', 'encoding': 'gpt2', 'vocab_size': 50257}
# transformers' Conv1D keeps its weight as (in, out): nn.Linear's transposed
CONV1D = ('attn.c_attn.weight', 'attn.c_proj.weight', 'mlp.c_fc.weight', 'mlp.c_proj.weight')
GELU = {'gelu_new': True, 'gelu_pytorch_tanh': True, 'gelu': False}  # tanh approximation?


def is_gpt2(init_from):
    """A GPT-2 by name, or a save_pretrained folder (its config.json; ours hold ckpt.pt)."""
    return init_from in NAMES or os.path.isfile(os.path.join(init_from, 'config.json'))


def gpt2(init_from, dropout=0.0):
    """(GPTConfig, state_dict, meta) of GPT-2 init_from, float32 on the CPU; else FileError, one
    line. Only GPT-2's names and folders: never another Hub id."""
    if not is_gpt2(init_from):
        ours = " (a checkpoint of ours: --out_dir)" * bool(checkpoints(init_from))
        raise FileError(f"init_from={init_from!r}: give gpt2, gpt2-medium, -large, -xl, or a folder "
                        f"GPT-2's save_pretrained wrote{ours}")
    try:
        import transformers
    except ImportError:
        raise FileError(f"init_from={init_from!r} loads GPT-2 through Hugging Face transformers, "
                        "which is not installed: pip install -r requirements-hf.txt") from None
    import huggingface_hub
    # their notes, retries and bars on stderr: ours is one line
    transformers.logging.set_verbosity_error()
    huggingface_hub.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    try:
        GPT2 = transformers.GPT2LMHeadModel
        hf, loaded = GPT2.from_pretrained(init_from, output_loading_info=True)
        c = hf.config
    except Exception as e:  # no such folder or file, no network, a broken file
        raise FileError(f"cannot load GPT-2 from {init_from}: {describe(e)}") from None
    # another model's folder loads too, as a GPT-2 with random weights: refused
    missing = sorted(loaded['missing_keys']) + sorted(map(str, loaded['mismatched_keys']))
    if c.model_type != 'gpt2' or missing:
        what = f"model_type {c.model_type!r}" if c.model_type != 'gpt2' else f"no {missing[0]}"
        raise FileError(f"{init_from} is not GPT-2's weights ({what}): --init_from takes gpt2, "
                        "gpt2-medium, -large, -xl, or a folder GPT-2's save_pretrained wrote")
    hf = hf.float()
    unlike = {'activation_function': c.activation_function not in GELU,
              'n_inner': c.n_inner not in (None, 4 * c.n_embd),
              'layer_norm_epsilon': c.layer_norm_epsilon != 1e-5,
              'scale_attn_by_inverse_layer_idx': c.scale_attn_by_inverse_layer_idx,
              'reorder_and_upcast_attn': c.reorder_and_upcast_attn,
              'scale_attn_weights': not c.scale_attn_weights,
              'tie_word_embeddings': not c.tie_word_embeddings}  # (ours are tied)
    if wrong := [k for k, differs in unlike.items() if differs]:
        value = getattr(c, wrong[0])
        raise FileError(f"{init_from}: {wrong[0]}={value!r} is not GPT-2's, which our GPT computes")
    try:
        config = GPTConfig(block_size=c.n_positions, vocab_size=c.vocab_size, n_layer=c.n_layer,
                           n_head=c.n_head, n_embd=c.n_embd, dropout=dropout, bias=True,
                           attn='mha', pos_emb='learned', gelu_tanh=GELU[c.activation_function])
    except ValueError as e:
        raise FileError(f"{init_from}: {e}") from None
    # the names are nanoGPT's and ours; transformers' attention mask buffers are not weights
    state = {k: v.t() if k.endswith(CONV1D) else v for k, v in hf.state_dict().items()
             if not k.endswith(('.attn.bias', '.attn.masked_bias'))}
    return config, state, dict(META, vocab_size=c.vocab_size)
