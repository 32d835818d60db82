# Baby GPT on tiny Shakespeare, char level, attention: retnet. Everything else is train.py's
# defaults, which are nanoGPT's config/train_shakespeare_char.py (6 layers, 6 heads, 384 wide,
# block 256, dropout 0.2, lr 1e-3, 5000 iterations, batch 64).
out_dir = 'out-shakespeare-char-retnet'
attn = 'retnet'
# RetNet's fixed decay: gamma_h = 1 - 2^(-5-h) per head (Sun et al. 2023)
# the MLP narrowed to MHA's parameters: the output gate, the conv, the per-head norm add weights
match_mha_params = True
