"""OpenWebText (Gokaslan & Cohen 2019) with GPT-2 BPE, as nanoGPT prepares it: ~9B train tokens (~17
GB), 0.05% held out for validation. Downloads from the Hugging Face hub (~54 GB of cache).
    python data/openwebtext/prepare.py [--num_proc 8]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lib.datafiles import hf_recipe, run_hf_recipe  # noqa: E402


def split(dataset, seed: int = 2357):
    """OpenWebText has only a train split: hold out 0.05% of documents as val (nanoGPT's split)."""
    parts = dataset["train"].train_test_split(test_size=0.0005, seed=seed, shuffle=True)
    return {"train": parts["train"], "val": parts["test"]}


prepare = hf_recipe(Path(__file__).resolve().parent, split)

if __name__ == "__main__":
    run_hf_recipe(
        __doc__,
        prepare,
        lambda load_dataset, num_proc: load_dataset("openwebtext", num_proc=num_proc),
    )
