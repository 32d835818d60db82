"""A bad config raises ValueError naming the field and what is allowed."""
import pytest

from model import GPTConfig

BAD = [
    (dict(attn='flash'), r"attn.*one of \('mha', 'gqa', 'mqa', 'mla', 'linear', 'retnet', "
                         r"'mamba2', 'deltanet', 'gated_deltanet'\), or a hybrid"),
    (dict(attn='delta'), r"attn='delta' is invalid"),                       # an unknown rule
    # a crafted checkpoint's model_args
    (dict(bias='yes'), r"GPTConfig.bias='yes' is invalid: must be of type bool"),
    (dict(match_mha_params=1), r"match_mha_params=1 is invalid: must be of type bool"),
    # does not fit
    (dict(attn='gated_deltanet*3+gqa', n_layer=3), r"attn.*has 4 layers, more than n_layer=3"),
    (dict(attn='deltanet*0+gqa'), r"attn.*hybrid.*; not 'deltanet\*0'$"),
    (dict(attn='deltanet*x+gqa'), r"attn.*hybrid"),
    (dict(attn='mamba2*2+foo+gqa'), r"hybrid.*; not 'foo'$"),  # the wrong part named
    (dict(attn='deltanet+'), r"attn.*hybrid"), (dict(attn=3), r"attn=3 is invalid"),
    (dict(attn='mha*99999999999'), r"has 99999999999 layers"),  # unbuilt
    (dict(attn='mha*\u00b2'), r"attn.*hybrid"),
    (dict(attn='mha*\uff13'), r"attn.*hybrid"),  # a full-width 3: ASCII digits only
    # leading zeros do not hide a count
    (dict(attn='linear*0000009999999999'), r"has 9999999999 layers"),
    # never reads
    (dict(attn='gated_deltanet', conv_size=300), r"conv_size=300 is invalid: must be <= "
                                                 r"block_size=256"),
    (dict(attn='mha', conv_size=8), r"conv_size=8 is invalid: no layer of attn='mha' uses it"),
    (dict(attn='linear*2+gqa', conv_size=2), r"conv_size=2 is invalid: no layer of "
                                             r"attn='linear\*2\+gqa' uses it"),
    (dict(attn='gated_deltanet', n_layer=2, n_head=4, n_embd=64, block_size=4000, conv_size=3000,
          match_mha_params=True),
     r"match_mha_params.*MLP would need -\d+ units: .*\(lower its sizes, or turn it off\)"),
    (dict(attn='deltanet+gqa+mla'), r"mixes softmax layouts"),
    # the hybrid's GQA rule
    (dict(attn='mamba2+gqa', n_kv_head=4), r"n_kv_head.*n_head=6 allows \[2, 3\]"),
    # unused
    (dict(attn='deltanet', n_kv_head=2), r"n_kv_head=2 is invalid: no layer of attn='deltanet' "
                                         r"uses it$"),
    (dict(attn='retnet', q_lora_rank=8), r"q_lora_rank=8 is invalid: no layer of attn='retnet' "
                                         r"uses it"),
    (dict(attn='gqa', kv_lora_rank=64), r"kv_lora_rank=64 is invalid: no layer of attn='gqa' uses "
                                        r"it"),
    (dict(attn='deltanet*3+gqa', rope_head_dim=8), r"rope_head_dim=8 is invalid: no layer of .* "
                                                   r"uses it"),
    (dict(pos_emb='alibi'), r"pos_emb.*must be 'rope' or 'learned'"),
    (dict(linear_kernels='triton'), r"linear_kernels='triton' is invalid: must be 'fla' .* or "
                                    r"'torch'"),
    (dict(n_embd=100, n_head=6), r"n_embd.*divisible by n_head"),
    (dict(attn='gqa', n_kv_head=4), r"n_kv_head.*n_head=6 allows \[2, 3\].*divisor"),
    (dict(attn='gqa', n_kv_head=6), r"n_kv_head.*\[2, 3\]"),
    # no grouping: n_head is wrong
    (dict(attn='gqa', n_head=5, n_embd=40), r"n_head=5 is invalid.*allows \[\]"),
    (dict(attn='mha', n_kv_head=3), r"n_kv_head=3.*allows \[6\]"),
    (dict(attn='mqa', n_kv_head=2), r"n_kv_head.*allows \[1\]"),
    (dict(attn='mla', n_kv_head=2), r"n_kv_head=2 is invalid: no layer of attn='mla' uses it$"),
    (dict(n_kv_head=-1), r"n_kv_head.*>= 0"),
    (dict(attn='mla', rope_head_dim=7), r"rope_head_dim.*even"),
    (dict(attn='mla', rope_head_dim=-2), r"rope_head_dim.*>= 0"),
    (dict(n_embd=30, n_head=6), r"n_embd.*even for RoPE"),
    (dict(kv_lora_rank=-1), r"kv_lora_rank.*>= 0"),
    (dict(attn='mla', n_layer=2, n_head=4, n_embd=64, kv_lora_rank=256, match_mha_params=True),
     r"match_mha_params.*MLP would need -\d+ units"),
    (dict(q_lora_rank=-3), r"q_lora_rank.*>= 0"),
    (dict(block_size=0), r"block_size.*>= 1"),
    (dict(n_layer=2.5), r"n_layer=2.5 is invalid: must be of type int"),
    (dict(chunk_size=0), r"chunk_size.*>= 1"),
    (dict(dropout=1.0), r"dropout.*\[0, 1\)"),
    (dict(rope_base=0.0), r"rope_base.*> 0"),
    (dict(dropout='0.1'), r"dropout='0.1' is invalid: must be of type float"),
    (dict(dropout=None), r"dropout=None"),
    (dict(rope_base='1e4'), r"rope_base='1e4' is invalid"),
    (dict(rope_base=float('inf')), r"rope_base=inf.*finite"),
    # True is an int to Python, not a count
    (dict(n_layer=True), r"n_layer=True is invalid: must be of type int"),
    # windows: W >= 1 keys, on softmax layers, below block_size - n_sink, sinks with a window
    (dict(window=-1), r"window=-1 is invalid: must be >= 0"),
    (dict(attn='gqa@0'), r"attn='gqa@0' is invalid: .* own window of W >= 1 keys: 'gqa@64'"),
    (dict(attn='gqa@*2+mha'), r"attn.*; not 'gqa@\*2'$"),
    (dict(attn='mha@x'), r"attn='mha@x' is invalid"),
    (dict(attn='deltanet@8+gqa'), r"'deltanet@8': a window is for softmax layers \(deltanet keeps"),
    (dict(attn='deltanet', window=8), r"window=8 is invalid: attn='deltanet' has no softmax layer"),
    (dict(attn='gqa@8+gqa', window=8), r"window=8 is invalid: give one: window= windows every"),
    (dict(n_sink=4), r"n_sink=4 is invalid: sinks are the first keys a windowed layer keeps"),
    (dict(n_sink=-1), r"n_sink=-1 is invalid: must be >= 0"),
    (dict(window=256), r"window=256 is invalid: 256 keys see all of a block_size=256 sequence"),
    (dict(window=250, n_sink=6), r"window=250 is invalid: 250 keys and 6 sinks see all"),
    (dict(attn='mha@300+mha'), r"attn='mha@300\+mha' is invalid: 300 keys see all"),
]


@pytest.mark.parametrize('kwargs,message', BAD, ids=[str(k) for k, _ in BAD])
def test_bad_config_raises_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GPTConfig(**kwargs)


def test_layout_defaults_for_n_kv_head():
    assert GPTConfig(attn='mha').n_kv_head == 6
    assert GPTConfig(attn='mqa').n_kv_head == 1
    assert GPTConfig(attn='gqa').n_kv_head == 2          # smallest divisor of 6 above 1
    assert GPTConfig(attn='gqa', n_kv_head=3).n_kv_head == 3
    assert GPTConfig(attn='gqa', n_head=32, n_embd=4096, n_kv_head=8).n_kv_head == 8
    # odd head_dim is fine without RoPE, and learned positions keep MLA's (unrotated) shared key
    GPTConfig(n_embd=30, n_head=6, pos_emb='learned')
    # MHA's parameter count, which they match, does not need RoPE's even head_dim
    for attn in ('mla', 'linear'):
        GPTConfig(attn=attn, n_embd=30, n_head=6, match_mha_params=True)


def test_mla_sizes_default_to_the_papers_ratios():
    """d_c = 4 head_dim and d_R = head_dim / 2 (DeepSeek-V2: 512 and 64 at head_dim 128) unless
    given; a small model with match_mha_params then builds (the old fixed d_c = 256 asked for a
    negative MLP width)."""
    for n_head, n_embd in ((6, 384), (4, 64), (32, 4096)):
        cfg = GPTConfig(attn='mla', n_head=n_head, n_embd=n_embd, n_layer=2, match_mha_params=True)
        head_dim = n_embd // n_head
        assert (cfg.kv_lora_rank, cfg.rope_head_dim) == (4 * head_dim, head_dim // 2)
    assert GPTConfig(attn='mla', kv_lora_rank=96, rope_head_dim=8).kv_lora_rank == 96
    # a hybrid's MLA too
    assert GPTConfig(attn='deltanet+mla', n_layer=2, n_head=4, n_embd=64).kv_lora_rank == 64


def test_a_stack_keeps_the_defaults_of_fields_it_does_not_use():
    """GQA's config shows kv_lora_rank = rope_head_dim = 0, not MLA's sizes filled in, MLA and the
    linear layouts n_kv_head = 0; what older code filled in (MLA's sizes in a checkpoint converted
    before 12/2026, n_kv_head = n_head in every MLA or linear checkpoint before the layouts' own
    rules) still loads, as the default."""
    for attn in ('mha', 'gqa', 'retnet', 'gated_deltanet*3+gqa'):
        cfg = GPTConfig(attn=attn)
        assert (cfg.kv_lora_rank, cfg.rope_head_dim, cfg.q_lora_rank) == (0, 0, 0)
    # head_dim 64: what the old code filled in
    old = GPTConfig(attn='gqa', kv_lora_rank=4 * 64, rope_head_dim=32)
    assert (old.kv_lora_rank, old.rope_head_dim) == (0, 0)
    for attn in ('mla', 'deltanet', 'linear*2+retnet'):
        assert GPTConfig(attn=attn).n_kv_head == GPTConfig(attn=attn, n_kv_head=6).n_kv_head == 0


def test_hybrid_pattern_repeats_over_the_layers():
    """'gated_deltanet*3+gqa' on 6 layers: 3 Gated DeltaNet, 1 GQA, then the pattern again from its
    start (Qwen3-Next's full_attention_interval); each block is built with its layer's layout."""
    from model import GPT, CausalSelfAttention, LinearAttention
    cfg = GPTConfig(attn='gated_deltanet*3+gqa', n_layer=6, n_head=4, n_embd=32)
    assert cfg.layouts == ['gated_deltanet'] * 3 + ['gqa'] + ['gated_deltanet'] * 2
    assert cfg.softmax == 'gqa' and cfg.n_kv_head == 2
    kinds = [type(b.attn) for b in GPT(cfg).transformer.h]
    assert kinds == [LinearAttention] * 3 + [CausalSelfAttention] + [LinearAttention] * 2
    assert GPTConfig(attn='mla+retnet', n_layer=3).layouts == ['mla', 'retnet', 'mla']
    assert GPTConfig(attn='deltanet', n_layer=3).softmax is None
