"""
One command to compare encodings: train the same model with every encoding (same data, seeds and token budget),
evaluate each at several lengths (eval_length.py), and write a report (markdown tables and plots).

    python sweep.py --size=cpu --seeds 1337 1338           # the whole sweep on 2 CPU cores: ~20 minutes
    python sweep.py --size=gpu --seeds 1337 1338 1339      # config/<encoding>.py as they are, on one GPU
    python sweep.py --size=cpu --train --max_iters=500     # extra train.py options go after --train

Runs go to <out_dir>/<encoding>-seed<seed>. A finished run is not trained again and an interrupted one resumes, so
re-running the command after a crash or Ctrl-C continues where it stopped. With several seeds the report gives
mean ± standard deviation over seeds: a difference smaller than that is noise.
"""

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import eval_length
from checkpoint import CheckpointError, load_checkpoint, model_from_checkpoint
from model import POS_ENCODINGS, ROPE_SCALINGS

ROOT = Path(__file__).resolve().parent
SIZES = {  # train.py arguments and evaluation lengths per size; the training length is the block size
    "cpu": dict(
        train=["config/cpu.py", "--max_iters=1200", "--lr_decay_iters=1200", "--eval_interval=400"],
        lengths=[64, 128, 256, 512, 1024],
        eval_tokens=16384,
    ),
    "gpu": dict(train=[], lengths=[256, 512, 1024, 2048, 4096], eval_tokens=65536),
}


def run_dir(out_dir: Path, enc: str, seed: int) -> Path:
    return out_dir / f"{enc}-seed{seed}"


def finished(d: Path) -> bool | None:
    """True if d holds a finished run, False if an unfinished one (to resume), None if none. An unreadable
    ckpt.pt stops the sweep: training afresh over it could destroy the only copy of a run."""
    path = d / "ckpt.pt"
    if not path.exists():
        return None
    try:
        ckpt = load_checkpoint(path)
    except CheckpointError as e:
        sys.exit(f"[sweep] {e}\n[sweep] not training over it: move {d} aside (or delete it), then re-run")
    max_iters = ckpt.get("config", {}).get("max_iters")
    return max_iters is None or ckpt.get("iter_num", 0) >= max_iters


def train(enc: str, seed: int, d: Path, args) -> float:
    state = finished(d)
    if state:
        print(f"[sweep] {d.name}: finished earlier, not trained again", flush=True)
        return 0.0
    cmd = [
        sys.executable,
        "train.py",
        f"config/{enc}.py",
        *SIZES[args.size]["train"],
        f"--out_dir={d}",
        f"--seed={seed}",
        f"--wandb_log={args.wandb_log}",
        f"--wandb_run_name={enc}-seed{seed}",
        *args.train,
    ]
    if state is False:
        cmd.append("--init_from=resume")
    print(f"[sweep] {d.name}: {' '.join(cmd[1:])}", flush=True)
    t0 = time.time()
    r = subprocess.run(cmd, cwd=ROOT)
    if r.returncode != 0:
        sys.exit(f"[sweep] training {d.name} failed (exit {r.returncode}); fix it and re-run: finished runs are kept")
    seconds = time.time() - t0
    (d / "sweep.json").write_text(json.dumps({"seconds": seconds}))
    return seconds


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
    plot_report(agg, report, out_dir)
    path = out_dir / "report.md"
    path.write_text("\n".join(lines))
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


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=SIZES, default="cpu" if not torch.cuda.is_available() else "gpu")
    p.add_argument("--encodings", nargs="+", default=list(POS_ENCODINGS), choices=list(POS_ENCODINGS))
    p.add_argument("--seeds", type=int, nargs="+", default=[1337])
    p.add_argument("--lengths", type=int, nargs="+", default=None, help="evaluation lengths (default: per size)")
    p.add_argument(
        "--rope_scaling",
        nargs="*",
        default=["yarn", "dynamic_ntk"],
        choices=[s for s in ROPE_SCALINGS if s != "none"],
        help="extra RoPE rows (eval_length)",
    )
    p.add_argument("--out_dir", default=None, help="default: sweep-<size>")
    p.add_argument("--wandb_log", action="store_true")
    p.add_argument("--train", nargs=argparse.REMAINDER, default=[], help="train.py options for every run")
    args = p.parse_args(argv)
    for name in ("encodings", "seeds"):
        xs = getattr(args, name)
        if len(set(xs)) != len(xs):
            p.error(f"--{name} {' '.join(map(str, xs))}: each may appear once")
    if min(args.seeds) < 0:
        p.error(f"--seeds: seeds must be >= 0, not {min(args.seeds)}")
    if args.lengths and min(args.lengths) < 2:
        p.error(f"--lengths: every length must be >= 2, not {min(args.lengths)}")
    out_dir = Path(args.out_dir or f"sweep-{args.size}")
    if out_dir.exists() and not out_dir.is_dir():
        p.error(f"--out_dir={out_dir} is a file, not a folder")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        p.error(f"--out_dir={out_dir}: cannot create it: {e.strerror}")
    size = SIZES[args.size]
    t0 = time.time()
    runs = []
    n = len(args.encodings) * len(args.seeds)
    for i, (seed, enc) in enumerate((s, e) for s in args.seeds for e in args.encodings):
        d = run_dir(out_dir, enc, seed)
        done = time.time() - t0
        eta = f", ETA {done / i * (n - i) / 60:.0f} min for training" if i else ""
        print(f"[sweep] run {i + 1}/{n}{eta}", flush=True)
        train(enc, seed, d, args)
        try:
            ckpt = load_checkpoint(d / "ckpt.pt")
        except CheckpointError as e:
            sys.exit(f"[sweep] {e}")
        seconds = json.loads((d / "sweep.json").read_text())["seconds"] if (d / "sweep.json").exists() else 0.0
        n_params = model_from_checkpoint(ckpt).get_num_params()  # the tied wte/lm_head once; no wpe table
        runs.append(dict(enc=enc, seed=seed, dir=str(d), val=ckpt["best_val_loss"], params=n_params, seconds=seconds))
    (out_dir / "runs.json").write_text(json.dumps(runs, indent=1))
    lengths = args.lengths or size["lengths"]
    eval_args = [r["dir"] for r in runs] + [
        "--lengths",
        *map(str, lengths),
        "--eval_tokens",
        str(size["eval_tokens"]),
        "--out_json",
        str(out_dir / "eval.json"),
        "--plot",
        "",
    ]
    if args.rope_scaling:
        eval_args += ["--rope_scaling", *args.rope_scaling]
    if args.wandb_log:
        eval_args += ["--wandb_log", "--wandb_run_name", f"sweep-{args.size}-eval"]
    report = eval_length.main(eval_args)
    path = write_report(out_dir, report, runs, argv)
    print(f"[sweep] report: {path}")


if __name__ == "__main__":
    main(sys.argv[1:])
