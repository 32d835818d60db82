"""
MLA's two ways to attend (DeepSeek-V2). Every head's K and V come from one latent per token, c,
through W_UK and W_UV (the layer's k_up and v_up: Linears without bias, weights (nh d_h, d_c)), and
its rope key k_R is shared by all heads: the layer passes latent = [c | k_R] (B, 1, L, d_c + d_R)
and its queries [q_nope | q_rope] (B, nh, L, d_h + d_R).

    attend_materialized   training (and generation without a cache): K = [W_UK c | k_R] and
                          V = W_UV c formed per head, then ordinary causal attention
    attend_absorbed       decode, over the cached latents: W_UK folded into the query
                          (q_nopeᵀ W_UK c = (W_UKᵀ q_nope)ᵀ c) and W_UV applied after, so it
                          is MQA over [c | k_R] and no K or V is formed

Both return (B, nh, L, d_h), before the output projection.
"""
import torch

from ops.softmax import attend


def attend_materialized(q, latent, k_up, v_up, scale, dropout_p=0.0, mask=None):
    """latent (B, 1, L, d_c + d_R): these L tokens'; causal, or under mask (a window's band)."""
    (B, H, L, _), dc = q.shape, k_up.in_features
    heads = lambda x: x.view(B, L, H, x.size(-1) // H).transpose(1, 2)  # (not -1: B may be 0)
    c, k_rope = latent[:, 0, :, :dc], latent[..., dc:]                   # (B, L, dc), (B, 1, L, dR)
    k = torch.cat([heads(k_up(c)), k_rope.expand(-1, H, -1, -1)], dim=-1)  # (B, nh, L, dh + dR)
    v = heads(v_up(c))                                                   # (B, nh, L, dh)
    return attend(q, k, v, scale, dropout_p, mask)

def attend_absorbed(q, latent, k_up, v_up, scale, dropout_p=0.0, mask=None):
    """latent (B, 1, S, d_c + d_R): the cache's; mask as attend's (None: causal)."""
    H, dc = q.size(1), k_up.in_features
    dh = k_up.out_features // H
    W_UK, W_UV = k_up.weight.view(H, dh, dc), v_up.weight.view(H, dh, dc)
    q_lat = torch.einsum('bhld,hdc->bhlc', q[..., :dh], W_UK)
    q = torch.cat([q_lat, q[..., dh:]], dim=-1)                          # (B, nh, L, dc + dR)
    # SDPA gets the value whole (k_R's columns dropped after): with one head dim for K and V its
    # fused kernel reads the cache once (else a math kernel rescales it every step); a static
    # cache's FlexAttention gets c alone
    value = latent if mask is None else latent[..., :dc]
    y = attend(q, latent, value, scale, dropout_p, mask)[..., :dc]       # (B, nh, L, dc)
    return torch.einsum('bhlc,hdc->bhld', y, W_UV)                       # (B, nh, L, dh)
