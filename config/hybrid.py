# Baby GPT on tiny Shakespeare, char level, a hybrid stack as Qwen3-Next builds it: three Gated
# DeltaNet layers to one softmax layer (GQA), the pattern repeated over the layers (6 layers: 3 GDN,
# GQA, 2 GDN; the CPU preset's 4: 3 GDN, GQA). Kimi Linear's is 3:1 too, with MLA:
# --attn='gated_deltanet*3+mla' --out_dir=out-hybrid-mla. The pattern may not be longer than
# n_layer, and holds one softmax layout. Everything else is train.py's defaults (nanoGPT's
# train_shakespeare_char.py).
out_dir = 'out-shakespeare-char-hybrid'
attn = 'gated_deltanet*3+gqa'
n_kv_head = 2             # the GQA layer's: n_head / 2 query heads a K/V head (3 here; cpu.py: 2)
match_mha_params = True   # MLP sized to MHA's parameter count
