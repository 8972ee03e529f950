"""The embedded corpus in short documents, character level: each speech (a speaker's line and what
is said until the next speaker; a median of 85 characters), the record separator (\\x1e, the
end-of-text token) before each one after the first. Documents shorter than a block: what document
packing changes (compare/sweep.py --packing). No network needed. python
data/shakespeare_char_speeches/prepare.py
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lib.datafiles import prepare_documents, read_embedded_corpus, speeches  # noqa: E402


def prepare(out_dir: Path | None = None) -> None:
    prepare_documents(
        speeches(read_embedded_corpus()),
        out_dir or Path(__file__).resolve().parent,
        tokenizer="char",
    )


if __name__ == "__main__":
    prepare()
