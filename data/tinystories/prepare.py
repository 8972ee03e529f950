"""TinyStories (Eldan & Li 2023): short children's stories, GPT-2 BPE, <|endoftext|> after each
(~470M tokens). python data/tinystories/prepare.py [--num_proc 8]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lib.datafiles import hf_recipe, run_hf_recipe  # noqa: E402

prepare = hf_recipe(
    Path(__file__).resolve().parent, lambda d: {"train": d["train"], "val": d["validation"]}
)

if __name__ == "__main__":
    run_hf_recipe(
        __doc__, prepare, lambda load_dataset, num_proc: load_dataset("roneneldan/TinyStories")
    )
