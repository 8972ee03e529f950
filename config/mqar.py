# Multi-query associative recall of the synthetic suite (compare/synthetic.py, Zoology's layout),
# composed after an encoding's config:
# python train.py config/rope.py config/mqar.py -> out-rope-mqar, about four minutes on one CPU core
# task_pairs key-value pairs together at the start, then every key asked once at random places in
# filler; the answer (the key's value) never enters the input. Training rows have 1 to task_pairs
# pairs, and every other position also asks for the token before it (task_prev_tokens): without that
# curriculum runs sat at the floor for 3,000 steps; with it, seeds learned at 1,000 to 2,500 steps
# (at 1,500 steps with the schedule ending there, two seeds did not).
from config.synthetic import *  # noqa: F403 (the suite's model and schedule)

task = "mqar"
task_layout = "zoology"
task_pairs = 4
task_queries = 4
task_prev_tokens = True
learning_rate = 3e-3
min_lr = 3e-4
max_iters = 3000
lr_decay_iters = 3000
eval_interval = 250
