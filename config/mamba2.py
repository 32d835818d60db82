# Baby GPT on tiny Shakespeare, char level, attention: mamba2. Everything else is train.py's
# defaults, which are nanoGPT's config/train_shakespeare_char.py (6 layers, 6 heads, 384 wide,
# block 256, dropout 0.2, lr 1e-3, 5000 iterations, batch 64).
out_dir = 'out-shakespeare-char-mamba2'
attn = 'mamba2'
# Mamba-2's data-dependent gate: alpha_t = exp(-exp(A_log) softplus(W_a x + dt_bias)) (Dao, Gu 2024)
match_mha_params = True   # MLP narrowed to MHA's parameters (output gate, conv, W_a add weights)
