# A CPU-sized run, composed after an encoding's config: python train.py config/rope.py config/cpu.py
# nanoGPT's CPU recipe (4 layers, 4 heads, 128 dims, block 64, batch 12, 2000 iterations, no
# dropout): a few minutes on 2 cores, character-level val loss ~1.9.
device = "cpu"
compile = False
eval_iters = 20
eval_interval = 250
log_interval = 50
block_size = 64
batch_size = 12
n_layer = 4
n_head = 4
n_embd = 128
max_iters = 2000
lr_decay_iters = 2000
dropout = 0.0
