# The position task of the synthetic suite (synthetic.py), composed after an encoding's config:
#   python train.py config/rope.py config/offset.py          -> out-rope-offset, about a minute on one CPU core
# Filler from the key range with a marker in it, then a query and a number k from 1 to 4: the answer is the token k
# places after the marker, found by position alone. A quarter of the training rows are needle rows (task_mix).
task = "offset"
task_mix = 0.25
device = "cpu"
compile = False
block_size = 64
batch_size = 64
n_layer = 2
n_head = 2
n_embd = 32
dropout = 0.0
learning_rate = 3e-3  # at 1e-3 it learns three times slower
min_lr = 3e-4
warmup_iters = 100
max_iters = 1500
lr_decay_iters = 1500
eval_interval = 100
eval_iters = 8  # 512 validation sequences
log_interval = 100
