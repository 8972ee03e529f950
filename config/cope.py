# The comparison experiment: train.py's defaults (a ~10M-parameter GPT, 6 layers, 6 heads, 384 dims,
# block 256, character-level complete works of Shakespeare, 5000 iterations; minutes on one GPU).
# The config/<encoding>.py files differ only in this line; outputs go to out-<encoding>. Add
# config/cpu.py after it for a CPU-sized run.
pos_encoding = "cope"
