"""
One causal Transformer (nanoGPT's GPT) whose attention block is picked by config: MHA, GQA, MQA (softmax
attention with n_kv_head K/V heads), MLA (DeepSeek-V2) and the linear-attention family (a fixed state rewritten
every token: Katharopoulos, RetNet, Mamba-2, DeltaNet, Gated DeltaNet), or a per-layer mix of them ('hybrid').
Training / prefill feeds L = S = T tokens under a causal mask; decode feeds L = 1 token that attends to
S = T + 1 keys. k_j, v_j depend only on tokens <= j, so each layout caches them (or a state); q is not cached.
This file is the switch (LAYOUTS names each layout's class); the maths is in softmax.py and linear.py.
"""

import math
from dataclasses import dataclass, fields, replace

import torch
import torch.nn as nn
from torch.nn import functional as F

from ops.cache import Cache, LayerCache
from ops.linear import ShortConv, l2norm, linear_chunked, linear_step, phi
from ops.linear_fla import fla_runs, linear_fla
from ops.softmax import apply_rope, attend, rope_table

# The linear layouts, the founding chapter's table: each keeps a fixed state S per head and rewrites it every token,
#     S_t = α_t S_{t-1} (I - β_t k_t k_tᵀ) + β_t v_t k_tᵀ,     o_t = S_t q_t,
# and they differ only in the knob: how the old state is forgotten (α) and whether a write corrects it (β).
LINEAR_RULES = {  # layout: (forget: α_t, correct: the delta rule)
    'linear':         (None,    False),  # Katharopoulos et al. 2020: accumulate (α = 1, write v kᵀ), phi = elu + 1
    'retnet':         ('decay', False),  # RetNet's decay (Sun et al. 2023): α = γ_h = 1 - 2^(-5-h), fixed per head
    'mamba2':         ('gate',  False),  # Mamba-2's gate: α_t = exp(-exp(A_log) softplus(W_a x + dt_bias)) on v kᵀ,
                                         # Gated DeltaNet's "Mamba2" (Dao & Gu 2024 less Δ_t on the input, D skip)
    'deltanet':       (None,    True),   # DeltaNet (Schlag et al. 2021; Yang et al. 2024): β_t = σ(W_β x), α = 1
    'gated_deltanet': ('gate',  True),   # Gated DeltaNet (Yang, Kautz, Hatamizadeh 2024): both
}
LAYER_FIELDS = {'n_kv_head': 0, 'kv_lora_rank': 0, 'rope_head_dim': 0, 'q_lora_rank': 0, 'conv_size': 4}  # defaults

@dataclass
class GPTConfig:
    block_size: int = 256
    vocab_size: int = 65       # tiny Shakespeare, char level
    n_layer: int = 6
    n_head: int = 6
    n_embd: int = 384
    dropout: float = 0.0
    bias: bool = False         # bias in Linears and LayerNorms, like GPT-2
    attn: str = 'mha'          # a name of LAYOUTS, or a hybrid 'gated_deltanet*3+gqa': per layer, repeated
    n_kv_head: int = 0         # K/V heads; 0 = the layout's: mha n_head, gqa n_head's smallest divisor > 1, mqa 1
    pos_emb: str = 'rope'      # 'rope', or nanoGPT's 'learned' absolute positions
    rope_base: float = 10000.0
    kv_lora_rank: int = 0      # MLA d_c, the cached latent; 0 = 4 * head_dim (DeepSeek-V2's ratio)
    rope_head_dim: int = 0     # MLA d_R, the decoupled rope query/key; 0 = head_dim / 2 (even, >= 2)
    q_lora_rank: int = 0       # MLA query compression; 0 = off (as DeepSeek-V2-Lite)
    chunk_size: int = 64       # linear layouts: chunk of the chunkwise-parallel training form
    linear_kernels: str = 'fla'  # linear layouts: fla's Triton kernels where they run (CUDA, fla installed), or 'torch'
    conv_size: int = 4         # linear layouts but 'linear': a causal depthwise conv on q, k, v over this many tokens
    match_mha_params: bool = False  # widen/narrow the MLP so the model has MHA's parameter count

    def __post_init__(self):
        for f in fields(self):  # a checkpoint's model_args may hold anything (True is an int to Python: refused)
            kind = type(getattr(self, f.name))
            if kind is not f.type and not (kind is int and f.type is float):
                self.bad(f.name, f"must be of type {f.type.__name__}")
        for name in ('block_size', 'vocab_size', 'n_layer', 'n_head', 'n_embd', 'chunk_size', 'conv_size'):
            if getattr(self, name) < 1:
                self.bad(name, "must be >= 1")
        for name in ('n_kv_head', 'kv_lora_rank', 'rope_head_dim', 'q_lora_rank'):
            if getattr(self, name) < 0:
                self.bad(name, "must be >= 0")
        if not 0 <= self.dropout < 1:
            self.bad('dropout', "must be in [0, 1)")
        if not 0 < self.rope_base < math.inf:
            self.bad('rope_base', "must be a finite number > 0")
        if self.pos_emb not in ('rope', 'learned'):
            self.bad('pos_emb', "must be 'rope' or 'learned'")
        if self.linear_kernels not in ('fla', 'torch'):
            self.bad('linear_kernels', "must be 'fla' (where they run, else ours) or 'torch' (ours)")
        if self.n_embd % self.n_head:
            self.bad('n_embd', f"must be divisible by n_head={self.n_head}")
        layouts = set(self.pattern())
        if len([a for a in layouts if a not in LINEAR_RULES]) > 1:
            self.bad('attn', "mixes softmax layouts: a hybrid pairs linear layouts with one softmax layout")
        for layout in sorted(layouts):  # each layout's own rules, and the defaults of the fields it uses
            LAYOUTS[layout].configure(self, layout)
        used = {f for a in layouts for f in LAYOUTS[a].uses(a)}  # the others keep their defaults (or what an older
        old = dict(n_kv_head=self.n_head, kv_lora_rank=4 * self.head_dim, rope_head_dim=max(2, self.head_dim // 4 * 2))
        for name, default in LAYER_FIELDS.items():  # train.py filled in: each head its K/V, MLA's sizes)
            if name not in used and getattr(self, name) not in (default, old.get(name)):
                self.bad(name, f"no layer of attn={self.attn!r} uses it")
            setattr(self, name, getattr(self, name) if name in used else default)
        if self.match_mha_params and (hidden := mlp_hidden(self)) < 1:
            self.bad('match_mha_params', f"the MLP would need {hidden} units: the attention alone outweighs MHA's "
                     "block (lower its sizes, or turn it off)")

    def bad(self, field, rule):
        raise ValueError(f"GPTConfig.{field}={getattr(self, field)!r} is invalid: {rule}")

    def pattern(self):
        """'gated_deltanet*3+gqa' -> ['gated_deltanet'] * 3 + ['gqa']: one period of the layers."""
        parts = [(p, *p.partition('*')[::2]) for p in self.attn.split('+')]
        count = lambda n: not n or n.isascii() and n.isdigit() and int(n) > 0  # name*n: a count >= 1, or none
        wrong = [p for p, name, n in parts if name not in LAYOUTS or not count(n)]
        if wrong:
            self.bad('attn', f"must be one of {tuple(LAYOUTS)}, or a hybrid of them like 'gated_deltanet*3+gqa'"
                     + (f"; not {wrong[0]!r}" if len(parts) > 1 else ''))
        if (length := sum(int(n or 1) for _, _, n in parts)) > self.n_layer:
            self.bad('attn', f"has {length} layers, more than n_layer={self.n_layer}")
        return [name for _, name, n in parts for _ in range(int(n or 1))]

    @property
    def layouts(self):  # each layer's: the pattern repeated over n_layer (Qwen3-Next's 3:1 on 6 layers: 3, 1, 2)
        pattern = self.pattern()
        return [pattern[i % len(pattern)] for i in range(self.n_layer)]

    def layer_counts(self):  # {layout: its number of layers}, counted without listing them (n_layer may be huge)
        p, (full, rest) = self.pattern(), divmod(self.n_layer, len(self.pattern()))
        return {a: full * p.count(a) + p[:rest].count(a) for a in dict.fromkeys(p)}

    @property
    def softmax(self):  # the softmax layout of the stack, or None if every layer is linear
        return next((a for a in self.pattern() if a not in LINEAR_RULES), None)

    @property
    def head_dim(self):
        return self.n_embd // self.n_head

    def used_fields(self):
        """The fields this stack's layers use (the others keep their defaults: nothing reads them)."""
        used = {f for a in set(self.pattern()) for f in LAYOUTS[a].uses(a)}
        used |= {'rope_base'} if self.pos_emb == 'rope' and self.softmax else set()
        linear_only = {*LAYER_FIELDS, 'chunk_size', 'linear_kernels', 'rope_base'}
        return [f.name for f in fields(self) if f.name not in linear_only - used]

    def cache_elements(self, T, layout=None):
        """Elements a cache holds after T tokens (batch 1): the table of the README; all layers, or one layout's."""
        if layout is None:
            return sum(n * self.cache_elements(T, a) for a, n in self.layer_counts().items())
        return LAYOUTS[layout].cache_elements(self, layout, T)

    def cache_bytes(self, T, dtype=torch.float32):  # linear layouts keep their state in float32 at least
        state = torch.promote_types(dtype, torch.float32).itemsize
        return sum(n * self.cache_elements(T, a) * (state if a in LINEAR_RULES else dtype.itemsize)
                   for a, n in self.layer_counts().items())

# --- The attention layouts: same forward(x, rope, pos, cache) and init_cache(batch, capacity, dtype, device) ---

class Attention(nn.Module):
    """What the layouts share: heads() splits heads, out() merges them via c_proj (built last: the init's order)."""

    def __init__(self, config):
        super().__init__()
        self.config, self.n_head, self.head_dim, self.dropout = config, config.n_head, config.head_dim, config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)

    def heads(self, x, n):  # (B, L, n * d) -> (B, n, L, d)
        return x.view(x.size(0), x.size(1), n, x.size(2) // n).transpose(1, 2)  # (not -1: a batch may be empty)

    def out(self, y):  # (B, nh, L, d) -> (B, L, n_embd)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).flatten(2)))

class CausalSelfAttention(Attention):
    """MHA / GQA / MQA: groups of n_head / n_kv_head query heads share a K/V head; only those are cached."""
    KV_HEADS = {'mha': lambda h: [h], 'gqa': lambda h: [d for d in range(2, h) if h % d == 0], 'mqa': lambda h: [1]}

    @classmethod
    def configure(cls, c, layout):  # the K/V heads the layout allows, the first its default; RoPE rotates pairs
        allowed = cls.KV_HEADS[layout](c.n_head)
        c.n_kv_head = c.n_kv_head or (allowed[0] if allowed else 0)
        if c.n_kv_head not in allowed:
            c.bad('n_kv_head' if allowed else 'n_head', f"attn={c.attn!r} with n_head={c.n_head} allows {allowed}"
                  + " (gqa: the divisors 1 < d < n_head)" * (layout == 'gqa'))
        if c.pos_emb == 'rope' and c.head_dim % 2:
            c.bad('n_embd', f"n_embd / n_head = {c.head_dim} must be even for RoPE (or use pos_emb='learned')")

    @staticmethod
    def uses(layout):
        return ('n_kv_head',)

    @staticmethod
    def cache_elements(c, layout, T):  # K and V of the n_kv_head heads
        return 2 * c.n_kv_head * c.head_dim * T

    def __init__(self, config, layout=None):
        super().__init__(config)
        self.n_kv_head = config.n_kv_head
        self.c_attn = nn.Linear(config.n_embd, (self.n_head + 2 * self.n_kv_head) * self.head_dim, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x, rope, pos, cache=None):
        H, H_kv = self.n_head, self.n_kv_head
        qkv = self.heads(self.c_attn(x), H + 2 * H_kv)  # (B, nh + 2 n_kv, L, hs): queries, keys, values
        qk = apply_rope(qkv[:, :H + H_kv], rope)        # queries and keys rotated in one call
        q, k, v = qk[:, :H], qk[:, H:], qkv[:, H + H_kv:]
        k, v, mask = (k, v, None) if cache is None else cache.update(pos, k, v)  # (B, n_kv, S, hs): all so far
        return self.out(attend(q, k, v, dropout_p=self.dropout if self.training else 0.0, mask=mask))  # (B, nh, L, hs)

    def init_cache(self, batch_size, capacity, dtype, device):
        shape = (batch_size, self.n_kv_head, capacity, self.head_dim)
        return LayerCache([shape, shape], dtype, device)

class LinearAttention(Attention):
    """The linear layouts: no softmax, no RoPE; the cache is a float32 state per head, S (d_k, d_v). 'linear'
    (Katharopoulos): phi = elu + 1 and a normalizer z = Σ phi(k), S's last column (v gets a channel of ones). The
    others, as Gated DeltaNet: q, k, v = SiLU(a causal depthwise conv over the last conv_size tokens), whose inputs
    are cached too; q, k L2-normed, q / sqrt(d_k); the output RMS-normed per head, SiLU-gated."""

    @staticmethod
    def configure(c, layout):
        if layout != 'linear' and c.conv_size > max(c.block_size, LAYER_FIELDS['conv_size']):
            c.bad('conv_size', f"must be <= block_size={c.block_size} (taps further back never see a token)")

    @staticmethod
    def uses(layout):  # 'linear' has no short conv
        return ('chunk_size', 'linear_kernels') + ('conv_size',) * (layout != 'linear')

    @staticmethod
    def cache_elements(c, layout, T):  # a state (d_k, d_v) per head whatever T, + z ('linear') or the conv's inputs
        if layout == 'linear':
            return c.n_head * c.head_dim * (c.head_dim + 1)
        return c.n_head * c.head_dim * c.head_dim + 3 * c.n_embd * (c.conv_size - 1)

    def __init__(self, config, layout):
        super().__init__(config)
        (self.forget, self.delta), self.normalizer = LINEAR_RULES[layout], layout == 'linear'
        C, H = config.n_embd, self.n_head
        parts = {'qkv': 3 * C, 'gate': C * (not self.normalizer), 'a': H * (self.forget == 'gate'),
                 'beta': H * self.delta}
        self.parts = {name: n for name, n in parts.items() if n}  # one projection: q, k, v, output gate, W_a x, W_β x
        self.c_attn = nn.Linear(C, sum(self.parts.values()), bias=config.bias)
        if self.forget == 'gate':  # Mamba-2's init: A ~ U[1, 16], softplus(dt_bias) = dt ~ logU[1e-3, 0.1]
            self.A_log = nn.Parameter(torch.empty(H).uniform_(1, 16).log())
            dt = torch.empty(H).uniform_(math.log(1e-3), math.log(0.1)).exp()
            self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # the inverse of softplus
        if not self.normalizer:
            K = config.conv_size  # the short conv's taps, per channel of q, k, v; nn.Conv1d's init
            self.conv = nn.Parameter(torch.empty(K, 3 * C).uniform_(-K ** -0.5, K ** -0.5))
            self.o_norm = nn.RMSNorm(self.head_dim, eps=1e-6)
        self.c_proj = nn.Linear(C, C, bias=config.bias)

    def forward(self, x, rope, pos, cache=None):
        (B, L, _), H, f32 = x.shape, self.n_head, torch.promote_types(x.dtype, torch.float32)
        parts = dict(zip(self.parts, self.c_attn(x).split(list(self.parts.values()), dim=-1)))
        S, *seen = cache.bufs if cache is not None else [None]  # the state (None: zero) and the conv's last inputs
        with torch.autocast(x.device.type, enabled=False):  # the conv, the gates, the state and the solve in f32
            qkv = parts['qkv'].to(f32)                                                 # (B, L, 3 n_embd)
            if not self.normalizer:  # the conv over the last K tokens: with a cache, the K - 1 before these L
                seen = torch.cat([seen[0], qkv], 1) if seen else qkv                   # (B, K - 1 + L, 3 n_embd)
                qkv = F.silu(ShortConv.apply(seen, self.conv.to(f32)))
                qkv = qkv[:, -L:] if cache is not None else qkv  # (in training no slice: its backward zero-fills)
            # (B, nh, L, hs) each, made contiguous once here: else every matmul below would copy its transposed view
            q, k, v = qkv.view(B, L, 3, H, self.head_dim).permute(2, 0, 3, 1, 4).contiguous()
            if self.normalizer:
                q, k, v = phi(q), phi(k), F.pad(v, (0, 1), value=1.0)  # v's last channel of ones sums z = Σ phi(k)
            else:
                q, k = l2norm(q) * self.head_dim ** -0.5, l2norm(k)
            g, beta = self.knob(parts, B, L, f32)                                      # (B, nh, L) each
            if self.config.linear_kernels == 'fla' and fla_runs(q):  # the same update on fla's Triton kernels
                y, new_S = linear_fla(q, k, v, g, beta, S, self.delta, S is not None)
            elif L == 1 and S is not None:  # decode
                y, new_S = linear_step(q, k, v, g, beta, S, self.delta)
            else:
                y, new_S = linear_chunked(q, k, v, g, beta, S, self.delta, self.config.chunk_size, S is not None)
        if cache is not None:  # in place: the buffers keep their addresses (CUDA graphs)
            S.copy_(new_S)
            if not self.normalizer:
                cache.bufs[1].copy_(seen[:, L:])  # the last K - 1 inputs
        if self.normalizer:
            return self.out((y[..., :-1] / (y[..., -1:] + 1e-6)).type_as(x))
        return self.out(self.o_norm(y.type_as(x)) * F.silu(self.heads(parts['gate'], H)))

    def knob(self, parts, B, L, dtype):
        """g = log α and β, (B, nh, L): what the rule forgets (None: α = 1, nothing) and how strongly it corrects."""
        g, heads = None, torch.arange(self.n_head, dtype=dtype, device=parts['qkv'].device)
        if self.forget == 'decay':  # RetNet's γ_h = 1 - 2^(-5-h)
            g = torch.log1p(-2.0 ** (-5.0 - heads))[:, None].expand(B, -1, L)
        if self.forget == 'gate':
            g = -self.A_log.to(dtype).exp()[:, None] * F.softplus(parts['a'].to(dtype) + self.dt_bias).transpose(1, 2)
        beta = (torch.sigmoid(parts['beta'].to(dtype)).transpose(1, 2) if self.delta else
                heads.new_ones(B, self.n_head, L))
        return g if g is None else g.contiguous(), beta.contiguous()  # (else a product with them comes out strided)

    def init_cache(self, batch_size, capacity, dtype, device):
        S = (batch_size, self.n_head, self.head_dim, self.head_dim + self.normalizer)  # + z for Katharopoulos
        seen = [] if self.normalizer else [(batch_size, self.config.conv_size - 1, 3 * self.config.n_embd)]
        return LayerCache([S, *seen], torch.promote_types(dtype, torch.float32), device, grows=False)

class MultiHeadLatentAttention(Attention):
    """DeepSeek-V2 MLA. K and V come from a small latent c = norm(W_DKV h), shared by all heads;
    position comes from a decoupled rope key k_R = RoPE(W_KR h), also shared by all heads, because
    RoPE cannot be absorbed into W_UK. The cache holds [c | k_R]: d_c + d_R elements per token."""

    @staticmethod
    def configure(c, layout):  # 0 = DeepSeek-V2's ratios to head_dim
        c.kv_lora_rank = c.kv_lora_rank or 4 * c.head_dim
        c.rope_head_dim = c.rope_head_dim or max(2, c.head_dim // 4 * 2)
        if c.rope_head_dim % 2:
            c.bad('rope_head_dim', "must be even for attn='mla' (RoPE rotates pairs)")

    @staticmethod
    def uses(layout):
        return ('kv_lora_rank', 'rope_head_dim', 'q_lora_rank')

    @staticmethod
    def cache_elements(c, layout, T):  # the latent and the rope key, [c | k_R], shared by every head
        return (c.kv_lora_rank + c.rope_head_dim) * T

    def __init__(self, config, layout=None):
        super().__init__(config)
        H, self.dh, self.dR, self.dc = config.n_head, config.head_dim, config.rope_head_dim, config.kv_lora_rank
        q_out = H * (self.dh + self.dR)  # per head: [nope | rope] query
        r = config.q_lora_rank  # queries through a normed low-rank bottleneck (W_DQ, W_UQ) too, or straight
        self.c_q = (nn.Sequential(nn.Linear(config.n_embd, r, bias=config.bias), nn.RMSNorm(r, eps=1e-6),
                                  nn.Linear(r, q_out, bias=config.bias)) if r else
                    nn.Linear(config.n_embd, q_out, bias=config.bias))
        self.kv_down = nn.Linear(config.n_embd, self.dc + self.dR, bias=config.bias)  # W_DKV and W_KR stacked
        self.kv_norm = nn.RMSNorm(self.dc, eps=1e-6)
        self.k_up = nn.Linear(self.dc, H * self.dh, bias=False)  # W_UK; no bias: absorbed at decode
        self.v_up = nn.Linear(self.dc, H * self.dh, bias=False)  # W_UV; no bias: absorbed at decode
        self.c_proj = nn.Linear(H * self.dh, config.n_embd, bias=config.bias)
        self.scale = 1.0 / math.sqrt(self.dh + self.dR)  # on both score terms

    def forward(self, x, rope, pos, cache=None):
        H, dh, dR, dc = self.n_head, self.dh, self.dR, self.dc
        q = self.heads(self.c_q(x), H)                                   # (B, nh, L, dh + dR)
        q = torch.cat([q[..., :dh], apply_rope(q[..., dh:], rope)], dim=-1)
        c, k_rope = self.kv_down(x).unsqueeze(1).split([dc, dR], dim=-1)  # (B, 1, L, dc), (B, 1, L, dR)
        latent = torch.cat([self.kv_norm(c), apply_rope(k_rope, rope)], dim=-1)  # (B, 1, L, dc + dR)
        dropout_p = self.dropout if self.training else 0.0
        if cache is None:  # training (and uncached generation): materialize per-head K and V, ordinary attention
            k = torch.cat([self.heads(self.k_up(latent[:, 0, :, :dc]), H),
                           latent[..., dc:].expand(-1, H, -1, -1)], dim=-1)  # (B, nh, L, dh + dR)
            v = self.heads(self.v_up(latent[:, 0, :, :dc]), H)              # (B, nh, L, dh)
            y = attend(q, k, v, self.scale, dropout_p)                      # (B, nh, L, dh)
        else:  # with a cache: W_UK folded into q, attention over the cached latents, W_UV after; no K, V formed
            latent, mask = cache.update(pos, latent)                        # (B, 1, S, dc + dR)
            q_lat = torch.einsum('bhld,hdc->bhlc', q[..., :dh], self.k_up.weight.view(H, dh, dc))
            q = torch.cat([q_lat, q[..., dh:]], dim=-1)                     # (B, nh, L, dc + dR)
            # MQA with key [c | k_R] and value c. SDPA gets the value whole (k_R's columns dropped after): with one
            # head dim for K and V its fused kernel reads the cache once (else a math kernel rescales it every step)
            value = latent if mask is None else latent[..., :dc]  # (a static cache's FlexAttention: c alone)
            y = attend(q, latent, value, self.scale, dropout_p, mask)[..., :dc]  # (B, nh, L, dc)
            y = torch.einsum('bhlc,hdc->bhld', y, self.v_up.weight.view(H, dh, dc))  # (B, nh, L, dh)
        return self.out(y)

    def init_cache(self, batch_size, capacity, dtype, device):
        return LayerCache([(batch_size, 1, capacity, self.dc + self.dR)], dtype, device)

# Every layout, and its class: configure(config, layout) checks a config and fills in the layout's defaults, uses()
# names its fields, cache_elements() counts its cache. Adding a layout adds its class and its line here.
LAYOUTS = {'mha': CausalSelfAttention, 'gqa': CausalSelfAttention, 'mqa': CausalSelfAttention,
           'mla': MultiHeadLatentAttention, **dict.fromkeys(LINEAR_RULES, LinearAttention)}
ATTN_LAYOUTS = tuple(LAYOUTS)

# --- The Transformer: nanoGPT's MLP, Block and GPT ----------------------------------------------------------

def mlp_hidden(config):
    """4 * n_embd, or (match_mha_params) the width that gives the model MHA's parameter count."""
    if not config.match_mha_params:
        return 4 * config.n_embd
    with torch.device('meta'):  # counted, nothing allocated; MHA's weights, without RoPE's rule of an even head_dim
        count = lambda cfg, a: sum(p.numel() for p in LAYOUTS[a](cfg, a).parameters())
        mha = replace(config, attn='mha', **LAYER_FIELDS, pos_emb='learned', match_mha_params=False)
        extra = sum(n * (count(mha, 'mha') - count(config, a)) for a, n in config.layer_counts().items())
        extra /= config.n_layer
    return 4 * config.n_embd + round(extra / (2 * config.n_embd + config.bias))  # c_fc row + c_proj column

class MLP(nn.Module):

    def __init__(self, config):
        super().__init__()
        hidden = mlp_hidden(config)
        self.c_fc = nn.Linear(config.n_embd, hidden, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(hidden, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))

class Block(nn.Module):

    def __init__(self, config, layout):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = LAYOUTS[layout](config, layout)
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
            h=nn.ModuleList([Block(config, layout) for layout in config.layouts]),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
        ))
        if config.pos_emb == 'learned':
            self.transformer.wpe = nn.Embedding(config.block_size, config.n_embd)
        # RoPE on MLA's d_R (0 without an MLA layer) or a head; the linear layouts have none
        self.rope_dim = (config.rope_head_dim or config.head_dim) if config.pos_emb == 'rope' and config.softmax else 0
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
        """RoPE's (L, 2, d) table for every layer, or None; made per forward (a buffer would be cast to 16 bits)."""
        return rope_table(self.rope_dim, positions, self.config.rope_base) if self.rope_dim else None

    def init_cache(self, batch_size, dtype=None, device=None, static=False):
        """An empty cache for batch_size sequences of up to block_size tokens. static=True: fixed shapes for
        torch.compile / CUDA graphs; its position is never read on the host, so block_size is the caller's to keep."""
        p = self.lm_head.weight
        return Cache([block.attn.init_cache(batch_size, self.config.block_size, dtype or p.dtype, device or p.device)
                      for block in self.transformer.h], static)

    def forward(self, idx, targets=None, cache=None):
        """idx (B, L): tokens at positions 0..L-1, or with a cache the L tokens after the len(cache) it holds."""
        B, L = idx.size()
        pos = cache.pos if cache is not None else 0  # a tensor for a static cache: never read on the host
        if L == 0 or (not torch.is_tensor(pos) and pos + L > self.config.block_size):  # (0: nothing to predict from)
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
        loss = None if targets is None else F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1),
                                                            ignore_index=-1)
        return logits, loss

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None, top_p=None, use_cache=True):
        """idx (B, T) followed by max_new_tokens sampled tokens; temperature 0 = greedy."""
        return torch.cat([idx, *self.stream(idx, max_new_tokens, temperature, top_k, top_p, use_cache)], dim=1)

    @torch.inference_mode()
    def stream(self, idx, max_new_tokens, temperature=1.0, top_k=None, top_p=None, use_cache=True, cache=None):
        """Yield the new tokens (B, 1) one step at a time. The model sees a window of at most block_size tokens;
        when it is full it slides forward, keeping its last half, positions restarting at 0: with and without
        the cache the tokens are the same. Pass a cache to inspect it after."""
        if idx.dim() != 2 or idx.size(1) == 0:
            raise ValueError(f"empty prompt, or not (B, T): {tuple(idx.shape)}; generation needs a token to start from")
        ok = (max_new_tokens >= 0 and (temperature == 0 or 1e-6 <= temperature <= 1e6)  # (logits / it stays finite)
              and (top_k is None or isinstance(top_k, int) and top_k >= 1) and (top_p is None or 0 < top_p <= 1))
        if not ok:
            raise ValueError(f"need max_new_tokens >= 0, temperature 0 or in [1e-6, 1e6], an integer top_k >= 1, "
                             f"0 < top_p <= 1, not {max_new_tokens}, {temperature}, {top_k}, {top_p}")
        block_size = self.config.block_size  # the prompt as the sampled tokens are (an inference tensor, contiguous),
        idx = idx.clone(memory_format=torch.contiguous_format)  # else torch.compile makes a graph for its prefill alone
        start = max(0, idx.size(1) - block_size)  # idx[:, start:] is the window
        new = idx[:, start:]  # the tokens the cache has not seen: the window, then 1 token a step
        cache = (self.init_cache(idx.size(0)) if cache is None else cache) if use_cache else None
        for _ in range(max_new_tokens):
            if idx.size(1) - start > block_size:  # the window is full: slide it forward
                start = idx.size(1) - max(1, block_size // 2)
                new = idx[:, start:]
            if cache is not None and new.size(1) == idx.size(1) - start:  # the whole window: a (re-)prefill
                cache.reset()
            logits, _ = self(new, cache=cache) if cache is not None else self(idx[:, start:])  # else the window again
            new = sample(logits[:, -1, :].float(), temperature, top_k, top_p)  # (B, 1)
            idx = torch.cat((idx, new), dim=1)
            yield new

def num_params(config):
    """GPT(config)'s parameter count before anything is built (n_layer may be 10^9): one block of each layout on the
    meta device times its layers, plus the embeddings and the final norm; inf where a tensor's size overflows."""
    try:
        with torch.device('meta'):
            blocks = sum(n * sum(p.numel() for p in Block(config, a).parameters())
                         for a, n in config.layer_counts().items())
    except (RuntimeError, OverflowError):  # "Storage size calculation overflowed", or past int64
        return math.inf
    positions = config.block_size * (config.pos_emb == 'learned')  # wte is tied to lm_head: counted once
    return blocks + (config.vocab_size + positions + 1 + config.bias) * config.n_embd

def sample(logits, temperature=1.0, top_k=None, top_p=None):
    """One token per row of logits (B, vocab): greedy at temperature 0, else top-k / nucleus sampling."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None:
        v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
        logits = logits.masked_fill(logits < v[:, [-1]], -float('inf'))
    if top_p is not None:  # keep the smallest set of tokens whose probability reaches top_p
        probs, order = logits.softmax(-1).sort(descending=True)
        drop = probs.cumsum(-1) - probs >= top_p  # mass before this token already reaches top_p
        drop[:, 0] = False  # the most likely token always stays (a top_p that rounds to 0 would drop them all)
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), -float('inf'))
    return torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)
