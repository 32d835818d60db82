# Baby GPT on tiny Shakespeare, char level, attention: deltanet. Everything else is train.py's
# defaults, which are nanoGPT's config/train_shakespeare_char.py (6 layers, 6 heads, 384 wide,
# block 256, dropout 0.2, lr 1e-3, 5000 iterations, batch 64).
out_dir = 'out-shakespeare-char-deltanet'
attn = 'deltanet'
# the delta rule: beta_t = sigmoid(W_beta x), L2-normed q and k (Schlag et al. 2021, Yang et al.
# 2024)
match_mha_params = True   # MLP narrowed to MHA's parameters (output gate, conv, W_beta add weights)
