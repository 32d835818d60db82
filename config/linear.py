# Baby GPT on tiny Shakespeare, char level, attention: linear. Everything else is train.py's
# defaults, which are nanoGPT's config/train_shakespeare_char.py (6 layers, 6 heads, 384 wide,
# block 256, dropout 0.2, lr 1e-3, 5000 iterations, batch 64).
out_dir = 'out-shakespeare-char-linear'
# accumulate (Katharopoulos et al. 2020): phi(x) = elu(x) + 1; as many parameters as MHA
attn = 'linear'
chunk_size = 64
