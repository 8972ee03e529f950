"""The model's settings that are not an encoding's formula: the shape every model has (ModelShape),
how an encoding declares an option (Option, with its checks), and activation checkpointing. model.py
builds GPTConfig from these; nothing here imports the project's code."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Option:
    """An encoding's setting (a GPTConfig field, a train.py key). check: what is wrong with a value,
    or None; derive: a default of None from the config; idle: why a given value does nothing among
    train.py's options (a dict), or None."""

    default: Any
    help: str
    check: Callable[[Any], str | None] = lambda value: None
    derive: Callable[[Any], Any] | None = None
    idle: Callable[[dict], str | None] = lambda options: None
    before: Any = None  # what a config saved before the option existed computed (None: the default)


def number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def positive_int(v: Any) -> str | None:
    return (
        None
        if isinstance(v, int) and not isinstance(v, bool) and v >= 1
        else "must be a positive integer"
    )


def boolean(v: Any) -> str | None:
    return None if isinstance(v, bool) else "must be True or False"


def finite(v: Any) -> str | None:
    return None if number(v) and math.isfinite(v) else "must be a finite number"


def one_of(values: tuple, what: str) -> Callable[[Any], str | None]:
    return lambda v: None if v in values else f"is not {what}; valid choices: {', '.join(values)}"


def at_most(name: str, value: float, most: float, why: str) -> None:
    """A ValueError where |value| (an option's, named) passes most: the bound on its side, and
    why."""
    if abs(value) > most:
        bound = f"at most {most:.4g}" if value > 0 else f"at least {-most:.4g}"
        raise ValueError(f"{name}={value!r} must be {bound}: {why}")


def optional(check: Callable[[Any], str | None]) -> Callable[[Any], str | None]:
    return lambda v: None if v is None else check(v)


def greater(bound: float, rule: str, equal: bool = False) -> Callable[[Any], str | None]:
    return lambda v: None if number(v) and (v >= bound if equal else v > bound) else rule


# stream: nanoGPT's, causal; documents: each end-of-text begins one, block-causal
PACKINGS = ("stream", "documents")


@dataclass
class ModelShape:
    """The model's shape: GPTConfig's fields that every model has; GPTConfig adds every encoding's
    options."""

    block_size: int = 1024  # training context length (the most a `learned` model can take)
    vocab_size: int = 50304  # GPT-2's 50257, padded up to a multiple of 64 for speed
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    # biases in Linears and LayerNorms, like GPT-2; False is a bit better and faster
    bias: bool = True
    pos_encoding: str = "learned"  # a name of model.POS_ENCODINGS (model.py checks it)
    gelu: str = "exact"  # exact (nanoGPT's, faster on CPU) | tanh (GPT-2's own; from_hf uses it)
    packing: str = "stream"  # a name of PACKINGS: whether the documents of a row see each other
    # packing="documents": the token that begins each document (the data's end-of-text)
    eot_token: int | None = None

    def __post_init__(self):
        for name in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd"):
            if problem := positive_int(getattr(self, name)):
                raise ValueError(f"{name}={getattr(self, name)!r} {problem}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout={self.dropout!r} must be in [0, 1)")
        if self.gelu not in ("exact", "tanh"):
            raise ValueError(f"gelu={self.gelu!r} is not a GELU; valid choices: exact, tanh")
        if self.packing not in PACKINGS:
            raise ValueError(
                f"packing={self.packing!r} is not a packing; valid choices: {', '.join(PACKINGS)}"
            )
        eot = self.eot_token
        if self.packing == "documents" and not (
            isinstance(eot, int) and not isinstance(eot, bool) and 0 <= eot < self.vocab_size
        ):
            raise ValueError(
                "packing='documents' needs eot_token, the token id that begins each document "
                "(below vocab_size="
                f"{self.vocab_size}), got {self.eot_token!r}; train.py reads it from the dataset"
            )


ACTIVATION_CHECKPOINTING = ("none", "full", "selective")


def set_activation_checkpointing(model, mode: str) -> None:
    """Recompute in the backward rather than keep: all sublayers ("full"), attention ("selective"),
    or none ("none"), for each of a model.GPT's blocks (a training setting: a resume may change
    it)."""
    if mode not in ACTIVATION_CHECKPOINTING:
        raise ValueError(
            f"activation_checkpointing={mode!r}: choose {', '.join(ACTIVATION_CHECKPOINTING)}"
        )
    for block in model.transformer.h:
        block.checkpointing = mode
