"""
One causal Transformer (nanoGPT's GPT) whose attention block is picked by config: MHA, GQA, MQA (softmax
attention with n_kv_head K/V heads), MLA (DeepSeek-V2) and the linear-attention family (a fixed state rewritten
every token: Katharopoulos, RetNet, Mamba-2, DeltaNet, Gated DeltaNet), or a per-layer mix of them ('hybrid').
Training / prefill feeds L = S = T tokens under a causal mask; decode feeds L = 1 token that attends to
S = T + 1 keys. k_j, v_j depend only on tokens <= j, so each layout caches them (or a state); q is not cached.
"""

import math
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# The linear layouts, the founding chapter's table: each keeps a fixed state S per head and rewrites it every token,
#     S_t = α_t S_{t-1} (I - β_t k_t k_tᵀ) + β_t v_t k_tᵀ,     o_t = S_t q_t,
# and they differ only in the knob: how the old state is forgotten (α) and whether a write corrects it (β).
LINEAR_RULES = {  # layout: (forget: α_t, correct: the delta rule)
    'linear':         (None,    False),  # Katharopoulos et al. 2020: accumulate (α = 1, write v kᵀ), phi = elu + 1
    'retnet':         ('decay', False),  # RetNet (Sun et al. 2023): α = γ_h = 1 - 2^(-5-h), fixed per head
    'mamba2':         ('gate',  False),  # Mamba-2 (Dao & Gu 2024): α_t = exp(-exp(A_log) softplus(W_a x + dt_bias))
    'deltanet':       (None,    True),   # DeltaNet (Schlag et al. 2021; Yang et al. 2024): β_t = σ(W_β x), α = 1
    'gated_deltanet': ('gate',  True),   # Gated DeltaNet (Yang, Kautz, Hatamizadeh 2024): both
}
SOFTMAX = ('mha', 'gqa', 'mqa', 'mla')
ATTN_LAYOUTS = (*SOFTMAX, *LINEAR_RULES)

@dataclass
class GPTConfig:
    block_size: int = 256
    vocab_size: int = 65       # tiny Shakespeare, char level
    n_layer: int = 6
    n_head: int = 6
    n_embd: int = 384
    dropout: float = 0.0
    bias: bool = False         # bias in Linears and LayerNorms, like GPT-2
    attn: str = 'mha'          # one of ATTN_LAYOUTS, or a hybrid 'gated_deltanet*3+gqa': per layer, repeated over n_layer
    n_kv_head: int = 0         # K/V heads; 0 = the layout's: mha n_head, gqa n_head's smallest divisor > 1, mqa 1
    pos_emb: str = 'rope'      # 'rope', or nanoGPT's 'learned' absolute positions
    rope_base: float = 10000.0
    kv_lora_rank: int = 0      # MLA d_c, the cached latent; 0 = 4 * head_dim (DeepSeek-V2's ratio)
    rope_head_dim: int = 0     # MLA d_R, the decoupled rope query/key; 0 = head_dim / 2 (even, >= 2)
    q_lora_rank: int = 0       # MLA query compression; 0 = off (as DeepSeek-V2-Lite)
    chunk_size: int = 64       # linear layouts: chunk of the chunkwise-parallel training form
    conv_size: int = 4         # linear layouts but 'linear': a causal depthwise conv on q, k, v over this many tokens
    match_mha_params: bool = False  # widen/narrow the MLP so the model has MHA's parameter count

    def __post_init__(self):
        number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)  # (True is an int to Python)
        whole = lambda least: (lambda v: number(v) and isinstance(v, int) and v >= least, f"must be an integer >= {least}")
        wrong = [p for p in self.attn.split('+') if not self.pattern(p)] if isinstance(self.attn, str) else []
        rules = [('attn', lambda v: isinstance(v, str) and bool(self.pattern()),  # (field, test, rule)
                  f"must be one of {ATTN_LAYOUTS}, or a hybrid of them like 'gated_deltanet*3+gqa' (a count from 1 to "
                  f"999999){''.join(f'; not {p!r}' for p in wrong[:3] if len(wrong) < len(self.attn.split('+')))}"),
                 ('pos_emb', lambda v: v in ('rope', 'learned'), "must be one of ('rope', 'learned')"),
                 *[(f, *whole(1)) for f in ('block_size', 'vocab_size', 'n_layer', 'n_head', 'n_embd', 'chunk_size',
                                            'conv_size')],
                 *[(f, *whole(0)) for f in ('n_kv_head', 'q_lora_rank', 'kv_lora_rank', 'rope_head_dim')],
                 *[(f, lambda v: isinstance(v, bool), "must be True or False") for f in ('bias', 'match_mha_params')],
                 ('dropout', lambda v: number(v) and 0.0 <= v < 1.0, "must be a number in [0, 1)"),
                 ('rope_base', lambda v: number(v) and 0 < v < math.inf, "must be a finite number > 0"),
                 ('n_embd', lambda v: v % self.n_head == 0, f"must be divisible by n_head={self.n_head}"),
                 ('attn', lambda v: len(self.pattern()) <= self.n_layer,
                  f"has {len(self.pattern())} layers, more than n_layer={self.n_layer}"),
                 ('attn', lambda v: len(set(self.pattern()) & set(SOFTMAX)) <= 1,
                  f"mixes softmax layouts: a hybrid pairs linear layouts with one of {SOFTMAX}")]
        for field, ok, rule in rules:  # in order: later tests may rely on earlier fields being valid
            if not ok(getattr(self, field)):
                self.bad(field, rule)
        h, softmax = self.n_head, self.softmax  # K/V head counts each layout allows; mla and linear: n_head, none shared
        allowed = {'mha': [h], 'mqa': [1], 'gqa': [d for d in range(2, h) if h % d == 0]}.get(softmax, [h])
        self.n_kv_head = self.n_kv_head or (allowed[0] if allowed else 0)  # 0 = the layout's default
        if self.n_kv_head not in allowed:
            rule = 'divisors 1 < d < n_head' if softmax == 'gqa' else 'or 0, its default'
            self.bad('n_kv_head' if allowed else 'n_head', f"attn={self.attn!r} with n_head={h} allows {allowed} ({rule})")
        mla_sizes = {'kv_lora_rank': 4 * self.head_dim, 'rope_head_dim': max(2, self.head_dim // 4 * 2), 'q_lora_rank': 0}
        for field, default in mla_sizes.items():  # 0 = DeepSeek-V2's ratios to head_dim; a stack without MLA keeps 0s
            if softmax != 'mla' and getattr(self, field) not in (0, default):  # (old converted checkpoints hold these)
                self.bad(field, f"only attn='mla' uses it; attn={self.attn!r} has no MLA layer")
            setattr(self, field, (getattr(self, field) or default) if softmax == 'mla' else 0)
        convs = any(a in LINEAR_RULES and a != 'linear' for a in self.pattern())
        if convs and self.conv_size > max(self.block_size, GPTConfig.conv_size):
            self.bad('conv_size', f"must be <= block_size={self.block_size} (taps further back never see a token)")
        if not convs and self.conv_size != GPTConfig.conv_size:
            self.bad('conv_size', f"only the linear layouts but 'linear' have the short conv; attn={self.attn!r} has none")
        if softmax == 'mla' and self.rope_head_dim % 2:
            self.bad('rope_head_dim', "must be even for attn='mla' (RoPE rotates pairs)")
        if self.pos_emb == 'rope' and softmax in ('mha', 'gqa', 'mqa') and self.head_dim % 2:
            self.bad('n_embd', f"n_embd / n_head = {self.head_dim} must be even for RoPE (or use pos_emb='learned')")
        if self.match_mha_params and (hidden := mlp_hidden(self)) < 1:
            self.bad('match_mha_params', f"the MLP would need {hidden} units: the attention alone outweighs "
                     f"MHA's block (lower {'kv_lora_rank, q_lora_rank' if softmax == 'mla' else 'conv_size'}, or turn it off)")

    def bad(self, field, rule):
        raise ValueError(f"GPTConfig.{field}={getattr(self, field)!r} is invalid: {rule}")

    def pattern(self, attn=None):
        """'gated_deltanet*3+gqa' -> [gated_deltanet, gated_deltanet, gated_deltanet, gqa]; [] if not one."""
        attn = self.attn if attn is None else attn
        parts = [p.partition('*') for p in attn.split('+')] if isinstance(attn, str) else [('', '', '')]
        ok = all(name in ATTN_LAYOUTS and (not star or n.isascii() and n.isdigit() and 0 < int(n.lstrip('0')[:7] or 0)
                 < 10 ** 6) for name, star, n in parts)  # (a count of a million layers is refused before it is built)
        return [name for name, _, n in parts for _ in range(int(n or 1))] if ok else []

    @property
    def layouts(self):  # each layer's: the pattern repeated over n_layer (Qwen3-Next's 3:1 on 6 layers: 3, 1, 2)
        return [p[i % len(p)] for p in [self.pattern()] for i in range(self.n_layer)]  # (parsed once)

    def layer_counts(self):  # {layout: its number of layers}, counted without listing them (n_layer may be huge)
        p, (full, rest) = self.pattern(), divmod(self.n_layer, len(self.pattern()))
        return {a: full * p.count(a) + p[:rest].count(a) for a in dict.fromkeys(p)}

    @property
    def softmax(self):  # the softmax layout of the stack, or None if every layer is linear
        return next((a for a in self.pattern() if a in SOFTMAX), None)

    @property
    def head_dim(self):
        return self.n_embd // self.n_head

    def cache_elements(self, T, layout=None):
        """Elements a cache holds after T tokens (batch 1): the table of the README; all layers, or one layout's."""
        if layout is None:
            return sum(n * self.cache_elements(T, a) for a, n in self.layer_counts().items())
        hd = self.head_dim  # a linear layout: a state (d_k, d_v) per head whatever T, + z ('linear') or the conv's inputs
        if layout == 'linear':
            return self.n_head * hd * (hd + 1)
        if layout in LINEAR_RULES:
            return self.n_head * hd * hd + 3 * self.n_embd * (self.conv_size - 1)
        return (self.kv_lora_rank + self.rope_head_dim) * T if layout == 'mla' else 2 * self.n_kv_head * hd * T

    def cache_bytes(self, T, dtype=torch.float32):  # linear layouts keep their state in float32 at least
        state = torch.promote_types(dtype, torch.float32).itemsize
        return sum(n * self.cache_elements(T, a) * (state if a in LINEAR_RULES else dtype.itemsize)
                   for a, n in self.layer_counts().items())

# --- What the layouts share: RoPE, the causal attention call, the caches -----------------------------------

def rope_table(dim, positions, base):
    """(L, 2, dim): cos and signed sin (-sin, +sin) of pos * base^(-2i/dim) for each pair (x[2i], x[2i+1]).
    The angles in float64: in float32 their error grows with the position (~1e-4 rad at 2048)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64, device=positions.device) / dim))
    angles = torch.outer(positions.double(), inv_freq).repeat_interleave(2, dim=1)
    sign = 1.0 - 2.0 * (torch.arange(dim, device=positions.device) % 2 == 0)  # -1, +1, -1, ...
    return torch.stack([angles.cos(), angles.sin() * sign], dim=1).float()

def apply_rope(x, rope):
    """(x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) for each pair of x (..., L, d), in float32 at least."""
    if rope is None:
        return x
    cos, sin = rope.unbind(-2)  # real arithmetic, not a complex product: torch.compile cannot fuse complex ops
    x32 = x.to(torch.promote_types(x.dtype, torch.float32))
    return (x32 * cos + x32.unflatten(-1, (-1, 2)).flip(-1).flatten(-2) * sin).type_as(x)

# decode: never cuDNN attention, which plans per key length (a cached H200 step 10x slower than no cache)
DECODE_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

def attend(q, k, v, scale=None, dropout_p=0.0, mask=None):
    """softmax(q kᵀ * scale + mask) v. q (B, nh, L, d), k (B, n_kv, S, d), v (B, n_kv, S, dv); n_kv divides nh
    (groups share a K/V head). mask (L, S), True = seen; None = causal with the L queries the LAST L of the S keys."""
    (B, H, L, D), (H_kv, S) = q.shape, k.shape[1:3]
    if mask is None and L == S:  # training, or a prefill into an empty cache: is_causal's top-left mask is right only here
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, scale=scale,
                                              enable_gqa=H != H_kv)
    if mask is None and L > 1:
        mask = torch.ones(L, S, dtype=torch.bool, device=q.device).tril(S - L)  # query i sees keys <= S - L + i
    G = H // H_kv if L == 1 else 1  # decode: a group's G query heads become G queries of its one K/V head
    with sdpa_kernel(DECODE_BACKENDS):
        y = F.scaled_dot_product_attention(q.reshape(B, H // G, G * L, D), k, v, attn_mask=mask, dropout_p=dropout_p,
                                           scale=scale, enable_gqa=G == 1 and H != H_kv)
    return y.reshape(B, H, L, v.size(-1))  # reshape, not view: the output's strides depend on the backend

class LayerCache:
    """One layer's buffers: K and V (B, n_kv, T, hs), MLA's [latent | rope key] (B, 1, T, d_c + d_R), or a state."""

    def __init__(self, shapes, dtype, device, grows=True):
        self.bufs = [torch.zeros(s, dtype=dtype, device=device) for s in shapes]
        self.grows = grows  # along time (dim 2); a state does not

    def update(self, pos, *xs):
        """Write xs (B, heads, L, dim) at [pos, pos + L); return the buffers to attend to and their (L, S) mask:
        an int pos gives the filled part (mask None: causal), a tensor pos the whole buffers, unfilled masked."""
        L = xs[0].size(2)
        if not torch.is_tensor(pos):
            for buf, x in zip(self.bufs, xs):
                buf[:, :, pos:pos + L] = x
            return *[buf[:, :, :pos + L] for buf in self.bufs], None
        positions = pos + torch.arange(L, device=pos.device)
        for buf, x in zip(self.bufs, xs):
            buf.index_copy_(2, positions, x)
        return *self.bufs, torch.arange(self.bufs[0].size(2), device=pos.device) <= positions[:, None]

class Cache:
    """Every layer's cache and the position GPT.forward advances: an int, or (static=True) a device tensor."""

    def __init__(self, layers, static=False):
        self.layers = layers
        self.pos = torch.zeros((), dtype=torch.long, device=layers[0].bufs[0].device) if static else 0
        if static:  # CUDA graph replays write into these in place: their addresses must never change
            for t in [self.pos] + [b for layer in layers for b in layer.bufs]:
                torch._dynamo.mark_static_address(t)

    def __len__(self):
        return int(self.pos)

    @property
    def nbytes(self):  # of the filled positions (all of a state)
        n = len(self)
        return sum((b[:, :, :n] if l.grows else b).numel() * b.element_size() for l in self.layers for b in l.bufs)

    def reset(self):
        """Empty again, buffers kept; only a linear layout's state is zeroed (K/V past pos: sliced off or masked)."""
        self.pos = self.pos.zero_() if torch.is_tensor(self.pos) else 0
        for b in (b for layer in self.layers if not layer.grows for b in layer.bufs):
            b.zero_()

# --- The attention layouts: same forward(x, rope, pos, cache) and init_cache(batch, capacity, dtype, device) ---

class Attention(nn.Module):
    """What the layouts share: heads() splits heads, out() merges them via c_proj (built last: the init's draw order)."""

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

    def __init__(self, config):
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

class ShortConv(torch.autograd.Function):
    """The causal depthwise conv c_t = Σ_s w_{K-1-s} x_{t-s} (s = 0 .. K-1), w (K, C), over x (B, T, C), zeros before
    x_0. Its backward written out: autograd's, through K shifted slices, zero-fills and adds x K times."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        c = x * w[-1]                                                        # (B, T, C): s = 0, the token itself
        for s in range(1, len(w)):                                           # s tokens back (none if s >= T)
            c[:, s:].addcmul_(x[:, :-s], w[-1 - s])
        return c

    @staticmethod
    def backward(ctx, dc):
        x, w = ctx.saved_tensors
        dx = dc * w[-1]
        for s in range(1, len(w)):
            dx[:, :-s].addcmul_(dc[:, s:], w[-1 - s])
        return dx, torch.stack([(dc[:, s:] * x[:, :x.size(1) - s]).sum((0, 1)) for s in reversed(range(len(w)))])

class UnitLowerSolve(torch.autograd.Function):
    """u = (I + A)⁻¹ e for the strictly lower part of A (..., C, C), through the inverse, kept for the backward:
    there de = (I + A)⁻ᵀ du is a product, where autograd's would solve again (a small LAPACK call per matrix)."""

    @staticmethod
    def forward(ctx, A, e):
        eye = torch.eye(A.size(-1), dtype=A.dtype, device=A.device).expand_as(A)
        T = torch.linalg.solve_triangular(A, eye, upper=False, unitriangular=True)     # (I + A)⁻¹
        u = T @ e
        ctx.save_for_backward(T, u)
        return u

    @staticmethod
    def backward(ctx, du):
        T, u = ctx.saved_tensors
        de = T.mT @ du
        return (de @ u.mT).neg_().tril_(-1), de  # only j < i of A is read

def l2norm(x):  # x / sqrt(|x|² + 1e-6) as in fla and Qwen3-Next (F.normalize's backward: ~5% of a step slower)
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)

def phi(x):
    """elu(x) + 1 > 0, computed in float32 at least: in bf16 elu(x) + 1 rounds to 0 near x = -8."""
    x = x.to(torch.promote_types(x.dtype, torch.float32))
    return torch.where(x >= 0, x + 1, torch.exp(x.clamp(max=0)))

# The update, written once: S (B, nh, d_k, d_v) = Σ k vᵀ (transposed: o = q S on rows), g = log α and β (B, nh, L).

def linear_step(q, k, v, g, beta, S, delta):
    """One token (decode), q, k (B, nh, 1, d_k), v (B, nh, 1, d_v): S <- α S (I - β k kᵀ) + β v kᵀ, o = q S."""
    if g is not None:                          # forget: α_t S_{t-1} (g None: α = 1)
        S = S * g.exp()[..., None]
    if delta:                                  # correct: write the error of the memory on k_t, at rate β_t
        v = beta[..., None] * (v - k @ S)
    S = S + k.transpose(-2, -1) @ v            # write: S_t = α_t S_{t-1} (I - β_t k_t k_tᵀ) + β_t k_t v_tᵀ
    return q @ S, S

def linear_chunked(q, k, v, g, beta, S, delta, chunk_size, keep_state=True):
    """Training, prefill: the same update over chunks of C tokens, matrix products inside a chunk and the state
    between chunks. Inside a chunk, with G_i = Σ_{j<=i} g_j (log of the decay since the chunk began) and u_i what
    token i writes (v_i, or for the delta rule the corrected β_i (v_i - S_{i-1} k_i)):
        o_i = e^{G_i} q_i S_0 + Σ_{j<=i} e^{G_i - G_j} (q_i · k_j) u_j,   S_C = e^{G_C} S_0 + Σ_j e^{G_C - G_j} k_j u_jᵀ.
    The delta rule's u solve one unit-lower-triangular system per chunk (the WY / UT form, Yang et al. 2024):
        (I + A) U = diag(β) (V - diag(e^G) K S_0),   A_ij = β_i e^{G_i - G_j} (k_i · k_j) for j < i.
    S None is a zero state (training: its products skipped); keep_state=False skips the last chunk's write to S."""
    # α = 1: log α = 0; a gate clamped at e^-10⁴, 0 as e^-inf is (a -inf, as at exp(A_log) = inf, makes G_i - G_i nan)
    gated = g is not None
    g = torch.zeros_like(beta) if g is None else g.clamp(min=-1e4)
    # chunks of C tokens, the last shorter (one chunk unsplit: split's backward would copy it whole)
    each = [x.split(chunk_size, dim=2) if x.size(2) > chunk_size else [x] for x in (q, k, v, g, beta)]
    out = []
    for n, (q, k, u, g, beta) in enumerate(zip(*each)):                             # (B, nh, C, .) each
        C = q.size(2)
        G = g.cumsum(-1)[..., None]                                                   # (B, nh, C, 1)
        causal = torch.ones(C, C, dtype=q.dtype, device=q.device).tril()
        # e^{G_i - G_j}, 0 above the diagonal: tril before the exp (G_i - G_j > 0 may overflow; -inf: a slow CPU exp)
        decay = (G - G.mT).tril().exp() * causal if gated else causal
        eG = G.exp()
        if delta:  # the errors of the memory on each key, corrected for the writes before it in the chunk
            err = beta[..., None] * (u if S is None else u - eG * (k @ S))
            u = UnitLowerSolve.apply((beta[..., None] * k) @ k.mT * decay, err)  # (I + A)⁻¹ err; reads j < i
        y = (q @ k.mT * decay) @ u                                                    # (B, nh, C, d_v)
        out.append(y if S is None else y + eG * (q @ S))
        if n < len(each[0]) - 1 or keep_state:  # the state carried to the next chunk; None is zero, its products skipped
            write = ((G[:, :, -1:] - G).exp() * k).mT @ u
            S = write if S is None else eG[:, :, -1:] * S + write
    return torch.cat(out, 2) if len(out) > 1 else out[0], S

class LinearAttention(Attention):
    """The linear layouts: no softmax, no RoPE; the cache is a float32 state per head, S (d_k, d_v). 'linear'
    (Katharopoulos): phi = elu + 1 and a normalizer z = Σ phi(k), S's last column (v gets a channel of ones). The
    others, as Gated DeltaNet: q, k, v = SiLU(a causal depthwise conv over the last conv_size tokens), whose inputs
    are cached too; q, k L2-normed, q / sqrt(d_k); the output RMS-normed per head, SiLU-gated."""

    def __init__(self, config, layout):
        super().__init__(config)
        (self.forget, self.delta), self.normalizer = LINEAR_RULES[layout], layout == 'linear'
        C, H = config.n_embd, self.n_head
        parts = {'qkv': 3 * C, 'gate': C * (not self.normalizer), 'a': H * (self.forget == 'gate'), 'beta': H * self.delta}
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
            y, new_S = (linear_step(q, k, v, g, beta, S, self.delta) if L == 1 and S is not None else  # decode
                        linear_chunked(q, k, v, g, beta, S, self.delta, self.config.chunk_size, S is not None))
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
        beta = torch.sigmoid(parts['beta'].to(dtype)).transpose(1, 2) if self.delta else heads.new_ones(B, self.n_head, L)
        return g if g is None else g.contiguous(), beta.contiguous()  # (else a product with them comes out strided)

    def init_cache(self, batch_size, capacity, dtype, device):
        S = (batch_size, self.n_head, self.head_dim, self.head_dim + self.normalizer)  # + z for Katharopoulos
        seen = [] if self.normalizer else [(batch_size, self.config.conv_size - 1, 3 * self.config.n_embd)]
        return LayerCache([S, *seen], torch.promote_types(dtype, torch.float32), device, grows=False)

class MultiHeadLatentAttention(Attention):
    """DeepSeek-V2 MLA. K and V come from a small latent c = norm(W_DKV h), shared by all heads;
    position comes from a decoupled rope key k_R = RoPE(W_KR h), also shared by all heads, because
    RoPE cannot be absorbed into W_UK. The cache holds [c | k_R]: d_c + d_R elements per token."""

    def __init__(self, config):
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
            # MQA with key [c | k_R] and value c, passed whole (k_R's columns dropped after): with one head dim
            # for K and V the fused kernel reads the cache once (else a math kernel rescales it every step)
            y = attend(q, latent, latent, self.scale, dropout_p, mask)[..., :dc]  # (B, nh, L, dc)
            y = torch.einsum('bhlc,hdc->bhld', y, self.v_up.weight.view(H, dh, dc))  # (B, nh, L, dh)
        return self.out(y)

    def init_cache(self, batch_size, capacity, dtype, device):
        return LayerCache([(batch_size, 1, capacity, self.dc + self.dR)], dtype, device)

def make_attention(config, layout):
    if layout in LINEAR_RULES:
        return LinearAttention(config, layout)
    return MultiHeadLatentAttention(config) if layout == 'mla' else CausalSelfAttention(config)

# --- The Transformer: nanoGPT's MLP, Block and GPT ----------------------------------------------------------

def mlp_hidden(config):
    """4 * n_embd, or (match_mha_params) the width that gives the model MHA's parameter count."""
    if not config.match_mha_params:
        return 4 * config.n_embd
    with torch.device('meta'):  # counted, nothing allocated; MHA's weights, without RoPE's rule of an even head_dim
        count = lambda cfg, a: sum(p.numel() for p in make_attention(cfg, a).parameters())
        mha = replace(config, attn='mha', n_kv_head=0, q_lora_rank=0, kv_lora_rank=0, rope_head_dim=0, pos_emb='learned',
                      conv_size=GPTConfig.conv_size, match_mha_params=False)
        extra = sum(n * (count(mha, 'mha') - count(config, a)) for a, n in config.layer_counts().items()) / config.n_layer
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
        self.attn = make_attention(config, layout)
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
            raise ValueError(f"empty prompt, or not (B, T): {tuple(idx.shape)}; generation needs a token to condition on")
        ok = (max_new_tokens >= 0 and (temperature == 0 or 1e-6 <= temperature <= 1e6)  # (logits / it stays finite)
              and (top_k is None or isinstance(top_k, int) and top_k >= 1) and (top_p is None or 0 < top_p <= 1))
        if not ok:
            raise ValueError(f"need max_new_tokens >= 0, temperature 0 or in [1e-6, 1e6], an integer top_k >= 1, "
                             f"0 < top_p <= 1, not {max_new_tokens}, {temperature}, {top_k}, {top_p}")
        block_size = self.config.block_size  # below: the prompt as the tokens sampled are (an inference tensor, contiguous),
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
