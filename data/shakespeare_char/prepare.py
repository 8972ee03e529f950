"""The embedded default: the complete works of Shakespeare, character level (84 characters), no
network needed. python data/shakespeare_char/prepare.py
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lib.datafiles import prepare_text, read_embedded_corpus  # noqa: E402


def prepare(out_dir: Path | None = None) -> None:
    prepare_text(
        read_embedded_corpus(), out_dir or Path(__file__).resolve().parent, tokenizer="char"
    )


if __name__ == "__main__":
    prepare()
