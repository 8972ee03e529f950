"""OpenWebText (Gokaslan & Cohen 2019) with GPT-2 BPE, as nanoGPT prepares it: ~9B train tokens (~17 GB),
0.05% held out for validation. Downloads from the Hugging Face hub (~54 GB of cache).
    python data/openwebtext/prepare.py [--num_proc 8]
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from datafiles import prepare_hf  # noqa: E402
from devices import missing  # noqa: E402


def split(dataset, seed: int = 2357):
    """OpenWebText has only a train split: hold out 0.05% of documents as val (nanoGPT's split)."""
    parts = dataset["train"].train_test_split(test_size=0.0005, seed=seed, shuffle=True)
    return {"train": parts["train"], "val": parts["test"]}


def prepare(dataset, out_dir: Path | None = None, num_proc: int | None = None) -> dict[str, int]:
    """Tokenize a loaded DatasetDict and write train.bin, val.bin and meta.json."""
    out_dir = out_dir or Path(__file__).resolve().parent
    return prepare_hf(split(dataset), out_dir, eot=True, num_proc=num_proc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num_proc", type=int, default=None)
    args = parser.parse_args()
    if problem := missing("datasets", "this dataset (read from the Hugging Face hub)"):
        sys.exit(f"error: {problem}")
    from datasets import load_dataset

    dataset = load_dataset("openwebtext", num_proc=args.num_proc)
    prepare(dataset, num_proc=args.num_proc)


if __name__ == "__main__":
    main()
