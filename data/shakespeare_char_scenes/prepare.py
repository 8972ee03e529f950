"""The embedded corpus as documents, character level: each scene of a play (an act's heading with
its first scene), each work's front matter, each poem or sequence of sonnets, the record separator
(\\x1e, the end-of-text token) before each one after the first. For packing="documents"; no network
needed. python data/shakespeare_char_scenes/prepare.py
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lib.datafiles import prepare_documents, read_embedded_corpus, scenes  # noqa: E402


def prepare(out_dir: Path | None = None) -> None:
    prepare_documents(
        scenes(read_embedded_corpus()), out_dir or Path(__file__).resolve().parent, tokenizer="char"
    )


if __name__ == "__main__":
    prepare()
