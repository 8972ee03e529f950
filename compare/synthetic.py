"""
Synthetic token-level tasks (SYNTHETIC_TASKS): retrieval a small model can learn on a CPU, and how far past its
training length each encoding still does it. train.py trains on them alone (task=..., e.g. `python train.py
config/rope.py config/passkey.py`), this file scores checkpoints at longer lengths, and `compare/sweep.py --synthetic`
runs the whole suite. (compare/tasks.py's TEXT_TASKS are retrieval written in a text dataset's tokens, mixed into text
runs.)

    python -m compare.synthetic out-rope-passkey out-alibi-passkey            # 1x to 16x the training length

A vocabulary of V tokens (task_vocab, default 128): three special tokens (MARK, QUERY, SEP), then three equal
ranges of keys, values and filler. A sequence of length L is L + 1 tokens, as training reads T + 1 tokens for
inputs and targets, and the answer tokens are known; the loss is on them alone.

- **needle** (one step): filler, MARK, a key, filler, QUERY, the key. The key is the only token of its range, so
  content alone finds it.
- **passkey** (two steps): the same with filler drawn from the key range, so the key is found only through the MARK
  before it: a head must carry "the token before me is MARK" to the key's position, and another read it there.
- **mqar** (multi-query associative recall, Arora et al. 2023, Zoology): task_pairs (key, value) pairs at random
  places in filler, then task_queries of the keys, each followed by its value. Each query is one trial.
- **copy** (order): a random string of keys, SEP, the string again; every copied token is one trial. The keys repeat
  (41 of them at V = 128), so matching content is ambiguous and the model must keep the string's order. Training
  copies take every length that fits (at one length the copy is always the same distance back, learnable from
  position alone); evaluation copies are as long as fits, half the sequence.
- **offset** (position): filler from the key range with MARK in it, then QUERY and a number k (1 to 4), then the
  token k places after MARK: neither content nor the marker alone finds it, only the distance from the marker.

task_mix makes that share of the training rows needle rows: a curriculum under which the two-step lookups are learned
in hundreds of steps instead of sitting at chance for thousands (the lookup is learned where content finds the key,
which is also the token after MARK, and then found through MARK where content cannot).

task_prev_tokens makes every training position that is not an answer also ask for the token before it: a curriculum
that builds the previous-token head which retrieval by key needs (a value's position must know the key before it, so
that a query can find it there: an induction head). With it, mqar is learned in about a thousand steps; without it,
runs sat at the floor for 3,000 (the loss on the answers alone gives that head almost no gradient until the head
that reads it exists).

Accuracy is greedy exact match at each answer token given the true tokens before it (teacher-forced, one forward):
for one-token answers that is greedy decoding itself. A model "learned" a task when its accuracy at the training
length reaches LEARNED (90%).
"""

import argparse
import functools
import json
import sys
from copy import deepcopy
from dataclasses import dataclass

import numpy as np
import torch

from lib.devices import device_memory, forward_bytes, gb

MARK, QUERY, SEP = 0, 1, 2
N_SPECIAL = 3
EVAL_MEMORY = 2 * 2**30  # bytes an evaluation batch may take
LEARNED = 0.9  # accuracy at the training length from which a run counts as having learned its task


class SyntheticError(ValueError):
    pass


@dataclass(frozen=True)
class Vocab:
    """Token ranges of a vocabulary of `size` tokens: the specials, then keys, values and filler (each a third)."""

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

    def draw(self, rng: np.random.Generator, span: tuple[int, int], n: int, distinct: bool = False) -> np.ndarray:
        if distinct:
            return rng.choice(np.arange(*span), n, replace=False)
        return rng.integers(*span, size=n)


# ----------------------------------------------------------------------------------------------------------------
# Generators: each returns the inputs x (L,) int64 and the targets y (L,) int64, which are -1 (no loss, no trial)
# except where the model must answer: y[t] is the token it must predict after reading x[:t + 1]. `train` asks for the
# training distribution (copy varies its length, mqar its number of pairs), otherwise the evaluation one.


def _shifted(tokens: np.ndarray, answer: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A sequence of L + 1 tokens whose answers are its own next tokens (teacher forcing) as (x, y) of L each."""
    return tokens[:-1], np.where(answer[1:], tokens[1:], -1)


def _lookup(v: Vocab, L: int, rng: np.random.Generator, filler: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    tokens = v.draw(rng, filler, L + 1)
    key = v.draw(rng, v.keys, 1)[0]
    at = int(rng.integers(0, L - 2))  # MARK at 0 … L - 3: MARK, key, then at least QUERY and the answer
    tokens[at], tokens[at + 1], tokens[L - 1], tokens[L] = MARK, key, QUERY, key
    answer = np.zeros(L + 1, dtype=bool)
    answer[L] = True
    return _shifted(tokens, answer)


def needle(v: Vocab, L: int, rng: np.random.Generator, train: bool = False, **_) -> tuple[np.ndarray, np.ndarray]:
    """Filler, MARK, key at a uniform depth, filler, QUERY: the answer is the key, the only token of its range in the
    sequence, found by its content."""
    return _lookup(v, L, rng, v.filler)


def passkey(v: Vocab, L: int, rng: np.random.Generator, train: bool = False, **_) -> tuple[np.ndarray, np.ndarray]:
    """As needle, with filler from the key range: the key is the token after MARK, found through MARK alone."""
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
    """`pairs` (key, value) pairs, keys distinct and values distinct, then `queries` distinct keys of them; the answer
    at each query is its key's value, which never enters the input (a later query cannot rule out values answered
    before it). Layout scattered: the pairs at random places in filler, the queries together at the end. Layout
    zoology (Arora et al. 2023): the pairs together at the start, the queries at random places in the filler after
    them. In training, any number of pairs from 1 to `pairs`: with one or two the value is found by its range alone,
    and that lookup is learned before the binding of key and value."""
    if train:
        pairs = int(rng.integers(1, pairs + 1))
        queries = min(queries, pairs)
    keys, values = v.draw(rng, v.keys, pairs, distinct=True), v.draw(rng, v.values, pairs, distinct=True)
    asked = rng.choice(pairs, queries, replace=False)
    x = v.draw(rng, v.filler, L)
    y = np.full(L, -1, dtype=np.int64)
    if layout == "zoology":
        x[0 : 2 * pairs : 2], x[1 : 2 * pairs : 2] = keys, values
        at = np.sort(rng.choice(np.arange(2 * pairs, L), queries, replace=False))  # each query's place
    else:
        n_fill = L - 2 * pairs - queries
        gaps = np.bincount(rng.integers(0, pairs + 1, n_fill), minlength=pairs + 1)  # filler before each pair, after
        first = np.cumsum(gaps[:-1]) + 2 * np.arange(pairs)  # each key's place: the filler and pairs before it
        x[first], x[first + 1] = keys, values
        at = np.arange(L - queries, L)
    x[at], y[at] = keys[asked], values[asked]
    return x, y


def copy(v: Vocab, L: int, rng: np.random.Generator, train: bool = False, **_) -> tuple[np.ndarray, np.ndarray]:
    """Filler, a string of keys, SEP, the string again (the answers). The string is as long as fits, L // 2 tokens;
    in training any length from 1 to that, so that its distance back varies."""
    longest = L // 2
    n = int(rng.integers(1, longest + 1)) if train else longest
    pad = L + 1 - 2 * n - 1
    s = v.draw(rng, v.keys, n)
    tokens = np.concatenate([v.draw(rng, v.filler, pad), s, [SEP], s]).astype(np.int64)
    answer = np.zeros(L + 1, dtype=bool)
    answer[L + 1 - n :] = True
    return _shifted(tokens, answer)


def offset(v: Vocab, L: int, rng: np.random.Generator, train: bool = False, **_) -> tuple[np.ndarray, np.ndarray]:
    """Filler from the key range with MARK at a uniform depth, then QUERY and a number k from 1 to OFFSETS (the
    first OFFSETS value tokens): the answer is the token k places after MARK, found by position alone."""
    tokens = v.draw(rng, v.keys, L + 1)
    k = int(rng.integers(1, OFFSETS + 1))
    at = int(rng.integers(0, L - 2 - k))  # MARK at 0 … L - 3 - k: the k-th token after it comes before QUERY
    tokens[at], tokens[L - 2], tokens[L - 1] = MARK, QUERY, v.values[0] + k - 1
    tokens[L] = tokens[at + k]
    answer = np.zeros(L + 1, dtype=bool)
    answer[L] = True
    return _shifted(tokens, answer)


OFFSETS = 4  # offset asks for the 1st to the 4th token after the marker
SYNTHETIC_TASKS = {"needle": needle, "passkey": passkey, "mqar": mqar, "copy": copy, "offset": offset}
# compare/sweep.py --synthetic's tasks: copy is left out (RoPE reached 20% in 2,000 steps at this size, at 32 and 64
# dims)
SUITE = ("needle", "passkey", "mqar", "offset")


def fixed_tokens(task: str, pairs: int = 8, queries: int = 4) -> int:
    """The fewest tokens a sequence of the task holds (its fixed parts) and its answer: the shortest length is this
    minus one."""
    return {"needle": 4, "passkey": 4, "mqar": 2 * pairs + queries + 1, "copy": 3, "offset": 4 + OFFSETS}[task]


def check(
    task: str,
    length: int,
    vocab: int,
    pairs: int = 8,
    queries: int = 4,
    layout: str = "scattered",
    knob: str = "raise block_size",
) -> None:
    """Raise SyntheticError, naming the fix, where the task cannot be made at this length with this vocabulary. knob
    is the fix for a length too short: training's block size, or an evaluation's lengths."""
    if task not in SYNTHETIC_TASKS:
        raise SyntheticError(f"task={task!r} is not a synthetic task; choose one of {', '.join(SYNTHETIC_TASKS)}")
    if task == "mqar" and layout not in MQAR_LAYOUTS:
        raise SyntheticError(f"task_layout={layout!r}: choose {' or '.join(MQAR_LAYOUTS)}")
    if task == "mqar" and pairs < 1:
        raise SyntheticError(f"task_pairs={pairs} must be at least 1 (key-value pairs per sequence)")
    if task == "mqar" and not 1 <= queries <= pairs:
        raise SyntheticError(
            f"task_queries={queries} must be between 1 and task_pairs={pairs} (each query asks one pair's key)"
        )
    need = fixed_tokens(task, pairs, queries)
    if length + 1 < need:
        raise SyntheticError(
            f"task={task!r} needs a length of at least {need - 1} tokens (its fixed parts alone), got {length}; {knob}"
        )
    v = Vocab(vocab)
    # each range must give the task a choice: two keys at least, and mqar's keys distinct
    least = pairs if task == "mqar" else 2
    if v.n < least:
        raise SyntheticError(
            f"task_vocab={vocab} is too small for {task!r}: {N_SPECIAL} special tokens and three ranges (keys, "
            f"values, filler) of {v.n} tokens each, where the task needs {least}; use task_vocab >= "
            f"{N_SPECIAL + 3 * least} (128 is the default)"
        )


def sequence(task: str, vocab: int, length: int, rng: np.random.Generator, train: bool = False, **kw):
    """One sequence of the task: inputs x (length,) and targets y (length,), -1 except at the answers."""
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
    """Inputs x and targets y (B, T) of B sequences; y is -1 (ignored by the loss) except at the answers. Each row is
    a needle row with probability mix (the curriculum of task_mix), else one of the task's. previous (the curriculum
    of task_prev_tokens): every other position asks for the token before it too (the first position for nothing)."""
    seqs = [sequence("needle" if rng.uniform() < mix else task, vocab, T, rng, train, **kw) for _ in range(B)]
    x, y = np.stack([x for x, _ in seqs]), np.stack([y for _, y in seqs])
    if previous:
        before = np.pad(x[:, :-1], ((0, 0), (1, 0)), constant_values=-1)  # (B, T): x[t - 1], -1 at t = 0
        y = np.where(y < 0, before, y)
    return torch.from_numpy(x), torch.from_numpy(y)


def task_options(cfg: dict) -> dict:
    """The generator options of a train.py config (or a checkpoint's)."""
    return {
        "pairs": cfg.get("task_pairs", 8),
        "queries": cfg.get("task_queries", 4),
        "layout": cfg.get("task_layout", "scattered"),  # checkpoints from before the option: the scattered layout
    }


# ----------------------------------------------------------------------------------------------------------------
# Evaluation


def eval_rng(seed: int, task: str, length: int) -> np.random.Generator:
    """The sequences of one (task, length) cell: the same for every checkpoint with the same seed."""
    return np.random.default_rng([seed, list(SYNTHETIC_TASKS).index(task), length])


@torch.no_grad()
def scores(
    model, task: str, vocab: int, length: int, n: int, seed: int = 0, batch_size: int = 50, device: str = "cpu", **kw
) -> dict[str, float]:
    """Exact-match accuracy over n evaluation sequences of the task at this length: "token", over the answer tokens
    (the argmax at each answer position given the true tokens before it; every answer token is one trial), and
    "sequence", the share of sequences whose answers are all right (copy's whole string). model is a GPT, or any
    callable from inputs (B, T) to logits (B, T, V)."""
    rng = eval_rng(seed, task, length)
    right = total = whole = 0
    for i in range(0, n, batch_size):
        x, y = batch(task, vocab, min(batch_size, n - i), length, rng, train=False, **kw)
        x, y = x.to(device), y.to(device)
        mask = y >= 0
        if hasattr(model, "features"):  # only the answers' hidden states (N, C) go to the vocabulary
            logits = model.lm_head(model.features(x)[mask])
        else:
            logits = model(x)[mask]
        hit = torch.zeros_like(y, dtype=torch.bool)
        hit[mask] = logits.argmax(-1) == y[mask]
        right += int(hit.sum())
        total += int(mask.sum())
        whole += int((hit | ~mask).all(1).sum())
    return {"token": right / total, "sequence": whole / n}


def accuracy(model, task: str, vocab: int, length: int, n: int, seed: int = 0, **kw) -> float:
    """Exact-match accuracy over the answer tokens (scores' "token")."""
    return scores(model, task, vocab, length, n, seed, **kw)["token"]


# ----------------------------------------------------------------------------------------------------------------
# Floors: what a model scores without retrieving anything. Each task has a family of shortcuts, strategies that read
# the sequence without finding the answer where the task hides it; the best of them, on the evaluation's own
# sequences, is the floor a table must be read against (a model at the floor has learned a shortcut, not the task).


def _keys(x, t, v):  # chance among the keys
    return np.arange(*v.keys)


def _most_frequent_key(x, t, v):  # passkey: the key after MARK is one more occurrence of it
    seen = x[: t + 1]
    counts = np.bincount(seen[(seen >= v.keys[0]) & (seen < v.keys[1])] - v.keys[0], minlength=v.n)
    return v.keys[0] + np.flatnonzero(counts == counts.max())


def _values_present(x, t, v):  # mqar: the answers never enter the input, so no value present can be ruled out
    seen = x[: t + 1]
    return np.unique(seen[(seen >= v.values[0]) & (seen < v.values[1])])


def _last_value(x, t, v):  # mqar: the value seen last (a recency guess, blind to the key asked)
    seen = x[: t + 1]
    return seen[(seen >= v.values[0]) & (seen < v.values[1])][-1:]


def _after_mark(x, t, v):  # offset: the token right after MARK (right when k = 1)
    return x[np.flatnonzero(x[: t + 1] == MARK)[:1] + 1]


def _commonest_after_mark(x, t, v):  # offset: the commonest of the OFFSETS tokens after MARK (every tied one): k unread
    after = x[np.flatnonzero(x[: t + 1] == MARK)[0] + 1 :][:OFFSETS]
    tokens, counts = np.unique(after, return_counts=True)
    return tokens[counts == counts.max()]


def _followed_before(x, t, v):  # copy: a token that followed an earlier occurrence of the current one
    earlier = np.flatnonzero(x[:t] == x[t])
    return np.unique(x[earlier + 1]) if len(earlier) else np.arange(*v.keys)


# Each task's shortcuts: {name: fn(x, t, vocab) -> the tokens it picks among, uniformly, for the answer after x[:t+1]}
SHORTCUTS = {
    "needle": {"chance among the keys": _keys},  # the key is the only key token: finding it by content is the task
    "passkey": {"the most frequent key": _most_frequent_key, "chance among the keys": _keys},
    "mqar": {"a value present": _values_present, "the last value": _last_value},
    "offset": {
        "the token after the marker": _after_mark,
        "the commonest of the 4 after the marker": _commonest_after_mark,
    },
    "copy": {"a token that followed the current one": _followed_before},
}


def shortcut(task: str, x: np.ndarray, t: int, v: Vocab) -> np.ndarray:
    """The candidates of the task's first shortcut (the one the docs name) for the answer after x[:t + 1]."""
    return next(iter(SHORTCUTS[task].values()))(x, t, v)


FLOOR_SEQUENCES = 2000  # the steadier estimate: at 400 sequences a floor of 27% moves by ~2 points between lengths


def floor(task: str, vocab: int, length: int, n: int, seed: int = 0, **kw) -> dict:
    """_floor's answer, computed once per process for the same arguments (a sweep's reports ask it again: 2,000
    sequences a length), a copy the caller may change."""
    return deepcopy(_floor(task, vocab, length, n, seed, **kw))


@functools.cache
def _floor(task: str, vocab: int, length: int, n: int, seed: int = 0, **kw) -> dict:
    """The best shortcut's accuracy on the n sequences that scores() reads (drawn through batch(), as it does), its
    expected "token" (each answer right with probability 1/|candidates| if it is among them) and "sequence" (every
    answer of a sequence right) accuracy; "strategy", its name (the best on the token accuracy); "band", the 95%
    half-width of an accuracy of the floor's size measured on these answers (binomial: what another no-retrieval
    strategy as good on average scores on these sequences; a cell within floor ± band is at the floor, not below
    it); "strategies", every shortcut's token accuracy; and "steady", the best shortcut's token accuracy over
    FLOOR_SEQUENCES sequences (these n and more from the same stream), a steadier estimate."""
    v, rng = Vocab(vocab), eval_rng(seed, task, length)
    names = list(SHORTCUTS[task])
    p = {name: [] for name in names}  # per answer token: the chance that the shortcut is right
    seq = {name: [] for name in names}  # per sequence: the chance that it is right at every answer
    for i in range(max(n, FLOOR_SEQUENCES)):
        if i == n:  # the scored sequences end here
            scored = {name: (np.array(p[name]), np.array(seq[name])) for name in names}
        x, y = (a[0].numpy() for a in batch(task, vocab, 1, length, rng, train=False, **kw))
        for name, fn in SHORTCUTS[task].items():
            hits = [float(y[t] in (c := fn(x, t, v))) / len(c) for t in np.flatnonzero(y >= 0)]
            p[name] += hits
            seq[name].append(float(np.prod(hits)))
    if n >= FLOOR_SEQUENCES:
        scored = {name: (np.array(p[name]), np.array(seq[name])) for name in names}
    best = max(names, key=lambda name: scored[name][0].mean())
    tok, whole = scored[best]
    return {
        "token": float(tok.mean()),
        "sequence": float(whole.mean()),
        "strategy": best,
        "band": float(1.96 * np.sqrt(tok.mean() * (1 - tok.mean()) / len(tok))),
        "strategies": {name: float(scored[name][0].mean()) for name in names},
        "steady": float(np.mean(p[best])),
    }


def evaluate_checkpoint(
    model, cfg: dict, lengths: list[int], n: int, seed: int = 0, device: str = "cpu"
) -> dict[int, dict | None]:
    """{length: scores (token and sequence accuracy) or None (no positions there)} for the checkpoint's own task."""
    task, vocab = cfg["task"], cfg["task_vocab"]
    out = {}
    for L in lengths:
        check(task, L, vocab, **task_options(cfg), knob="evaluate at longer lengths")
        B = max(1, min(50, EVAL_MEMORY // forward_bytes(model, L, logits=False)))  # long sequences, a few at a time
        out[L] = (
            scores(model, task, vocab, L, n, seed, B, device, **task_options(cfg))
            if L <= model.encoding.max_length
            else None
        )
    return out


def learned_at(history: list[dict], threshold: float = LEARNED) -> int | None:
    """The first evaluated iteration whose accuracy reached threshold, or None."""
    return next((h["iter"] for h in history if h.get("acc", 0) >= threshold), None)


def check_memory(model, lengths: list[int], device: str) -> None:
    """Refuse, before any work, a length whose single sequence would not fit in the device's memory."""
    memory = device_memory(device)
    for L in lengths:
        if memory and (need := forward_bytes(model, L, logits=False)) > memory:
            raise SyntheticError(
                f"length {L:,} needs at least {gb(need)} for one sequence, more than the {gb(memory)} of {device}; "
                "evaluate shorter lengths"
            )


def main(argv: list[str] | None = None) -> dict:
    from lib.checkpoint import CheckpointError
    from lib.configurator import ConfigError
    from lib.devices import check_device
    from lib.outputs import OutputError, check_output, write_atomic
    from lib.runs import load_run

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dirs", nargs="+", help="folders holding ckpt.pt of runs trained on a synthetic task")
    p.add_argument("--lengths", type=int, nargs="+", default=None, help="default: 1, 2, 4, 8 and 16 times training's")
    p.add_argument("--n", type=int, default=400, help="sequences per length")
    p.add_argument("--seed", type=int, default=0, help="which sequences (the same for every checkpoint); >= 0")
    p.add_argument("--device", default="cpu")
    p.add_argument("--out_json", default="", help="also write the accuracies to this JSON file")
    args = p.parse_args(argv)
    if args.n < 1 or (args.lengths and min(args.lengths) < 1):
        p.error("--n and every length must be at least 1")
    if args.lengths and len(set(args.lengths)) != len(args.lengths):  # a row has a cell per length, not per mention
        p.error(f"--lengths {' '.join(map(str, args.lengths))}: each length may appear once")
    if not 0 <= args.seed < 2**63:
        p.error(f"--seed={args.seed}: must be in [0, 2**63) (numpy's generators take non-negative seeds)")
    try:
        check_device(args.device)
        if args.out_json:
            check_output(args.out_json, "--out_json", ("json",))
    except (ConfigError, OutputError) as e:
        p.error(str(e))
    runs = {}
    for d in args.out_dirs:  # every checkpoint and length checked before any is evaluated
        try:
            run = load_run(d, args.device)
        except CheckpointError as e:
            sys.exit(f"error: {e}")
        cfg = run.ckpt.get("config", {})
        if not cfg.get("task"):
            sys.exit(
                f"error: {d} was not trained on a synthetic task (train with task= one of {', '.join(SYNTHETIC_TASKS)})"
            )
        lengths = args.lengths or [cfg["block_size"] * k for k in (1, 2, 4, 8, 16)]
        try:
            for L in lengths:
                check(cfg["task"], L, cfg["task_vocab"], **task_options(cfg), knob="evaluate at longer lengths")
            check_memory(run.model, lengths, args.device)
        except SyntheticError as e:
            sys.exit(f"error: {d}: {e}")
        runs[d] = (run, lengths)
    report = {}
    for d, (run, lengths) in runs.items():
        ckpt, model = run.ckpt, run.model
        cfg = ckpt["config"]
        task, opts = cfg["task"], task_options(cfg)
        acc = evaluate_checkpoint(model, cfg, lengths, args.n, args.seed, args.device)
        floors = {L: floor(task, cfg["task_vocab"], L, args.n, args.seed, **opts) for L in lengths}
        report[d] = {
            "task": task,
            "accuracy": {L: None if a is None else a["token"] for L, a in acc.items()},
            "whole_sequence": {L: None if a is None else a["sequence"] for L, a in acc.items()},
            "floor": {L: f["token"] for L, f in floors.items()},
            "learned_at": learned_at(ckpt.get("history", [])),
        }
        print(f"| {d} | {task} | " + " | ".join(map(str, lengths)) + " |")
        rows = [("accuracy", "accuracy"), ("floor", "floor (no retrieval)")]
        rows += [("whole_sequence", "whole string")] if task == "copy" else []
        for key, name in rows:
            cells = " | ".join("n/a" if a is None else f"{100 * a:.1f}%" for a in report[d][key].values())
            print(f"| | {name} | {cells} |")
    if args.out_json:
        write_atomic(args.out_json, json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
