# The two-step lookup of the synthetic suite (synthetic.py), composed after an encoding's config:
#   python train.py config/rope.py config/passkey.py         -> out-rope-passkey, about a minute on one CPU core
# A marker, then a key hidden in filler drawn from the key range, a query at the end: the key is found only through
# the marker before it. A quarter of the training rows are needle rows (task_mix), a curriculum without which runs
# sit at chance for thousands of steps.
task = "passkey"
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
max_iters = 1500
lr_decay_iters = 1500
eval_interval = 100
eval_iters = 8  # 512 validation sequences
log_interval = 100
