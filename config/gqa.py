# Baby GPT on tiny Shakespeare, char level, attention: gqa. Everything else is train.py's
# defaults, which are nanoGPT's config/train_shakespeare_char.py (6 layers, 6 heads, 384 wide,
# block 256, dropout 0.2, lr 1e-3, 5000 iterations, batch 64).
out_dir = 'out-shakespeare-char-gqa'
attn = 'gqa'
n_kv_head = 2             # 3 query heads share each K/V head
match_mha_params = True   # MLP widened to MHA's parameter count
