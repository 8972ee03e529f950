# The position task of the synthetic suite (compare/synthetic.py), composed after an encoding's
# config:
# python train.py config/rope.py config/offset.py -> out-rope-offset, about a minute on one CPU core
# Filler from the key range with a marker in it, then a query and a number k from 1 to 4: the answer
# is the token k places after the marker, found by position alone. A quarter of the training rows
# are needle rows (task_mix).
from config.synthetic import *  # noqa: F403 (the suite's model and schedule)

task = "offset"
task_mix = 0.25
learning_rate = 3e-3  # at 1e-3 it learns three times slower
min_lr = 3e-4
max_iters = 1500
lr_decay_iters = 1500
