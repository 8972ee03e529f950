# The two-step lookup of the synthetic suite (compare/synthetic.py), composed after an encoding's
# config:
# python train.py config/rope.py config/passkey.py -> out-rope-passkey, about a minute on one CPU
# core A marker, then a key hidden in filler drawn from the key range, a query at the end: the key
# is found only through the marker before it. A quarter of the training rows are needle rows
# (task_mix), a curriculum without which runs sit at chance for thousands of steps.
from config.synthetic import *  # noqa: F403 (the suite's model and schedule)

task = "passkey"
task_mix = 0.25
max_iters = 1500
lr_decay_iters = 1500
