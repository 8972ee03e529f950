# The order task of the synthetic suite (synthetic.py), composed after an encoding's config:
#   python train.py config/rope.py config/copy.py            -> out-rope-copy, about two minutes on one CPU core
# A random string of keys, a separator, the string again; the keys repeat, so the copy must keep their order. Training
# strings take every length up to half the block; a quarter of the rows are needle rows (task_mix).
task = "copy"
task_mix = 0.25
device = "cpu"
compile = False
block_size = 64
batch_size = 64
n_layer = 2
n_head = 2
n_embd = 32
dropout = 0.0
learning_rate = 1e-3
min_lr = 1e-4
warmup_iters = 100
max_iters = 3000
lr_decay_iters = 3000
eval_interval = 100
eval_iters = 8  # 512 validation sequences
log_interval = 100
