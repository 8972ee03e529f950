"""
Retrieval tasks in text (TEXT_TASKS), trained on and evaluated: does an encoding *use* a long context, not only keep
its perplexity? They are written in the dataset's own tokens, and train.py's task_fraction mixes them into a text
run's training rows; compare/synthetic.py's SYNTHETIC_TASKS (train.py's task=...) are token-level sequences without
text.

    python -m compare.tasks --out_dir out-rope out-alibi --lengths 256 512 1024 4096 --trials 5

- **passkey** (Mohtashami & Jaggi 2023, the protocol of position interpolation, Chen et al. 2023): a random key
  of digits hidden at a depth (0: start, 1: end) in repeated filler sentences, then "What is the pass key? The
  pass key is " and the key. Scored over a grid of lengths × depths; k_max is the longest length whose accuracy
  (over depths) is at least 20%.
- **recall** (multi-query associative recall, Arora et al. 2023, Zoology): key:value pairs ("ab:12 cd:34 ..."),
  filler, then some of the keys again as queries, each followed by its value. Each query is one trial.
- **copy**: a random string of letters, a separator, the same string again (by default the string fills the
  length, so the copy is half the sequence).

A task sequence of length L is L + 1 tokens, as training reads T + 1 tokens for x and y: the model reads L tokens.
Every piece is encoded with the dataset's tokenizer on its own (filler and phrases as text, each digit and letter
of a key or string alone), so lengths are exact in tokens and the answer span is known for char-level and BPE data.

Accuracy is greedy exact match of each answer span given everything before it, computed teacher-forced: one forward
pass, argmax at each answer position. That equals greedy decoding: decoding reproduces the answer's first token iff
the argmax there is right, and then its next input is the true token, so by induction it reproduces the whole span
iff every teacher-forced argmax in it is right. Learned positions have no position past block_size: n/a there.
"""

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

from lib.configurator import ConfigError
from lib.outputs import PLOT_FORMATS, OutputError, check_output, save_figure, write_atomic

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
DIGITS = "0123456789"
LETTERS = "abcdefghijklmnopqrstuvwxyz"
PASS_NEEDLE = "The pass key is {}. Remember it. "
PASS_QUESTION = "What is the pass key? The pass key is "
COPY_SEPARATOR = ". Again: "
K_MAX_ACCURACY = 0.2  # k_max: the longest length with at least this accuracy


class TaskError(ValueError):
    pass


# ----------------------------------------------------------------------------------------------------------------
# generators: each returns tokens (length + 1,) int64 and answer (length + 1,) bool, the answer tokens' positions


def encode(tok, text: str, task: str) -> list[int]:
    try:
        return tok.encode(text)
    except ValueError as e:  # a character vocabulary without a character the task writes
        needed = {"passkey": PASS_NEEDLE.format("") + PASS_QUESTION + DIGITS, "recall": ": " + DIGITS + LETTERS}
        text = FILLER + needed.get(task, COPY_SEPARATOR + LETTERS)
        missing = ", ".join(repr(c) for c in sorted(set(text) - set(getattr(tok, "stoi", text))))
        raise TaskError(
            f"the {task} task writes characters that this dataset's vocabulary lacks ({missing or e}); "
            f"leave it out, or use a dataset with them"
        ) from e


def symbols(tok, chars: str, task: str) -> list[int]:
    """One token per character (digits and letters are single tokens in both the char and GPT-2 vocabularies)."""
    ids = [encode(tok, ch, task) for ch in chars]
    if any(len(i) != 1 for i in ids):
        raise TaskError(f"the {task} task needs one token per character of {chars!r}")
    return [i[0] for i in ids]


def filler(tok, n: int, task: str, start: int = 0) -> list[int]:
    """n tokens of the repeated filler sentences, from token `start` of the repetition."""
    unit = encode(tok, FILLER, task)
    reps = (start + n) // len(unit) + 1
    return (unit * reps)[start : start + n]


def assemble(pieces: list[tuple[list[int], bool]], length: int, task: str) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate (tokens, is_answer) pieces, checking the total is length + 1 tokens."""
    tokens = np.array([t for p, _ in pieces for t in p], dtype=np.int64)
    answer = np.array([a for p, a in pieces for _ in p], dtype=bool)
    assert len(tokens) == length + 1, (task, len(tokens), length)
    return tokens, answer


def too_short(task: str, length: int, fixed: int) -> TaskError:
    return TaskError(f"the {task} task needs a length of at least {fixed} tokens (its phrases alone), got {length}")


def text_passkey(
    tok, length: int, rng: np.random.Generator, depth: float | None = None, n_digits: int = 5
) -> tuple[np.ndarray, np.ndarray]:
    """Filler with "The pass key is <key>. Remember it. " at depth (the fraction of the filler before it; default
    uniform), then the question and the key. The filler is cut at a token, mid-word, as in Mohtashami & Jaggi's
    code (landmark-attention), so that every depth is exact."""
    depth = rng.uniform() if depth is None else depth
    if not 0 <= depth <= 1:
        raise TaskError(f"depth={depth} must be in [0, 1]")
    key = "".join(rng.choice(list(DIGITS), n_digits))
    head, tail = PASS_NEEDLE.split("{}")
    key_ids = symbols(tok, key, "passkey")
    needle = encode(tok, head, "passkey") + key_ids + encode(tok, tail, "passkey")
    question = encode(tok, PASS_QUESTION, "passkey")
    n_fill = length + 1 - len(needle) - len(question) - len(key_ids)
    if n_fill < 0:
        raise too_short("passkey", length, length - n_fill)
    before = round(depth * n_fill)
    pieces = [
        (filler(tok, before, "passkey"), False),
        (needle, False),
        (filler(tok, n_fill - before, "passkey", start=before), False),
        (question, False),
        (key_ids, True),
    ]
    return assemble(pieces, length, "passkey")


def text_recall(
    tok, length: int, rng: np.random.Generator, n_pairs: int = 8, n_queries: int = 4, n_digits: int = 2
) -> tuple[np.ndarray, np.ndarray]:
    """n_pairs "ab:12 " pairs (distinct two-letter keys), filler, then n_queries of the keys in random order, each
    followed by its value (the answer)."""
    keys = [LETTERS[i // 26] + LETTERS[i % 26] for i in rng.choice(26 * 26, n_pairs, replace=False)]
    values = ["".join(rng.choice(list(DIGITS), n_digits)) for _ in keys]
    colon, space = encode(tok, ":", "recall"), encode(tok, " ", "recall")
    pairs = []
    for k, v in zip(keys, values, strict=True):
        pairs += symbols(tok, k, "recall") + colon + symbols(tok, v, "recall") + space
    queries = []
    for i in rng.choice(n_pairs, n_queries, replace=False):
        queries += [(space + symbols(tok, keys[i], "recall") + colon, False), (symbols(tok, values[i], "recall"), True)]
    n_fill = length + 1 - len(pairs) - sum(len(q) for q, _ in queries)
    if n_fill < 0:
        raise too_short("recall", length, length - n_fill)
    return assemble([(pairs, False), (filler(tok, n_fill, "recall"), False), *queries], length, "recall")


def text_copy(
    tok, length: int, rng: np.random.Generator, n_chars: int | None = None, vary: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """A random string of n_chars letters (default: as long as fits twice; vary: a uniform draw from 1 to that), the
    separator, the string again; filler pads the start."""
    sep = encode(tok, COPY_SEPARATOR, "copy")
    if n_chars is None:
        longest = (length + 1 - len(sep)) // 2
        n_chars = int(rng.integers(1, longest + 1)) if vary and longest >= 1 else longest
    if n_chars < 1 or 2 * n_chars + len(sep) > length + 1:
        raise too_short("copy", length, 2 * max(n_chars, 1) + len(sep) - 1)
    s = symbols(tok, "".join(rng.choice(list(LETTERS), n_chars)), "copy")
    pad = filler(tok, length + 1 - 2 * n_chars - len(sep), "copy")
    return assemble([(pad, False), (s, False), (sep, False), (s, True)], length, "copy")


TEXT_TASKS = {"passkey": text_passkey, "recall": text_recall, "copy": text_copy}
# in training, copies of every length: at one length the copy is always the same distance back, which a head can
# learn by position alone (at 128 tokens: 99% of characters right, and 4% at 256); at many it must match content
TRAINING_KW = {"copy": {"vary": True}}


def check_tasks(tok, length: int, names=tuple(TEXT_TASKS)) -> None:
    """Raise TaskError if a task cannot be made at this length with this tokenizer (before any training)."""
    for name in names:
        TEXT_TASKS[name](tok, length, np.random.default_rng(0))


def check_training_tasks(cfg: dict, tok) -> None:
    """A training run's tasks (task_fraction > 0, written by tok, the data's tokenizer; None without tasks) fit its
    block_size: a ConfigError before any training where one does not."""
    if tok is not None:
        try:
            check_tasks(tok, cfg["block_size"])
        except TaskError as e:
            raise ConfigError(f"task_fraction={cfg['task_fraction']}: {e}") from e


# ----------------------------------------------------------------------------------------------------------------
# training: a fraction of a batch's rows become task sequences


def mix_tasks(
    x: torch.Tensor, y: torch.Tensor, fraction: float, tok, seed: tuple[int, ...], names=tuple(TEXT_TASKS)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Replace fraction of the rows of a training batch x, y (B, T) by task sequences (in expectation: floor(f·B)
    rows, one more with probability frac(f·B)), each task equally likely. Targets are -1 (ignored) except at the
    answer tokens: the filler teaches nothing and a random key's first sight is unpredictable, so only the
    retrieval is learned, and the text loss stays about text. seed (task_seed, iteration, micro-step, rank) makes
    every batch reproducible without state, so a resumed run draws what it would have drawn."""
    if fraction <= 0:
        return x, y
    rng = np.random.default_rng(seed)
    B, T = x.shape
    n = int(fraction * B) + int(rng.uniform() < fraction * B % 1)
    x, y = x.clone(), y.clone()
    for row in rng.choice(B, n, replace=False):
        name = names[rng.integers(len(names))]
        tokens, answer = TEXT_TASKS[name](tok, T, rng, **TRAINING_KW.get(name, {}))
        targets = np.where(answer[1:], tokens[1:], -1)
        x[row] = torch.from_numpy(tokens[:-1]).to(x.device)
        y[row] = torch.from_numpy(targets).to(y.device)
    return x, y


# ----------------------------------------------------------------------------------------------------------------
# evaluation


def trials(tok, task: str, length: int, n_trials: int, seed: int = 0, **kw) -> list[tuple[np.ndarray, np.ndarray]]:
    """The n_trials sequences of one cell, the same for every checkpoint: seeded by (seed, task, length, kw)."""
    cell = [seed, list(TEXT_TASKS).index(task), length, *(round(float(v) * 1000) for v in kw.values())]
    rng = np.random.default_rng(cell)
    return [TEXT_TASKS[task](tok, length, rng, **kw) for _ in range(n_trials)]


def answer_logits(model, idx: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Logits (N, V) at the N positions mask (B, L) selects: a GPT projects only those hidden states to the
    vocabulary (B·L·V logits of GPT-2's vocabulary at 8192 tokens would not fit); any other model is called."""
    if hasattr(model, "features"):
        return model.lm_head(model.features(idx)[mask])
    return model(idx)[0][mask]


@torch.no_grad()
def evaluate_task(
    model, tok, task: str, length: int, n_trials: int, seed: int = 0, batch_size: int = 8, device: str = "cpu", **kw
) -> dict[str, float]:
    """Greedy exact-match accuracy over the answer spans of n_trials sequences (teacher-forced, which equals greedy
    decoding, see the module docstring), and the accuracy per answer token. kw go to the task (e.g. depth)."""
    seqs = trials(tok, task, length, n_trials, seed, **kw)
    spans_ok, spans, tokens_ok, n_tokens = 0, 0, 0, 0
    for i in range(0, n_trials, batch_size):
        chunk = seqs[i : i + batch_size]
        idx = torch.from_numpy(np.stack([t for t, _ in chunk])).to(device)
        answer = torch.from_numpy(np.stack([a for _, a in chunk])).to(device)
        mask = answer[:, 1:]  # (B, L): the inputs' positions whose next token is an answer token
        right = torch.ones_like(mask)  # True off the answer
        right[mask] = answer_logits(model, idx[:, :-1], mask).argmax(-1) == idx[:, 1:][mask]
        for r, a in zip(right.cpu().numpy(), answer[:, 1:].cpu().numpy(), strict=True):
            # each contiguous run of answer tokens is one span
            starts = np.flatnonzero(a & ~np.concatenate([[False], a[:-1]]))
            ends = np.flatnonzero(a & ~np.concatenate([a[1:], [False]])) + 1
            spans_ok += sum(bool(r[s:e].all()) for s, e in zip(starts, ends, strict=True))
            spans += len(starts)
            tokens_ok += int(r[a].sum())
            n_tokens += int(a.sum())
    return {"accuracy": spans_ok / spans, "token_accuracy": tokens_ok / n_tokens}


def k_max(accuracy: dict[int, float | None]) -> int | None:
    """The longest length whose accuracy is at least K_MAX_ACCURACY (None if none is)."""
    ok = [L for L, a in accuracy.items() if a is not None and a >= K_MAX_ACCURACY]
    return max(ok) if ok else None


def evaluate_checkpoint(model, tok, lengths, depths, n_trials, seed, tasks, batch_size, device) -> dict:
    """Passkey accuracy per length and depth (grid), its mean per length and k_max; recall and copy per length, exact
    match and per token (<task>_tokens: a long copy is rarely all right, but its share of right characters shows
    how far back the model still reads)."""
    out = {"passkey_grid": {}, "passkey": {}}
    for L in lengths:
        if "passkey" in tasks:
            grid = (
                [
                    evaluate_task(model, tok, "passkey", L, n_trials, seed, batch_size, device, depth=d)["accuracy"]
                    for d in depths
                ]
                if L <= model.encoding.max_length
                else None
            )
            out["passkey_grid"][L] = grid
            out["passkey"][L] = None if grid is None else float(np.mean(grid))
        for task in (t for t in tasks if t != "passkey"):
            r = (
                evaluate_task(model, tok, task, L, n_trials, seed, batch_size, device)
                if L <= model.encoding.max_length
                else None
            )
            out.setdefault(task, {})[L] = r and r["accuracy"]
            out.setdefault(f"{task}_tokens", {})[L] = r and r["token_accuracy"]
    if "passkey" in tasks:
        out["k_max"] = k_max(out["passkey"])
    return out


def markdown_table(report: dict, lengths: list[int], tasks: list[str]) -> str:
    fmt = lambda a: "n/a" if a is None else f"{100 * a:.0f}%"
    cols = [f"{t} {L}" for t in tasks for L in lengths] + (["k_max"] if "passkey" in tasks else [])
    lines = ["| checkpoint | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
    for name, r in report["checkpoints"].items():
        cells = [fmt(r[t][L]) for t in tasks for L in lengths]
        cells += [str(r["k_max"] or "-")] if "passkey" in tasks else []
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_heatmaps(report: dict, lengths: list[int], depths: list[float], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["checkpoints"])
    width = (1.5 + 0.5 * len(lengths)) * len(names) + 1.5
    fig, axes = plt.subplots(1, len(names), figsize=(width, 4), squeeze=False, layout="constrained")
    for ax, name in zip(axes[0], names, strict=True):
        grid = report["checkpoints"][name]["passkey_grid"]
        acc = np.array([[np.nan] * len(depths) if grid[L] is None else grid[L] for L in lengths]).T  # (depths, L)
        im = ax.imshow(acc, vmin=0, vmax=1, cmap="viridis", aspect="auto", origin="upper")
        for j, L in enumerate(lengths):
            if grid[L] is None:  # no positions there (learned)
                ax.text(j, (len(depths) - 1) / 2, "n/a", ha="center", va="center")
        ax.set(title=f"{name}: passkey", xlabel="length")
        ax.set_xticks(range(len(lengths)), [str(L) for L in lengths], rotation=45)
        ax.set_yticks(range(len(depths)), [f"{d:.2f}" for d in depths])
    axes[0][0].set_ylabel("depth of the key")
    fig.colorbar(im, ax=axes[0].tolist(), label="exact-match accuracy")
    save_figure(fig, path, dpi=120, bbox_inches="tight")


def main(argv: list[str] | None = None) -> dict:
    from lib.checkpoint import CheckpointError
    from lib.datafiles import DataError
    from lib.devices import check_device, device_memory, forward_bytes, gb
    from lib.runs import load_run
    from lib.tokenizer import tokenizer_from_meta

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out_dir", nargs="+", required=True, help="folders holding ckpt.pt (train.py's out_dir)")
    p.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096])
    p.add_argument("--depths", type=int, default=10, help="passkey depths, evenly spaced from 0 to 1")
    p.add_argument("--trials", type=int, default=5, help="sequences per cell")
    p.add_argument("--tasks", nargs="+", choices=list(TEXT_TASKS), default=list(TEXT_TASKS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out_json", default="tasks.json", help="the numbers ('': none)")
    p.add_argument("--plot", default="passkey.png", help=f"the passkey heatmaps: {', '.join(PLOT_FORMATS)} ('': none)")
    args = p.parse_args(argv)
    if min(args.lengths) < 1 or args.depths < 2 or args.trials < 1 or args.batch_size < 1:
        p.error("lengths and --trials, --batch_size must be at least 1, --depths at least 2")
    if args.depths > min(args.lengths) + 1:  # depths are token positions in the filler: more would repeat them
        p.error(f"--depths={args.depths}: more depths than the shortest length has tokens ({min(args.lengths)})")
    if args.seed < 0:
        p.error(f"--seed={args.seed}: must be >= 0")
    lengths, args.tasks = list(dict.fromkeys(args.lengths)), list(dict.fromkeys(args.tasks))  # each once: columns
    try:
        check_device(args.device)
        for flag, suffixes in (("out_json", ()), ("plot", PLOT_FORMATS)):
            if getattr(args, flag) and (flag != "plot" or "passkey" in args.tasks):  # empty: not written
                check_output(getattr(args, flag), f"--{flag}", suffixes)
    except (ConfigError, OutputError) as e:
        p.error(str(e))
    names = [Path(d).name for d in args.out_dir]
    if len(set(names)) != len(names):  # sweeps' folders share names: then the paths as given label the rows
        names = list(args.out_dir)
    if len(set(names)) != len(names):
        p.error("--out_dir: a folder is given twice")
    depths = np.linspace(0, 1, args.depths).round(3).tolist()
    runs, memory = {}, device_memory(args.device)
    for name, out_dir in zip(names, args.out_dir, strict=True):  # every checkpoint checked before any is evaluated
        try:
            run = load_run(out_dir, args.device, text=True)
        except (CheckpointError, DataError) as e:
            sys.exit(f"error: {e}")
        if "tokenizer" not in run.ckpt:
            sys.exit(f"error: {run.path} stores no tokenizer (a nanoGPT checkpoint?); retrain with train.py")
        tok = tokenizer_from_meta(run.ckpt["tokenizer"])
        L = max((L for L in lengths if L <= run.model.encoding.max_length), default=0)  # the longest evaluated
        need = forward_bytes(run.model, L, min(args.batch_size, args.trials), logits=False) + 9 * args.trials * L
        if memory and need > memory:
            sys.exit(
                f"error: {out_dir}: evaluating {L} tokens needs at least {gb(need)}, more than the "
                f"{gb(memory)} of {args.device}; use shorter --lengths, fewer --trials or a smaller --batch_size"
            )
        try:
            check_tasks(tok, min(lengths), args.tasks)
        except TaskError as e:
            sys.exit(f"error: {out_dir}: {e}")
        runs[name] = (out_dir, run.model, tok)
    report = {"lengths": lengths, "depths": depths, "trials": args.trials, "seed": args.seed, "checkpoints": {}}
    for name, (out_dir, model, tok) in runs.items():
        report["checkpoints"][name] = evaluate_checkpoint(
            model, tok, lengths, depths, args.trials, args.seed, args.tasks, args.batch_size, args.device
        )
        print(f"{out_dir}: done", file=sys.stderr)
    print(markdown_table(report, lengths, args.tasks))
    if args.out_json:
        write_atomic(args.out_json, json.dumps(report, indent=1))
    if args.plot and "passkey" in args.tasks:
        plot_heatmaps(report, lengths, depths, args.plot)
    return report


if __name__ == "__main__":
    main()
