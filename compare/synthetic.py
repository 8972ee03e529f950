"""
Synthetic token-level tasks (SYNTHETIC_TASKS): retrieval a small model can learn on a CPU, and how
far past its training length each encoding still does it. train.py trains on them alone (task=...,
e.g. `python train.py config/rope.py config/passkey.py`; lib/synthetic_tasks.py makes them), this
file scores checkpoints at longer lengths, and `python -m compare.sweep --synthetic` runs the whole
suite. (The retrieval tasks of lib/text_tasks.py are written in a text dataset's tokens, mixed into
text runs.)

    python -m compare.synthetic out-rope-passkey out-alibi-passkey  # 1x to 16x the training length

Accuracy is greedy exact match at each answer token given the true tokens before it (teacher-forced,
one forward): for one-token answers that is greedy decoding itself. A model "learned" a task when
its accuracy at the training length reaches LEARNED (90%).
"""

import argparse
import functools
import json
import sys
from copy import deepcopy

if not __package__:  # run by its path, where the project's modules are not importable
    sys.exit("run it from the repository's root as: python -m compare.synthetic")

import numpy as np
import torch

from lib.devices import device_memory, forward_bytes, gb
from lib.synthetic_tasks import (
    MARK,
    OFFSETS,
    SYNTHETIC_TASKS,
    SyntheticError,
    Vocab,
    batch,
    check,
    learned_at,
    task_options,
)

EVAL_MEMORY = 2 * 2**30  # bytes an evaluation batch may take
# compare/sweep.py --synthetic's tasks: copy is left out (RoPE reached 20% in 2,000 steps at this
# size, at 32 and 64 dims)
SUITE = ("needle", "passkey", "mqar", "offset")


# --------------------------------------------------------------------------------------------------
# Evaluation


def eval_rng(seed: int, task: str, length: int) -> np.random.Generator:
    """The sequences of one (task, length) cell: the same for every checkpoint with the same
    seed."""
    return np.random.default_rng([seed, list(SYNTHETIC_TASKS).index(task), length])


@torch.no_grad()
def scores(
    model,
    task: str,
    vocab: int,
    length: int,
    n: int,
    seed: int = 0,
    batch_size: int = 50,
    device: str = "cpu",
    **kw,
) -> dict[str, float]:
    """Exact-match accuracy over n evaluation sequences of the task at this length: "token", over
    the answer tokens (the argmax at each answer position given the true tokens before it; every
    answer token is one trial), and "sequence", the share of sequences whose answers are all right
    (copy's whole string). model is a GPT, or any callable from inputs (B, T) to logits (B, T,
    V)."""
    rng = eval_rng(seed, task, length)
    right = total = whole = 0
    for i in range(0, n, batch_size):
        x, y = batch(task, vocab, min(batch_size, n - i), length, rng, train=False, **kw)
        x = x.to(device)
        y = y.to(device)
        mask = y >= 0
        # only the answers' hidden states (N, C) go to the vocabulary
        if hasattr(model, "features"):
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


# --------------------------------------------------------------------------------------------------
# Floors: what a model scores without retrieving anything. Each task has a family of shortcuts,
# strategies that read the sequence without finding the answer where the task hides it; the best of
# them, on the evaluation's own sequences, is the floor a table must be read against (a model at the
# floor has learned a shortcut, not the task).


def _keys(x, t, v):  # chance among the keys
    return np.arange(*v.keys)


def _most_frequent_key(x, t, v):  # passkey: the key after MARK is one more occurrence of it
    seen = x[: t + 1]
    counts = np.bincount(seen[(seen >= v.keys[0]) & (seen < v.keys[1])] - v.keys[0], minlength=v.n)
    return v.keys[0] + np.flatnonzero(counts == counts.max())


# mqar: the answers never enter the input, so no value present can be ruled out
def _values_present(x, t, v):
    seen = x[: t + 1]
    return np.unique(seen[(seen >= v.values[0]) & (seen < v.values[1])])


def _last_value(x, t, v):  # mqar: the value seen last (a recency guess, blind to the key asked)
    seen = x[: t + 1]
    return seen[(seen >= v.values[0]) & (seen < v.values[1])][-1:]


def _after_mark(x, t, v):  # offset: the token right after MARK (right when k = 1)
    return x[np.flatnonzero(x[: t + 1] == MARK)[:1] + 1]


# offset: the commonest of the OFFSETS tokens after MARK (every tied one): k unread
def _commonest_after_mark(x, t, v):
    after = x[np.flatnonzero(x[: t + 1] == MARK)[0] + 1 :][:OFFSETS]
    tokens, counts = np.unique(after, return_counts=True)
    return tokens[counts == counts.max()]


# copy: a token that followed an earlier occurrence of the current one
def _followed_before(x, t, v):
    earlier = np.flatnonzero(x[:t] == x[t])
    return np.unique(x[earlier + 1]) if len(earlier) else np.arange(*v.keys)


# Each task's shortcuts: {name: fn(x, t, vocab) -> the tokens it picks among, uniformly, for the
# answer after x[:t+1]}
SHORTCUTS = {
    "needle": {
        "chance among the keys": _keys
    },  # the key is the only key token: finding it by content is the task
    "passkey": {"the most frequent key": _most_frequent_key, "chance among the keys": _keys},
    "mqar": {"a value present": _values_present, "the last value": _last_value},
    "offset": {
        "the token after the marker": _after_mark,
        "the commonest of the 4 after the marker": _commonest_after_mark,
    },
    "copy": {"a token that followed the current one": _followed_before},
}


# the steadier estimate: at 400 sequences a floor of 27% moves by ~2 points between lengths
FLOOR_SEQUENCES = 2000


def floor(task: str, vocab: int, length: int, n: int, seed: int = 0, **kw) -> dict:
    """_floor's answer, computed once per process for the same arguments (a sweep's reports ask it
    again: 2,000 sequences a length), a copy the caller may change."""
    return deepcopy(_floor(task, vocab, length, n, seed, **kw))


@functools.cache
def _floor(task: str, vocab: int, length: int, n: int, seed: int = 0, **kw) -> dict:
    """The best shortcut's accuracy on the n sequences that scores() reads (drawn through batch(),
    as it does), its expected "token" (each answer right with probability 1/|candidates| if it is
    among them) and "sequence" (every answer of a sequence right) accuracy; "strategy", its name
    (the best on the token accuracy); "band", the 95% half-width of an accuracy of the floor's size
    measured on these answers (binomial: what another no-retrieval strategy as good on average
    scores on these sequences; a cell within floor ± band is at the floor, not below it);
    "strategies", every shortcut's token accuracy; and "steady", the best shortcut's token accuracy
    over FLOOR_SEQUENCES sequences (these n and more from the same stream), a steadier estimate."""
    v = Vocab(vocab)
    rng = eval_rng(seed, task, length)
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
    """{length: scores (token and sequence accuracy) or None (no positions there)} for the
    checkpoint's own task."""
    task = cfg["task"]
    vocab = cfg["task_vocab"]
    out = {}
    for L in lengths:
        check(task, L, vocab, **task_options(cfg), knob="evaluate at longer lengths")
        # long sequences, a few at a time
        B = max(1, min(50, EVAL_MEMORY // forward_bytes(model, L, logits=False)))
        out[L] = (
            scores(model, task, vocab, L, n, seed, B, device, **task_options(cfg))
            if L <= model.encoding.max_length
            else None
        )
    return out


def check_memory(model, lengths: list[int], device: str) -> None:
    """Refuse, before any work, a length whose single sequence would not fit in the device's
    memory."""
    memory = device_memory(device)
    for L in lengths:
        if memory and (need := forward_bytes(model, L, logits=False)) > memory:
            raise SyntheticError(
                f"length {L:,} needs at least {gb(need)} for one sequence, more than the "
                f"{gb(memory)} of {device}; "
                "evaluate shorter lengths"
            )


def main(argv: list[str] | None = None) -> dict:
    from lib.checkpoint import CheckpointError
    from lib.configurator import ConfigError
    from lib.devices import check_device
    from lib.outputs import OutputError, check_output, write_atomic
    from lib.runs import add_run_folders, load_run

    p = argparse.ArgumentParser(
        prog="python -m compare.synthetic",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_run_folders(
        p, nargs="+", help="folders holding ckpt.pt of runs trained on a synthetic task"
    )
    p.add_argument(
        "--lengths",
        type=int,
        nargs="+",
        default=None,
        help="default: 1, 2, 4, 8 and 16 times training's",
    )
    p.add_argument("--n", type=int, default=400, help="sequences per length")
    p.add_argument(
        "--seed", type=int, default=0, help="which sequences (the same for every checkpoint); >= 0"
    )
    p.add_argument("--device", default="cpu")
    p.add_argument("--out_json", default="", help="also write the accuracies to this JSON file")
    args = p.parse_args(argv)
    if args.n < 1 or (args.lengths and min(args.lengths) < 1):
        p.error("--n and every length must be at least 1")
    # a row has a cell per length, not per mention
    if args.lengths and len(set(args.lengths)) != len(args.lengths):
        p.error(f"--lengths {' '.join(map(str, args.lengths))}: each length may appear once")
    if not 0 <= args.seed < 2**63:
        p.error(
            f"--seed={args.seed}: must be in [0, 2**63) (numpy's generators take non-negative "
            "seeds)"
        )
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
                f"error: {d} was not trained on a synthetic task (train with task= one of "
                f"{', '.join(SYNTHETIC_TASKS)})"
            )
        lengths = args.lengths or [cfg["block_size"] * k for k in (1, 2, 4, 8, 16)]
        try:
            for L in lengths:
                check(
                    cfg["task"],
                    L,
                    cfg["task_vocab"],
                    **task_options(cfg),
                    knob="evaluate at longer lengths",
                )
            check_memory(run.model, lengths, args.device)
        except SyntheticError as e:
            sys.exit(f"error: {d}: {e}")
        runs[d] = (run, lengths)
    report = {}
    for d, (run, lengths) in runs.items():
        ckpt = run.ckpt
        model = run.model
        cfg = ckpt["config"]
        task = cfg["task"]
        opts = task_options(cfg)
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
            cells = " | ".join(
                "n/a" if a is None else f"{100 * a:.1f}%" for a in report[d][key].values()
            )
            print(f"| | {name} | {cells} |")
    if args.out_json:
        write_atomic(args.out_json, json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
