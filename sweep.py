"""
One command to compare encodings: train the same model with every encoding (same data, seeds and token budget),
evaluate each at several lengths (eval_length.py), and write a report (markdown tables and plots).

    python sweep.py --size=cpu --seeds 1337 1338           # the whole sweep on 2 CPU cores: ~20 minutes
    python sweep.py --size=gpu --seeds 1337 1338 1339      # config/<encoding>.py as they are, on one GPU
    python sweep.py --size=gpu --seeds 1337 1338 1339 --jobs 3 --train --task_fraction=0.1   # with retrieval tasks
    python sweep.py --size=cpu --train --max_iters=500     # extra train.py options go after --train
    python sweep.py --synthetic --seeds 1337 1338 1339 --jobs 2   # the synthetic tasks (synthetic.py), on a CPU

Runs go to <out_dir>/<encoding>-seed<seed>. A finished run is not trained again and an interrupted one resumes, so
re-running the command after a crash or Ctrl-C continues where it stopped. With several seeds the report gives
mean ± standard deviation over seeds: a difference smaller than that is noise. Runs trained with retrieval tasks
(--train --task_fraction=0.1) are also scored on them (passkey, recall, copy at every evaluation length). The
report opens with a summary: one row per encoding.

--synthetic [TASK ...] runs the token-level suite instead: every encoding trained on each task (config/<task>.py,
default all of them) and scored at 1x to 16x its training length, 400 sequences per cell. Runs go to
<out_dir>/<task>/<encoding>-seed<seed>; the report gives, per task, how many seeds learned it at the training length
and their accuracy by length, a plot per task, and what it cost.
"""

import argparse
import json
import multiprocessing
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import torch

import eval_length
import synthetic
import tasks
from checkpoint import LINKS, CheckpointError, load_checkpoint, model_from_checkpoint
from model import POS_ENCODINGS, ROPE_SCALINGS
from outputs import cannot_write, write_atomic
from tokenizer import tokenizer_from_meta

ROOT = Path(__file__).resolve().parent
SIZES = {  # train.py arguments and evaluation lengths per size; the training length is the block size
    "cpu": dict(
        train=["config/cpu.py", "--max_iters=1200", "--lr_decay_iters=1200", "--eval_interval=400"],
        lengths=[64, 128, 256, 512, 1024],
        eval_tokens=16384,
    ),
    "gpu": dict(train=[], lengths=[256, 512, 1024, 2048, 4096], eval_tokens=65536),
}


# train.py options that the sweep sets for each run itself: given again after --train, they would override it (every
# seed trained with one --seed, every run in one out_dir)
SET_BY_SWEEP = ("out_dir", "seed", "init_from", "wandb_log", "wandb_run_name", "overwrite")


def run_dir(out_dir: Path, enc: str, seed: int) -> Path:
    return out_dir / f"{enc}-seed{seed}"


def stamp(path: Path) -> list[int]:
    """Which version of a file (a checkpoint, a report) something was computed from: its size and modification time.
    Every write replaces the file, so a run trained again (after its checkpoints were deleted) or resumed has a new
    stamp, found without reading the checkpoint; a copy that does not keep the times only costs computing it again.
    The size tells apart two writes within one tick of a coarse file clock."""
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns]


def read_json(path: Path) -> dict | None:
    """A JSON file the sweep wrote, or None where it is missing or unreadable (a file left truncated by an older
    version, or edited by hand): the sweep then makes it again."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def progress(ckpt: dict) -> tuple[int, int | None]:
    """(iterations trained, max_iters) of a checkpoint; max_iters None for a checkpoint without train.py's config."""
    return ckpt.get("iter_num", 0), ckpt.get("config", {}).get("max_iters")


def finished(d: Path) -> bool | None:
    """True if d holds a finished run (it reached max_iters), False if an unfinished one (to resume), None if none.
    An unreadable ckpt.pt stops the sweep: training afresh over it could destroy the only copy of a run. So does a
    folder with other checkpoints but no ckpt.pt: the sweep can neither resume it nor (train.py refuses) start anew."""
    path = d / "ckpt.pt"
    if not path.exists():
        if others := [name for name in ("ckpt_best.pt", *LINKS) if os.path.lexists(d / name)]:
            sys.exit(
                f"[sweep] {d} holds {', '.join(others)} but no ckpt.pt (the checkpoint the sweep resumes and reports): "
                "move the folder aside (or delete it), then re-run the sweep to train the run again"
            )
        return None
    try:
        ckpt = load_checkpoint(path)
    except CheckpointError as e:
        sys.exit(f"[sweep] {e}\n[sweep] not training over it: move {d} aside (or delete it), then re-run")
    done, max_iters = progress(ckpt)
    return max_iters is None or done >= max_iters


def finished_checkpoint(d: Path) -> dict:
    """The checkpoint of a finished run, for the report; a run that stopped early (Ctrl-C, SIGTERM) or is missing
    stops the sweep: reporting it as trained would put a half-trained model beside trained ones."""
    try:
        ckpt = load_checkpoint(d / "ckpt.pt")
    except CheckpointError as e:
        sys.exit(f"[sweep] {e}")
    done, max_iters = progress(ckpt)
    if max_iters is not None and done < max_iters:
        sys.exit(
            f"[sweep] {d.parent.name}/{d.name} stopped at iteration {done:,} of {max_iters:,} (interrupted?): re-run "
            "the same command to resume it"
        )
    return ckpt


def train_command(enc: str, seed: int, d: Path, args, configs: list[str]) -> list[str] | None:
    """train.py's command for one run (resuming an unfinished one), or None if the run is finished."""
    state = finished(d)
    if state:
        print(f"[sweep] {d.parent.name}/{d.name}: finished earlier, not trained again", flush=True)
        return None
    cmd = [
        sys.executable,
        "train.py",
        f"config/{enc}.py",
        *configs,
        f"--out_dir={d}",
        f"--seed={seed}",
        f"--wandb_log={args.wandb_log}",
        f"--wandb_run_name={enc}-seed{seed}",
        *args.train,
    ]
    return cmd + ["--init_from=resume"] if state is False else cmd


def train_all(jobs: list[tuple[Path, list[str]]], n_parallel: int) -> None:
    """Run the training commands, n_parallel at a time. One at a time, a run prints as it goes; side by side, each
    writes <run>/train.log and the CPU threads are shared out. Finished runs record their wall-clock seconds. A run
    that exits without reaching max_iters (stopped from outside) stops the sweep, as a failed one does. Ctrl-C stops
    the runs in progress (each saves a checkpoint) and the sweep: the same command resumes them."""
    threads = max(1, (os.cpu_count() or 1) // n_parallel)
    env = os.environ | ({"OMP_NUM_THREADS": str(threads)} if n_parallel > 1 else {})
    running: list[tuple[Path, subprocess.Popen, float, object]] = []
    t0, done, total = time.time(), 0, len(jobs)
    queue = list(jobs)

    def stop_running() -> None:
        for _, other, _, _ in running:
            if other.poll() is None:
                other.send_signal(signal.SIGTERM)  # once: train.py saves a checkpoint, and the next sweep resumes it
        for _, other, _, log in running:
            other.wait()
            if log:
                log.close()

    try:
        while queue or running:
            while queue and len(running) < n_parallel:
                d, cmd = queue.pop(0)
                d.mkdir(parents=True, exist_ok=True)
                print(f"[sweep] {d.parent.name}/{d.name}: {' '.join(cmd[1:])}", flush=True)
                log = open(d / "train.log", "a") if n_parallel > 1 else None
                # a session of its own: a Ctrl-C in the terminal reaches the sweep alone, which stops each run once
                # (a second signal would make train.py quit without saving)
                proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=log, start_new_session=True)
                running.append((d, proc, time.time(), log))
            time.sleep(0.2)
            for item in list(running):
                d, proc, start, log = item
                if proc.poll() is None:
                    continue
                running.remove(item)
                if log:
                    log.close()
                where = f"; its log: {d / 'train.log'}" if log else ""
                if proc.returncode != 0:
                    stop_running()
                    sys.exit(
                        f"[sweep] training {d.parent.name}/{d.name} failed (exit {proc.returncode}){where}; fix it "
                        "and re-run: finished runs are kept"
                    )
                if not finished(d):
                    stop_running()
                    sys.exit(
                        f"[sweep] training {d.parent.name}/{d.name} stopped before max_iters (a signal from outside "
                        f"the sweep?){where}; re-run the same command to resume it"
                    )
                timing = {"seconds": time.time() - start, "parallel": n_parallel}
                write_atomic(d / "sweep.json", json.dumps(timing))
                done += 1
                elapsed = time.time() - t0
                print(
                    f"[sweep] {d.parent.name}/{d.name}: trained ({done}/{total}, ETA "
                    f"{elapsed / done * (total - done) / 60:.0f} min)",
                    flush=True,
                )
    except KeyboardInterrupt:
        print("\n[sweep] interrupted: stopping the runs in progress (each saves a checkpoint) ...", flush=True)
        stop_running()
        raise


def evaluate_tasks(runs: list[dict], lengths: list[int], args) -> dict:
    """Retrieval accuracy of every run at every length (tasks.py): passkey over a grid of depths, recall and copy;
    the same sequences for every run."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    depths = np.linspace(0, 1, args.task_depths).round(3).tolist()
    out = {"lengths": lengths, "depths": depths, "trials": args.task_trials, "runs": {}}
    t0 = time.time()
    for i, r in enumerate(runs):
        ckpt = load_checkpoint(Path(r["dir"]) / "ckpt.pt")
        model = model_from_checkpoint(ckpt).to(device).eval()
        tok = tokenizer_from_meta(ckpt["tokenizer"])
        try:
            out["runs"][r["dir"]] = tasks.evaluate_checkpoint(
                model, tok, lengths, depths, args.task_trials, 0, list(tasks.TASKS), 8, device
            )
        except tasks.TaskError as e:
            sys.exit(f"[sweep] {r['dir']}: {e}")
        eta = (time.time() - t0) / (i + 1) * (len(runs) - i - 1) / 60
        print(
            f"[sweep] retrieval tasks: {Path(r['dir']).name} done ({i + 1}/{len(runs)}, ETA {eta:.0f} min)", flush=True
        )
    return out


def mean_spread(xs: list[float], digits: int = 2) -> str:
    if len(xs) == 1:
        return f"{xs[0]:.{digits}f}"
    return f"{statistics.mean(xs):.{digits}f} ± {statistics.stdev(xs):.{digits}f}"


def commit() -> str:
    r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return r.stdout.strip() or "unknown"


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


def aggregate(report: dict) -> dict:
    """{name: {mode: {L: [ppl per seed] or None}}}, runs of one encoding (and scaling) over seeds together."""
    out: dict = {}
    for r in report["runs"]:
        by_mode = out.setdefault(r["name"], {m: {} for m in report["modes"]})
        for m, by_len in r["results"].items():
            for L, res in by_len.items():
                by_mode[m].setdefault(int(L), [])
                if res is not None:
                    by_mode[m][int(L)].append(res["ppl"])
    return out


def pct(xs: list[float | None]) -> str:
    """Accuracies over seeds as a percentage, mean ± std; n/a where the model has no positions there (learned)."""
    xs = [100 * x for x in xs if x is not None]
    return mean_spread(xs, 0) + "%" if xs else "n/a"


def summary_lines(report: dict, runs: list[dict], agg: dict) -> list[str]:
    """One row per encoding, mean ± std over seeds: what to compare first."""
    train_len, lengths, tk = report["runs"][0]["train_len"], report["lengths"], report.get("tasks")
    mode = "sliding" if "sliding" in report["modes"] else report["modes"][0]
    far = [k for k in (4, 16) if k * train_len in lengths]
    L4 = 4 * train_len if tk and 4 * train_len in tk["lengths"] else None
    cols = ["val loss"] + [f"perplexity {k}×" for k in far]
    cols += (["passkey k_max"] if tk else []) + ([f"recall {L4}", f"copy {L4} (chars)"] if L4 else [])
    lines = [
        f"## Summary: mean ± std over seeds (perplexity with {mode} windows; accuracy is exact match, copy's per "
        "character; k_max: the longest length with passkey accuracy >= 20%, 0 if none)",
        "",
        "| encoding | " + " | ".join(cols) + " | training k tokens/s |",
        "|---|" + "---:|" * (len(cols) + 1),
    ]
    for enc in dict.fromkeys(r["enc"] for r in runs):
        rs = [r for r in runs if r["enc"] == enc]
        cells = [mean_spread([r["val"] for r in rs], 3)]
        cells += [mean_spread(v) if (v := agg[enc][mode][k * train_len]) else "n/a" for k in far]
        if tk:
            res = [tk["runs"][r["dir"]] for r in rs]
            k_max = [x["k_max"] or 0 for x in res]
            cells.append(mean_spread(k_max, 0) if any(k_max) else "0")
            if L4:
                cells += [pct([x["recall"][L4] for x in res]), pct([x["copy_tokens"][L4] for x in res])]
        speed = [r["tokens"] / r["seconds"] / 1000 for r in rs if r["seconds"]]
        cells.append(mean_spread(speed, 1) if speed else "-")
        lines.append(f"| {enc} | " + " | ".join(cells) + " |")
    parallel = max(r["parallel"] for r in runs)
    lines += [
        "",
        "Training speed is wall clock (start-up and evaluations included)"
        + (f", with {parallel} runs side by side" if parallel > 1 else "")
        + ": compare it only within one sweep on an otherwise idle machine.",
    ]
    return lines


def retrieval_lines(report: dict, runs: list[dict], out_dir: Path) -> list[str]:
    """Accuracy by length for each task (mean ± std over seeds) and the passkey heatmaps (averaged over seeds)."""
    tk = report["tasks"]
    lengths, depths = tk["lengths"], tk["depths"]
    lines = [
        "## Retrieval tasks (tasks.py), mean ± std over seeds",
        "",
        f"{tk['trials']} sequences per cell, the same for every run; passkey over {len(depths)} depths. Exact match of "
        "each answer (5-digit key, 2-digit value), and for copy also the share of right characters.",
    ]
    heat = {}
    for task, title in (
        ("passkey", "passkey"),
        ("recall", "recall (exact)"),
        ("copy", "copy (exact)"),
        ("copy_tokens", "copy (characters)"),
    ):
        lines += ["", f"| {title} | " + " | ".join(map(str, lengths)) + " |", "|---|" + "---:|" * len(lengths)]
        for enc in dict.fromkeys(r["enc"] for r in runs):
            res = [tk["runs"][r["dir"]] for r in runs if r["enc"] == enc]
            lines.append(f"| {enc} | " + " | ".join(pct([x[task][L] for x in res]) for L in lengths) + " |")
            grids = [x["passkey_grid"] for x in res]
            heat[enc] = {
                "passkey_grid": {L: None if grids[0][L] is None else np.mean([g[L] for g in grids], 0) for L in lengths}
            }
    tasks.plot_heatmaps({"checkpoints": heat}, lengths, depths, str(out_dir / "passkey.png"))
    return lines + ["", "![passkey accuracy by length and depth, mean over seeds](passkey.png)", ""]


def write_report(out_dir: Path, report: dict, runs: list[dict], argv: list[str]) -> Path:
    agg = aggregate(report)
    lengths, train_len = report["lengths"], report["runs"][0]["train_len"]
    lines = [
        "# Positional encodings: train short, test long",
        "",
        f"Command: `python sweep.py {' '.join(argv)}`  ",
        f"Machine: {machine()}; torch {torch.__version__}; {time.strftime('%Y-%m-%d')}; commit {commit()}  ",
        f"Training length {train_len}; seeds {sorted({r['seed'] for r in runs})}; training "
        f"{sum(r['seconds'] for r in runs) / 60:.1f} min, evaluation {report['seconds'] / 60:.1f} min.",
        "",
        *summary_lines(report, runs, agg),
        "",
        "## Validation loss at the training length (train.py's estimate, best of its evaluations)",
        "",
        "| encoding | val loss | parameters (tied embedding once, no position table) | minutes to train |",
        "|---|---:|---:|---:|",
    ]
    for enc in dict.fromkeys(r["enc"] for r in runs):
        rs = [r for r in runs if r["enc"] == enc]
        lines.append(
            f"| {enc} | {mean_spread([r['val'] for r in rs], 3)} | {rs[0]['params'] / 1e6:.2f}M | "
            f"{statistics.mean(r['seconds'] for r in rs) / 60:.1f} |"
        )
    for mode in report["modes"]:
        lines += ["", f"## Perplexity by evaluation length, {mode} windows", ""]
        if mode == "sliding":
            lines.append(
                f"(stride {report['stride']}: each window scores its last quarter only, so every token is scored once, "
                "with at least 3/4 of the window as context; the text's first 3/4 window is not scored)\n"
            )
        lines.append("| encoding | " + " | ".join(f"{L}{' (train)' if L == train_len else ''}" for L in lengths) + " |")
        lines.append("|---|" + "---:|" * len(lengths))
        for name, by_mode in agg.items():
            cells = [mean_spread(v) if v else "n/a" for v in (by_mode[mode][L] for L in lengths)]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "![perplexity by length](length.png)", "", "![loss by position](position.png)", ""]
    if report.get("tasks"):
        lines += retrieval_lines(report, runs, out_dir)
    plot_report(agg, report, out_dir)
    path = out_dir / "report.md"
    write_atomic(path, "\n".join(lines))
    return path


def plot_report(agg: dict, report: dict, out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train_len = report["runs"][0]["train_len"]
    fig, axes = plt.subplots(1, len(report["modes"]), figsize=(6.5 * len(report["modes"]), 4.8), squeeze=False)
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
    fig.savefig(out_dir / "length.png", dpi=110)
    plt.close(fig)
    first = report["runs"][0]["out_dir"].rsplit("-seed", 1)[1]  # loss by position: the first seed's runs
    runs = [r for r in report["runs"] if r["out_dir"].endswith(f"-seed{first}")]
    eval_length.plot(dict(report, runs=runs), str(out_dir / "position.png"))


# ----------------------------------------------------------------------------------------------------------------
# The synthetic suite: every encoding on each token-level task (synthetic.py), scored past the training length

SYNTHETIC_FACTORS = (1, 2, 4, 8)  # evaluation lengths, in training lengths (16x costs as much as these together)


def evaluate_synthetic(d: Path, lengths: list[int] | None, trials: int) -> dict:
    """A run's accuracy at each length (default: SYNTHETIC_FACTORS times its training length; cached in
    <run>/synthetic.json, for this checkpoint, these lengths and trials), per answer token and per whole sequence,
    whether and when it learned its task, its training length, task options and training seconds."""
    ckpt = finished_checkpoint(d)
    cfg = ckpt["config"]
    lengths = lengths or [cfg["block_size"] * k for k in SYNTHETIC_FACTORS]
    cache = d / "synthetic.json"
    key = {"lengths": lengths, "trials": trials, "checkpoint": stamp(d / "ckpt.pt"), "version": SYNTHETIC_VERSION}
    if (old := read_json(cache)) and old.get("key") == key:
        return old
    t0 = time.time()
    model = model_from_checkpoint(ckpt).eval()
    acc = synthetic.evaluate_checkpoint(model, cfg, lengths, trials)
    history = ckpt.get("history", [])
    timing = read_json(d / "sweep.json") or {}
    out = {
        "key": key,
        "task": cfg["task"],
        "task_options": {"vocab": cfg["task_vocab"], **synthetic.task_options(cfg)},
        "accuracy": {str(L): None if a is None else a["token"] for L, a in acc.items()},
        "whole_sequence": {str(L): None if a is None else a["sequence"] for L, a in acc.items()},
        "learned_at": synthetic.learned_at(history),
        "final_val_acc": history[-1]["acc"] if history else None,
        "iters": ckpt["iter_num"],
        "block_size": cfg["block_size"],  # the training length
        "params": model.get_num_params(),
        "seconds": timing.get("seconds", 0.0),
        "eval_seconds": time.time() - t0,
    }
    write_atomic(cache, json.dumps(out, indent=1))
    return out


SYNTHETIC_VERSION = 2  # the generators' version a cached evaluation was made with (2: mqar without its leak)


def task_floors(results: dict, trials: int) -> dict:
    """{task: {length: the shortcut's accuracy (synthetic.floor)}} on the sequences the runs were scored on."""
    out = {}
    for task, by_enc in results.items():
        r = next(iter(by_enc.values()))[0]
        opts = dict(r["task_options"])
        vocab = opts.pop("vocab")
        out[task] = {L: synthetic.floor(task, vocab, int(L), trials, **opts) for L in r["accuracy"]}
    return out


def seed_cells(rs: list[dict], L: int, key: str = "accuracy") -> tuple[str, str]:
    """At length L: (mean ± std over every seed, mean ± std over the seeds that learned the task, '-' if none)."""
    learned = [r for r in rs if r["learned_at"] is not None]
    if rs[0][key][str(L)] is None:
        return "n/a", "n/a"  # no positions there (learned)
    return pct([r[key][str(L)] for r in rs]), pct([r[key][str(L)] for r in learned]) if learned else "-"


def synthetic_table(by_enc: dict, lengths: list[int], train_len: int, floors: dict, key: str, part: int) -> list[str]:
    """One task's table of key (accuracy or whole_sequence) by length: over every seed (part 0) or over the seeds
    that learned (part 1), under a row of the floor."""
    lines = [
        "| encoding | learned | at step | " + " | ".join(f"{L} ({L / train_len:.3g}×)" for L in lengths) + " |",
        "|---|---:|---:|" + "---:|" * len(lengths),
        "| *floor (no retrieval)* | | | " + " | ".join(f"*{100 * floors[str(L)]:.0f}%*" for L in lengths) + " |",
    ]
    for enc, rs in by_enc.items():
        steps = [r["learned_at"] for r in rs if r["learned_at"] is not None]
        at = f"{statistics.mean(steps):,.0f}" if steps else "-"
        cells = [seed_cells(rs, L, key)[part] for L in lengths]
        lines.append(f"| {enc} | {len(steps)} of {len(rs)} | {at} | " + " | ".join(cells) + " |")
    return lines


def synthetic_report(out_dir: Path, results: dict, argv: list[str], wall: float, trials: int) -> Path:
    """report.md: per task, the floor, seeds learned and accuracy by length per encoding over every seed and over
    the seeds that learned; a plot per task; the cost."""
    first = next(iter(next(iter(results.values())).values()))[0]
    lengths = [int(L) for L in first["accuracy"]]
    runs = [r for by_enc in results.values() for rs in by_enc.values() for r in rs]
    if len(blocks := sorted({r["block_size"] for r in runs})) > 1:  # their lengths and multiples would not line up
        sys.exit(
            f"[sweep] the runs were trained at different lengths (block_size {', '.join(map(str, blocks))}), which one "
            "report cannot compare: move the runs trained with other options aside, then re-run the sweep"
        )
    train_len = first["block_size"]
    train_min, eval_min = sum(r["seconds"] for r in runs) / 60, sum(r["eval_seconds"] for r in runs) / 60
    seeds = max(len(rs) for by_enc in results.values() for rs in by_enc.values())
    floors = task_floors(results, trials)
    lines = [
        "# Synthetic tasks: retrieval past the training length",
        "",
        f"Command: `python sweep.py {' '.join(argv)}`  ",
        f"Machine: {machine()}; torch {torch.__version__}; {time.strftime('%Y-%m-%d')}; commit {commit()}  ",
        f"{len(runs)} runs ({first['params']:,} parameters each, trained at {train_len} tokens); training "
        f"{train_min:.0f} CPU-minutes (each run's wall clock, one thread each when side by side), evaluation "
        f"{eval_min:.0f} minutes; this invocation {wall / 60:.0f} minutes of wall clock.",
        "",
        f"A run *learned* its task when its validation accuracy at the training length (on the evaluation's "
        f"distribution) reached {synthetic.LEARNED:.0%} at some evaluation; **learned** counts those seeds and gives "
        "the step (the first evaluation at or above it, mean over them). Accuracy is exact match per answer token over "
        f"{trials} sequences per length, the same sequences for every run, mean ± std over seeds: first over every "
        "seed, then over the seeds that learned. The *floor* is what a strategy that retrieves nothing scores on the "
        "same sequences (synthetic.shortcut: passkey the most frequent key, mqar a value present in the context, "
        "offset the token right after the marker, copy a token that followed an earlier occurrence of the current "
        "one, needle chance among the keys): a cell at the floor has learned the shortcut, not the task.",
    ]
    for task, by_enc in results.items():
        token_floor = {L: f["token"] for L, f in floors[task].items()}
        lines += ["", f"## {task}", "", "Every seed:", ""]
        lines += synthetic_table(by_enc, lengths, train_len, token_floor, "accuracy", 0)
        lines += ["", "The seeds that learned it:", ""]
        lines += synthetic_table(by_enc, lengths, train_len, token_floor, "accuracy", 1)
        if task == "copy":  # per token, the shortcut copies most of a string; the whole string is the task
            lines += ["", "Whole string exact (every copied token right), every seed:", ""]
            seq_floor = {L: f["sequence"] for L, f in floors[task].items()}
            lines += synthetic_table(by_enc, lengths, train_len, seq_floor, "whole_sequence", 0)
    lines += ["", "![accuracy by length, per task, every seed; dashed: the floor](synthetic.png)", ""]
    plot_synthetic(results, floors, lengths, train_len, out_dir / "synthetic.png")
    path = out_dir / "report.md"
    write_atomic(path, "\n".join(lines))
    summary = {"seeds": seeds, "trials": trials, "floors": floors, "results": results}
    write_atomic(out_dir / "results.json", json.dumps(summary, indent=1))
    return path


def plot_synthetic(results: dict, floors: dict, lengths: list[int], train_len: int, path: Path) -> None:
    """A panel per task: accuracy by length, mean ± std over every seed, and the task's floor (dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(4.2 * len(results), 4), squeeze=False, sharey=True)
    for ax, (task, by_enc) in zip(axes[0], results.items(), strict=True):
        ax.set_prop_cycle(eval_length.line_styles())
        for enc, rs in by_enc.items():
            learned = sum(r["learned_at"] is not None for r in rs)
            pts = [(L, [r["accuracy"][str(L)] for r in rs]) for L in lengths]
            pts = [(L, xs) for L, xs in pts if None not in xs]
            ax.errorbar(
                [L for L, _ in pts],
                [100 * statistics.mean(xs) for _, xs in pts],
                yerr=[100 * statistics.stdev(xs) if len(xs) > 1 else 0 for _, xs in pts],
                marker="o",
                capsize=3,
                label=f"{enc} ({learned}/{len(rs)})",
            )
        floor = [100 * floors[task][str(L)]["token"] for L in lengths]
        ax.plot(lengths, floor, color="black", ls="--", lw=1.2, label="floor (no retrieval)")
        ax.axvline(train_len, color="gray", ls=":", lw=1)
        ax.set(xscale="log", xlabel="evaluation length (tokens)", title=task, ylim=(-3, 103))
        ax.set_xticks(lengths, [str(L) for L in lengths])
        ax.minorticks_off()  # a log axis labels its minor ticks too (6×10¹ over 64)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, title="encoding (seeds learned)", title_fontsize=7)
    axes[0][0].set_ylabel("accuracy (%), mean over every seed")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def synthetic_suite(args, argv: list[str], out_dir: Path) -> None:
    """Train every encoding on each task and seed (resuming, skipping finished runs), score, report."""
    t0 = time.time()
    # a seed at a time, so that an interrupted suite has whole seeds to report
    triples = [(t, e, s) for s in args.seeds for t in args.synthetic for e in args.encodings]
    dirs = {x: out_dir / x[0] / f"{x[1]}-seed{x[2]}" for x in triples}
    jobs = [
        (dirs[t, e, s], cmd)
        for t, e, s in triples
        if (cmd := train_command(e, s, dirs[t, e, s], args, [f"config/{t}.py"]))
    ]
    train_all(jobs, args.jobs)
    results: dict = {}
    trials = args.task_trials or 400
    # --jobs evaluations side by side, each on its share of the cores; Ctrl-C reaches the sweep alone, which lets the
    # evaluations in progress end (each a few seconds) and drops the rest: the next run evaluates them
    threads = max(1, (os.cpu_count() or 1) // args.jobs)
    # workers from a fork server, not forked from this process: a fork after torch has run its thread pool here (a
    # caller that evaluated something first, a test) can deadlock the child in OpenMP
    fresh = multiprocessing.get_context("forkserver")
    fresh.set_forkserver_preload(["torch", "synthetic"])
    with ProcessPoolExecutor(args.jobs, fresh, initializer=evaluation_worker, initargs=(threads,)) as pool:
        futures = [pool.submit(evaluate_synthetic, dirs[x], args.lengths, trials) for x in triples]
        try:
            for i, ((t, e, s), future) in enumerate(zip(triples, futures, strict=True)):
                try:
                    r = future.result()
                except (CheckpointError, synthetic.SyntheticError) as err:
                    pool.shutdown(cancel_futures=True)
                    sys.exit(f"[sweep] {err}")
                results.setdefault(t, {}).setdefault(e, []).append(r)
                print(f"[sweep] evaluated {t}/{e}-seed{s} ({i + 1}/{len(triples)})", flush=True)
        except KeyboardInterrupt:
            print("\n[sweep] interrupted: finishing the evaluations in progress ...", flush=True)
            pool.shutdown(cancel_futures=True)
            raise
    print(f"[sweep] report: {synthetic_report(out_dir, results, argv, time.time() - t0, trials)}")


def evaluation_worker(threads: int) -> None:
    """A process of the evaluation pool: its share of the cores, and deaf to Ctrl-C (the sweep answers it)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(threads)


def main(argv: list[str]) -> None:
    """The command: Ctrl-C stops it with one line (the runs in progress save their checkpoints), never a traceback."""
    try:
        _main(argv)
    except KeyboardInterrupt:
        sys.exit("[sweep] interrupted; run the same command again to resume (finished runs are kept)")


def check_train_options(p: argparse.ArgumentParser, options: list[str]) -> None:
    """--train's options go to every run; one the sweep sets per run itself would make the runs copies of each
    other (every seed trained with one --seed)."""
    for opt in options:
        key = opt[2:].split("=", 1)[0] if opt.startswith("--") else None
        if key in SET_BY_SWEEP:
            p.error(
                f"--train {opt}: the sweep sets {key} for each run itself (--seeds, --out_dir, --wandb_log); drop it "
                "from the options after --train"
            )


def _main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=SIZES, default=None, help="default: gpu where there is one, else cpu")
    p.add_argument("--encodings", nargs="+", default=list(POS_ENCODINGS), choices=list(POS_ENCODINGS))
    p.add_argument("--seeds", type=int, nargs="+", default=[1337])
    p.add_argument(
        "--lengths",
        type=int,
        nargs="+",
        default=None,
        help="evaluation lengths (default: per size; synthetic: 1, 2, 4 and 8 times the training length, and the "
        "report labels each length with its multiple of that, 100 (1.56×))",
    )
    p.add_argument(
        "--rope_scaling",
        nargs="*",
        default=None,
        choices=[s for s in ROPE_SCALINGS if s != "none"],
        help="extra RoPE rows (eval_length; default: yarn dynamic_ntk)",
    )
    p.add_argument("--out_dir", default=None, help="default: sweep-<size>, or sweep-synthetic")
    p.add_argument("--eval_tokens", type=int, default=None, help="validation tokens per length (default: per size)")
    p.add_argument("--wandb_log", action="store_true")
    p.add_argument("--jobs", type=int, default=1, help="training runs side by side (they share the CPU cores or GPU)")
    p.add_argument(
        "--task_trials", type=int, default=None, help="sequences per length (and depth): default 5, synthetic 400"
    )
    p.add_argument("--task_depths", type=int, default=None, help="passkey depths, evenly spaced in [0, 1] (default 10)")
    p.add_argument(
        "--synthetic",
        nargs="*",
        default=None,
        choices=list(synthetic.TASKS),
        help="run the synthetic suite: these tasks (none named: "
        + ", ".join(synthetic.SUITE)
        + "), config/<task>.py each; --size, --rope_scaling, --eval_tokens and --task_depths are the text sweep's",
    )
    p.add_argument("--train", nargs=argparse.REMAINDER, default=[], help="train.py options for every run")
    args = p.parse_args(argv)
    if args.synthetic is not None:
        args.synthetic = args.synthetic or list(synthetic.SUITE)
    # the text sweep's options: None unless given, so that the synthetic suite, which has no use for them (its model
    # and sequences are its own), refuses them instead of ignoring them; then their defaults
    text_only = {"size": "gpu" if torch.cuda.is_available() else "cpu", "rope_scaling": ["yarn", "dynamic_ntk"]}
    text_only |= {"eval_tokens": None, "task_depths": 10}
    for name, default in text_only.items():
        if args.synthetic is not None and getattr(args, name) is not None:
            p.error(f"--{name}: the synthetic suite does not use it (only the text sweep does); drop it")
        if getattr(args, name) is None:
            setattr(args, name, default)
    # a name twice would train one run twice (side by side, into one folder) and count it twice in the report
    for name in ("encodings", "seeds", "synthetic", "lengths", "rope_scaling"):
        xs = getattr(args, name) or []
        if len(set(xs)) != len(xs):
            p.error(f"--{name} {' '.join(map(str, xs))}: each may appear once")
    if min(args.seeds) < 0:
        p.error(f"--seeds: seeds must be >= 0, not {min(args.seeds)}")
    for name, least in (("jobs", 1), ("task_trials", 1), ("eval_tokens", 1), ("task_depths", 2)):
        if (x := getattr(args, name)) is not None and x < least:
            p.error(f"--{name}={x}: must be at least {least}")
    if args.lengths and min(args.lengths) < 2:
        p.error(f"--lengths: every length must be >= 2, not {min(args.lengths)}")
    check_train_options(p, args.train)
    out_dir = Path(args.out_dir or ("sweep-synthetic" if args.synthetic is not None else f"sweep-{args.size}"))
    if out_dir.exists() and not out_dir.is_dir():
        p.error(f"--out_dir={out_dir} is a file, not a folder; choose a folder for the runs and the report")
    if problem := cannot_write(out_dir, create=True):
        p.error(f"--out_dir={out_dir}: cannot write there ({problem}); choose another folder")
    if args.synthetic is not None:
        return synthetic_suite(args, argv, out_dir)
    args.task_trials = args.task_trials or 5
    size = SIZES[args.size]
    pairs = [(enc, seed, run_dir(out_dir, enc, seed)) for seed in args.seeds for enc in args.encodings]
    jobs = [(d, cmd) for enc, seed, d in pairs if (cmd := train_command(enc, seed, d, args, size["train"]))]
    train_all(jobs, args.jobs)
    runs = []
    for enc, seed, d in pairs:
        ckpt = finished_checkpoint(d)
        timing = read_json(d / "sweep.json") or {}
        cfg = ckpt.get("config", {})
        runs.append(
            dict(
                enc=enc,
                seed=seed,
                dir=str(d),
                val=ckpt["best_val_loss"],
                params=model_from_checkpoint(ckpt).get_num_params(),  # the tied wte/lm_head once; no wpe table
                seconds=timing.get("seconds", 0.0),
                parallel=timing.get("parallel", 1),
                tokens=ckpt.get("iter_num", 0)
                * cfg.get("batch_size", 0)
                * cfg.get("block_size", 0)
                * cfg.get("gradient_accumulation_steps", 1),
                task_fraction=cfg.get("task_fraction", 0.0),
            )
        )
    write_atomic(out_dir / "runs.json", json.dumps(runs, indent=1))
    lengths = args.lengths or size["lengths"]
    evaluation = {
        "lengths": lengths,
        "eval_tokens": args.eval_tokens or size["eval_tokens"],
        "out_json": str(out_dir / "eval.json"),
        "plot": "",  # the report draws its own
        "rope_scaling": args.rope_scaling,
    }
    if args.wandb_log:
        evaluation |= {"wandb_log": True, "wandb_run_name": f"sweep-{args.size}-eval"}
    # what the report is made of: the evaluation's settings and every checkpoint as it is on disk. A sweep run again
    # with nothing new (every run finished, the same settings) keeps its report instead of evaluating again, if the
    # report is still the one they made: not one that the synthetic suite (or anything else) wrote over it since
    inputs = {"eval": evaluation, "tasks": [args.task_trials, args.task_depths]}
    inputs["runs"] = [[r["dir"], *stamp(Path(r["dir"]) / "ckpt.pt")] for r in runs]
    inputs_path = out_dir / "report_inputs.json"
    report_path = out_dir / "report.md"
    if not args.wandb_log and report_path.exists() and inputs_path.exists():
        if read_json(inputs_path) == inputs | {"report": stamp(report_path)}:
            print(f"[sweep] report: {report_path} (up to date: no run or setting changed since it was written)")
            return
    report = eval_length.evaluate_runs([r["dir"] for r in runs], **evaluation)
    if any(r["task_fraction"] > 0 for r in runs):
        report["tasks"] = evaluate_tasks(runs, lengths, args)
        write_atomic(out_dir / "tasks.json", json.dumps(report["tasks"], indent=1))
    path = write_report(out_dir, report, runs, argv)
    write_atomic(inputs_path, json.dumps(inputs | {"report": stamp(path)}))
    print(f"[sweep] report: {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
