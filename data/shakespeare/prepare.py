"""The complete works of Shakespeare with GPT-2's BPE (tiktoken, from the vendored
data/gpt2.tiktoken), offline. python data/shakespeare/prepare.py
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lib.datafiles import prepare_text, read_embedded_corpus  # noqa: E402


def prepare(out_dir: Path | None = None) -> None:
    prepare_text(
        read_embedded_corpus(), out_dir or Path(__file__).resolve().parent, tokenizer="gpt2"
    )


if __name__ == "__main__":
    prepare()
