# The order task of the synthetic suite (compare/synthetic.py), composed after an encoding's config:
# python train.py config/rope.py config/copy.py -> out-rope-copy, about two minutes on one CPU core
# A random string of keys, a separator, the string again; the keys repeat, so the copy must keep
# their order. Training strings take every length up to half the block; a quarter of the rows are
# needle rows (task_mix).
from config.synthetic import *  # noqa: F403 (the suite's model and schedule)

task = "copy"
task_mix = 0.25
max_iters = 3000
lr_decay_iters = 3000
