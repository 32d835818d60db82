# Baby GPT on tiny Shakespeare, char level, local and global layers in turn, as Gemma 2 and gpt-oss
# lay them out: 'gqa@16' layers see their 16 most recent keys, plain 'gqa' layers all of them. The
# pattern repeats over n_layer; Gemma 3's 5 local : 1 global is --attn='gqa@16*5+gqa' (on the baby
# GPT's 6 layers), Mistral's every layer local config/sliding.py, a mix with linear layers
# --attn='gated_deltanet*2+gqa@16+gqa'.
out_dir = 'out-shakespeare-char-local_global'
attn = 'gqa@16+gqa'
n_kv_head = 2             # 3 query heads share each K/V head (cpu.py: 2)
match_mha_params = True   # MLP widened to MHA's parameter count
