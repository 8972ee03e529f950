"""Any local text file, character level or GPT-2 BPE; the last 10% is the validation split.
    python data/text/prepare.py --input my.txt [--tokenizer char|gpt2] [--out_dir data/text] \
        [--separator '\n\n\n']
Then train with --dataset=text (or the name of the folder given as --out_dir). --separator: the text
is documents split at each occurrence of it (Python escapes such as \n are read), marked with an
end-of-text token for --packing=documents (GPT-2's <|endoftext|>, or for chars the record separator
\x1e); the validation split is the last documents.
"""

import argparse
import re
import sys
import unicodedata
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lib.datafiles import DataError, prepare_text  # noqa: E402

ESCAPES = {
    "\\": "\\",
    "'": "'",
    '"': '"',
    "a": "\a",
    "b": "\b",
    "f": "\f",
    "n": "\n",
    "r": "\r",
    "t": "\t",
    "v": "\v",
}
ESCAPE = re.compile(
    r"\\(N\{[^}]*\}|x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8}|[0-7]{1,3}|.)", re.DOTALL
)


def read_escapes(typed: str) -> str:
    """The characters typed with Python's escapes read (\\n, \\u00a7, \\N{SECTION SIGN}); a
    backslash that starts no escape (\\s) or ends the string is itself. A \\N{...} that names no
    character is a DataError."""

    def one(m: re.Match) -> str:
        e = m[1]
        if e.startswith("N{"):
            try:
                return unicodedata.lookup(e[2:-1])
            except KeyError:
                raise DataError(f"--separator={typed!r}: \\{e} names no character") from None
        if e[0] in "xuU" and len(e) > 1 or e[0] in "01234567":
            return chr(int(e[1:], 16) if e[0] in "xuU" else int(e, 8))
        return ESCAPES.get(e, "\\" + e)

    return ESCAPE.sub(one, typed)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--input", required=True, help="a UTF-8 text file")
    parser.add_argument("--tokenizer", choices=["char", "gpt2"], default="char")
    parser.add_argument("--out_dir", default=str(Path(__file__).resolve().parent))
    parser.add_argument("--val_fraction", type=float, default=0.1)
    parser.add_argument(
        "--separator", help="the string between documents, e.g. '\\n\\n\\n' (default: one stream)"
    )
    args = parser.parse_args(argv)
    try:
        # the characters typed
        separator = None if args.separator is None else read_escapes(args.separator)
        if separator == "":
            raise DataError(
                "--separator is empty: give the string that separates documents, e.g. '\\n\\n\\n'"
            )
        # its own line ends: '\r\n\r\n' splits a CRLF file
        with open(args.input, encoding="utf-8", newline="") as f:
            text = f.read()
        prepare_text(text, args.out_dir, args.tokenizer, args.val_fraction, separator)
    except (OSError, UnicodeDecodeError, DataError) as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
