# The one-step lookup of the synthetic suite (synthetic.py), composed after an encoding's config:
#   python train.py config/rope.py config/needle.py          -> out-rope-needle, about half a minute on one CPU core
# A marker, then a key hidden at a random depth in filler of another range, a query at the end: the key is the only
# token of its range, so content alone finds it. A 30k-parameter model learns it in a few hundred steps.
task = "needle"
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
max_iters = 600
lr_decay_iters = 600
eval_interval = 100
eval_iters = 8  # 512 validation sequences
log_interval = 100
