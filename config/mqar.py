# Multi-query associative recall of the synthetic suite (synthetic.py, as in Zoology), composed after an encoding's
# config:
#   python train.py config/rope.py config/mqar.py            -> out-rope-mqar, about two minutes on one CPU core
# task_pairs key-value pairs at random places in filler, then task_queries of the keys, each followed by its value.
# Training rows have 1 to task_pairs pairs, and a quarter of them are needle rows (task_mix).
task = "mqar"
task_pairs = 4  # with 8 pairs and 4 queries, runs stayed near chance for 1,600 steps at this width
task_queries = 2
task_mix = 0.25
device = "cpu"
compile = False
block_size = 64
batch_size = 64
n_layer = 2
n_head = 2
n_embd = 32
dropout = 0.0
learning_rate = 3e-3
min_lr = 3e-4
warmup_iters = 100
max_iters = 1500
lr_decay_iters = 1500
eval_interval = 100
eval_iters = 8  # 512 validation sequences
log_interval = 100
