"""TinyStories (Eldan & Li 2023): short children's stories, GPT-2 BPE, <|endoftext|> after each (~470M tokens).
python data/tinystories/prepare.py [--num_proc 8]
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from datafiles import prepare_hf  # noqa: E402
from devices import missing  # noqa: E402


def split(dataset):
    return {"train": dataset["train"], "val": dataset["validation"]}


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

    dataset = load_dataset("roneneldan/TinyStories")
    prepare(dataset, num_proc=args.num_proc)


if __name__ == "__main__":
    main()
