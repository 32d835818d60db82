# Baby GPT on tiny Shakespeare, char level, attention: gated_deltanet. Everything else is train.py's
# defaults, which are nanoGPT's config/train_shakespeare_char.py (6 layers, 6 heads, 384 wide,
# block 256, dropout 0.2, lr 1e-3, 5000 iterations, batch 64).
out_dir = 'out-shakespeare-char-gated_deltanet'
attn = 'gated_deltanet'
# the gated delta rule: Mamba-2's gate and the delta rule (Yang, Kautz, Hatamizadeh 2024)
match_mha_params = True   # MLP narrowed to MHA's parameters (gate, conv, W_a, W_beta add weights)
