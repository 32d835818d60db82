"""
Published models for bench.py cache: a Hugging Face config.json read into what each layer caches
(model.py's formulas: kv_elements, latent_elements, state_elements), the weights' parameters, and
the sizes our layouts re-lay the model out with. A config this file cannot read exactly is refused.
"""
import json
import math
import os
from dataclasses import dataclass, field

from model import kv_elements, latent_elements, state_elements

# fields that change what a layer keeps, in families that do not read them here
UNREAD = ('attention_chunk_size', 'hybrid_override_pattern', 'text_config',
          'sliding_window_pattern', 'no_rope_layers', 'kv_lora_rank', 'linear_num_value_heads')


class ModelError(ValueError):
    """A config.json we cannot read: the one line says which and why."""


@dataclass
class Published:
    groups: list              # (layers, what, elements(T), a fixed state?, window: keeps the last
                              # window tokens, 0: all) per kind of layer
    params: int               # the weights, as published (0: not given)
    n_layer: int              # the sizes our layouts re-lay it out with
    n_head: int
    head_dim: int
    notes: list = field(default_factory=list)
    name: str = ''
    context: int = 0          # its max_position_embeddings (0: not given)
    source: str = ''          # the config.json, or '' (a model given by its sizes)

    def cache_bytes(self, T, itemsize, windows=True):
        """Batch 1; a linear layer's state float32 at least; windows=False: as if no layer had a
        window (each keeps every token)."""
        kept = lambda window: min(T, window) if window and windows else T
        return sum(n * fn(kept(window)) * (max(itemsize, 4) if state else itemsize)
                   for n, _, fn, state, window in self.groups)

    def layout(self):
        return ' + '.join(f"{n} x {what}" for n, what, *_ in self.groups)

    @property
    def windowed(self):
        return any(window for *_, window in self.groups)


# --- each family: its layers' caches and its parameters ------------------------------------------

def softmax_layers(c, n_kv, d):
    """Softmax layers, n_kv K/V heads of width d; those windowed keep the last sliding_window."""
    L, window = c['num_hidden_layers'], c.get('sliding_window')
    H = c.get('num_attention_heads', n_kv)
    types = c.get('layer_types') or ['full_attention'] * L
    if H % n_kv:
        raise ModelError(f"{n_kv} K/V heads for {H} query heads: not a model these families have")
    if set(types) - {'full_attention', 'sliding_attention'} or len(types) != L:
        raise ModelError(f"layer_types other than {L} full_attention / sliding_attention")
    # Mistral's window slides on every layer (Mistral-7B-v0.1); Llama has none, and Qwen's
    # sliding_window is read only under use_sliding_window (refused above), as transformers does
    windowed = bool(window) and c.get('model_type') == 'mistral' and 'layer_types' not in c
    slides = [t == 'sliding_attention' or windowed for t in types]
    if any(slides) and not window:
        raise ModelError("sliding_attention layers without a sliding_window")
    what, elements = f"softmax, {n_kv} K/V heads of {d}", lambda T: kv_elements(T, n_kv, d, d)
    groups = [(slides.count(False), what, elements, False, 0),
              (slides.count(True), what + f", window {window}", elements, False, window)]
    return [g for g in groups if g[0]]


def llama(c):  # llama, mistral, qwen2 (q, k, v biases), qwen3 (q, k RMSNorms): SwiGLU MLPs
    C, H, L = c['hidden_size'], c['num_attention_heads'], c['num_hidden_layers']
    kv, d = c.get('num_key_value_heads') or H, c.get('head_dim') or C // H
    I, kind, bias = c['intermediate_size'], c['model_type'], bool(c.get('attention_bias'))
    if kind.startswith('qwen') and c.get('use_sliding_window'):
        raise ModelError("use_sliding_window: Qwen's windows on some layers are not read here")
    qwen2 = kind == 'qwen2'  # (its q, k, v have biases, its output none, whatever attention_bias)
    attn = 2 * C * H * d + 2 * C * kv * d + (bias and not qwen2) * C
    attn += (bias or qwen2) * (H * d + 2 * kv * d) + (kind == 'qwen3') * 2 * d
    layer = attn + 3 * C * I + bool(c.get('mlp_bias')) * (2 * I + C) + 2 * C
    params = embeddings(c) + L * layer + C
    return Published(softmax_layers(c, kv, d), params, L, H, d)


def falcon(c):  # falcon-7b: one K/V head (multi_query), attention and MLP in parallel
    C, H, L = c['hidden_size'], c['num_attention_heads'], c['num_hidden_layers']
    if c.get('new_decoder_architecture') or c.get('alibi'):
        raise ModelError("new_decoder_architecture / alibi: Falcon's other variants are not read "
                         "here")
    if C % H:
        raise ModelError(f"hidden_size={C} is not a multiple of num_attention_heads={H}")
    d = C // H
    kv = 1 if c.get('multi_query', True) else H
    ffn, bias = c.get('ffn_hidden_size') or 4 * C, bool(c.get('bias'))
    layer = C * (H + 2 * kv) * d + C * C + 2 * C * ffn + bias * ((H + 2 * kv) * d + 2 * C + ffn)
    layer += 2 * C * (1 + (not c.get('parallel_attn', True)))  # LayerNorms: weight and bias
    params = embeddings(c, tied=True) + L * layer + 2 * C
    return Published(softmax_layers(c, kv, d), params, L, H, d)


def gpt2(c):
    C, H, L, V, P = (c[k] for k in ('n_embd', 'n_head', 'n_layer', 'vocab_size', 'n_positions'))
    inner = c.get('n_inner') or 4 * C
    # c_attn and c_proj, c_fc and mlp.c_proj, with biases; two LayerNorms
    layer = 4 * C * C + 4 * C + 2 * C * inner + inner + C + 4 * C
    params = V * C * (1 + (not c.get('tie_word_embeddings', True))) + P * C + L * layer + 2 * C
    if C % H:
        raise ModelError(f"n_embd={C} is not a multiple of n_head={H}")
    layers = softmax_layers({'num_hidden_layers': L}, H, C // H)
    return Published(layers, params, L, H, C // H)


def deepseek(c):  # MLA: it caches [c | k_R] (the paper; vLLM, SGLang) and forms K and V from it
    C, H, L = c['hidden_size'], c['num_attention_heads'], c['num_hidden_layers']
    dc, dR = c['kv_lora_rank'], c['qk_rope_head_dim']
    nope, dv = c['qk_nope_head_dim'], c['v_head_dim']
    r, dq = c.get('q_lora_rank'), nope + dR
    q = C * r + r + r * H * dq if r else C * H * dq
    attn = q + C * (dc + dR) + dc + dc * H * (nope + dv) + H * dv * C
    experts = c['n_routed_experts']
    moe = (experts + c['n_shared_experts']) * 3 * C * c['moe_intermediate_size'] + C * experts
    dense = min(c.get('first_k_dense_replace', 0), L)
    mlps = dense * 3 * C * c['intermediate_size'] + (L - dense) * moe
    params = embeddings(c) + L * (attn + 2 * C) + mlps + C
    groups = [(L, f"MLA, d_c {dc} + d_R {dR}", lambda T: latent_elements(T, dc, dR), False, 0)]
    mtp = c.get('num_nextn_predict_layers')
    notes = [f"{mtp} multi-token-prediction layer(s) not counted"] * bool(mtp)
    return Published(groups, params, L, H, nope, notes)


def qwen3_next(c):  # 3 Gated DeltaNet layers to 1 gated softmax layer, MoE MLPs
    C, H, L = c['hidden_size'], c['num_attention_heads'], c['num_hidden_layers']
    kv, d, every = c['num_key_value_heads'], c['head_dim'], c.get('full_attention_interval', 4)
    nk, nv, dk, dv, K = (c[k] for k in ('linear_num_key_heads', 'linear_num_value_heads',
                                        'linear_key_head_dim', 'linear_value_head_dim',
                                        'linear_conv_kernel_dim'))
    types = c.get('layer_types') or [
        'full_attention' if (i + 1) % every == 0 else 'linear_attention' for i in range(L)]
    if set(types) - {'full_attention', 'linear_attention'} or len(types) != L:
        raise ModelError(f"layer_types: {L} of 'full_attention' / 'linear_attention' expected")
    conv = 2 * nk * dk + nv * dv  # the short conv runs over q, k (nk heads) and v (nv heads)
    full = 2 * C * H * d + 2 * C * kv * d + H * d * C + 2 * d  # q and its output gate, q/k norms
    linear = C * (2 * nk * dk + 2 * nv * dv) + C * 2 * nv + conv * K + 2 * nv + dv + nv * dv * C
    E, moe = c['num_experts'], c['moe_intermediate_size']
    mlp = E * 3 * C * moe + 3 * C * c['shared_expert_intermediate_size'] + C * E + C
    n_full = types.count('full_attention')
    params = embeddings(c) + n_full * full + (L - n_full) * linear + L * (mlp + 2 * C) + C
    groups = [(n_full, f"softmax, {kv} K/V heads of {d}",
               lambda T: kv_elements(T, kv, d, d), False, 0),
              (L - n_full, f"Gated DeltaNet, {nv} heads of {dk} x {dv}",
               lambda T: state_elements(nv, dk, dv, conv, K), True, 0)]
    return Published([g for g in groups if g[0]], params, L, H, d)


def gemma(c):  # gemma2, gemma3_text: local and global layers, GeGLU MLPs, 4 norms a layer
    C, H, L, d = c['hidden_size'], c['num_attention_heads'], c['num_hidden_layers'], c['head_dim']
    kv, I = c.get('num_key_value_heads') or H, c['intermediate_size']
    three = c['model_type'] != 'gemma2'
    if c.get('use_bidirectional_attention'):
        raise ModelError("use_bidirectional_attention: an encoder's window (half of it either "
                         "side) is not read here")
    # Gemma 2 alternates local and global; Gemma 3 has 5 local to 1 global (its older configs say so)
    every = c.get('sliding_window_pattern', 6) if three else 2
    if not c.get('layer_types') and (every is None or every < 1):
        raise ModelError(f"sliding_window_pattern={every!r}: every Nth layer global needs N >= 1")
    types = c.get('layer_types') or [
        'full_attention' if (i + 1) % every == 0 else 'sliding_attention' for i in range(L)]
    attn = 2 * C * H * d + 2 * C * kv * d + bool(c.get('attention_bias')) * (H * d + 2 * kv * d + C)
    layer = attn + three * 2 * d + 3 * C * I + 4 * C  # (Gemma 3: q and k norms)
    params = embeddings(c, tied=True) + L * layer + C
    return Published(softmax_layers({**c, 'layer_types': types}, kv, d), params, L, H, d)


def gpt_oss(c):  # local and global in turn; a learned sink logit per head, not a kept token; MoE
    C, H, L, d = c['hidden_size'], c['num_attention_heads'], c['num_hidden_layers'], c['head_dim']
    kv, E, I = c['num_key_value_heads'], c['num_local_experts'], c['intermediate_size']
    types = c.get('layer_types') or [
        'full_attention' if i % 2 else 'sliding_attention' for i in range(L)]
    attn = 2 * C * H * d + 2 * C * kv * d + H  # q, k, v, o and the sinks
    attn += c.get('attention_bias', True) * (H * d + 2 * kv * d + C)
    moe = C * E + E + E * (C * 2 * I + 2 * I + I * C + C)  # the router; experts with biases
    params = embeddings(c) + L * (attn + moe + 2 * C) + C
    return Published(softmax_layers({**c, 'layer_types': types}, kv, d), params, L, H, d)


def embeddings(c, tied=False):  # the token embedding, and the head unless tied to it
    return c['vocab_size'] * c['hidden_size'] * (1 + (not c.get('tie_word_embeddings', tied)))


FAMILIES = {'llama': llama, 'mistral': llama, 'qwen2': llama, 'qwen3': llama, 'falcon': falcon,
            'gpt2': gpt2, 'deepseek_v2': deepseek, 'deepseek_v3': deepseek,
            'qwen3_next': qwen3_next, 'gemma2': gemma, 'gemma3_text': gemma, 'gpt_oss': gpt_oss}
SIZE_FIELDS = {'hidden_size', 'num_attention_heads', 'num_hidden_layers', 'vocab_size',
               'num_key_value_heads', 'head_dim', 'intermediate_size', 'sliding_window', 'n_embd',
               'n_head', 'n_layer', 'n_positions', 'max_position_embeddings', 'n_inner',
               'ffn_hidden_size', 'kv_lora_rank',
               'q_lora_rank', 'qk_rope_head_dim', 'qk_nope_head_dim', 'v_head_dim',
               'n_routed_experts', 'n_shared_experts', 'moe_intermediate_size',
               'first_k_dense_replace', 'num_experts', 'shared_expert_intermediate_size',
               'full_attention_interval', 'linear_conv_kernel_dim', 'linear_key_head_dim',
               'linear_value_head_dim', 'linear_num_key_heads', 'linear_num_value_heads',
               'sliding_window_pattern', 'num_local_experts'}
# the UNREAD fields a family reads
OWN = {'deepseek_v2': 'kv_lora_rank', 'deepseek_v3': 'kv_lora_rank',
       'qwen3_next': 'linear_num_value_heads', 'gemma3_text': 'sliding_window_pattern'}


CONFIG_BYTES = 1 << 20  # a published config.json is kilobytes (Qwen3-Next's, 3)


def read_config(path):
    """A published config.json -> Published; a file we cannot read exactly: ModelError."""
    if os.path.exists(path) and not os.path.isfile(path):  # a FIFO would block, a device not end
        raise ModelError(f"{path}: not a file (a config.json is one)")
    try:
        with open(path) as f:
            text = f.read(CONFIG_BYTES + 1)
        c = json.loads(text) if len(text) <= CONFIG_BYTES else None
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:  # (ValueError: JSON's,
        # a 5,000-digit number too; RecursionError: nested thousands deep)
        why = getattr(e, 'strerror', None) or (e if str(e) else type(e).__name__)
        raise ModelError(f"cannot read {path}: {why}") from None
    if len(text) > CONFIG_BYTES:
        raise ModelError(f"{path}: over {CONFIG_BYTES:,} characters: not a config.json (a few "
                         "kilobytes)")
    if not isinstance(c, dict):
        raise ModelError(f"{path}: not a config.json (a JSON object)")
    kind = c.get('model_type')
    if not isinstance(kind, str) or kind not in FAMILIES:
        raise ModelError(f"{path}: model_type {kind!r} is not one bench.py cache reads "
                         f"({', '.join(FAMILIES)}); give its sizes with --sizes=")
    unread = [k for k in UNREAD if c.get(k) is not None and OWN.get(kind) != k]
    if unread:
        raise ModelError(f"{path}: {unread[0]!r} changes what a layer caches, and a {kind} config "
                         "is read here without it")
    # the sizes a family reads: whole numbers (not true/false), >= 0
    odd = [k for k, v in c.items() if k in SIZE_FIELDS and v is not None
           and (type(v) is not int or v < 0)]
    if odd:
        raise ModelError(f"{path}: {odd[0]}={c[odd[0]]!r} is not a whole number >= 0")
    try:
        model = FAMILIES[kind](c)
        sizes = [model.n_layer, model.n_head, model.head_dim, model.params,
                 *(fn(1) for _, _, fn, *_ in model.groups)]
        if not all(isinstance(n, int) and n >= 1 for n in sizes):
            raise ValueError
    except ModelError as e:
        raise ModelError(f"{path}: {e}") from None
    except KeyError as e:
        raise ModelError(f"{path}: a {kind} config needs {e.args[0]!r}") from None
    except (TypeError, ValueError, ZeroDivisionError, OverflowError, MemoryError):
        raise ModelError(f"{path}: its sizes or layer_types do not make a model") from None
    name = os.path.splitext(os.path.basename(path))[0]  # (a model's folder: its name)
    if name == 'config':
        name = os.path.basename(os.path.dirname(os.path.abspath(path)))
    model.name, model.source = name, path
    model.context = c.get('max_position_embeddings') or c.get('n_positions') or 0
    return model


CHAPTER = 'n_layer=32,n_head=32,head_dim=128,params=7e9'  # 16-bit K/V, 8,192 tokens in its table
SIZES = {'n_layer': int, 'n_head': int, 'head_dim': int, 'n_kv_head': int, 'params': float}


def from_sizes(text):
    """'n_layer=32,n_head=32,head_dim=128[,n_kv_head=8][,params=7e9]' -> Published (softmax)."""
    pairs = dict(p.partition('=')[::2] for p in text.split(','))
    wrong = [k for k in pairs if k not in SIZES] or [k for k in ('n_layer', 'n_head', 'head_dim')
                                                     if k not in pairs]
    if wrong:
        raise ModelError(f"{text!r}: sizes are {', '.join(f'{k}=N' for k in SIZES)} (n_layer, "
                         f"n_head, head_dim needed); not {wrong[0]!r}")
    try:
        s = {k: SIZES[k](v) for k, v in pairs.items()}
    except ValueError:
        raise ModelError(f"{text!r}: sizes are numbers") from None
    kv, params = s.get('n_kv_head', s['n_head']), s.get('params', 0)
    whole = math.isfinite(params) and params == int(params)
    if min(s.values()) < 1 or s['n_head'] % kv or not whole:
        raise ModelError(f"{text!r}: sizes are whole numbers >= 1, n_kv_head dividing n_head")
    d, L = s['head_dim'], s['n_layer']
    groups = [(L, f"softmax, {kv} K/V heads of {d}", lambda T: kv_elements(T, kv, d, d), False, 0)]
    name = "the founding chapter's 7B-class model" * (text == CHAPTER) or f"--sizes={text}"
    return Published(groups, int(params), L, s['n_head'], d, name=name)
