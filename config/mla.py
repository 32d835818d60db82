# Baby GPT on tiny Shakespeare, char level, attention: mla. Everything else is train.py's
# defaults, which are nanoGPT's config/train_shakespeare_char.py (6 layers, 6 heads, 384 wide,
# block 256, dropout 0.2, lr 1e-3, 5000 iterations, batch 64).
out_dir = 'out-shakespeare-char-mla'
attn = 'mla'
# kv_lora_rank (d_c) and rope_head_dim (d_R) default to DeepSeek-V2's 4 * head_dim and head_dim / 2
match_mha_params = True   # MLP narrowed to MHA's parameter count
