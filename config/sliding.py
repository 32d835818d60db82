# Baby GPT on tiny Shakespeare, char level, sliding-window attention as Mistral-7B-v0.1 lays it out:
# GQA on every layer, each query seeing its `window` most recent keys (itself included). Its cache
# stops growing at the window, and generation runs past block_size without starting over. The
# window is a quarter of the CPU preset's block (64), a sixteenth of the baby GPT's (256).
# StreamingLLM's attention sinks on top: --n_sink=4 (the first 4 keys stay seen).
out_dir = 'out-shakespeare-char-sliding'
attn = 'gqa'
n_kv_head = 2             # 3 query heads share each K/V head (cpu.py: 2)
window = 16
match_mha_params = True   # MLP widened to MHA's parameter count
