# The one-step lookup of the synthetic suite (compare/synthetic.py), composed after an encoding's
# config:
# python train.py config/rope.py config/needle.py -> out-rope-needle, about half a minute on one CPU
# core A marker, then a key hidden at a random depth in filler of another range, a query at the end:
# the key is the only token of its range, so content alone finds it. A 30k-parameter model learns it
# in a few hundred steps.
from config.synthetic import *  # noqa: F403 (the suite's model and schedule)

task = "needle"
max_iters = 600
lr_decay_iters = 600
