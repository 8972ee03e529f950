# Multi-query associative recall of the synthetic suite (synthetic.py, Zoology's layout), composed after an
# encoding's config:
#   python train.py config/rope.py config/mqar.py            -> out-rope-mqar, about four minutes on one CPU core
# task_pairs key-value pairs together at the start, then every key asked once at random places in filler; the answer
# (the key's value) never enters the input. Training rows have 1 to task_pairs pairs, and every other position also
# asks for the token before it (task_prev_tokens): without that curriculum runs sat at the floor for 3,000 steps;
# with it, seeds learned at 1,000 to 2,500 steps (at 1,500 steps with the schedule ending there, two seeds did not).
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
max_iters = 3000
lr_decay_iters = 3000
eval_interval = 250
eval_iters = 8  # 512 validation sequences
log_interval = 100
