"""
compare/sweep.py's reports: the records a sweep is made of, and the markdown tables and plots
written from them. compare/sweep.py trains and evaluates; everything a reader sees in
<out_dir>/report.md is written here, one section per kind of sweep:

- the text sweep (perplexity by length, and the retrieval tasks of compare/tasks.py when the runs
  trained with them);
- the synthetic suite (accuracy by length per task, against each task's floor);
- the recipe study (the synthetic suite with each encoding's best recipe of a small grid, on fresh
  seeds, with intervals and exact tests: which differences the seeds can tell).
"""

import json
import math
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from itertools import combinations
from pathlib import Path

import numpy as np
import torch

from compare import eval_length, synthetic, tasks
from lib import synthetic_tasks
from lib.outputs import save_figure, write_atomic
from model import POS_ENCODINGS

ROOT = Path(__file__).resolve().parents[1]

# --------------------------------------------------------------------------------------------------
# Records


@dataclass
class TextRun:
    """A text sweep's trained run, as the report reads it."""

    enc: str
    seed: int
    dir: str
    val: float  # train.py's best validation loss
    params: int  # the tied wte/lm_head once; no wpe table
    seconds: float  # training's wall clock
    parallel: int  # runs side by side while it trained
    tokens: int  # tokens trained on
    task_fraction: float  # the share of retrieval-task rows in its training batches


@dataclass
class TaskScore:
    """A synthetic-task run's scores: accuracy per answer token and per whole sequence at each
    evaluation length (None where the model has no positions: learned past its block), when it
    learned its task (the first evaluation at synthetic_tasks.LEARNED), its final validation
    accuracy at the training length, and what it cost. Cached as <run>/synthetic.json, under key
    (the lengths, trials and checkpoint it was computed from)."""

    key: dict
    task: str
    task_options: dict  # the generator's options, vocab included
    accuracy: dict[int, float | None]
    whole_sequence: dict[int, float | None]
    learned_at: int | None
    final_val_acc: float | None
    iters: int
    block_size: int  # the training length
    params: int
    seconds: float
    eval_seconds: float

    @classmethod
    def from_json(cls, d: dict) -> "TaskScore":
        """From synthetic.json, whose lengths are strings (JSON's keys)."""
        lengths = {k: {int(L): a for L, a in d[k].items()} for k in ("accuracy", "whole_sequence")}
        return cls(**(d | lengths))

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class Cell:
    """One encoding's runs of one task (over seeds), with the recipe they were trained with."""

    enc: str
    scores: list[TaskScore]
    recipe: str = ""

    @property
    def learned(self) -> int:
        return sum(s.learned_at is not None for s in self.scores)

    def at(self, L: int, key: str = "accuracy") -> list[float] | None:
        """The seeds' accuracies at length L, None where the model has no positions there."""
        xs = [getattr(s, key)[L] for s in self.scores]
        return None if None in xs else xs


def by_encoding(items: list, enc=lambda x: x.enc) -> dict[str, list]:
    """{encoding: its items (seeds), in the order the encodings first appear}."""
    out: dict[str, list] = {}
    for x in items:
        out.setdefault(enc(x), []).append(x)
    return out


# --------------------------------------------------------------------------------------------------
# Formatting and provenance


def mean_spread(xs: list[float], digits: int = 2) -> str:
    if len(xs) == 1:
        return f"{xs[0]:.{digits}f}"
    return f"{statistics.mean(xs):.{digits}f} ± {statistics.stdev(xs):.{digits}f}"


def pct(xs: list[float | None] | None) -> str:
    """Accuracies over seeds as a percentage, mean ± std; n/a where the model has no positions there
    (learned)."""
    xs = [100 * x for x in xs or [] if x is not None]
    return mean_spread(xs, 0) + "%" if xs else "n/a"


def commit() -> str:
    """The code the study ran: the commit, marked where the tree has changes it does not hold (a new
    encoding being tried: edited files, or new ones git does not ignore)."""
    git = lambda *a: subprocess.run(
        ["git", *a], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()  # noqa: E731
    head = git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = git("status", "--porcelain", "--untracked-files=normal")
    return f"{head} with uncommitted changes" if head != "unknown" and dirty else head


def machine() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    cpu = (
        next(
            (
                ln.split(":", 1)[1].strip()
                for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")
            ),
            platform.processor(),
        )
        if Path("/proc/cpuinfo").exists()
        else ""
    )
    return f"{cpu or platform.machine()}, {torch.get_num_threads()} threads"


def provenance(argv: list[str]) -> list[str]:
    return [
        f"Command: `python -m compare.sweep {' '.join(argv)}`  ",
        f"Machine: {machine()}; torch {torch.__version__}; {time.strftime('%Y-%m-%d')}; commit "
        f"{commit()}  ",
    ]


def matplotlib_pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# --------------------------------------------------------------------------------------------------
# The text sweep: perplexity by length (compare/eval_length.py's report), and the retrieval tasks of
# compare/tasks.py


def aggregate(report: dict) -> dict:
    """{name: {mode: {L: [ppl per seed]}}}: eval_length's runs of one encoding (and scaling) over
    seeds together."""
    out: dict = {}
    for r in report["runs"]:
        by_mode = out.setdefault(r["name"], {m: {} for m in report["modes"]})
        for m, by_len in r["results"].items():
            for L, res in by_len.items():
                by_mode[m].setdefault(int(L), [])
                if res is not None:
                    by_mode[m][int(L)].append(res["ppl"])
    return out


def summary_lines(report: dict, runs: list[TextRun], agg: dict) -> list[str]:
    """One row per encoding, mean ± std over seeds: what to compare first."""
    train_len = report["runs"][0]["train_len"]
    lengths = report["lengths"]
    tk = report.get("tasks")
    mode = "sliding" if "sliding" in report["modes"] else report["modes"][0]
    far = [k for k in (4, 16) if k * train_len in lengths]
    L4 = 4 * train_len if tk and 4 * train_len in tk["lengths"] else None
    cols = ["val loss"] + [f"perplexity {k}×" for k in far]
    cols += (["passkey k_max"] if tk else []) + (
        [f"recall {L4}", f"copy {L4} (chars)"] if L4 else []
    )
    lines = [
        f"## Summary: mean ± std over seeds (perplexity with {mode} windows; accuracy is exact "
        "match, copy's per "
        "character; k_max: the longest length with passkey accuracy >= 20%, 0 if none)",
        "",
        "| encoding | " + " | ".join(cols) + " | training k tokens/s |",
        "|---|" + "---:|" * (len(cols) + 1),
    ]
    for enc, rs in by_encoding(runs).items():
        cells = [mean_spread([r.val for r in rs], 3)]
        cells += [mean_spread(v) if (v := agg[enc][mode][k * train_len]) else "n/a" for k in far]
        if tk:
            res = [tk["runs"][r.dir] for r in rs]
            k_max = [x["k_max"] or 0 for x in res]
            cells.append(mean_spread(k_max, 0) if any(k_max) else "0")
            if L4:
                cells += [
                    pct([x["recall"][L4] for x in res]),
                    pct([x["copy_tokens"][L4] for x in res]),
                ]
        speed = [r.tokens / r.seconds / 1000 for r in rs if r.seconds]
        cells.append(mean_spread(speed, 1) if speed else "-")
        lines.append(f"| {enc} | " + " | ".join(cells) + " |")
    parallel = max(r.parallel for r in runs)
    lines += [
        "",
        "Training speed is wall clock (start-up and evaluations included)"
        + (f", with {parallel} runs side by side" if parallel > 1 else "")
        + ": compare it only within one sweep on an otherwise idle machine.",
    ]
    return lines


def retrieval_lines(report: dict, runs: list[TextRun]) -> list[str]:
    """Accuracy by length for each of compare/tasks.py's tasks (mean ± std over seeds)."""
    tk = report["tasks"]
    lengths = tk["lengths"]
    depths = tk["depths"]
    lines = [
        "## Retrieval tasks (python -m compare.tasks), mean ± std over seeds",
        "",
        f"{tk['trials']} sequences per cell, the same for every run; passkey over {len(depths)} "
        "depths. Exact match of "
        "each answer (5-digit key, 2-digit value), and for copy also the share of right "
        "characters.",
    ]
    for task, title in (
        ("passkey", "passkey"),
        ("recall", "recall (exact)"),
        ("copy", "copy (exact)"),
        ("copy_tokens", "copy (characters)"),
    ):
        lines += [
            "",
            f"| {title} | " + " | ".join(map(str, lengths)) + " |",
            "|---|" + "---:|" * len(lengths),
        ]
        for enc, rs in by_encoding(runs).items():
            res = [tk["runs"][r.dir] for r in rs]
            lines.append(
                f"| {enc} | " + " | ".join(pct([x[task][L] for x in res]) for L in lengths) + " |"
            )
    return lines + ["", "![passkey accuracy by length and depth, mean over seeds](passkey.png)", ""]


def packing_lines(report: dict, runs: list[TextRun], agg: dict) -> list[str]:
    """What document packing changes per encoding (a sweep with --packing stream documents), mean
    over seeds: the validation loss each run trained to; the perplexity at the training length with
    every run evaluated inside the documents (the stream runs too: how well each models a document);
    the perplexity at the longest length under the rule each run trained with. [] without such
    pairs."""
    runs_of = by_encoding(runs)
    pairs = [(enc, f"{enc} documents") for enc in runs_of if f"{enc} documents" in runs_of]
    if not pairs or "inside_documents" not in report:
        return []
    inside = aggregate(report["inside_documents"])
    train_len = report["runs"][0]["train_len"]
    longest = max(report["lengths"])
    mode = "sliding" if "sliding" in report["modes"] else report["modes"][0]

    def ppl(table: dict, name: str, L: int) -> str:
        return mean_spread(v) if (v := table[name][mode].get(L)) else "n/a"

    lines = [
        "## Document packing: what changes per encoding",
        "",
        "Each encoding trained as one stream and with packing=documents (positions restart at "
        "each end-of-text",
        "token, attention stays inside a document), on the same data. Inside documents: every run "
        "evaluated with",
        "attention kept inside the validation text's documents; as trained: under its own rule. "
        "Perplexity from",
        f"{mode} windows; a change below the seeds' spread is noise.",
        "",
        "| encoding | val loss stream | val loss documents | inside documents, stream-trained | "
        "inside documents, "
        f"documents-trained | {longest} as trained, stream | {longest} as trained, documents |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for enc, docs in pairs:
        cells = [mean_spread([r.val for r in runs_of[name]], 3) for name in (enc, docs)]
        cells += [ppl(inside, name, train_len) for name in (enc, docs)]
        cells += [ppl(agg, name, longest) for name in (enc, docs)]
        lines.append(f"| {enc} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def text_report(out_dir: Path, report: dict, runs: list[TextRun], argv: list[str]) -> Path:
    """report.md of a text sweep, and its plots (length.png, position.png; passkey.png with the
    retrieval tasks)."""
    agg = aggregate(report)
    lengths = report["lengths"]
    train_len = report["runs"][0]["train_len"]
    lines = [
        "# Positional encodings: train short, test long",
        "",
        *provenance(argv),
        f"Training length {train_len}; seeds {sorted({r.seed for r in runs})}; training "
        f"{sum(r.seconds for r in runs) / 60:.1f} min, evaluation {report['seconds'] / 60:.1f} "
        "min.",
        "",
        *summary_lines(report, runs, agg),
        "",
        "## Validation loss at the training length (train.py's estimate, best of its evaluations)",
        "",
        "| encoding | val loss | parameters (tied embedding once, no position table) | minutes to "
        "train |",
        "|---|---:|---:|---:|",
    ]
    for enc, rs in by_encoding(runs).items():
        lines.append(
            f"| {enc} | {mean_spread([r.val for r in rs], 3)} | {rs[0].params / 1e6:.2f}M | "
            f"{statistics.mean(r.seconds for r in rs) / 60:.1f} |"
        )
    for mode in report["modes"]:
        lines += ["", f"## Perplexity by evaluation length, {mode} windows", ""]
        if mode == "sliding":
            lines.append(
                f"(stride {report['stride']}: each window scores its last quarter only, so every "
                "token is scored once, "
                "with at least 3/4 of the window as context; the text's first 3/4 window is not "
                "scored)\n"
            )
        lines.append(
            "| "
            "encoding "
            "| "
            "" + " | ".join(f"{L}{' (train)' if L == train_len else ''}" for L in lengths) + " |"
        )
        lines.append("|---|" + "---:|" * len(lengths))
        for name, by_mode in agg.items():
            cells = [mean_spread(v) if v else "n/a" for v in (by_mode[mode][L] for L in lengths)]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "![perplexity by length](length.png)",
        "",
        "![loss by position](position.png)",
        "",
    ]
    lines += packing_lines(report, runs, agg)
    plot_lengths(agg, report, out_dir)
    if report.get("tasks"):
        lines += retrieval_lines(report, runs)
        plot_passkey(report, runs, out_dir / "passkey.png")
    path = out_dir / "report.md"
    write_atomic(path, "\n".join(lines))
    return path


def plot_lengths(agg: dict, report: dict, out_dir: Path) -> None:
    """length.png: perplexity by length per encoding (mean ± std over seeds); position.png: the
    first seed's loss by position (eval_length's plot)."""
    plt = matplotlib_pyplot()
    train_len = report["runs"][0]["train_len"]
    fig, axes = plt.subplots(
        1, len(report["modes"]), figsize=(6.5 * len(report["modes"]), 4.8), squeeze=False
    )
    for ax, mode in zip(axes[0], report["modes"], strict=True):
        ax.set_prop_cycle(eval_length.line_styles())
        for name, by_mode in agg.items():
            pts = [(L, v) for L, v in sorted(by_mode[mode].items()) if v]
            xs = [L for L, _ in pts]
            ys = [statistics.mean(v) for _, v in pts]
            err = [statistics.stdev(v) if len(v) > 1 else 0 for _, v in pts]
            ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=name)
        ax.axvline(train_len, color="gray", ls=":", lw=1)
        ax.set(
            xscale="log",
            yscale="log",
            xlabel="evaluation length (tokens)",
            ylabel="perplexity",
            title=f"{mode} windows (dotted: training length)",
        )
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, out_dir / "length.png", dpi=110)
    # loss by position: the first seed's runs
    first = report["runs"][0]["out_dir"].rsplit("-seed", 1)[1]
    runs = [r for r in report["runs"] if r["out_dir"].endswith(f"-seed{first}")]
    eval_length.plot(dict(report, runs=runs), str(out_dir / "position.png"))


def plot_passkey(report: dict, runs: list[TextRun], path: Path) -> None:
    """The passkey heatmaps by length and depth, each encoding's averaged over its seeds."""
    tk = report["tasks"]
    heat = {}
    for enc, rs in by_encoding(runs).items():
        grids = [tk["runs"][r.dir]["passkey_grid"] for r in rs]
        mean = {
            L: None if grids[0][L] is None else np.mean([g[L] for g in grids], 0)
            for L in tk["lengths"]
        }
        heat[enc] = {"passkey_grid": mean}
    tasks.plot_heatmaps({"checkpoints": heat}, tk["lengths"], tk["depths"], str(path))


# --------------------------------------------------------------------------------------------------
# The synthetic suite: accuracy by length per task, read against each task's floor


def task_floors(cells: dict[str, list[Cell]], trials: int) -> dict[str, dict[int, dict]]:
    """{task: {length: synthetic.floor}}, on the sequences the runs were scored on."""
    out = {}
    for task, cs in cells.items():
        s = cs[0].scores[0]
        opts = dict(s.task_options)
        vocab = opts.pop("vocab")
        out[task] = {L: synthetic.floor(task, vocab, L, trials, **opts) for L in s.accuracy}
    return out


def lengths_of(cells: dict[str, list[Cell]]) -> tuple[list[int], int]:
    """The evaluation lengths and the training length of a suite's runs, which one report needs to
    share."""
    scores = [s for cs in cells.values() for c in cs for s in c.scores]
    # their lengths and multiples would not line up
    if len(blocks := sorted({s.block_size for s in scores})) > 1:
        sys.exit(
            "[sweep] the runs were trained at different lengths (block_size "
            f"{', '.join(map(str, blocks))}), which one "
            "report cannot compare: move the runs trained with other options aside, then re-run "
            "the sweep"
        )
    return list(scores[0].accuracy), blocks[0]


def length_header(lengths: list[int], train_len: int) -> str:
    return " | ".join(f"{L} ({L / train_len:.3g}×)" for L in lengths)


def synthetic_table(
    cs: list[Cell], lengths: list[int], train_len: int, floors: dict, key: str, learned: bool
):
    """One task's table of key (accuracy or whole_sequence) by length: over every seed, or over the
    seeds that learned (learned=True), under a row of the floor."""
    lines = [
        "| encoding | learned | at step | " + length_header(lengths, train_len) + " |",
        "|---|---:|---:|" + "---:|" * len(lengths),
        "| *floor (no "
        "retrieval)* | | | " + " | ".join(f"*{100 * floors[L]:.0f}%*" for L in lengths) + " |",
    ]
    for c in cs:
        steps = [s.learned_at for s in c.scores if s.learned_at is not None]
        at = f"{statistics.mean(steps):,.0f}" if steps else "-"
        seeds = [s for s in c.scores if s.learned_at is not None] if learned else c.scores
        cells = [pct(Cell(c.enc, seeds).at(L, key)) if seeds else "-" for L in lengths]
        lines.append(
            f"| {c.enc} | {len(steps)} of {len(c.scores)} | {at} | " + " | ".join(cells) + " |"
        )
    return lines


def synthetic_report(
    out_dir: Path, cells: dict[str, list[Cell]], argv: list[str], wall: float, trials: int
) -> Path:
    """report.md: per task, the floor, seeds learned and accuracy by length per encoding over every
    seed and over the seeds that learned; synthetic.png, a panel per task; results.json; the
    cost."""
    lengths, train_len = lengths_of(cells)
    scores = [s for cs in cells.values() for c in cs for s in c.scores]
    floors = task_floors(cells, trials)
    lines = [
        "# Synthetic tasks: retrieval past the training length",
        "",
        *provenance(argv),
        f"{len(scores)} runs ({scores[0].params:,} parameters each, trained at {train_len} "
        "tokens); training "
        f"{sum(s.seconds for s in scores) / 60:.0f} CPU-minutes (each run's wall clock, one thread "
        "each when side by "
        f"side), evaluation {sum(s.eval_seconds for s in scores) / 60:.0f} minutes; this "
        f"invocation {wall / 60:.0f} "
        "minutes of wall clock.",
        "",
        "A run *learned* its task when its validation accuracy at the training length (on the "
        "evaluation's "
        f"distribution) reached {synthetic_tasks.LEARNED:.0%} at some evaluation; **learned** "
        "counts those seeds and "
        "gives the step (the first evaluation at or above it, mean over them). Accuracy is exact "
        "match per answer "
        f"token over {trials} sequences per length, the same sequences for every run, mean ± std "
        "over seeds: first "
        "over every seed, then over the seeds that learned. The *floor* is the best of the task's "
        "shortcuts, "
        "strategies that retrieve nothing (synthetic.SHORTCUTS), on the same sequences: a cell at "
        "the floor has "
        "learned a shortcut, not the task.",
    ]
    for task, cs in cells.items():
        token_floor = {L: f["token"] for L, f in floors[task].items()}
        lines += ["", f"## {task}", "", "Every seed:", ""]
        lines += synthetic_table(cs, lengths, train_len, token_floor, "accuracy", learned=False)
        lines += ["", "The seeds that learned it:", ""]
        lines += synthetic_table(cs, lengths, train_len, token_floor, "accuracy", learned=True)
        # per token, the shortcut copies most of a string; the whole string is the task
        if task == "copy":
            lines += ["", "Whole string exact (every copied token right), every seed:", ""]
            seq_floor = {L: f["sequence"] for L, f in floors[task].items()}
            lines += synthetic_table(
                cs, lengths, train_len, seq_floor, "whole_sequence", learned=False
            )
    lines += [
        "",
        "![accuracy by length, per task, every seed; dashed: the floor](synthetic.png)",
        "",
    ]
    plot_tasks(cells, floors, lengths, train_len, out_dir / "synthetic.png")
    path = out_dir / "report.md"
    write_atomic(path, "\n".join(lines))
    seeds = max(len(c.scores) for cs in cells.values() for c in cs)
    results = {
        task: {c.enc: [s.to_json() for s in c.scores] for c in cs} for task, cs in cells.items()
    }
    write_atomic(
        out_dir / "results.json",
        json.dumps(
            {"seeds": seeds, "trials": trials, "floors": floors, "results": results}, indent=1
        ),
    )
    return path


def plot_tasks(
    cells: dict[str, list[Cell]], floors: dict, lengths: list[int], train_len: int, path: Path
) -> None:
    """A panel per task: accuracy by length, mean ± std over every seed, and the task's floor
    (dashed, with its band shaded where it has one)."""
    plt = matplotlib_pyplot()
    fig, axes = plt.subplots(
        1, len(cells), figsize=(4.2 * len(cells), 4), squeeze=False, sharey=True
    )
    for ax, (task, cs) in zip(axes[0], cells.items(), strict=True):
        ax.set_prop_cycle(eval_length.line_styles())
        for c in cs:
            pts = [(L, xs) for L in lengths if (xs := c.at(L))]
            ax.errorbar(
                [L for L, _ in pts],
                [100 * statistics.mean(xs) for _, xs in pts],
                yerr=[100 * statistics.stdev(xs) if len(xs) > 1 else 0 for _, xs in pts],
                marker="o",
                capsize=3,
                label=f"{c.enc}{f' [{c.recipe}]' if c.recipe else ''} "
                f"({c.learned}/{len(c.scores)})",
            )
        f = np.array([100 * floors[task][L]["token"] for L in lengths])
        band = np.array([100 * floors[task][L].get("band", 0) for L in lengths])
        ax.plot(lengths, f, color="black", ls="--", lw=1.2, label="floor (no retrieval)")
        ax.fill_between(lengths, f - band, f + band, color="black", alpha=0.1, lw=0)
        ax.axvline(train_len, color="gray", ls=":", lw=1)
        ax.set(xscale="log", xlabel="evaluation length (tokens)", title=task, ylim=(-3, 103))
        ax.set_xticks(lengths, [str(L) for L in lengths])
        ax.minorticks_off()  # a log axis labels its minor ticks too (6×10¹ over 64)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6.5, title="encoding (seeds learned)", title_fontsize=7)
    axes[0][0].set_ylabel("accuracy (%), mean over every seed")
    fig.tight_layout()
    save_figure(fig, path, dpi=110)


# --------------------------------------------------------------------------------------------------
# The recipe study: each encoding's best recipe of a grid (chosen on the selection seeds), reported
# on fresh seeds, with intervals, and the differences exact tests can tell


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval (95%) of a proportion k / n: sound at the ends (0 of 5, 5 of 5),
    where the normal approximation gives an interval of zero width."""
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, centre - half / (1 + z * z / n)), min(1.0, centre + half / (1 + z * z / n))


def fisher_exact(k1: int, n1: int, k2: int, n2: int) -> float:
    """Fisher's exact test, two-sided: the probability, with the margins fixed, of a table as
    unlikely as (k1 of n1 against k2 of n2) or less (every table whose hypergeometric probability is
    at most the observed one's)."""
    k = k1 + k2
    n = n1 + n2
    prob = [
        math.comb(n1, a) * math.comb(n2, k - a) / math.comb(n, k)
        for a in range(max(0, k - n2), min(k, n1) + 1)
    ]
    observed = math.comb(n1, k1) * math.comb(n2, k2) / math.comb(n, k)
    return min(1.0, sum(p for p in prob if p <= observed * (1 + 1e-9)))


def permutation_p(a: list[float], b: list[float]) -> float:
    """The exact two-sided permutation test of a difference in means: the share of the ways to split
    the pooled values into groups of len(a) and len(b) whose difference is at least as large as the
    observed one (252 splits for 5 against 5; the smallest p it can give is 2 / 252 = 0.008)."""
    pooled = a + b
    na = len(a)
    observed = abs(statistics.mean(a) - statistics.mean(b))
    total = sum(pooled)
    splits = list(combinations(range(len(pooled)), na))
    extreme = 0
    for idx in splits:
        sa = sum(pooled[i] for i in idx)
        if abs(sa / na - (total - sa) / len(b)) >= observed - 1e-12:
            extreme += 1
    return extreme / len(splits)


def versus_floor(xs: list[float], f: dict) -> str:
    """A cell's mean against the floor: '' above it, ' (floor)' within the floor's band, ' (below)'
    under it."""
    m = statistics.mean(xs)
    if m < f["token"] - f["band"]:
        return " (below)"
    return " (floor)" if m <= f["token"] + f["band"] else ""


@dataclass
class Study:
    """The recipe study's results: per task, the grid (each encoding's final validation accuracy per
    recipe, over the selection seeds) and the chosen recipe's cells on the fresh seeds."""

    # {task: {enc: {recipe: [final val acc per selection seed]}}}
    grid: dict[str, dict[str, dict[str, list[float]]]]
    recipes: dict[str, list[str]]  # {task: the grid's recipes, in order (ties go to the earlier)}
    chosen: dict[str, dict[str, str]]  # {task: {enc: recipe}}
    # {task: [the chosen recipe's runs on the fresh seeds, per encoding]}
    cells: dict[str, list[Cell]]
    selection_seeds: list[int]
    grid_seconds: float = 0.0
    # {task: {recipe: train.py options}}
    options: dict[str, dict[str, list[str]]] = field(default_factory=dict)


def separations(cs: list[Cell], lengths: list[int]) -> list[str]:
    """The differences the seeds tell apart (p < 0.05, exact, two-sided, uncorrected): learned
    counts (Fisher) and accuracy at the training length and the longest length (permutation), for
    every pair of encodings."""
    out = []
    for a, b in combinations(cs, 2):
        n1 = len(a.scores)
        n2 = len(b.scores)
        if (p := fisher_exact(a.learned, n1, b.learned, n2)) < 0.05:
            hi, lo = (a, b) if a.learned > b.learned else (b, a)
            out.append(
                f"learned: {hi.enc} {hi.learned} of {n1} against {lo.enc} {lo.learned} of "
                f"{n2} (p = {p:.3f})"
            )
        for L in (lengths[0], lengths[-1]):
            xa = a.at(L)
            xb = b.at(L)
            if xa and xb and (p := permutation_p(xa, xb)) < 0.05:
                (hi, xh), (lo, xl) = sorted(
                    [(a, xa), (b, xb)], key=lambda t: -statistics.mean(t[1])
                )
                out.append(f"at {L}: {hi.enc} {pct(xh)} against {lo.enc} {pct(xl)} (p = {p:.3f})")
    return out


def recipe_report(out_dir: Path, study: Study, argv: list[str], wall: float, trials: int) -> Path:
    """report.md of the recipe study: the grid and the choices, then per task each encoding's
    learned count with its Wilson interval and its accuracy by length against the floor, the
    differences exact tests tell apart, the cost; recipes.png; results.json."""
    lengths, train_len = lengths_of(study.cells)
    floors = task_floors(study.cells, trials)
    scores = [s for cs in study.cells.values() for c in cs for s in c.scores]
    n_grid = sum(
        len(xs) for by_enc in study.grid.values() for rs in by_enc.values() for xs in rs.values()
    )
    seeds = sorted({len(c.scores) for cs in study.cells.values() for c in cs})
    lines = [
        "# Retrieval: each encoding with its best recipe",
        "",
        *provenance(argv),
        f"Cost: the grid {n_grid} runs, {study.grid_seconds / 60:.0f} CPU-minutes; the chosen "
        f"recipes {len(scores)} "
        f"runs on fresh seeds, {sum(s.seconds for s in scores) / 60:.0f} CPU-minutes (each run's "
        "wall clock, one "
        "thread each when side by side); evaluation "
        f"{sum(s.eval_seconds for s in scores) / 60:.0f} minutes; this "
        f"invocation {wall / 60:.0f} minutes of wall clock.",
        "",
        "Each encoding is trained on each task with every recipe of the grid on the selection "
        "seeds "
        f"({', '.join(map(str, study.selection_seeds))}), and its recipe is the one with the "
        "highest final validation "
        "accuracy (at the training length, on the evaluation's distribution; mean over the "
        "selection seeds; within 1 "
        "point the earlier recipe of the grid). Then it is trained with that recipe on fresh "
        "seeds, which alone are "
        "reported. A run *learned* its task when its validation accuracy reached "
        f"{synthetic_tasks.LEARNED:.0%}; the "
        "interval of the learned count is Wilson's (95%). Accuracy is exact match per answer token "
        "over "
        f"{trials} sequences per length, the same for every run, mean ± std over seeds. The floor "
        "is the best "
        "shortcut (a strategy that retrieves nothing, synthetic.SHORTCUTS) on the same sequences, "
        "± the band within "
        "which another such strategy scores (95%): *(floor)* marks a mean within it, *(below)* "
        "one under it.",
        "",
        "## The grid: final validation accuracy at the training length, selection seeds",
    ]
    for task, by_enc in study.grid.items():
        recipes = study.recipes[task]
        described = "; ".join(r + ": " + " ".join(study.options[task][r]) for r in recipes)
        lines += ["", f"{task} ({described})", ""]
        lines += [
            "| encoding | " + " | ".join(recipes) + " | chosen |",
            "|---|" + "---:|" * len(recipes) + "---|",
        ]
        for enc, rs in by_enc.items():
            cells = [pct(rs[r]) for r in recipes]
            lines.append(f"| {enc} | " + " | ".join(cells) + f" | {study.chosen[task][enc]} |")
    for task, cs in study.cells.items():
        fl = floors[task]
        lines += [
            "",
            f"## {task}",
            "",
            "| encoding | recipe | learned (95% interval) | at step | "
            f"{length_header(lengths, train_len)} |",
            "|---|---|---:|---:|" + "---:|" * len(lengths),
            "| *floor: "
            + fl[lengths[0]]["strategy"]
            + "* | | | | "
            + " | ".join(
                f"*{100 * fl[L]['token']:.0f} ± {100 * fl[L]['band']:.0f}%*" for L in lengths
            )
            + " |",
        ]
        for c in cs:
            n = len(c.scores)
            lo, hi = wilson(c.learned, n)
            steps = [s.learned_at for s in c.scores if s.learned_at is not None]
            at = f"{statistics.mean(steps):,.0f}" if steps else "-"
            cells = [
                pct(xs) + versus_floor(xs, fl[L]) if (xs := c.at(L)) else "n/a" for L in lengths
            ]
            learned = f"{c.learned} of {n} ({100 * lo:.0f}–{100 * hi:.0f}%)"
            lines.append(f"| {c.enc} | {c.recipe} | {learned} | {at} | " + " | ".join(cells) + " |")
        steady = ", ".join(f"{L}: {100 * fl[L]['steady']:.1f}%" for L in lengths)
        lines += [
            "",
            f"The floor over {synthetic.FLOOR_SEQUENCES:,} sequences (a steadier "
            f"estimate): {steady}.",
        ]
        found = separations(cs, lengths)
        lines += [
            "",
            f"Told apart at {'/'.join(map(str, seeds))} seeds (exact tests, p < 0.05, two-sided, "
            "uncorrected):",
        ]
        lines += [f"- {x}" for x in found] or [
            "- none: no two encodings are distinguishable at these seeds"
        ]
    lines += [
        "",
        "![accuracy by length, chosen recipes, fresh seeds; dashed: the floor](recipes.png)",
        "",
    ]
    plot_tasks(study.cells, floors, lengths, train_len, out_dir / "recipes.png")
    path = out_dir / "report.md"
    write_atomic(path, "\n".join(lines))
    results = {
        "grid": study.grid,
        "chosen": study.chosen,
        "options": study.options,
        "floors": floors,
        "results": {
            t: {c.enc: [s.to_json() for s in c.scores] for c in cs} for t, cs in study.cells.items()
        },
    }
    write_atomic(out_dir / "results.json", json.dumps(results, indent=1))
    return path


# --------------------------------------------------------------------------------------------------
# The extension study (--extend): each run fine-tuned at factor times its training length, against
# itself without


@dataclass
class Extension:
    """A source run and its fine-tune at a longer length, as the extension study's report reads
    them."""

    kind: str  # "text", or the synthetic task both were trained on
    enc: str
    scaling: str  # RoPE's scaling during the fine-tune ("none": none, and every other encoding)
    seed: int
    source: str  # the run extended
    dir: str  # the fine-tuned run
    source_val: float  # the source's best validation loss, at its training length
    # the fine-tune's evaluations at the new length: {"iter", "train", "val"[, "acc"]}
    history: list[dict]
    seconds: float  # the fine-tune's wall clock


def scalable(enc: str) -> bool:
    """Whether an encoding takes RoPE's scalings (its variants are rows of their own)."""
    return POS_ENCODINGS[enc].rope_scalable


def extension_name(r: Extension) -> str:
    """A fine-tuned variant's row name, seeds together."""
    return f"{r.enc}+{r.scaling}" if r.scaling != "none" else r.enc


def extension_label(r: Extension, F: int) -> str:
    """A variant's label in the tables: the encoding, and RoPE's scaling with its factor."""
    if r.scaling != "none":
        return f"{r.enc} · {r.scaling} (s={F})"
    return f"{r.enc} · none" if scalable(r.enc) else r.enc


def steps_to(histories: list[list[dict]], targets: list[float]) -> str:
    """The first evaluation at which each fine-tune's validation loss is at most its target (mean ±
    std over seeds, and how many reached it where not all did)."""
    steps = [
        next((h["iter"] for h in hist if h["val"] <= t), None)
        for hist, t in zip(histories, targets, strict=True)
    ]
    reached = [s for s in steps if s is not None]
    if not reached:
        return f"not in {histories[0][-1]['iter']}"
    cell = mean_spread([float(s) for s in reached], 0)
    return cell if len(reached) == len(steps) else f"{cell} ({len(reached)} of {len(steps)})"


def extension_rows(runs: list[Extension], report: dict, F: int) -> list[tuple]:
    """(variant label, fine-tuned?, its runs, {L: [ppl per seed]}) for the text table and plot: each
    encoding as trained and fine-tuned, RoPE's per scaling (without fine-tuning at s = F), in the
    order of the runs."""
    source = aggregate(report["sources"])
    tuned = aggregate(report["fine-tuned"])
    rows = []
    for name, rs in by_encoding(runs, extension_name).items():
        enc = rs[0].enc
        scaling = rs[0].scaling
        label = extension_label(rs[0], F)
        before = source[enc if scaling == "none" else f"{enc}+{scaling} (s={F:g})"]["sliding"]
        rows.append((label, False, rs, before))
        rows.append((label, True, rs, tuned[name]["sliding"]))
    return rows


def extend_report(
    out_dir: Path,
    runs: list[Extension],
    report: dict,
    tasks: dict,
    F: int,
    steps: int,
    L0: int,
    seconds: dict,
    argv: list[str],
) -> Path:
    """report.md of the extension study: perplexity by length and the fine-tunes' validation loss
    (before, after, the steps to their source's loss) per encoding and scaling, as trained and
    fine-tuned; the synthetic task's accuracy by length the same way, against its floor;
    extension.png; results.json."""
    # F, steps and L0: as the runs were trained (their checkpoints')
    text = [r for r in runs if r.kind == "text"]
    lengths = [int(L) for L in report["fine-tuned"]["lengths"]]
    tuned = sum(r.seconds for r in runs)
    lines = [
        "# Extending the context: fine-tuned at a longer length, against the same models without",
        "",
        *provenance(argv),
        f"Sources trained at {L0} tokens, seeds "
        f"{sorted({r.seed for r in runs if r.kind == 'text'})}; each fine-tuned "
        f"at {F * L0} tokens "
        f"({F}×) for {steps} iterations. Cost: the sources' training {seconds['sources'] / 60:.1f} "
        "min (as their sweep "
        f"recorded it), {len(runs)} fine-tunes {tuned / 60:.1f} min (each run's wall clock, one "
        "thread each when side "
        f"by side), evaluation {seconds['evaluation'] / 60:.1f} min; this invocation "
        f"{seconds['wall'] / 60:.1f} "
        "minutes of wall clock.",
        "",
        "Rows in pairs: the source as trained (RoPE with the scaling applied at evaluation, s = "
        f"{F}, L0 = {L0}), then "
        f"fine-tuned with it. *val loss* is train.py's estimate at {F * L0} tokens before the "
        "fine-tune's first step "
        "and after its last; *steps* the first evaluation at which it reached the source's own "
        "validation loss at "
        f"{L0} tokens. Perplexity with sliding windows (stride L/4), mean ± std over seeds.",
        "",
        "| encoding · scaling | fine-tuned | val loss at "
        + f"{F * L0}: start → end | steps to the source's val loss | "
        + " | ".join(f"{L} ({L / L0:g}×)" for L in lengths)
        + " |",
        "|---|---|---:|---:|" + "---:|" * len(lengths),
    ]
    for label, fine_tuned, rs, by_len in extension_rows(text, report, F):
        ppl = [mean_spread(v) if (v := by_len.get(L)) else "n/a" for L in lengths]
        if fine_tuned:
            start = [h[0]["val"] for h in (r.history for r in rs)]
            end = [r.history[-1]["val"] for r in rs]
            val = f"{mean_spread(start, 3)} → {mean_spread(end, 3)}"
            cells = [
                f"{steps} steps",
                val,
                steps_to([r.history for r in rs], [r.source_val for r in rs]),
            ]
        else:
            cells = ["no", "", ""]
        lines.append(f"| {label} | " + " | ".join(cells + ppl) + " |")
    if tasks:
        lines += extension_task_lines(runs, tasks, F)
    lines += ["", "![perplexity by length and the fine-tuning curves](extension.png)", ""]
    plot_extension(text, report, tasks, runs, F, L0, out_dir / "extension.png")
    path = out_dir / "report.md"
    write_atomic(path, "\n".join(lines))
    results = {
        "runs": [asdict(r) for r in runs],
        "eval": report,
        "tasks": tasks,
        "seconds": seconds,
    }
    write_atomic(out_dir / "results.json", json.dumps(results, indent=1))
    return path


def task_accuracy(
    runs: list[Extension], tasks: dict, variant: str | None
) -> dict[int, list[float] | None]:
    """{length: the seeds' token accuracy} of a group of runs: their sources read with variant (a
    scaling, "none"), or (variant None) the fine-tuned runs; None at a length the model has no
    positions for."""
    out = {}
    for L in tasks["lengths"]:
        xs = [
            tasks["scores"][r.source if variant else r.dir][variant or "fine-tuned"][str(L)]
            for r in runs
        ]
        out[L] = None if None in xs else xs
    return out


def task_floor(tasks: dict) -> dict[int, float]:
    """{length: the task's floor}, on the sequences its runs were scored on."""
    opts = dict(tasks["options"])
    vocab = opts.pop("vocab")
    return {
        L: synthetic.floor(tasks["task"], vocab, L, tasks["trials"], **opts)["token"]
        for L in tasks["lengths"]
    }


def extension_task_lines(runs: list[Extension], tasks: dict, F: int) -> list[str]:
    """The synthetic task's table: accuracy by length per encoding and scaling, as trained and
    fine-tuned, under the task's floor; when each fine-tune learned the task at the new length."""
    task = tasks["task"]
    lengths = tasks["lengths"]
    rs_all = [r for r in runs if r.kind == task]
    L0 = lengths[0]
    floors = task_floor(tasks)
    lines = [
        "",
        f"## Retrieval after extension: {task}",
        "",
        f"The synthetic suite's {task} runs (trained at {L0} tokens), fine-tuned at {F * L0} the "
        "same way; exact match "
        f"per answer token over {tasks['trials']} sequences per length, the same for every run; "
        "seeds "
        f"{sorted({r.seed for r in rs_all})} (mean ± std where there are several). "
        f"*learned at* is the fine-tune's first evaluation with validation accuracy at {F * L0} "
        "tokens of at least "
        f"{synthetic_tasks.LEARNED:.0%} (0: before its first step). The floor is what a model that "
        "retrieves nothing "
        "scores.",
        "",
        "| encoding · scaling | "
        "fine-tuned | learned at | " + " | ".join(f"{L} ({L / L0:g}×)" for L in lengths) + " |",
        "|---|---|---:|" + "---:|" * len(lengths),
        "| *floor (no "
        "retrieval)* | | | " + " | ".join(f"*{100 * floors[L]:.0f}%*" for L in lengths) + " |",
    ]
    for rs in by_encoding(rs_all, extension_name).values():
        label = extension_label(rs[0], F)
        scaling = rs[0].scaling
        before = task_accuracy(rs, tasks, scaling)
        after = task_accuracy(rs, tasks, None)
        at = [synthetic_tasks.learned_at(r.history) for r in rs]
        learned = [a for a in at if a is not None]
        when = (
            f"{mean_spread([float(a) for a in learned], 0)} ({len(learned)} of {len(at)})"
            if learned
            else "-"
        )
        lines.append(f"| {label} | no | | " + " | ".join(pct(before[L]) for L in lengths) + " |")
        lines.append(
            f"| {label} | yes | {when} | " + " | ".join(pct(after[L]) for L in lengths) + " |"
        )
    return lines


def plot_extension(
    text: list[Extension],
    report: dict,
    tasks: dict,
    runs: list[Extension],
    F: int,
    L0: int,
    path: Path,
) -> None:
    """extension.png: perplexity by length for RoPE's scalings and for the other encodings (dashed:
    as trained, solid: fine-tuned; mean ± std over seeds), the fine-tunes' validation loss by step
    (RoPE's scalings, and the sources' loss at their length, dotted), and the synthetic task's
    accuracy by length."""
    plt = matplotlib_pyplot()
    panels = 4 if tasks else 3
    fig, axes = plt.subplots(1, panels, figsize=(5.2 * panels, 4.4))
    colors = plt.get_cmap("tab10").colors
    rows = extension_rows(text, report, F)
    names = list(dict.fromkeys(label for label, *_ in rows))
    for label, fine_tuned, rs, by_len in rows:
        ax = axes[0] if scalable(rs[0].enc) else axes[1]
        pts = [(int(L), v) for L, v in sorted(by_len.items(), key=lambda kv: int(kv[0])) if v]
        ax.errorbar(
            [L for L, _ in pts],
            [statistics.mean(v) for _, v in pts],
            yerr=[statistics.stdev(v) if len(v) > 1 else 0 for _, v in pts],
            marker="o",
            capsize=3,
            ls="-" if fine_tuned else "--",
            color=colors[names.index(label) % 10],
            label=f"{label}{', fine-tuned' if fine_tuned else ''}",
        )
    for ax, title in zip(axes[:2], ("RoPE", "the other encodings"), strict=True):
        for x in (L0, F * L0):
            ax.axvline(x, color="gray", ls=":", lw=1)
        ax.set(
            xscale="log",
            yscale="log",
            xlabel="evaluation length (tokens)",
            ylabel="perplexity (sliding)",
        )
        ax.set_title(f"{title}: dashed as trained, solid fine-tuned at {F * L0}", fontsize=9)
    for name, rs in by_encoding(text, extension_name).items():
        if not scalable(rs[0].enc):
            continue
        iters = [h["iter"] for h in rs[0].history]
        vals = [statistics.mean(r.history[k]["val"] for r in rs) for k in range(len(iters))]
        axes[2].plot(
            iters,
            vals,
            marker="o",
            color=colors[names.index(extension_label(rs[0], F)) % 10],
            label=name,
        )
    if rope := [r.source_val for r in text if scalable(r.enc)]:
        axes[2].axhline(
            statistics.mean(rope),
            color="black",
            ls=":",
            lw=1,
            label=f"the sources' val loss at {L0}",
        )
    # a study of other encodings alone: the RoPE panels say so
    for ax in (axes[0], axes[2]) if not rope else ():
        ax.text(
            0.5,
            0.5,
            "no RoPE run in this study",
            ha="center",
            va="center",
            transform=ax.transAxes,
            fontsize=8,
        )
    axes[2].set(xlabel="fine-tuning step", ylabel=f"val loss at {F * L0} tokens (mean over seeds)")
    axes[2].set_title("RoPE: fine-tuning curves", fontsize=9)
    if tasks:
        ax = axes[3]
        task = tasks["task"]
        task_runs = [r for r in runs if r.kind == task]
        for k, (name, rs) in enumerate(by_encoding(task_runs, extension_name).items()):
            for variant, ls in ((rs[0].scaling, "--"), (None, "-")):
                acc = task_accuracy(rs, tasks, variant)
                pts = [(L, xs) for L, xs in acc.items() if xs]
                ax.plot(
                    [L for L, _ in pts],
                    [100 * statistics.mean(xs) for _, xs in pts],
                    marker="o",
                    ls=ls,
                    color=colors[k % 10],
                    label=name if variant is None else None,
                )
        floors = task_floor(tasks)  # {length: floor}, a length once
        ax.plot(
            list(floors),
            [100 * f for f in floors.values()],
            color="black",
            ls=":",
            lw=1.2,
            label="floor",
        )
        ax.set(
            xscale="log", xlabel="evaluation length (tokens)", ylabel="accuracy (%)", ylim=(-3, 103)
        )
        ax.set_title(f"{task}: dashed as trained, solid fine-tuned", fontsize=9)
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6.5)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
