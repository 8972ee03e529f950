# GPT-2 124M on OpenWebText (nanoGPT's train_gpt2.py config): ~300B tokens, 8x A100 40GB for ~4
# days. Prepare the data first: python data/openwebtext/prepare.py Launch: torchrun --standalone
# --nproc_per_node=8 train.py config/gpt2.py [--pos_encoding=rope]
dataset = "openwebtext"
pos_encoding = "learned"
n_layer = 12
n_head = 12
n_embd = 768
dropout = 0.0
block_size = 1024
batch_size = 12
gradient_accumulation_steps = 5 * 8  # 12 * 1024 * 40 = ~0.5M tokens per iteration
learning_rate = 6e-4
max_iters = 600000
lr_decay_iters = 600000
min_lr = 6e-5
beta2 = 0.95
warmup_iters = 2000
eval_interval = 1000
eval_iters = 200
log_interval = 10
weight_decay = 1e-1
