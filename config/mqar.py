# Multi-query associative recall of the synthetic suite (synthetic.py, Zoology's layout), composed after an
# encoding's config:
#   python train.py config/rope.py config/mqar.py            -> out-rope-mqar, about two minutes on one CPU core
# task_pairs key-value pairs together at the start, then every key asked once at random places in filler; the answer
# (the key's value) never enters the input. Training rows have 1 to task_pairs pairs, and every other position also
# asks for the token before it (task_prev_tokens): without that curriculum runs sat at the floor for 3,000 steps.
task = "mqar"
task_layout = "zoology"
task_pairs = 4
task_queries = 4
task_prev_tokens = True
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
