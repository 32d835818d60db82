# nanoGPT's CPU recipe, combinable with any layout: python train.py config/gqa.py config/cpu.py
# (4 layers, 4 heads, 128 wide, block 64, batch 12, 2000 iterations, no dropout)
device = 'cpu'
compile = False
eval_iters = 20
log_interval = 1
block_size = 64
batch_size = 12
n_layer = 4
n_head = 4
n_embd = 128
max_iters = 2000
lr_decay_iters = 2000
dropout = 0.0
