"""
Synthetic token-level tasks (SYNTHETIC_TASKS): the sequences a run trains on with task=...
(train.py), and that compare/synthetic.py scores at longer lengths.

A vocabulary of V tokens (task_vocab, default 128): three special tokens (MARK, QUERY, SEP), then
three equal ranges of keys, values and filler. A sequence of length L is L + 1 tokens, as training
reads T + 1 tokens for inputs and targets, and the answer tokens are known; the loss is on them
alone.

- **needle** (one step): filler, MARK, a key, filler, QUERY, the key. The key is the only token of
  its range, so content alone finds it.
- **passkey** (two steps): the same with filler drawn from the key range, so the key is found only
  through the MARK before it: a head must carry "the token before me is MARK" to the key's position,
  and another read it there.
- **mqar** (multi-query associative recall, Arora et al. 2023, Zoology): task_pairs (key, value)
  pairs at random places in filler, then task_queries of the keys, each followed by its value. Each
  query is one trial.
- **copy** (order): a random string of keys, SEP, the string again; every copied token is one trial.
  The keys repeat (41 of them at V = 128), so matching content is ambiguous and the model must keep
  the string's order. Training copies take every length that fits (at one length the copy is always
  the same distance back, learnable from position alone); evaluation copies are as long as fits,
  half the sequence.
- **offset** (position): filler from the key range with MARK in it, then QUERY and a number k (1 to
  4), then the token k places after MARK: neither content nor the marker alone finds it, only the
  distance from the marker.

task_mix makes that share of the training rows needle rows: a curriculum under which the two-step
lookups are learned in hundreds of steps instead of sitting at chance for thousands (the lookup is
learned where content finds the key, which is also the token after MARK, and then found through MARK
where content cannot).

task_prev_tokens makes every training position that is not an answer also ask for the token before
it: a curriculum that builds the previous-token head which retrieval by key needs (a value's
position must know the key before it, so that a query can find it there: an induction head). With
it, mqar is learned in about a thousand steps; without it, runs sat at the floor for 3,000 (the loss
on the answers alone gives that head almost no gradient until the head that reads it exists).
"""

from dataclasses import dataclass

import numpy as np
import torch

MARK, QUERY, SEP = 0, 1, 2
N_SPECIAL = 3
LEARNED = 0.9  # accuracy at the training length from which a run counts as having learned its task


class SyntheticError(ValueError):
    pass


@dataclass(frozen=True)
class Vocab:
    """Token ranges of a vocabulary of `size` tokens: the specials, then keys, values and filler
    (each a third)."""

    size: int

    @property
    def n(self) -> int:
        return (self.size - N_SPECIAL) // 3  # tokens per range (filler takes the remainder too)

    @property
    def keys(self) -> tuple[int, int]:
        return N_SPECIAL, N_SPECIAL + self.n

    @property
    def values(self) -> tuple[int, int]:
        return N_SPECIAL + self.n, N_SPECIAL + 2 * self.n

    @property
    def filler(self) -> tuple[int, int]:
        return N_SPECIAL + 2 * self.n, self.size

    def draw(
        self, rng: np.random.Generator, span: tuple[int, int], n: int, distinct: bool = False
    ) -> np.ndarray:
        if distinct:
            return rng.choice(np.arange(*span), n, replace=False)
        return rng.integers(*span, size=n)


# --------------------------------------------------------------------------------------------------
# Generators: each returns the inputs x (L,) int64 and the targets y (L,) int64, which are -1 (no
# loss, no trial) except where the model must answer: y[t] is the token it must predict after
# reading x[:t + 1]. `train` asks for the training distribution (copy varies its length, mqar its
# number of pairs), otherwise the evaluation one.


def _shifted(tokens: np.ndarray, answer: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A sequence of L + 1 tokens whose answers are its own next tokens (teacher forcing) as (x, y)
    of L each."""
    return tokens[:-1], np.where(answer[1:], tokens[1:], -1)


def _lookup(
    v: Vocab, L: int, rng: np.random.Generator, filler: tuple[int, int]
) -> tuple[np.ndarray, np.ndarray]:
    tokens = v.draw(rng, filler, L + 1)
    key = v.draw(rng, v.keys, 1)[0]
    # MARK at 0 … L - 3: MARK, key, then at least QUERY and the answer
    at = int(rng.integers(0, L - 2))
    tokens[at], tokens[at + 1], tokens[L - 1], tokens[L] = MARK, key, QUERY, key
    answer = np.zeros(L + 1, dtype=bool)
    answer[L] = True
    return _shifted(tokens, answer)


def needle(
    v: Vocab, L: int, rng: np.random.Generator, train: bool = False, **_
) -> tuple[np.ndarray, np.ndarray]:
    """Filler, MARK, key at a uniform depth, filler, QUERY: the answer is the key, the only token of
    its range in the sequence, found by its content."""
    return _lookup(v, L, rng, v.filler)


def passkey(
    v: Vocab, L: int, rng: np.random.Generator, train: bool = False, **_
) -> tuple[np.ndarray, np.ndarray]:
    """As needle, with filler from the key range: the key is the token after MARK, found through
    MARK alone."""
    return _lookup(v, L, rng, v.keys)


MQAR_LAYOUTS = ("scattered", "zoology")


def mqar(
    v: Vocab,
    L: int,
    rng: np.random.Generator,
    train: bool = False,
    pairs: int = 8,
    queries: int = 4,
    layout: str = "scattered",
    **_,
) -> tuple[np.ndarray, np.ndarray]:
    """`pairs` (key, value) pairs, keys distinct and values distinct, then `queries` distinct keys
    of them; the answer at each query is its key's value, which never enters the input (a later
    query cannot rule out values answered before it). Layout scattered: the pairs at random places
    in filler, the queries together at the end. Layout zoology (Arora et al. 2023): the pairs
    together at the start, the queries at random places in the filler after them. In training, any
    number of pairs from 1 to `pairs`: with one or two the value is found by its range alone, and
    that lookup is learned before the binding of key and value."""
    if train:
        pairs = int(rng.integers(1, pairs + 1))
        queries = min(queries, pairs)
    keys = v.draw(rng, v.keys, pairs, distinct=True)
    values = v.draw(rng, v.values, pairs, distinct=True)
    asked = rng.choice(pairs, queries, replace=False)
    x = v.draw(rng, v.filler, L)
    y = np.full(L, -1, dtype=np.int64)
    if layout == "zoology":
        x[0 : 2 * pairs : 2], x[1 : 2 * pairs : 2] = keys, values
        # each query's place
        at = np.sort(rng.choice(np.arange(2 * pairs, L), queries, replace=False))
    else:
        n_fill = L - 2 * pairs - queries
        # filler before each pair, after
        gaps = np.bincount(rng.integers(0, pairs + 1, n_fill), minlength=pairs + 1)
        # each key's place: the filler and pairs before it
        first = np.cumsum(gaps[:-1]) + 2 * np.arange(pairs)
        x[first], x[first + 1] = keys, values
        at = np.arange(L - queries, L)
    x[at] = keys[asked]
    y[at] = values[asked]
    return x, y


def copy(
    v: Vocab, L: int, rng: np.random.Generator, train: bool = False, **_
) -> tuple[np.ndarray, np.ndarray]:
    """Filler, a string of keys, SEP, the string again (the answers). The string is as long as fits,
    L // 2 tokens; in training any length from 1 to that, so that its distance back varies."""
    longest = L // 2
    n = int(rng.integers(1, longest + 1)) if train else longest
    pad = L + 1 - 2 * n - 1
    s = v.draw(rng, v.keys, n)
    tokens = np.concatenate([v.draw(rng, v.filler, pad), s, [SEP], s]).astype(np.int64)
    answer = np.zeros(L + 1, dtype=bool)
    answer[L + 1 - n :] = True
    return _shifted(tokens, answer)


def offset(
    v: Vocab, L: int, rng: np.random.Generator, train: bool = False, **_
) -> tuple[np.ndarray, np.ndarray]:
    """Filler from the key range with MARK at a uniform depth, then QUERY and a number k from 1 to
    OFFSETS (the first OFFSETS value tokens): the answer is the token k places after MARK, found by
    position alone."""
    tokens = v.draw(rng, v.keys, L + 1)
    k = int(rng.integers(1, OFFSETS + 1))
    # MARK at 0 … L - 3 - k: the k-th token after it comes before QUERY
    at = int(rng.integers(0, L - 2 - k))
    tokens[at] = MARK
    tokens[L - 2] = QUERY
    tokens[L - 1] = v.values[0] + k - 1
    tokens[L] = tokens[at + k]
    answer = np.zeros(L + 1, dtype=bool)
    answer[L] = True
    return _shifted(tokens, answer)


OFFSETS = 4  # offset asks for the 1st to the 4th token after the marker
SYNTHETIC_TASKS = {
    "needle": needle,
    "passkey": passkey,
    "mqar": mqar,
    "copy": copy,
    "offset": offset,
}


def fixed_tokens(task: str, pairs: int = 8, queries: int = 4) -> int:
    """The fewest tokens a sequence of the task holds (its fixed parts) and its answer: the shortest
    length is this minus one."""
    return {
        "needle": 4,
        "passkey": 4,
        "mqar": 2 * pairs + queries + 1,
        "copy": 3,
        "offset": 4 + OFFSETS,
    }[task]


def check(
    task: str,
    length: int,
    vocab: int,
    pairs: int = 8,
    queries: int = 4,
    layout: str = "scattered",
    knob: str = "raise block_size",
) -> None:
    """Raise SyntheticError, naming the fix, where the task cannot be made at this length with this
    vocabulary. knob is the fix for a length too short: training's block size, or an evaluation's
    lengths."""
    if task not in SYNTHETIC_TASKS:
        raise SyntheticError(
            f"task={task!r} is not a synthetic task; choose one of {', '.join(SYNTHETIC_TASKS)}"
        )
    if task == "mqar" and layout not in MQAR_LAYOUTS:
        raise SyntheticError(f"task_layout={layout!r}: choose {' or '.join(MQAR_LAYOUTS)}")
    if task == "mqar" and pairs < 1:
        raise SyntheticError(
            f"task_pairs={pairs} must be at least 1 (key-value pairs per sequence)"
        )
    if task == "mqar" and not 1 <= queries <= pairs:
        raise SyntheticError(
            f"task_queries={queries} must be between 1 and task_pairs={pairs} (each query asks one "
            "pair's key)"
        )
    need = fixed_tokens(task, pairs, queries)
    if length + 1 < need:
        raise SyntheticError(
            f"task={task!r} needs a length of at least {need - 1} tokens (its fixed parts alone), "
            f"got {length}; {knob}"
        )
    v = Vocab(vocab)
    # each range must give the task a choice: two keys at least, and mqar's keys distinct
    least = pairs if task == "mqar" else 2
    if v.n < least:
        raise SyntheticError(
            f"task_vocab={vocab} is too small for {task!r}: {N_SPECIAL} special tokens and three "
            "ranges (keys, "
            f"values, filler) of {max(v.n, 0)} tokens each, where the task needs {least}; use "
            "task_vocab "
            ">= "
            f"{N_SPECIAL + 3 * least} (128 is the default)"
        )


def sequence(
    task: str, vocab: int, length: int, rng: np.random.Generator, train: bool = False, **kw
):
    """One sequence of the task: inputs x (length,) and targets y (length,), -1 except at the
    answers."""
    return SYNTHETIC_TASKS[task](Vocab(vocab), length, rng, train=train, **kw)


def batch(
    task: str,
    vocab: int,
    B: int,
    T: int,
    rng: np.random.Generator,
    train: bool = True,
    mix: float = 0.0,
    previous: bool = False,
    **kw,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs x and targets y (B, T) of B sequences; y is -1 (ignored by the loss) except at the
    answers. Each row is a needle row with probability mix (the curriculum of task_mix), else one of
    the task's. previous (the curriculum of task_prev_tokens): every other position asks for the
    token before it too (the first position for nothing)."""
    seqs = [
        sequence("needle" if rng.uniform() < mix else task, vocab, T, rng, train, **kw)
        for _ in range(B)
    ]
    x = np.stack([x for x, _ in seqs])
    y = np.stack([y for _, y in seqs])
    if previous:
        # (B, T): x[t - 1], -1 at t = 0
        before = np.pad(x[:, :-1], ((0, 0), (1, 0)), constant_values=-1)
        y = np.where(y < 0, before, y)
    return torch.from_numpy(x), torch.from_numpy(y)


def task_options(cfg: dict) -> dict:
    """The generator options of a train.py config (or a checkpoint's)."""
    return {
        "pairs": cfg.get("task_pairs", 8),
        "queries": cfg.get("task_queries", 4),
        # checkpoints from before the option: the scattered layout
        "layout": cfg.get("task_layout", "scattered"),
    }


def learned_at(history: list[dict], threshold: float = LEARNED) -> int | None:
    """The first evaluated iteration whose accuracy reached threshold, or None."""
    return next((h["iter"] for h in history if h.get("acc", 0) >= threshold), None)
