"""
One causal Transformer (nanoGPT's GPT) whose attention block is picked by config: MHA, GQA, MQA
(softmax attention with n_kv_head K/V heads), MLA (DeepSeek-V2) and the linear-attention family (a
fixed state rewritten every token: Katharopoulos, RetNet, Mamba-2, DeltaNet, Gated DeltaNet), or a
per-layer mix of them ('hybrid'); a softmax layer may be windowed (a query sees its W most recent
keys, and the first n_sink: Mistral, Gemma, gpt-oss, StreamingLLM). Training / prefill feeds
L = S = T tokens under a causal mask; decode feeds L = 1 token that attends to S = T + 1 keys.
k_j, v_j depend only on tokens <= j, so each layout caches them (or a state); q is not cached.
This file is the switch (LAYOUTS names each layout's class); the maths is in ops/ (softmax.py,
mla.py, linear.py, window.py, cache.py, sampling.py).
"""

import math
from dataclasses import dataclass, fields, replace

import torch
import torch.nn as nn
from torch.nn import functional as F

from ops.cache import Cache, LayerCache
from ops.linear import conv_silu, features, linear_chunked, linear_step, mamba2_gate, retnet_decay
from ops.linear_fla import fla_runs, linear_fla
from ops.mla import attend_absorbed, attend_materialized
from ops.sampling import stream
from ops.softmax import apply_rope, attend, rope_table
from ops.window import band, kept

# The linear layouts, the founding chapter's table: each keeps a fixed state S per head and rewrites
# it every token,
#     S_t = α_t S_{t-1} (I - β_t k_t k_tᵀ) + β_t v_t k_tᵀ,     o_t = S_t q_t,
# and they differ only in the knob: how the old state is forgotten (α) and whether a write corrects
# it (β). layout: (forget: α_t, correct: the delta rule)
LINEAR_RULES = {
    'linear':         (None,    False),  # Katharopoulos et al. 2020: accumulate (α = 1, v kᵀ)
    'retnet':         ('decay', False),  # RetNet (Sun et al. 2023): α = γ_h, fixed per head
    'mamba2':         ('gate',  False),  # Mamba-2 (Dao & Gu 2024): α_t from the token
    'deltanet':       (None,    True),   # DeltaNet (Schlag et al. 2021; Yang et al. 2024): β_t
    'gated_deltanet': ('gate',  True),   # Gated DeltaNet (Yang, Kautz, Hatamizadeh 2024): both
}  # α's formulas: ops/linear.py's retnet_decay and mamba2_gate
# What one layer caches, in elements (batch 1): GPTConfig.cache_elements, and bench.py cache's
# published models, count with these.
def kv_elements(T, n_kv_head, d_k, d_v):  # softmax: a key and a value per K/V head and token
    return n_kv_head * (d_k + d_v) * T

def latent_elements(T, d_c, d_R):  # MLA: [c | k_R] per token, shared by every head
    return (d_c + d_R) * T

def state_elements(n_head, d_k, d_v, conv_channels=0, conv_size=1):  # linear: whatever T
    return n_head * d_k * d_v + conv_channels * (conv_size - 1)  # + the short conv's last inputs

# the fields only some layouts use, and their defaults
LAYER_FIELDS = {'n_kv_head': 0, 'kv_lora_rank': 0, 'rope_head_dim': 0, 'q_lora_rank': 0, 'conv_size': 4}

FIELD_RULES = [  # GPTConfig's rules of one field, checked after the types: (fields, rule, message)
    (('block_size', 'vocab_size', 'n_layer', 'n_head', 'n_embd', 'chunk_size', 'conv_size'), lambda n: n >= 1,
     "must be >= 1"),
    (('n_kv_head', 'kv_lora_rank', 'rope_head_dim', 'q_lora_rank', 'window', 'n_sink'),
     lambda n: n >= 0, "must be >= 0"),
    (('dropout',), lambda p: 0 <= p < 1, "must be in [0, 1)"),
    (('rope_base',), lambda b: 0 < b < math.inf, "must be a finite number > 0"),
    (('pos_emb',), lambda s: s in ('rope', 'learned'), "must be 'rope' or 'learned'"),
    (('linear_kernels',), lambda s: s in ('fla', 'torch'),
     "must be 'fla' (where they run, else ours) or 'torch' (ours)"),
]

@dataclass
class GPTConfig:
    block_size: int = 256
    vocab_size: int = 65       # tiny Shakespeare, char level
    n_layer: int = 6           # Transformer blocks
    n_head: int = 6            # query heads
    n_embd: int = 384          # width of the residual stream (head_dim = n_embd / n_head)
    dropout: float = 0.0
    bias: bool = False         # bias in Linears and LayerNorms, like GPT-2
    gelu_tanh: bool = False    # the MLP's GELU by its tanh approximation (GPT-2's 'gelu_new')
    attn: str = 'mha'          # a layout, or a hybrid 'gated_deltanet*3+gqa': per layer, repeated;
                               # 'gqa@512*5+gqa': a layer's own window (Gemma 3's 5 local : 1 global)
    window: int = 0            # every softmax layer sees its `window` latest keys, itself included
    n_sink: int = 0            # windowed layers see the first n_sink keys too (StreamingLLM's sinks)
    n_kv_head: int = 0         # K/V heads; 0 = mha n_head, gqa n_head's smallest divisor > 1, mqa 1
    pos_emb: str = 'rope'      # 'rope', or nanoGPT's 'learned' absolute positions
    rope_base: float = 10000.0  # RoPE's base θ: pair i turns at θ^(-2i/d) per position
    kv_lora_rank: int = 0      # MLA d_c, the cached latent; 0 = 4 * head_dim (DeepSeek-V2's ratio)
    rope_head_dim: int = 0     # MLA d_R, the decoupled rope q/k; 0 = head_dim / 2 (even, >= 2)
    q_lora_rank: int = 0       # MLA query compression; 0 = off (as DeepSeek-V2-Lite)
    chunk_size: int = 64       # linear layouts: chunk of the chunkwise-parallel training form
    linear_kernels: str = 'fla'  # linear layouts: fla's Triton kernels where they run, or 'torch'
    conv_size: int = 4         # linear layouts but 'linear': taps of the causal conv on q, k, v
    match_mha_params: bool = False  # widen/narrow the MLP so the model has MHA's parameter count

    def __post_init__(self):
        for f in fields(self):  # model_args may hold anything (True, an int to Python: refused)
            kind = type(getattr(self, f.name))
            if kind is not f.type and not (kind is int and f.type is float):
                self.bad(f.name, f"must be of type {f.type.__name__}")
        for names, rule, message in FIELD_RULES:
            for name in names:
                if not rule(getattr(self, name)):
                    self.bad(name, message)
        if self.n_embd % self.n_head:
            self.bad('n_embd', f"must be divisible by n_head={self.n_head}")
        layouts = set(self.pattern())
        if len([a for a in layouts if a not in LINEAR_RULES]) > 1:
            self.bad('attn', "mixes softmax layouts: a hybrid pairs linear layouts with one softmax layout")
        for layout in sorted(layouts):  # each layout's rules, and the defaults of its fields
            LAYOUTS[layout].configure(self, layout)
        self.check_windows()
        # the fields no layer uses keep their defaults (or what an older train.py filled in)
        used = self.layer_fields()
        old = dict(n_kv_head=self.n_head, **MultiHeadLatentAttention.sizes(self))
        for name, default in LAYER_FIELDS.items():
            if name not in used and getattr(self, name) not in (default, old.get(name)):
                self.bad(name, f"no layer of attn={self.attn!r} uses it")
            setattr(self, name, getattr(self, name) if name in used else default)
        if self.match_mha_params and (hidden := mlp_hidden(self)) < 1:
            self.bad('match_mha_params', f"the MLP would need {hidden} units: the attention alone "
                     "outweighs MHA's block (lower its sizes, or turn it off)")

    def bad(self, field, rule):
        raise ValueError(f"GPTConfig.{field}={getattr(self, field)!r} is invalid: {rule}")

    def period(self):
        """'gqa@64*2+gqa' -> [('gqa', 64), ('gqa', 64), ('gqa', 0)]: one period of the layers, each
        layout with its window (its '@W', else `window` for a softmax layer; 0: full or linear)."""
        parts = [(p, *p.partition('*')[::2]) for p in self.attn.split('+')]
        whole = lambda n: n.isascii() and n.isdigit() and int(n) > 0  # >= 1
        layers = []
        for part, layer, n in parts:
            name, at, w = layer.partition('@')
            if name not in LAYOUTS or n and not whole(n) or at and not whole(w):
                self.bad('attn', f"must be one of {tuple(LAYOUTS)}, or a hybrid of them like "
                         "'gated_deltanet*3+gqa'; a layer's own window of W >= 1 keys: 'gqa@64'"
                         + (f"; not {part!r}" if len(parts) > 1 else ''))
            if at and name in LINEAR_RULES:
                self.bad('attn', f"{part!r}: a window is for softmax layers ({name} keeps a fixed "
                         "state)")
            window = int(w) if at else self.window * (name not in LINEAR_RULES)
            layers.append((name, window, int(n or 1)))
        if (length := sum(n for *_, n in layers)) > self.n_layer:
            self.bad('attn', f"has {length} layers, more than n_layer={self.n_layer}")
        return [(name, window) for name, window, n in layers for _ in range(n)]

    def pattern(self):
        """'gated_deltanet*3+gqa' -> ['gated_deltanet'] * 3 + ['gqa']: one period's layouts."""
        return [name for name, _ in self.period()]

    @property
    def layouts(self):  # each layer's: the pattern repeated (Qwen3-Next's 3:1 on 6 layers: 3, 1, 2)
        pattern = self.pattern()
        return [pattern[i % len(pattern)] for i in range(self.n_layer)]

    @property
    def windows(self):  # each layer's window (0: full attention, or a linear layer)
        period = [w for _, w in self.period()]
        return [period[i % len(period)] for i in range(self.n_layer)]

    def layer_counts(self, windows=False):
        """{layout: its layers} (windows=True: {(layout, window): ...}), counted, not listed
        (n_layer may be huge)."""
        p = self.period() if windows else self.pattern()
        full, rest = divmod(self.n_layer, len(p))
        return {a: full * p.count(a) + p[:rest].count(a) for a in dict.fromkeys(p)}

    def check_windows(self):
        """window and '@W': two ways to say it, never both; sinks need a window; a window under
        block_size - n_sink (else it cuts no pair of a training sequence)."""
        windows = {w for _, w in self.period() if w}
        if self.window and '@' in self.attn:
            self.bad('window', f"give one: window= windows every softmax layer, attn={self.attn!r} "
                     "windows its own")
        if self.window and not self.softmax:
            self.bad('window', f"attn={self.attn!r} has no softmax layer to window (a linear layer "
                     "keeps a fixed state)")
        if self.n_sink and not windows:
            self.bad('n_sink', "sinks are the first keys a windowed layer keeps seeing: give a "
                     "window (window=W, or attn's '@W')")
        if windows and max(windows) + self.n_sink >= self.block_size:
            sinks = f" and {self.n_sink} sinks" * bool(self.n_sink)
            self.bad('window' if self.window else 'attn', f"{max(windows)} keys{sinks} see all "
                     f"of a block_size={self.block_size} sequence: a window must be < block_size - "
                     "n_sink (full attention: none)")

    @property
    def endless(self):
        """Generation never starts over at block_size: every softmax layer is windowed (its cache
        stops growing) and RoPE depends only on the distance, which a window keeps < block_size."""
        softmax = [w for a, w in self.period() if a not in LINEAR_RULES]
        return self.pos_emb == 'rope' and bool(softmax) and all(softmax)

    @property
    def stack(self):  # attn, with the window and sinks its layers have: 'gqa, window 16 + 4 sinks'
        sinks = f" + {self.n_sink} sinks" * bool(self.n_sink)
        return self.attn + f", window {self.window}" * bool(self.window) + sinks

    @property
    def softmax(self):  # the softmax layout of the stack, or None if every layer is linear
        return next((a for a in self.pattern() if a not in LINEAR_RULES), None)

    @property
    def head_dim(self):
        return self.n_embd // self.n_head

    def layer_fields(self):  # the per-layout fields (LAYER_FIELDS, chunk_size, ...) its layers use
        return {f for a in set(self.pattern()) for f in LAYOUTS[a].uses(a)}

    def used_fields(self):
        """The fields this stack's layers use (the others keep their defaults, never read)."""
        used = self.layer_fields() | ({'rope_base'} if self.pos_emb == 'rope' and self.softmax else set())
        used |= {'window'} if self.softmax else set()
        used |= {'n_sink'} if any(w for _, w in self.period()) else set()
        per_layout = {*LAYER_FIELDS, 'chunk_size', 'linear_kernels', 'rope_base', 'window',
                      'n_sink'}
        return [f.name for f in fields(self) if f.name not in per_layout - used]

    def cache_elements(self, T, layout=None, window=0):
        """Elements cached after T tokens (batch 1), all layers', or a layer's: the README's table."""
        if layout is None:
            layers = self.layer_counts(windows=True).items()
            return sum(n * self.cache_elements(T, *layer) for layer, n in layers)
        return LAYOUTS[layout].cache_elements(self, layout, T, window)

    def cache_bytes(self, T, dtype=torch.float32):  # a linear layout's state: float32 at least
        state = max(dtype.itemsize, torch.float32.itemsize)
        itemsize = lambda a: state if a in LINEAR_RULES else dtype.itemsize
        return sum(n * self.cache_elements(T, a, w) * itemsize(a)
                   for (a, w), n in self.layer_counts(windows=True).items())

# --- The layouts: forward(x, rope, pos, cache) and init_cache(batch, capacity, dtype, device) ---

class Attention(nn.Module):
    """What the layouts share: heads() splits heads, out() merges them via c_proj (built last: the
    init's order); a softmax layer's window (0: none) and sinks."""

    def __init__(self, config, window=0):
        super().__init__()
        self.config, self.n_head, self.head_dim = config, config.n_head, config.head_dim
        self.dropout, self.resid_dropout = config.dropout, nn.Dropout(config.dropout)
        self.window, self.n_sink = window, config.n_sink if window else 0

    def uncached_mask(self, L, device):
        """The mask of L tokens at 0..L-1 without a cache: None (causal), or the window's band."""
        positions = torch.arange(L, device=device)
        return band(positions, positions, self.window, self.n_sink) if self.window else None

    @property
    def dropout_p(self):  # attention's dropout, in training only
        return self.dropout if self.training else 0.0

    def heads(self, x, n):  # (B, L, n * d) -> (B, n, L, d); not -1: a batch may be empty
        return x.view(x.size(0), x.size(1), n, x.size(2) // n).transpose(1, 2)

    def out(self, y):  # (B, nh, L, d) -> (B, L, n_embd)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).flatten(2)))

class CausalSelfAttention(Attention):
    """MHA / GQA / MQA: groups of n_head / n_kv_head query heads share a K/V head; it caches those."""
    KV_HEADS = {'mha': lambda h: [h], 'mqa': lambda h: [1],  # K/V heads allowed, the first by default
                'gqa': lambda h: [d for d in range(2, h) if h % d == 0]}

    @classmethod
    def configure(cls, c, layout):
        allowed = cls.KV_HEADS[layout](c.n_head)
        c.n_kv_head = c.n_kv_head or (allowed[0] if allowed else 0)
        if c.n_kv_head not in allowed:
            c.bad('n_kv_head' if allowed else 'n_head', f"attn={c.attn!r} with n_head={c.n_head} allows {allowed}"
                  + " (gqa: the divisors 1 < d < n_head)" * (layout == 'gqa'))
        if c.pos_emb == 'rope' and c.head_dim % 2:  # RoPE rotates pairs
            c.bad('n_embd', f"n_embd / n_head = {c.head_dim} must be even for RoPE (or use pos_emb='learned')")

    @staticmethod
    def uses(layout):
        return ('n_kv_head',)

    @staticmethod
    def cache_elements(c, layout, T, window=0):  # K and V of the n_kv_head heads (a window's last)
        return kv_elements(kept(T, window, c.n_sink), c.n_kv_head, c.head_dim, c.head_dim)

    def __init__(self, config, layout=None, window=0):
        super().__init__(config, window)
        self.n_kv_head = config.n_kv_head
        qkv = (self.n_head + 2 * self.n_kv_head) * self.head_dim
        self.c_attn = nn.Linear(config.n_embd, qkv, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x, rope, pos, cache=None):
        H, H_kv = self.n_head, self.n_kv_head
        qkv = self.heads(self.c_attn(x), H + 2 * H_kv)  # (B, nh + 2 n_kv, L, hs): q, k, v
        qk = apply_rope(qkv[:, :H + H_kv], rope)        # queries and keys rotated in one call
        q, k, v = qk[:, :H], qk[:, H:], qkv[:, H + H_kv:]
        if cache is None:  # causal, or the window's band
            mask = self.uncached_mask(x.size(1), x.device)
        else:
            k, v, mask = cache.update(pos, k, v)  # (B, n_kv, S, hs): every key the mask covers
        return self.out(attend(q, k, v, dropout_p=self.dropout_p, mask=mask))  # (B, nh, L, hs)

    def init_cache(self, batch_size, capacity, dtype, device):
        slots = kept(capacity, self.window, self.n_sink)  # a windowed layer's: a ring
        shape = (batch_size, self.n_kv_head, slots, self.head_dim)
        return LayerCache(dtype, device, window=self.window, n_sink=self.n_sink, k=shape, v=shape)

class LinearAttention(Attention):
    """The linear layouts: no softmax, no RoPE; the cache is a float32 state per head, S (d_k, d_v).
    'linear' (Katharopoulos): phi = elu + 1 and a normalizer z = Σ phi(k), S's last column (v
    gets a channel of ones). The others, as Gated DeltaNet: q, k, v = SiLU(a causal depthwise conv
    over the last conv_size tokens), whose inputs are cached too; q, k L2-normed, q / sqrt(d_k);
    the output RMS-normed per head, SiLU-gated."""

    @staticmethod
    def configure(c, layout):
        if layout != 'linear' and c.conv_size > max(c.block_size, LAYER_FIELDS['conv_size']):
            c.bad('conv_size', f"must be <= block_size={c.block_size} (taps further back never see a token)")

    @staticmethod
    def uses(layout):  # 'linear' has no short conv
        return ('chunk_size', 'linear_kernels') + ('conv_size',) * (layout != 'linear')

    @staticmethod
    def cache_elements(c, layout, T, window=0):  # a state per head, + z (S's column) or the conv's
        if layout == 'linear':
            return state_elements(c.n_head, c.head_dim, c.head_dim + 1)
        return state_elements(c.n_head, c.head_dim, c.head_dim, 3 * c.n_embd, c.conv_size)

    def __init__(self, config, layout, window=0):
        super().__init__(config)
        (self.forget, self.delta), self.normalizer = LINEAR_RULES[layout], layout == 'linear'
        C, H = config.n_embd, self.n_head
        # one projection: q, k, v, the output gate, W_a x, W_β x (the parts the rule has)
        parts = {'qkv': 3 * C, 'gate': C * (not self.normalizer), 'a': H * (self.forget == 'gate'),
                 'beta': H * self.delta}
        self.parts = {name: n for name, n in parts.items() if n}
        self.c_attn = nn.Linear(C, sum(self.parts.values()), bias=config.bias)
        if self.forget == 'gate':  # Mamba-2's init: A ~ U[1, 16], dt ~ logU[1e-3, 0.1]
            self.A_log = nn.Parameter(torch.empty(H).uniform_(1, 16).log())
            dt = torch.empty(H).uniform_(math.log(1e-3), math.log(0.1)).exp()
            self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # softplus(dt_bias) = dt
        if not self.normalizer:
            K = config.conv_size  # the short conv's taps, per channel of q, k, v; nn.Conv1d's init
            self.conv = nn.Parameter(torch.empty(K, 3 * C).uniform_(-K ** -0.5, K ** -0.5))
            self.o_norm = nn.RMSNorm(self.head_dim, eps=1e-6)
        self.c_proj = nn.Linear(C, C, bias=config.bias)

    def forward(self, x, rope, pos, cache=None):
        (B, L, _), H, f32 = x.shape, self.n_head, torch.promote_types(x.dtype, torch.float32)
        parts = dict(zip(self.parts, self.c_attn(x).split(list(self.parts.values()), dim=-1)))
        S = cache.state if cache is not None else None  # None: a zero state
        with torch.autocast(x.device.type, enabled=False):  # conv, gates, state, solve: f32
            qkv = parts['qkv'].to(f32)                                        # (B, L, 3 n_embd)
            if not self.normalizer:  # the causal conv, after the K - 1 inputs a cache holds
                before = cache.conv if cache is not None else None
                qkv, seen = conv_silu(qkv, before, self.conv.to(f32))
            q, k, v = features(qkv, H, self.head_dim, self.normalizer)       # (B, nh, L, hs) each
            g, beta = self.knob(parts, B, L, f32)                             # (B, nh, L) each
            y, new_S = self.apply_rule(q, k, v, g, beta, S)
        if cache is not None:  # in place: the buffers keep their addresses (CUDA graphs)
            cache.state.copy_(new_S)
            if not self.normalizer:
                cache.conv.copy_(seen[:, L:])  # the last K - 1 inputs
        if self.normalizer:
            return self.out((y[..., :-1] / (y[..., -1:] + 1e-6)).type_as(x))
        return self.out(self.o_norm(y.type_as(x)) * F.silu(self.heads(parts['gate'], H)))

    def knob(self, parts, B, L, dtype):
        """g = log α and β, (B, nh, L): how much the rule forgets (None: α = 1) and corrects."""
        g, device = None, parts['qkv'].device
        if self.forget == 'decay':
            g = retnet_decay(self.n_head, B, L, dtype, device)
        if self.forget == 'gate':
            g = mamba2_gate(parts['a'].to(dtype), self.A_log.to(dtype), self.dt_bias)
        beta = (torch.sigmoid(parts['beta'].to(dtype)).transpose(1, 2) if self.delta else
                torch.ones(B, self.n_head, L, dtype=dtype, device=device))
        return g if g is None else g.contiguous(), beta.contiguous()  # (else products are strided)

    def apply_rule(self, q, k, v, g, beta, S):  # from the state S (None: zero): y, the new S
        if self.config.linear_kernels == 'fla' and fla_runs(q):  # the same on fla's kernels
            return linear_fla(q, k, v, g, beta, S, self.delta, S is not None)
        if q.size(2) == 1 and S is not None:  # decode
            return linear_step(q, k, v, g, beta, S, self.delta)
        return linear_chunked(q, k, v, g, beta, S, self.delta, self.config.chunk_size, S is not None)

    def init_cache(self, batch_size, capacity, dtype, device):  # in float32 at least, as the state
        B, K, C = batch_size, self.config.conv_size, self.config.n_embd
        conv = {} if self.normalizer else {'conv': (B, K - 1, 3 * C)}  # the conv's last inputs
        state = (B, self.n_head, self.head_dim, self.head_dim + self.normalizer)  # + z for 'linear'
        return LayerCache(torch.promote_types(dtype, torch.float32), device, grows=False, state=state, **conv)

class MultiHeadLatentAttention(Attention):
    """DeepSeek-V2 MLA. K and V come from a small latent c = norm(W_DKV h), shared by all heads;
    position comes from a decoupled rope key k_R = RoPE(W_KR h), also shared by all heads, because
    RoPE cannot be absorbed into W_UK. The cache holds [c | k_R]: d_c + d_R elements per token."""

    @staticmethod
    def sizes(c):  # what 0 means: DeepSeek-V2's ratios to head_dim
        return dict(kv_lora_rank=4 * c.head_dim, rope_head_dim=max(2, c.head_dim // 4 * 2))

    @classmethod
    def configure(cls, c, layout):
        for name, default in cls.sizes(c).items():
            setattr(c, name, getattr(c, name) or default)
        if c.rope_head_dim % 2:
            c.bad('rope_head_dim', "must be even for attn='mla' (RoPE rotates pairs)")

    @staticmethod
    def uses(layout):
        return ('kv_lora_rank', 'rope_head_dim', 'q_lora_rank')

    @staticmethod
    def cache_elements(c, layout, T, window=0):  # [c | k_R], shared by every head (a window's last)
        return latent_elements(kept(T, window, c.n_sink), c.kv_lora_rank, c.rope_head_dim)

    def __init__(self, config, layout=None, window=0):
        super().__init__(config, window)
        H, self.dh, self.dR, self.dc = config.n_head, config.head_dim, config.rope_head_dim, config.kv_lora_rank
        C, q_out, bias = config.n_embd, H * (self.dh + self.dR), config.bias  # q: [nope | rope]
        r = config.q_lora_rank  # q through a normed low-rank bottleneck (W_DQ, W_UQ) too, or not
        self.c_q = (nn.Sequential(nn.Linear(C, r, bias=bias), nn.RMSNorm(r, eps=1e-6),
                                  nn.Linear(r, q_out, bias=bias)) if r else
                    nn.Linear(C, q_out, bias=bias))
        self.kv_down = nn.Linear(C, self.dc + self.dR, bias=bias)  # W_DKV and W_KR stacked
        self.kv_norm = nn.RMSNorm(self.dc, eps=1e-6)
        self.k_up = nn.Linear(self.dc, H * self.dh, bias=False)  # W_UK; no bias: absorbed at decode
        self.v_up = nn.Linear(self.dc, H * self.dh, bias=False)  # W_UV; no bias: absorbed at decode
        self.c_proj = nn.Linear(H * self.dh, C, bias=bias)
        self.scale = 1.0 / math.sqrt(self.dh + self.dR)  # on both score terms

    def forward(self, x, rope, pos, cache=None):
        H, dh, dR, dc = self.n_head, self.dh, self.dR, self.dc
        q = self.heads(self.c_q(x), H)                                    # (B, nh, L, dh + dR)
        q = torch.cat([q[..., :dh], apply_rope(q[..., dh:], rope)], dim=-1)
        c, k_rope = self.kv_down(x).unsqueeze(1).split([dc, dR], dim=-1)  # (B, 1, L, dc), (.., dR)
        latent = torch.cat([self.kv_norm(c), apply_rope(k_rope, rope)], dim=-1)  # (B, 1, L, dc+dR)
        k_up, v_up, scale, dropout_p = self.k_up, self.v_up, self.scale, self.dropout_p
        if cache is None:  # training, and uncached generation: K and V formed per head
            mask = self.uncached_mask(x.size(1), x.device)
            return self.out(attend_materialized(q, latent, k_up, v_up, scale, dropout_p, mask))
        latent, mask = cache.update(pos, latent)  # (B, 1, S, dc + dR): every latent the mask covers
        return self.out(attend_absorbed(q, latent, k_up, v_up, scale, dropout_p, mask))

    def init_cache(self, batch_size, capacity, dtype, device):
        latent = (batch_size, 1, kept(capacity, self.window, self.n_sink), self.dc + self.dR)
        return LayerCache(dtype, device, window=self.window, n_sink=self.n_sink, latent=latent)

# Every layout, and its class: configure(config, layout) checks a config and fills in the layout's
# defaults, uses() names its fields, cache_elements() counts its cache. Adding a layout adds its
# class and its line here.
LAYOUTS = {'mha': CausalSelfAttention, 'gqa': CausalSelfAttention, 'mqa': CausalSelfAttention,
           'mla': MultiHeadLatentAttention, **dict.fromkeys(LINEAR_RULES, LinearAttention)}
ATTN_LAYOUTS = tuple(LAYOUTS)

# --- The Transformer: nanoGPT's MLP, Block and GPT ------------------------------------------------

def mlp_hidden(config):
    """4 * n_embd, or (match_mha_params) the width that gives the model MHA's parameter count."""
    if not config.match_mha_params:
        return 4 * config.n_embd
    with torch.device('meta'):  # counted, not allocated; MHA without RoPE's even head_dim rule
        count = lambda cfg, a: sum(p.numel() for p in LAYOUTS[a](cfg, a).parameters())
        mha = replace(config, attn='mha', **LAYER_FIELDS, pos_emb='learned', match_mha_params=False,
                      window=0, n_sink=0)
        extra = sum(n * (count(mha, 'mha') - count(config, a)) for a, n in config.layer_counts().items())
        extra /= config.n_layer
    # each unit costs a row of c_fc and a column of c_proj (and a bias of c_fc)
    return 4 * config.n_embd + round(extra / (2 * config.n_embd + config.bias))

class MLP(nn.Module):

    def __init__(self, config):
        super().__init__()
        hidden = mlp_hidden(config)
        self.c_fc = nn.Linear(config.n_embd, hidden, bias=config.bias)
        self.gelu = nn.GELU(approximate='tanh' if config.gelu_tanh else 'none')
        self.c_proj = nn.Linear(hidden, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))

class Block(nn.Module):

    def __init__(self, config, layout, window=0):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = LAYOUTS[layout](config, layout, window)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x, rope, pos, cache=None):
        x = x + self.attn(self.ln_1(x), rope, pos, cache)
        x = x + self.mlp(self.ln_2(x))
        return x

class GPT(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config, layout, window)
                             for layout, window in zip(config.layouts, config.windows)]),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
        ))
        if config.pos_emb == 'learned':
            self.transformer.wpe = nn.Embedding(config.block_size, config.n_embd)
        # RoPE on MLA's d_R (0 without an MLA layer) or a head; the linear layouts have none
        rope_dim = config.rope_head_dim or config.head_dim
        self.rope_dim = rope_dim if config.pos_emb == 'rope' and config.softmax else 0
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():  # GPT-2: scaled init of the residual projections
            if pn.endswith('c_proj.weight'):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def get_num_params(self, non_embedding=True):
        n_params = sum(p.numel() for p in self.parameters())
        if non_embedding and 'wpe' in self.transformer:
            n_params -= self.transformer.wpe.weight.numel()
        return n_params

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            torch.nn.init.zeros_(module.bias)

    def rope(self, positions):
        """RoPE's (L, 2, d) table, or None; per forward, as a buffer would be cast to 16 bits."""
        return rope_table(self.rope_dim, positions, self.config.rope_base) if self.rope_dim else None

    def init_cache(self, batch_size, dtype=None, device=None, static=False):
        """An empty cache for batch_size sequences of up to block_size tokens (any length, every
        softmax layer windowed: config.endless). static=True: fixed shapes for torch.compile /
        CUDA graphs; its position is never read on the host, so block_size is the caller's to
        keep."""
        p = self.lm_head.weight
        return Cache([block.attn.init_cache(batch_size, self.config.block_size, dtype or p.dtype, device or p.device)
                      for block in self.transformer.h], static)

    def forward(self, idx, targets=None, cache=None):
        """idx (B, L): tokens at 0..L-1, or with a cache the L after the len(cache) it holds."""
        B, L = idx.size()
        pos = cache.pos if cache is not None else 0  # a static cache's is a tensor, never read here
        too_long = not (torch.is_tensor(pos) or self.config.endless) and pos + L > self.config.block_size
        if L == 0 or too_long:  # (0: no input)
            raise ValueError(f"cannot feed {L} tokens at position {pos}: block_size is {self.config.block_size}")
        positions = torch.arange(L, device=idx.device) + pos  # (L,)
        x = self.transformer.wte(idx)  # (B, L, n_embd)
        if self.config.pos_emb == 'learned':
            x = x + self.transformer.wpe(positions)
        x = self.transformer.drop(x)
        rope = self.rope(positions)
        for i, block in enumerate(self.transformer.h):
            x = block(x, rope, pos, cache.layers[i] if cache is not None else None)
        if cache is not None:
            cache.pos += L  # once, after the last layer (in place for a tensor)
        x = self.transformer.ln_f(x)
        if targets is None and cache is None:  # inference shortcut: only the last position
            x = x[:, [-1], :]
        logits = self.lm_head(x)
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, top_p=None, use_cache=True):
        """idx (B, T) followed by max_new_tokens sampled tokens; temperature 0 = greedy."""
        tokens = stream(self, idx, max_new_tokens, temperature, top_k, top_p, use_cache)
        return torch.cat([idx, *tokens], dim=1)
