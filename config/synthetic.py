# The model and schedule every task of the synthetic suite (compare/synthetic.py) starts from; each
# task's config (config/needle.py, passkey, mqar, offset, copy) reads this file and adds its own
# task, steps and rate: a 2-layer, 2-head, 32-dim GPT (about 30k parameters) at 64 tokens, batch 64,
# on a CPU.
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
eval_interval = 100
eval_iters = 8  # 512 validation sequences
log_interval = 100
