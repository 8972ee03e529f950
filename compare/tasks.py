"""
Retrieval tasks in text (TEXT_TASKS), trained on and evaluated: does an encoding *use* a long
context, not only keep its perplexity? They are written in the dataset's own tokens
(lib/text_tasks.py), and train.py's task_fraction mixes them into a text run's training rows;
compare/synthetic.py's tasks (train.py's task=...) are token-level sequences without text.

    python -m compare.tasks --out_dir out-rope out-alibi --lengths 256 512 1024 4096 --trials 5

The tasks are described in lib/text_tasks.py.

Accuracy is greedy exact match of each answer span given everything before it, computed
teacher-forced: one forward pass, argmax at each answer position. That equals greedy decoding:
decoding reproduces the answer's first token iff the argmax there is right, and then its next input
is the true token, so by induction it reproduces the whole span iff every teacher-forced argmax in
it is right. Learned positions have no position past block_size: n/a there.
"""

import argparse
import json
import sys
from pathlib import Path

if not __package__:  # run by its path, where the project's modules are not importable
    sys.exit("run it from the repository's root as: python -m compare.tasks")

import numpy as np
import torch

from lib.configurator import ConfigError
from lib.outputs import PLOT_FORMATS, OutputError, check_output, save_figure, write_atomic
from lib.text_tasks import TEXT_TASKS, TaskError, check_tasks

K_MAX_ACCURACY = 0.2  # k_max: the longest length with at least this accuracy


# --------------------------------------------------------------------------------------------------
# evaluation


def trials(
    tok, task: str, length: int, n_trials: int, seed: int = 0, **kw
) -> list[tuple[np.ndarray, np.ndarray]]:
    """The n_trials sequences of one cell, the same for every checkpoint: seeded by (seed, task,
    length, kw)."""
    cell = [
        seed,
        list(TEXT_TASKS).index(task),
        length,
        *(round(float(v) * 1000) for v in kw.values()),
    ]
    rng = np.random.default_rng(cell)
    return [TEXT_TASKS[task](tok, length, rng, **kw) for _ in range(n_trials)]


def answer_logits(model, idx: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Logits (N, V) at the N positions mask (B, L) selects: a GPT projects only those hidden states
    to the vocabulary (B·L·V logits of GPT-2's vocabulary at 8192 tokens would not fit); any other
    model is called."""
    if hasattr(model, "features"):
        return model.lm_head(model.features(idx)[mask])
    return model(idx)[0][mask]


@torch.no_grad()
def evaluate_task(
    model,
    tok,
    task: str,
    length: int,
    n_trials: int,
    seed: int = 0,
    batch_size: int = 8,
    device: str = "cpu",
    **kw,
) -> dict[str, float]:
    """Greedy exact-match accuracy over the answer spans of n_trials sequences (teacher-forced,
    which equals greedy decoding, see the module docstring), and the accuracy per answer token. kw
    go to the task (e.g. depth)."""
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


def evaluate_checkpoint(
    model, tok, lengths, depths, n_trials, seed, tasks, batch_size, device
) -> dict:
    """Passkey accuracy per length and depth (grid), its mean per length and k_max; recall and copy
    per length, exact match and per token (<task>_tokens: a long copy is rarely all right, but its
    share of right characters shows how far back the model still reads)."""
    out = {"passkey_grid": {}, "passkey": {}}
    for L in lengths:
        if "passkey" in tasks:
            grid = (
                [
                    evaluate_task(
                        model, tok, "passkey", L, n_trials, seed, batch_size, device, depth=d
                    )["accuracy"]
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
        # (depths, L)
        acc = np.array([[np.nan] * len(depths) if grid[L] is None else grid[L] for L in lengths]).T
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

    p = argparse.ArgumentParser(
        prog="python -m compare.tasks",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--out_dir", nargs="+", required=True, help="folders holding ckpt.pt (train.py's out_dir)"
    )
    p.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096])
    p.add_argument(
        "--depths", type=int, default=10, help="passkey depths, evenly spaced from 0 to 1"
    )
    p.add_argument("--trials", type=int, default=5, help="sequences per cell")
    p.add_argument("--tasks", nargs="+", choices=list(TEXT_TASKS), default=list(TEXT_TASKS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out_json", default="tasks.json", help="the numbers ('': none)")
    p.add_argument(
        "--plot",
        default="passkey.png",
        help=f"the passkey heatmaps: {', '.join(PLOT_FORMATS)} ('': none)",
    )
    args = p.parse_args(argv)
    if min(args.lengths) < 1 or args.depths < 2 or args.trials < 1 or args.batch_size < 1:
        p.error("lengths and --trials, --batch_size must be at least 1, --depths at least 2")
    # depths are token positions in the filler: more would repeat them
    if args.depths > min(args.lengths) + 1:
        p.error(
            f"--depths={args.depths}: more depths than the shortest length has tokens "
            f"({min(args.lengths)})"
        )
    if args.seed < 0:
        p.error(f"--seed={args.seed}: must be >= 0")
    # each once: columns
    lengths = list(dict.fromkeys(args.lengths))
    args.tasks = list(dict.fromkeys(args.tasks))
    try:
        check_device(args.device)
        for flag, suffixes in (("out_json", ()), ("plot", PLOT_FORMATS)):
            # empty: not written
            if getattr(args, flag) and (flag != "plot" or "passkey" in args.tasks):
                check_output(getattr(args, flag), f"--{flag}", suffixes)
    except (ConfigError, OutputError) as e:
        p.error(str(e))
    names = [Path(d).name for d in args.out_dir]
    # sweeps' folders share names: then the paths as given label the rows
    if len(set(names)) != len(names):
        names = list(args.out_dir)
    if len(set(names)) != len(names):
        p.error("--out_dir: a folder is given twice")
    depths = np.linspace(0, 1, args.depths).round(3).tolist()
    runs = {}
    memory = device_memory(args.device)
    # every checkpoint checked before any is evaluated
    for name, out_dir in zip(names, args.out_dir, strict=True):
        try:
            run = load_run(out_dir, args.device, text=True)
        except (CheckpointError, DataError) as e:
            sys.exit(f"error: {e}")
        if "tokenizer" not in run.ckpt:
            sys.exit(
                f"error: {run.path} stores no tokenizer (a nanoGPT checkpoint?); retrain "
                "with train.py"
            )
        tok = tokenizer_from_meta(run.ckpt["tokenizer"])
        # the longest evaluated
        L = max((L for L in lengths if L <= run.model.encoding.max_length), default=0)
        need = (
            forward_bytes(run.model, L, min(args.batch_size, args.trials), logits=False)
            + 9 * args.trials * L
        )
        if memory and need > memory:
            sys.exit(
                f"error: {out_dir}: evaluating {L} tokens needs at least {gb(need)}, more than the "
                f"{gb(memory)} of {args.device}; use shorter --lengths, fewer --trials or a "
                "smaller --batch_size"
            )
        try:
            check_tasks(tok, min(lengths), args.tasks)
        except TaskError as e:
            sys.exit(f"error: {out_dir}: {e}")
        runs[name] = (out_dir, run.model, tok)
    report = {
        "lengths": lengths,
        "depths": depths,
        "trials": args.trials,
        "seed": args.seed,
        "checkpoints": {},
    }
    for name, (out_dir, model, tok) in runs.items():
        report["checkpoints"][name] = evaluate_checkpoint(
            model,
            tok,
            lengths,
            depths,
            args.trials,
            args.seed,
            args.tasks,
            args.batch_size,
            args.device,
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
