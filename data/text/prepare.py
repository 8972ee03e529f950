"""Any local text file, character level or GPT-2 BPE; the last 10% is the validation split.
    python data/text/prepare.py --input my.txt [--tokenizer char|gpt2] [--out_dir data/text] [--separator '\n\n\n']
Then train with --dataset=text (or the name of the folder given as --out_dir). --separator: the text is documents
split at each occurrence of it (Python escapes such as \n are read), marked with an end-of-text token for
--packing=documents (GPT-2's <|endoftext|>, or for chars the record separator \x1e); the validation split is the last
documents.
"""

import argparse
import codecs
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from datafiles import DataError, prepare_text  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", required=True, help="a UTF-8 text file")
    parser.add_argument("--tokenizer", choices=["char", "gpt2"], default="char")
    parser.add_argument("--out_dir", default=str(Path(__file__).resolve().parent))
    parser.add_argument("--val_fraction", type=float, default=0.1)
    parser.add_argument("--separator", help="the string between documents, e.g. '\\n\\n\\n' (default: one stream)")
    args = parser.parse_args(argv)
    try:
        # the characters typed, with escapes (\n, \u00a7) read: characters past Latin-1 as escapes first, so that
        # unicode_escape (which reads bytes as Latin-1) keeps '§' and '═' as they are
        typed = args.separator
        separator = (
            None if typed is None else codecs.decode(typed.encode("latin-1", "backslashreplace"), "unicode_escape")
        )
        if separator == "":
            raise DataError("--separator is empty: give the string that separates documents, e.g. '\\n\\n\\n'")
        text = Path(args.input).read_text(encoding="utf-8")
        prepare_text(text, args.out_dir, args.tokenizer, args.val_fraction, separator)
    except (OSError, UnicodeDecodeError, DataError) as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
