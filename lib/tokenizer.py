"""
Tokenizers rebuilt from a small JSON description, the `tokenizer` entry of a dataset's meta.json and
of every checkpoint, so sample.py needs nothing but the checkpoint:
    {"kind": "char", "chars": "\\n !…z"}   one token per character, in sorted character order
    {"kind": "gpt2"}                      GPT-2's byte-level BPE via tiktoken (the vendored ranks)
    {"kind": "ids", "vocab_size": 128}    token ids written as numbers ("0 17 5"): synthetic tasks
"""

import base64
import hashlib
from functools import cache
from pathlib import Path

GPT2_RANKS = Path(__file__).resolve().parents[1] / "data" / "gpt2.tiktoken"
# tiktoken's r50k_base
GPT2_RANKS_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
GPT2_EOT = 50256


class CharTokenizer:
    def __init__(self, chars: str):
        self.chars = chars
        self.stoi = {ch: i for i, ch in enumerate(chars)}
        self.vocab_size = len(chars)
        self.meta = {"kind": "char", "chars": chars}

    @classmethod
    def from_text(cls, text: str) -> "CharTokenizer":
        return cls("".join(sorted(set(text))))

    def encode(self, text: str) -> list[int]:
        unknown = sorted(set(text) - self.stoi.keys())
        if unknown:
            shown = ", ".join(repr(ch) for ch in unknown[:10]) + (" …" if len(unknown) > 10 else "")
            raise ValueError(
                f"{len(unknown)} character(s) not in this model's character vocabulary: {shown}; "
                "remove them from the text"
            )
        return [self.stoi[ch] for ch in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.chars[i] for i in ids)


class GPT2Tokenizer:
    """GPT-2's BPE (tiktoken's `gpt2` encoding) built offline from data/gpt2.tiktoken, checked by
    hash."""

    vocab_size = GPT2_EOT + 1
    meta = {"kind": "gpt2"}

    def __init__(self):
        self.enc = _gpt2_encoding()

    def encode(self, text: str) -> list[int]:
        return self.enc.encode_ordinary(text)

    def decode(self, ids: list[int]) -> str:
        return self.enc.decode(ids)


class IdsTokenizer:
    """The synthetic tasks' tokens (compare/synthetic.py) as text: ids separated by spaces, "0 17
    5"."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.meta = {"kind": "ids", "vocab_size": vocab_size}

    def encode(self, text: str) -> list[int]:
        try:
            ids = [int(w) for w in text.split()]
        except ValueError as e:
            raise ValueError(
                f"this model reads token ids, numbers separated by spaces like '0 17 5' ({e})"
            ) from e
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(
                f"token id {bad[0]} is outside this model's vocabulary of {self.vocab_size} (0 to "
                f"{self.vocab_size - 1})"
            )
        return ids

    def decode(self, ids: list[int]) -> str:
        return " ".join(map(str, ids))


@cache
def _gpt2_encoding():
    import tiktoken
    from tiktoken_ext.openai_public import r50k_pat_str

    data = GPT2_RANKS.read_bytes()
    if hashlib.sha256(data).hexdigest() != GPT2_RANKS_SHA256:
        raise ValueError(
            f"{GPT2_RANKS} does not have the expected sha256 {GPT2_RANKS_SHA256}: "
            "restore it from git"
        )
    ranks = {
        base64.b64decode(tok): int(rank)
        for tok, rank in (line.split() for line in data.splitlines() if line)
    }
    return tiktoken.Encoding(
        name="gpt2",
        pat_str=r50k_pat_str,
        mergeable_ranks=ranks,
        special_tokens={"<|endoftext|>": GPT2_EOT},
    )


def tokenizer_from_meta(meta: dict) -> CharTokenizer | GPT2Tokenizer | IdsTokenizer:
    kind = meta.get("kind") if isinstance(meta, dict) else None
    if kind == "char":
        return CharTokenizer(meta["chars"])
    if kind == "gpt2":
        return GPT2Tokenizer()
    if kind == "ids":
        return IdsTokenizer(int(meta["vocab_size"]))
    raise ValueError(
        f"unknown tokenizer description {meta!r}; expected kind 'char', 'gpt2' or 'ids'"
    )
