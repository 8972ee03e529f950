"""
One command to compare encodings: train the same model with every encoding (same data, seeds and
token budget), evaluate each at several lengths (compare/eval_length.py), and write a report
(markdown tables and plots, compare/sweep_report.py).

    python -m compare.sweep --size=cpu --seeds 1337 1338       # all of it on 2 CPU cores: ~35 min
    python -m compare.sweep --size=gpu --seeds 1337 1338 1339  # config/<encoding>.py, on one GPU
    python -m compare.sweep --size=cpu --train --max_iters=500  # train.py options go after --train
    # with retrieval tasks; with and without document packing; the synthetic tasks, on a CPU
    python -m compare.sweep --size=gpu --seeds 1337 1338 1339 --jobs 3 --train --task_fraction=0.1
    python -m compare.sweep --size=cpu --seeds 1337 1338 --packing stream documents
    python -m compare.sweep --synthetic --seeds 1337 1338 1339 --jobs 2
    python -m compare.sweep --synthetic mqar offset --recipes --selection_seeds 2001 \
        --seeds 3001 3002 3003 3004 3005 --jobs 2

Runs go to <out_dir>/<encoding>-seed<seed>. A finished run is not trained again and an interrupted
one resumes, so re-running the command after a crash or Ctrl-C continues where it stopped. With
several seeds the report gives mean ± standard deviation over seeds: a difference smaller than that
is noise. Runs trained with retrieval tasks (--train --task_fraction=0.1) are also scored on them
(passkey, recall, copy at every evaluation length). The report opens with a summary: one row per
encoding.

--packing stream documents trains each encoding both ways (train.py's --packing), the documents runs
in <out_dir>/<encoding>-documents-seed<seed>, all on one dataset that marks its documents
(shakespeare_char_scenes unless --train --dataset=... names another), and the report puts
"<encoding> documents" beside each encoding's stream row.

--synthetic [TASK ...] runs the token-level suite instead: every encoding trained on each task
(config/<task>.py, default all of them) and scored at 1x to 8x its training length, 400 sequences
per cell. Runs go to <out_dir>/<task>/<encoding>-seed<seed>; the report gives, per task, how many
seeds learned it at the training length and their accuracy by length, a plot per task, and what it
cost.

--recipes (with --synthetic) gives every encoding its best recipe of a small grid (recipes(): the
task's curriculum on and off, two learning rates) before comparing: each recipe is trained on the
--selection_seeds, each encoding's best by final validation accuracy is trained on the --seeds, and
only those are reported, with the learned counts' 95% intervals and the differences exact tests tell
apart. Runs go to <out_dir>/grid/<recipe>/<task>/... and <out_dir>/final/<recipe>/<task>/....
"""

import argparse
import json
import multiprocessing
import os
import signal
import statistics
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, fields
from pathlib import Path

if not __package__:  # run by its path, where the project's modules are not importable
    sys.exit("run it from the repository's root as: python -m compare.sweep")

import numpy as np
import torch

from compare import eval_length, synthetic, tasks
from compare.sweep_report import (
    Cell,
    Extension,
    Study,
    TaskScore,
    TextRun,
    commit,
    extend_report,
    extension_name,
    recipe_report,
    synthetic_report,
    text_report,
)
from lib import synthetic_tasks, text_tasks
from lib.checkpoint import (
    CheckpointError,
    checkpoints,
    latest,
    load_checkpoint,
    model_from_checkpoint,
)
from lib.configurator import ConfigError, configure
from lib.datafiles import dataset_dir, no_documents
from lib.outputs import cannot_write, write_atomic
from lib.tokenizer import tokenizer_from_meta
from model import POS_ENCODINGS, ROPE_SCALINGS, GPTConfig
from shape import PACKINGS

ROOT = Path(__file__).resolve().parents[1]
# train.py arguments and evaluation lengths per size; the training length is the block size
SIZES = {
    "cpu": dict(
        train=["config/cpu.py", "--max_iters=1200", "--lr_decay_iters=1200", "--eval_interval=400"],
        lengths=[64, 128, 256, 512, 1024],
        eval_tokens=16384,
    ),
    "gpu": dict(train=[], lengths=[256, 512, 1024, 2048, 4096], eval_tokens=65536),
}


# train.py options that the sweep sets for each run itself: given again after --train, they would
# override it (every seed trained with one --seed, every run in one out_dir)
SET_BY_SWEEP = ("out_dir", "seed", "init_from", "wandb_log", "wandb_run_name", "overwrite")


def run_dir(out_dir: Path, enc: str, seed: int) -> Path:
    return out_dir / f"{enc}-seed{seed}"


def stamp(path: Path) -> list[int]:
    """Which version of a file (a checkpoint, a report) something was computed from: its size and
    modification time. Every write replaces the file, so a run trained again (after its checkpoints
    were deleted) or resumed has a new stamp, found without reading the checkpoint; a copy that does
    not keep the times only costs computing it again. The size tells apart two writes within one
    tick of a coarse file clock."""
    st = os.stat(path)
    return [st.st_size, st.st_mtime_ns]


def read_json(path: Path) -> dict | None:
    """A JSON file the sweep wrote, or None where it is missing or unreadable (a file left truncated
    by an older version, or edited by hand): the sweep then makes it again."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def progress(ckpt: dict) -> tuple[int, int | None]:
    """(iterations trained, max_iters) of a checkpoint; max_iters None for a checkpoint without
    train.py's config."""
    return ckpt.get("iter_num", 0), ckpt.get("config", {}).get("max_iters")


def saved_run(d: Path) -> dict | None:
    """The checkpoint the sweep resumes and reports in d (ckpt.pt or ckpt.dcp), None where there is
    none. An unreadable checkpoint stops the sweep: training afresh over it could destroy the only
    copy of a run. So does a folder with only a best checkpoint: the sweep can neither resume it nor
    (train.py refuses) start anew."""
    path = latest(d)
    if path is None:
        if others := [p.name for p in checkpoints(d)]:
            sys.exit(
                f"[sweep] {d} holds {', '.join(others)} but no ckpt.pt or ckpt.dcp (the checkpoint "
                "the sweep resumes "
                "and reports): move the folder aside (or delete it), then re-run the sweep to "
                "train the run again"
            )
        return None
    try:
        return load_checkpoint(path)
    except CheckpointError as e:
        sys.exit(
            f"[sweep] {e}\n[sweep] not training over it: move {d} aside (or delete it), then re-run"
        )


def reached_max_iters(ckpt: dict) -> bool:
    done, max_iters = progress(ckpt)
    return max_iters is None or done >= max_iters


def finished(d: Path) -> bool | None:
    """True if d holds a finished run (it reached max_iters), False if an unfinished one (to
    resume), None if none."""
    ckpt = saved_run(d)
    return None if ckpt is None else reached_max_iters(ckpt)


def finished_checkpoint(d: Path) -> dict:
    """The checkpoint of a finished run, for the report; a run that stopped early (Ctrl-C, SIGTERM)
    or is missing stops the sweep: reporting it as trained would put a half-trained model beside
    trained ones."""
    try:
        ckpt = load_checkpoint(latest(d) or d / "ckpt.pt")
    except CheckpointError as e:
        sys.exit(f"[sweep] {e}")
    done, max_iters = progress(ckpt)
    if max_iters is not None and done < max_iters:
        sys.exit(
            f"[sweep] {d.parent.name}/{d.name} stopped at iteration {done:,} of {max_iters:,} "
            "(interrupted?): re-run "
            "the same command to resume it"
        )
    return ckpt


# train.py options that say where and how a run ran, or what it logs, not what it trains: a run
# reused by a study may differ in these alone
NOT_TRAINING = (
    "out_dir",
    "log_interval",
    "eval_only",
    "always_save_checkpoint",
    "overwrite",
    "wandb_log",
    "wandb_project",
    "wandb_run_name",
    "wandb_group",
    "parallel",
    "backend",
    "device",
    "compile",
    "dtype",  # follows the device by default (bfloat16 on a GPU, float32 on a CPU)
    "activation_checkpointing",  # memory against time: the same numbers
)


def asked_config(arguments: list[str]) -> dict:
    """The options train.py would run with these arguments, resolved as train.py resolves them."""
    import train
    from lib import options

    explicit: set[str] = set()
    try:
        cfg = options.resolve(
            configure(train.defaults, arguments, explicit), train.defaults, explicit
        )
    except ConfigError as e:
        sys.exit(f"[sweep] train.py {' '.join(arguments)}: {e}")
    if cfg["pe_lr_scale"] is None:  # train.py resolves it with the model: the encoding's own
        cfg["pe_lr_scale"] = POS_ENCODINGS[cfg["pos_encoding"]].lr_scale
    # and the encoding's derived defaults (rpe_max_distance None: block_size // 2), as the model
    # builds them and the run's checkpoint records them
    model = GPTConfig(
        **{f.name: cfg[f.name] for f in fields(GPTConfig) if f.name in cfg}, eot_token=0
    )
    for name in POS_ENCODINGS[cfg["pos_encoding"]].options:
        if cfg.get(name) is None:
            cfg[name] = getattr(model, name)
    return cfg


def trained_differently(ckpt: dict, asked: dict) -> str | None:
    """How the run saved in ckpt was trained otherwise than asked ('key=value and key=value, and
    this study asks key=value and key=value'), from its options, every one that differs, the task
    first (it says what the run is); None where it was trained as asked."""
    trained = ckpt.get("config") or {}
    differ = []
    for key, value in asked.items():
        old = trained.get(key, value)
        if key in NOT_TRAINING or (key == "init_from" and "resume" in (old, value)):
            continue
        if key == "init_from" and Path(old).is_dir() and Path(value).is_dir():
            # the source, however its path is written
            old = Path(old).resolve()
            value = Path(value).resolve()
        if old != value:
            differ.append(key)
    if not differ:
        return None
    differ.sort(key=lambda key: key != "task")

    def listed(config: dict) -> str:
        pairs = [f"{key}={config.get(key)!r}" for key in differ]
        return pairs[0] if len(pairs) == 1 else ", ".join(pairs[:-1]) + " and " + pairs[-1]

    return f"{listed(trained)}, and this study asks {listed(asked)}"


def train_command(
    enc: str, seed: int, d: Path, args, configs: list[str], extra=(), last=()
) -> list[str] | None:
    """train.py's command for one run (resuming an unfinished one), or None if the run is finished.
    Options train.py would refuse for this run (another encoding's, --train's) stop the sweep before
    any training, as does a run in d that was trained otherwise than this command asks (another
    task, rate, number of steps, source...): reusing it would put its results under this study's
    labels."""
    arguments = train_arguments(enc, seed, d, args, configs, extra, last)
    # every run's options, checked first
    cmd = [sys.executable, "train.py", *arguments]
    asked = asked_config(arguments)
    if (ckpt := saved_run(d)) is None:
        return cmd
    if problem := trained_differently(ckpt, asked):
        sys.exit(
            f"[sweep] {d} was trained with {problem}: give this study another --out_dir, or move "
            f"{d} aside to train "
            "it again as asked"
        )
    if reached_max_iters(ckpt):
        print(f"[sweep] {d.parent.name}/{d.name}: finished earlier, not trained again", flush=True)
        return None
    return cmd + ["--init_from=resume"]


def train_arguments(
    enc: str, seed: int, d: Path, args, configs: list[str], extra=(), last=()
) -> list[str]:
    """train.py's arguments for one run: the encoding's config, then configs, then the sweep's own
    options, extra (a recipe's), --train's and last (an extension's); the last value of an option
    wins."""
    return [
        f"config/{enc}.py",
        *configs,
        f"--out_dir={d}",
        f"--seed={seed}",
        f"--wandb_log={args.wandb_log}",
        f"--wandb_run_name={d.name}",  # <encoding>[-documents]-seed<seed>
        *extra,
        *args.train,
        *last,
    ]


def train_all(jobs: list[tuple[Path, list[str]]], n_parallel: int) -> None:
    """Run the training commands, n_parallel at a time. One at a time, a run prints as it goes; side
    by side, each writes <run>/train.log and the CPU threads are shared out. Finished runs record
    their wall-clock seconds. A run that exits without reaching max_iters (stopped from outside)
    stops the sweep, as a failed one does. Ctrl-C stops the runs in progress (each saves a
    checkpoint) and the sweep: the same command resumes them."""
    threads = max(1, (os.cpu_count() or 1) // n_parallel)
    env = os.environ | ({"OMP_NUM_THREADS": str(threads)} if n_parallel > 1 else {})
    running: list[tuple[Path, subprocess.Popen, float, object]] = []
    t0 = time.time()
    done = 0
    total = len(jobs)
    queue = list(jobs)

    def stop_running() -> None:
        for _, other, _, _ in running:
            if other.poll() is None:
                # once: train.py saves a checkpoint, and the next sweep resumes it
                other.send_signal(signal.SIGTERM)
        for _, other, _, log in running:
            other.wait()
            if log:
                log.close()

    try:
        while queue or running:
            while queue and len(running) < n_parallel:
                d, cmd = queue.pop(0)
                d.mkdir(parents=True, exist_ok=True)
                # each start: the code it ran
                ran = (d / "code.txt").read_text() if (d / "code.txt").is_file() else ""
                write_atomic(
                    d / "code.txt", f"{ran}{time.strftime('%Y-%m-%d %H:%M:%S')} {commit()}\n"
                )
                print(f"[sweep] {d.parent.name}/{d.name}: {' '.join(cmd[1:])}", flush=True)
                log = open(d / "train.log", "a") if n_parallel > 1 else None
                # a session of its own: a Ctrl-C in the terminal reaches the sweep alone, which
                # stops each run once (a second signal would make train.py quit without saving)
                proc = subprocess.Popen(
                    cmd, cwd=ROOT, env=env, stdout=log, stderr=log, start_new_session=True
                )
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
                        f"[sweep] training {d.parent.name}/{d.name} failed (exit "
                        f"{proc.returncode}){where}; fix it "
                        "and re-run: finished runs are kept"
                    )
                if not finished(d):
                    stop_running()
                    sys.exit(
                        f"[sweep] training {d.parent.name}/{d.name} stopped before max_iters (a "
                        "signal from outside "
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
        print(
            "\n[sweep] interrupted: stopping the runs in progress (each saves a checkpoint) ...",
            flush=True,
        )
        stop_running()
        raise


def evaluate_tasks(runs: list[TextRun], lengths: list[int], args) -> dict:
    """Retrieval accuracy of every run at every length (compare/tasks.py): passkey over a grid of
    depths, recall and copy; the same sequences for every run."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    depths = np.linspace(0, 1, args.task_depths).round(3).tolist()
    out = {"lengths": lengths, "depths": depths, "trials": args.task_trials, "runs": {}}
    t0 = time.time()
    for i, r in enumerate(runs):
        ckpt = load_checkpoint(latest(r.dir))
        model = model_from_checkpoint(ckpt).to(device).eval()
        tok = tokenizer_from_meta(ckpt["tokenizer"])
        try:
            out["runs"][r.dir] = tasks.evaluate_checkpoint(
                model,
                tok,
                lengths,
                depths,
                args.task_trials,
                0,
                list(text_tasks.TEXT_TASKS),
                8,
                device,
            )
        except text_tasks.TaskError as e:
            sys.exit(f"[sweep] {r.dir}: {e}")
        eta = (time.time() - t0) / (i + 1) * (len(runs) - i - 1) / 60
        print(
            f"[sweep] retrieval tasks: {Path(r.dir).name} done "
            f"({i + 1}/{len(runs)}, ETA {eta:.0f} min)",
            flush=True,
        )
    return out


# --------------------------------------------------------------------------------------------------
# The synthetic suite: every encoding on each token-level task (compare/synthetic.py), scored past
# the training length

# evaluation lengths, in training lengths (16x costs as much as these together)
SYNTHETIC_FACTORS = (1, 2, 4, 8)


# the generators' version a cached evaluation was made with (2: mqar without its leak)
SYNTHETIC_VERSION = 2


def evaluate_synthetic(d: Path, lengths: list[int] | None, trials: int) -> TaskScore:
    """A run's scores at each length (default: SYNTHETIC_FACTORS times its training length), cached
    in <run>/synthetic.json for this checkpoint, these lengths and trials."""
    ckpt = finished_checkpoint(d)
    cfg = ckpt["config"]
    lengths = lengths or [cfg["block_size"] * k for k in SYNTHETIC_FACTORS]
    cache = d / "synthetic.json"
    key = {
        "lengths": lengths,
        "trials": trials,
        "checkpoint": stamp(latest(d)),
        "version": SYNTHETIC_VERSION,
    }
    if (old := read_json(cache)) and old.get("key") == key:
        return TaskScore.from_json(old)
    t0 = time.time()
    model = model_from_checkpoint(ckpt).eval()
    acc = synthetic.evaluate_checkpoint(model, cfg, lengths, trials)
    history = ckpt.get("history", [])
    score = TaskScore(
        key=key,
        task=cfg["task"],
        task_options={"vocab": cfg["task_vocab"], **synthetic_tasks.task_options(cfg)},
        accuracy={L: None if a is None else a["token"] for L, a in acc.items()},
        whole_sequence={L: None if a is None else a["sequence"] for L, a in acc.items()},
        learned_at=synthetic_tasks.learned_at(history),
        final_val_acc=history[-1]["acc"] if history else None,
        iters=ckpt["iter_num"],
        block_size=cfg["block_size"],
        params=model.get_num_params(),
        seconds=(read_json(d / "sweep.json") or {}).get("seconds", 0.0),
        eval_seconds=time.time() - t0,
    )
    write_atomic(cache, json.dumps(score.to_json(), indent=1))
    return score


def evaluate_all(
    dirs: list[Path], lengths: list[int] | None, trials: int, jobs: int
) -> list[TaskScore]:
    """Score the runs, jobs side by side, each on its share of the cores. Ctrl-C reaches the sweep
    alone, which lets the evaluations in progress end (each a few seconds) and drops the rest: the
    next run evaluates them."""
    threads = max(1, (os.cpu_count() or 1) // jobs)
    # workers from a fork server, not forked from this process: a fork after torch has run its
    # thread pool here (a caller that evaluated something first, a test) can deadlock the child in
    # OpenMP
    fresh = multiprocessing.get_context("forkserver")
    fresh.set_forkserver_preload(["torch", "synthetic"])
    out = []
    with ProcessPoolExecutor(
        jobs, fresh, initializer=evaluation_worker, initargs=(threads,)
    ) as pool:
        futures = [pool.submit(evaluate_synthetic, d, lengths, trials) for d in dirs]
        try:
            for i, (d, future) in enumerate(zip(dirs, futures, strict=True)):
                try:
                    out.append(future.result())
                except (CheckpointError, synthetic_tasks.SyntheticError) as err:
                    pool.shutdown(cancel_futures=True)
                    sys.exit(f"[sweep] {err}")
                print(
                    f"[sweep] evaluated {d.parent.name}/{d.name} ({i + 1}/{len(dirs)})", flush=True
                )
        except KeyboardInterrupt:
            print("\n[sweep] interrupted: finishing the evaluations in progress ...", flush=True)
            pool.shutdown(cancel_futures=True)
            raise
    return out


def evaluation_worker(threads: int) -> None:
    """A process of the evaluation pool: its share of the cores, and deaf to Ctrl-C (the sweep
    answers it)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(threads)


def synthetic_suite(args, argv: list[str], out_dir: Path) -> None:
    """Train every encoding on each task and seed (resuming, skipping finished runs), score,
    report."""
    t0 = time.time()
    # a seed at a time, so that an interrupted suite has whole seeds to report
    runs = [
        (t, e, s, out_dir / t / f"{e}-seed{s}")
        for s in args.seeds
        for t in args.synthetic
        for e in args.encodings
    ]
    train_all(
        [
            (d, cmd)
            for t, e, s, d in runs
            if (cmd := train_command(e, s, d, args, [f"config/{t}.py"]))
        ],
        args.jobs,
    )
    scores = evaluate_all([d for *_, d in runs], args.lengths, args.task_trials, args.jobs)
    cells: dict[str, dict[str, Cell]] = {}
    for (t, e, _, _), score in zip(runs, scores, strict=True):
        cells.setdefault(t, {}).setdefault(e, Cell(e, [])).scores.append(score)
    cells_by_task = {t: list(by_enc.values()) for t, by_enc in cells.items()}
    print(
        "[sweep] report: "
        f"{synthetic_report(out_dir, cells_by_task, argv, time.time() - t0, args.task_trials)}"
    )


# --------------------------------------------------------------------------------------------------
# The recipe study (--recipes): every encoding with its best recipe of a small grid, chosen on the
# selection seeds, reported on fresh seeds

# every recipe's budget: mqar's seeds learned at 1,000 to 2,500 steps, offset's slowest at ~2,700
RECIPE_STEPS = 3000
RATES = {"3e-3": 3e-3, "1e-3": 1e-3}  # the learning rates (min_lr a tenth), the suite's own first
CURRICULA = {  # the task's curriculum, (train.py option, on, off): on is the task config's
    "passkey": ("task_mix", 0.25, 0),
    "mqar": ("task_prev_tokens", True, False),
    "offset": ("task_mix", 0.25, 0),
}


def recipes(task: str) -> dict[str, list[str]]:
    """{name: train.py options} of the task's grid, in the order a tie is broken in: the suite's
    recipe (curriculum on, 3e-3) first, then the curriculum off at that rate, then both at the next
    rate."""
    out = {}
    curricula = (
        [(1, CURRICULA[task][1]), (0, CURRICULA[task][2])] if task in CURRICULA else [(None, None)]
    )
    for rate_name, rate in RATES.items():
        for on, value in curricula:
            name = (f"cur{on}-" if on is not None else "") + f"lr{rate_name}"
            options = [f"--{CURRICULA[task][0]}={value}"] if on is not None else []
            options += [f"--learning_rate={rate}", f"--min_lr={rate / 10:g}"]
            out[name] = options + [
                f"--max_iters={RECIPE_STEPS}",
                f"--lr_decay_iters={RECIPE_STEPS}",
            ]
    return out


def recipe_varies(task: str) -> set[str]:
    """The train.py options the task's recipes differ in."""
    values = [dict(opt[2:].split("=", 1) for opt in options) for options in recipes(task).values()]
    return {k for k in values[0] if len({v.get(k) for v in values}) > 1}


def trained_options(d: Path, options: list[str]) -> list[str]:
    """options (train.py's --key=value) as the run in d was trained with them: its checkpoint's
    values."""
    cfg = finished_checkpoint(d)["config"]
    keys = [opt[2:].split("=", 1)[0] for opt in options]
    return [f"--{k}={cfg[k]}" for k in keys]


def choose(grid: dict[str, list[float]], order: list[str]) -> str:
    """The recipe with the highest mean final validation accuracy; within 1 point, the earlier in
    order."""
    mean = {r: statistics.mean(grid[r]) for r in order}
    best = max(mean.values())
    return next(r for r in order if mean[r] >= best - 0.01)


def recipe_study(args, argv: list[str], out_dir: Path) -> None:
    """Train the grid on the selection seeds, choose each encoding's recipe per task, train the
    chosen recipes on the fresh seeds (resuming, skipping finished runs, as everywhere), score
    those, report."""
    t0 = time.time()
    grid_runs = [
        (t, r, e, s, out_dir / "grid" / r / t / f"{e}-seed{s}")
        for t in args.synthetic
        for r in recipes(t)
        for e in args.encodings
        for s in args.selection_seeds
    ]
    jobs = [
        (d, cmd)
        for t, r, e, s, d in grid_runs
        if (cmd := train_command(e, s, d, args, [f"config/{t}.py"], recipes(t)[r]))
    ]
    train_all(jobs, args.jobs)
    grid: dict = {}
    grid_seconds = 0.0
    for t, r, e, _, d in grid_runs:
        history = finished_checkpoint(d).get("history") or [{"acc": 0.0}]
        grid.setdefault(t, {}).setdefault(e, {}).setdefault(r, []).append(
            history[-1].get("acc", 0.0)
        )
        grid_seconds += (read_json(d / "sweep.json") or {}).get("seconds", 0.0)
    chosen = {
        t: {e: choose(rs, list(recipes(t))) for e, rs in by_enc.items()}
        for t, by_enc in grid.items()
    }
    for t, by_enc in chosen.items():
        print(f"[sweep] {t}: " + ", ".join(f"{e} {r}" for e, r in by_enc.items()), flush=True)
    final = [
        (t, e, s, out_dir / "final" / chosen[t][e] / t / f"{e}-seed{s}")
        for s in args.seeds  # a seed at a time, so that an interrupted study has whole seeds
        for t in args.synthetic
        for e in args.encodings
    ]
    jobs = [
        (d, cmd)
        for t, e, s, d in final
        if (cmd := train_command(e, s, d, args, [f"config/{t}.py"], recipes(t)[chosen[t][e]]))
    ]
    train_all(jobs, args.jobs)
    scores = evaluate_all([d for *_, d in final], args.lengths, args.task_trials, args.jobs)
    cells: dict[str, dict[str, Cell]] = {}
    for (t, e, _, _), score in zip(final, scores, strict=True):
        cells.setdefault(t, {}).setdefault(e, Cell(e, [], chosen[t][e])).scores.append(score)
    study = Study(
        grid=grid,
        recipes={t: list(recipes(t)) for t in args.synthetic},
        chosen=chosen,
        cells={t: list(by_enc.values()) for t, by_enc in cells.items()},
        selection_seeds=args.selection_seeds,
        grid_seconds=grid_seconds,
        options={  # as the grid's runs trained: --train may have changed their budget
            t: {r: trained_options(d, recipes(t)[r]) for tt, r, _, _, d in grid_runs if tt == t}
            for t in args.synthetic
        },
    )
    print(
        f"[sweep] report: {recipe_report(out_dir, study, argv, time.time() - t0, args.task_trials)}"
    )


# --------------------------------------------------------------------------------------------------
# The text sweep


def text_sweep(args, argv: list[str], out_dir: Path) -> None:
    """Train every encoding and seed at the size's settings, evaluate them (eval_length, and
    compare/tasks.py's tasks for runs trained with them), report; a sweep with nothing new keeps the
    report it wrote."""
    size = SIZES[args.size]
    plan = [
        (
            enc,
            packing,
            seed,
            run_dir(out_dir, enc if packing == "stream" else f"{enc}-{packing}", seed),
        )
        for seed in args.seeds
        for enc in args.encodings
        for packing in args.packing
    ]
    documents = "documents" in args.packing and not any(
        a.startswith("--dataset=") for a in args.train
    )
    # one dataset for both packings
    data = ["--dataset=shakespeare_char_scenes"] if documents else []
    jobs = [
        (d, cmd)
        for enc, packing, seed, d in plan
        if (
            cmd := train_command(
                enc, seed, d, args, size["train"], extra=[*data, f"--packing={packing}"]
            )
        )
    ]
    train_all(jobs, args.jobs)
    runs = [text_run(packed_name(enc, packing), seed, d) for enc, packing, seed, d in plan]
    write_atomic(out_dir / "runs.json", json.dumps([asdict(r) for r in runs], indent=1))
    lengths = args.lengths or size["lengths"]
    evaluation = {
        "lengths": lengths,
        "eval_tokens": args.eval_tokens or size["eval_tokens"],
        "out_json": str(out_dir / "eval.json"),
        "plot": "",  # the report draws its own
        "rope_scaling": args.rope_scaling
        if any(POS_ENCODINGS[r.enc].rope_scalable for r in runs)
        else [],
    }
    if "documents" in args.packing:  # a run with document packing beside its encoding's stream run
        evaluation["names"] = [r.enc for r in runs]
    if args.wandb_log:
        evaluation |= {"wandb_log": True, "wandb_run_name": f"sweep-{args.size}-eval"}
    # what the report is made of: the evaluation's settings and every checkpoint as it is on disk. A
    # sweep run again with nothing new (every run finished, the same settings) keeps its report
    # instead of evaluating again, if the report is still the one they made: not one that the
    # synthetic suite (or anything else) wrote over it since
    inputs = {"eval": evaluation, "tasks": [args.task_trials, args.task_depths]}
    inputs["runs"] = [[r.dir, *stamp(latest(r.dir))] for r in runs]
    inputs_path = out_dir / "report_inputs.json"
    report_path = out_dir / "report.md"
    if not args.wandb_log and report_path.exists() and inputs_path.exists():
        if read_json(inputs_path) == inputs | {"report": stamp(report_path)}:
            print(
                f"[sweep] report: {report_path} (up to date: no run or setting changed since it "
                "was written)"
            )
            return
    report = eval_length.evaluate_runs([r.dir for r in runs], **evaluation)
    # every run again, inside the documents: what packing changes there
    if "documents" in args.packing:
        inside = evaluation | {
            "packing": "documents",
            "out_json": str(out_dir / "eval-documents.json"),
        }
        if args.wandb_log:
            inside["wandb_run_name"] = f"sweep-{args.size}-eval-documents"
        report["inside_documents"] = eval_length.evaluate_runs([r.dir for r in runs], **inside)
    if any(r.task_fraction > 0 for r in runs):
        report["tasks"] = evaluate_tasks(runs, lengths, args)
        write_atomic(out_dir / "tasks.json", json.dumps(report["tasks"], indent=1))
    path = text_report(out_dir, report, runs, argv)
    write_atomic(inputs_path, json.dumps(inputs | {"report": stamp(path)}))
    print(f"[sweep] report: {path}")


def packed_name(enc: str, packing: str) -> str:
    """A text run's label in the report: its encoding, and "documents" where it packs documents
    apart."""
    return enc if packing == "stream" else f"{enc} {packing}"


def text_run(enc: str, seed: int, d: Path) -> TextRun:
    ckpt = finished_checkpoint(d)
    timing = read_json(d / "sweep.json") or {}
    cfg = ckpt.get("config", {})
    return TextRun(
        enc=enc,
        seed=seed,
        dir=str(d),
        val=ckpt["best_val_loss"],
        params=model_from_checkpoint(ckpt).get_num_params(),
        seconds=timing.get("seconds", 0.0),
        parallel=timing.get("parallel", 1),
        tokens=ckpt.get("iter_num", 0)
        * cfg.get("batch_size", 0)
        * cfg.get("block_size", 0)
        * cfg.get("gradient_accumulation_steps", 1),
        task_fraction=cfg.get("task_fraction", 0.0),
    )


# --------------------------------------------------------------------------------------------------
# Extension (--extend): the text sweep's runs (and a synthetic task's) fine-tuned at --factor times
# their training length for --steps, RoPE with each scaling, then evaluated to 4·factor times the
# original length against the same runs (and scalings) without fine-tuning

EXTEND_ENCODINGS = ("rope", "alibi", "kerple", "t5", "bias_rpe", "learned")
# RoPE's, each fine-tuned with and applied without; "none" is fine-tuned
EXTEND_SCALINGS = ("linear", "ntk", "yarn")
# the fine-tunes' peak rate, min_lr a tenth: a third of the sources' (PI and YaRN: ~1/15 LLaMA's)
EXTEND_RATE = 3e-4


def finetune_options(source: Path, trained: dict, scaling: str, args) -> list[str]:
    """train.py's options that make a run the extension of source (trained: its config) at factor
    times its length: a fresh schedule over --steps (warmup a tenth, six evaluations for the
    steps-to-a-loss curve, each on as many tokens as the source's, so factor times fewer batches),
    and RoPE's scaling with s = factor from L0 = its block_size (train.py's defaults, written
    out)."""
    n = args.steps
    F = args.factor
    block = trained["block_size"]
    opts = [
        f"--init_from={source}",
        f"--block_size={F * block}",
        f"--max_iters={n}",
        f"--lr_decay_iters={n}",
    ]
    opts += [f"--warmup_iters={max(1, n // 10)}", f"--eval_interval={max(1, n // 6)}"]
    if "eval_iters" in trained:  # a checkpoint of this project's records it
        opts += [f"--eval_iters={max(1, trained['eval_iters'] // F)}"]
    opts += [f"--learning_rate={EXTEND_RATE}", f"--min_lr={EXTEND_RATE / 10:g}"]
    if scaling != "none":
        opts += [
            f"--rope_scaling={scaling}",
            f"--rope_factor={F}",
            f"--rope_original_max_len={block}",
        ]
    # factor times the context: each block's attention recomputed, not kept (the same numbers)
    if args.size == "gpu":
        opts += ["--activation_checkpointing=selective"]
    return opts


def cached_json(path: Path, key, compute):
    """compute()'s result, kept in path under key (its inputs: the checkpoints' stamps, the
    settings): computed again only when they change. As JSON reads it back either way (a length as a
    key is a string)."""
    if (old := read_json(path)) and old.get("key") == key:
        return old["value"]
    value = json.loads(json.dumps(compute()))
    write_atomic(path, json.dumps({"key": key, "value": value}, indent=1))
    return value


def extension_task_scores(
    runs: list[Extension], lengths: list[int], scalings: list[str], factor: int, trials: int
):
    """{"scores": {run: {variant: {length: token accuracy or None}}}, "seconds"}: each source read
    as trained ("none") and, for RoPE, with each scaling at s = factor, and each fine-tuned run as
    saved ("fine-tuned"); the same sequences for every run."""
    out: dict = {}
    t0 = time.time()
    for r in runs:
        source = finished_checkpoint(Path(r.source))
        cfg = source["config"]
        model = model_from_checkpoint(source).eval()
        for scaling in (
            ["none", *(scalings if model.encoding.rope_scalable else [])]
            if r.scaling == "none"
            else []
        ):
            if scaling != "none":
                model.set_rope_scaling(scaling, float(factor))
            acc = synthetic.evaluate_checkpoint(model, cfg, lengths, trials)
            out.setdefault(r.source, {})[scaling] = {L: a and a["token"] for L, a in acc.items()}
        ckpt = finished_checkpoint(Path(r.dir))
        acc = synthetic.evaluate_checkpoint(
            model_from_checkpoint(ckpt).eval(), ckpt["config"], lengths, trials
        )
        out.setdefault(r.dir, {})["fine-tuned"] = {L: a and a["token"] for L, a in acc.items()}
    return {"scores": out, "seconds": time.time() - t0}


def extend_study(args, argv: list[str], out_dir: Path) -> None:
    """Train the sources that are missing (the text sweep's and the synthetic suite's own commands,
    into their folders), fine-tune each at factor times its length (resuming, skipping finished
    runs), evaluate (cached while no checkpoint changes), report."""
    t0 = time.time()
    size = SIZES[args.size]
    F = args.factor
    text_dir = Path(args.sources or f"sweep-{args.size}")
    task_dir = Path(args.task_sources or "sweep-synthetic")
    task_args = argparse.Namespace(**(vars(args) | {"train": []}))  # --train is the text runs'
    kinds = ["text"] + ([args.extend_task] if args.extend_task != "none" else [])
    plan = []  # (kind, enc, scaling, seed, source, fine-tuned run)
    for kind in kinds:
        for seed in args.seeds if kind == "text" else args.task_seeds:
            for enc in args.encodings:
                src = (
                    run_dir(text_dir, enc, seed)
                    if kind == "text"
                    else task_dir / kind / f"{enc}-seed{seed}"
                )
                where = out_dir if kind == "text" else out_dir / kind
                for scaling in (
                    ["none", *args.rope_scaling] if POS_ENCODINGS[enc].rope_scalable else ["none"]
                ):
                    name = (
                        enc
                        if scaling == "none" and not POS_ENCODINGS[enc].rope_scalable
                        else f"{enc}-{scaling}"
                    )
                    plan.append((kind, enc, scaling, seed, src, where / f"{name}-seed{seed}"))

    def source_command(kind, enc, seed, src):
        if kind == "text":
            return train_command(enc, seed, src, args, size["train"])
        return train_command(enc, seed, src, task_args, [f"config/{kind}.py"])

    sources = list(dict.fromkeys((kind, enc, seed, src) for kind, enc, _, seed, src, _ in plan))
    jobs = [
        (src, cmd)
        for kind, enc, seed, src in sources
        if (cmd := source_command(kind, enc, seed, src))
    ]
    train_all(jobs, args.jobs)
    jobs = []
    for kind, enc, scaling, seed, src, d in plan:
        configs = size["train"] if kind == "text" else [f"config/{kind}.py"]
        last = finetune_options(src, finished_checkpoint(src)["config"], scaling, args)
        if cmd := train_command(
            enc, seed, d, args if kind == "text" else task_args, configs, last=last
        ):
            jobs.append((d, cmd))
    train_all(jobs, args.jobs)
    # trained: each fine-tune's options, which the report's labels are read from
    runs = []
    trained = []
    for kind, enc, _, seed, src, d in plan:
        ckpt = finished_checkpoint(d)
        source = finished_checkpoint(src)
        seconds = (read_json(d / "sweep.json") or {}).get("seconds", 0.0)
        scaling = ckpt["config"].get("rope_scaling", "none")
        runs.append(
            Extension(
                kind,
                enc,
                scaling,
                seed,
                str(src),
                str(d),
                source["best_val_loss"],
                ckpt["history"],
                seconds,
            )
        )
        trained.append((ckpt["config"], source["config"]))
    source_seconds = sum(
        (read_json(src / "sweep.json") or {}).get("seconds", 0.0) for *_, src in sources
    )

    text = [r for r in runs if r.kind == "text"]
    L0 = sorted(
        {src["block_size"] for (_, src), r in zip(trained, runs, strict=True) if r.kind == "text"}
    )
    factors = sorted({c["block_size"] / src["block_size"] for c, src in trained})
    steps = sorted({c["max_iters"] for c, _ in trained})
    for what, found in (("lengths", L0), ("factors", factors), ("numbers of steps", steps)):
        if len(found) > 1:
            sys.exit(
                f"[sweep] the runs were trained at different {what} ({found}): one report "
                "cannot compare them"
            )
    L0 = L0[0]
    F = int(factors[0])
    steps = steps[0]
    # --factor 1: 1x once
    lengths = args.lengths or list(dict.fromkeys(L0 * k for k in (1, F, 2 * F, 4 * F)))
    evaluation = dict(
        lengths=lengths, modes=["sliding"], eval_tokens=args.eval_tokens or size["eval_tokens"]
    )
    evaluation |= dict(out_json="", plot="")
    stamps = [[r.dir, *stamp(latest(r.dir)), r.source, *stamp(latest(r.source))] for r in runs]
    key = {"evaluation": evaluation, "scalings": args.rope_scaling, "factor": F, "runs": stamps}
    sources_once = list(dict.fromkeys(r.source for r in text))
    # a scaling is read by RoPE's sources alone
    scaled = any(POS_ENCODINGS[e].rope_scalable for e in args.encodings)
    report = cached_json(
        out_dir / "eval.json",
        key,
        lambda: {
            "sources": eval_length.evaluate_runs(
                sources_once,
                names=[Path(s).name.rsplit("-seed", 1)[0] for s in sources_once],
                **(
                    dict(rope_scaling=list(args.rope_scaling), rope_factor=float(F))
                    if scaled
                    else {}
                ),
                **evaluation,
            ),
            "fine-tuned": eval_length.evaluate_runs(
                [r.dir for r in text], names=[extension_name(r) for r in text], **evaluation
            ),
        },
    )
    tasks = {}
    if len(kinds) > 1:
        task_runs = [r for r in runs if r.kind != "text"]
        cfg = finished_checkpoint(Path(task_runs[0].source))["config"]
        task_lengths = list(dict.fromkeys(cfg["block_size"] * k for k in (1, F, 2 * F, 4 * F)))
        task_key = key | {
            "lengths": task_lengths,
            "trials": args.task_trials,
            "version": SYNTHETIC_VERSION,
        }
        scores = cached_json(
            out_dir / kinds[1] / "scores.json",
            task_key,
            lambda: extension_task_scores(
                task_runs, task_lengths, list(args.rope_scaling), F, args.task_trials
            ),
        )
        options = {
            "vocab": cfg["task_vocab"],
            **synthetic_tasks.task_options(cfg),
        }  # the generator's: the floor reads them
        tasks = {
            "task": kinds[1],
            "lengths": task_lengths,
            "trials": args.task_trials,
            "options": options,
        } | scores
    evaluated = (
        report["sources"]["seconds"] + report["fine-tuned"]["seconds"] + tasks.get("seconds", 0.0)
    )
    seconds = {"sources": source_seconds, "evaluation": evaluated, "wall": time.time() - t0}
    path = extend_report(out_dir, runs, report, tasks, F, steps, L0, seconds, argv)
    print(f"[sweep] report: {path}")


# --------------------------------------------------------------------------------------------------
# The command line


def main(argv: list[str]) -> None:
    """The command: Ctrl-C stops it with one line (the runs in progress save their checkpoints),
    never a traceback."""
    try:
        _main(argv)
    except KeyboardInterrupt:
        sys.exit(
            "[sweep] interrupted; run the same command again to resume (finished runs are kept)"
        )


# train.py options that say what a study compares, which each run's config sets
# (config/<encoding>.py, and a synthetic run's config/<task>.py) or the sweep (--packing): given to
# every run by --train, they would train other runs than the folders and the report name (a passkey
# run filed as needle)
COMPARED = {
    "pos_encoding": "the encodings (--encodings)",
    "task": "the tasks (--synthetic; a text study: none)",
    "packing": "the packings (--packing)",
}


def check_train_options(p: argparse.ArgumentParser, options: list[str]) -> None:
    """--train's options go to every run; one the sweep sets per run itself would make the runs
    copies of each other (every seed trained with one --seed), and one that says what the study
    compares would train other runs than it files and reports."""
    for opt in options:
        key = opt[2:].split("=", 1)[0] if opt.startswith("--") else None
        if key in SET_BY_SWEEP:
            p.error(
                f"--train {opt}: the sweep sets {key} for each run itself (--seeds, --out_dir, "
                "--wandb_log); drop it "
                "from the options after --train"
            )
        if key in COMPARED:
            p.error(
                f"--train {opt}: each run's config sets {key}, which the study compares "
                f"({COMPARED[key]}); drop it "
                "from the options after --train"
            )


def _main(argv: list[str]) -> None:
    args, out_dir = parse_args(argv)
    if args.extend:
        extend_study(args, argv, out_dir)
    elif args.recipes:
        recipe_study(args, argv, out_dir)
    elif args.synthetic is not None:
        synthetic_suite(args, argv, out_dir)
    else:
        text_sweep(args, argv, out_dir)


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, Path]:
    """The options, checked (a bad one is a one-line error before any work), and the output
    folder."""
    p = argparse.ArgumentParser(
        prog="python -m compare.sweep",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    p.add_argument(
        "--size", choices=SIZES, default=None, help="default: gpu where there is one, else cpu"
    )
    p.add_argument(
        "--encodings",
        nargs="+",
        default=None,
        choices=list(POS_ENCODINGS),
        help="default: all; --extend: " + " ".join(EXTEND_ENCODINGS),
    )
    p.add_argument("--seeds", type=int, nargs="+", default=[1337])
    p.add_argument(
        "--packing",
        nargs="+",
        default=None,
        choices=list(PACKINGS),
        help="text sweep: each encoding with each packing (train.py's --packing; default stream "
        "alone)",
    )
    p.add_argument(
        "--lengths",
        type=int,
        nargs="+",
        default=None,
        help="evaluation lengths (default: per size; synthetic: 1, 2, 4 and 8 times the training "
        "length, and the "
        "report labels each length with its multiple of that, 100 (1.56×))",
    )
    p.add_argument(
        "--rope_scaling",
        nargs="*",
        default=None,
        choices=[s for s in ROPE_SCALINGS if s != "none"],
        help="extra RoPE rows (eval_length; default: yarn dynamic_ntk); --extend: RoPE's "
        "fine-tunes besides none, "
        "and the same scalings without fine-tuning (default: " + " ".join(EXTEND_SCALINGS) + ")",
    )
    p.add_argument("--out_dir", default=None, help="default: sweep-<size>, or sweep-synthetic")
    p.add_argument(
        "--eval_tokens",
        type=int,
        default=None,
        help="validation tokens per length (default: per size)",
    )
    p.add_argument("--wandb_log", action="store_true")
    p.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="training runs side by side (they share the CPU cores or GPU)",
    )
    p.add_argument(
        "--task_trials",
        type=int,
        default=None,
        help="sequences per length (and depth): default 5, synthetic 400",
    )
    p.add_argument(
        "--task_depths",
        type=int,
        default=None,
        help="passkey depths, evenly spaced in [0, 1] (default 10)",
    )
    p.add_argument(
        "--synthetic",
        nargs="*",
        default=None,
        choices=list(synthetic_tasks.SYNTHETIC_TASKS),
        help="run the synthetic suite: these tasks (none named: "
        + ", ".join(synthetic.SUITE)
        + "), config/<task>.py each; --size, --rope_scaling, --eval_tokens and --task_depths are "
        "the text sweep's",
    )
    p.add_argument(
        "--recipes",
        action="store_true",
        help="with --synthetic: each encoding's best recipe of the grid (recipes()), chosen on "
        "--selection_seeds, "
        "reported on --seeds",
    )
    p.add_argument(
        "--selection_seeds",
        type=int,
        nargs="+",
        default=None,
        help="--recipes: the seeds the grid is trained on (2001)",
    )
    p.add_argument(
        "--extend",
        action="store_true",
        help="the extension study: the text sweep's runs (--sources) and a synthetic task's "
        "(--task_sources), each "
        "fine-tuned at --factor times its training length for --steps, evaluated to 4·factor times "
        "it against "
        "themselves",
    )
    p.add_argument(
        "--factor",
        type=int,
        default=None,
        help="--extend: fine-tune at this many training lengths (4)",
    )
    p.add_argument(
        "--steps", type=int, default=None, help="--extend: each fine-tune's iterations (150)"
    )
    p.add_argument(
        "--sources", default=None, help="--extend: the text runs' folder (default: sweep-<size>)"
    )
    p.add_argument(
        "--task_sources",
        default=None,
        help="--extend: the task runs' folder (default: sweep-synthetic)",
    )
    p.add_argument(
        "--extend_task",
        default=None,
        choices=[*synthetic_tasks.SYNTHETIC_TASKS, "none"],
        help="--extend: the synthetic task fine-tuned and scored after extension (passkey)",
    )
    p.add_argument(
        "--task_seeds",
        type=int,
        nargs="+",
        default=None,
        help="--extend: the seeds of --extend_task's runs (default: --seeds; fewer make the study "
        "cheaper)",
    )
    p.add_argument(
        "--train", nargs=argparse.REMAINDER, default=[], help="train.py options for every run"
    )
    # everything after --train is train.py's, split off before parsing: argparse would read an
    # option there as an abbreviation of the sweep's own (--task=needle as --task_trials)
    cut = argv.index("--train") if "--train" in argv else len(argv)
    args = p.parse_args(argv[:cut])
    args.train = argv[cut + 1 :]
    scalings_given = args.rope_scaling
    if args.extend:  # options the extension study, as asked, never reads
        idle = {"task_depths": "it scores no passkey depths (the text sweep's)"}
        if args.extend_task == "none":
            idle |= dict.fromkeys(
                ("task_seeds", "task_sources", "task_trials"), "--extend_task none extends no task"
            )
        for name, why in idle.items():
            if getattr(args, name) is not None:
                p.error(f"--{name}: {why}; drop it")
    extend_only = {
        "factor": 4,
        "steps": 150,
        "sources": None,
        "task_sources": None,
        "extend_task": "passkey",
    }
    extend_only |= {"task_seeds": args.seeds}
    for name, default in extend_only.items():
        if not args.extend and getattr(args, name) is not None:
            p.error(
                f"--{name}: only the extension study (--extend) has it; drop it or add --extend"
            )
        if getattr(args, name) is None:
            setattr(args, name, default)
    if args.extend and (args.synthetic is not None or args.recipes):
        p.error(
            "--extend is a study of its own: drop --synthetic and --recipes (its task is "
            "--extend_task)"
        )
    if args.extend and args.rope_scaling is None:
        args.rope_scaling = list(EXTEND_SCALINGS)
    args.encodings = args.encodings or list(EXTEND_ENCODINGS if args.extend else POS_ENCODINGS)
    # as train.py says it
    if scalings_given and not any(POS_ENCODINGS[e].rope_scalable for e in args.encodings):
        from lib.options import idle_option

        p.error(
            "--rope_scaling: "
            f"{idle_option(args.encodings[0], 'rope_scaling', scalings_given[0], {})}"
        )
    if args.synthetic is not None:
        args.synthetic = args.synthetic or list(synthetic.SUITE)
    # the text sweep's options: None unless given, so that the synthetic suite, which has no use for
    # them (its model and sequences are its own), refuses them instead of ignoring them; then their
    # defaults
    text_only = {
        "size": "gpu" if torch.cuda.is_available() else "cpu",
        "rope_scaling": ["yarn", "dynamic_ntk"],
    }
    text_only |= {"eval_tokens": None, "task_depths": 10, "packing": ["stream"]}
    if args.extend and args.packing is not None:
        p.error(
            "--packing: only the text sweep trains both packings; drop it (an extension keeps "
            "its source's)"
        )
    tasks_asked = [a for a in args.train if a.startswith(("--task=", "--task_fraction="))]
    if args.packing and "documents" in args.packing and tasks_asked:
        p.error(
            f"--packing documents with --train {tasks_asked[0]}: a task's row is one "
            "sequence; drop one"
        )
    for name, default in text_only.items():
        if args.synthetic is not None and getattr(args, name) is not None:
            p.error(
                f"--{name}: the synthetic suite does not use it (only the text sweep does); drop it"
            )
        if getattr(args, name) is None:
            setattr(args, name, default)
    if args.recipes and args.synthetic is None:
        p.error(
            "--recipes: the recipe study is the synthetic suite's; add --synthetic and its tasks"
        )
    if args.selection_seeds is not None and not args.recipes:
        p.error(
            "--selection_seeds: only the recipe study (--recipes) has them; drop it or add "
            "--recipes"
        )
    args.selection_seeds = args.selection_seeds or [2001]
    if shared := sorted(set(args.selection_seeds) & set(args.seeds)):
        # a recipe chosen on a seed cannot be reported on it: the choice would flatter it
        if args.recipes:
            p.error(
                f"--seeds and --selection_seeds share {shared}: the reported seeds must be "
                "fresh; choose others"
            )
    # a name twice would train one run twice (side by side, into one folder) and count it twice in
    # the report
    for name in (
        "encodings",
        "seeds",
        "synthetic",
        "lengths",
        "rope_scaling",
        "selection_seeds",
        "task_seeds",
        "packing",
    ):
        xs = getattr(args, name) or []
        if len(set(xs)) != len(xs):
            p.error(f"--{name} {' '.join(map(str, xs))}: each may appear once")
    if min(every := args.seeds + args.selection_seeds + args.task_seeds) < 0:
        p.error(f"--seeds: seeds must be >= 0, not {min(every)}")
    for name, least in (
        ("jobs", 1),
        ("task_trials", 1),
        ("eval_tokens", 1),
        ("task_depths", 2),
        ("factor", 1),
    ):
        if (x := getattr(args, name)) is not None and x < least:
            p.error(f"--{name}={x}: must be at least {least}")
    if args.steps < 1:
        p.error(f"--steps={args.steps}: must be at least 1")
    if args.lengths and min(args.lengths) < 2:
        p.error(f"--lengths: every length must be >= 2, not {min(args.lengths)}")
    check_train_options(p, args.train)
    given = [a.split("=", 1)[1] for a in args.train if a.startswith("--dataset=")]
    # a dataset prepared already: read before any run
    meta = dataset_dir(given[-1]) / "meta.json" if given else None
    if args.packing and "documents" in args.packing and meta and meta.is_file():
        if "eot" not in json.loads(meta.read_text()):
            p.error(no_documents({"dataset": given[-1]}))
    # an option the recipes differ in, given to every run, would make the grid compare nothing
    if args.recipes:
        varied = {k for t in args.synthetic for k in recipe_varies(t)}
        for opt in args.train:
            if (key := opt[2:].split("=", 1)[0]) in varied:
                p.error(
                    f"--train {opt}: the recipes differ in {key} (the grid compares them); "
                    "drop it from --train"
                )
    if args.extend and "dynamic_ntk" in args.rope_scaling:
        p.error(
            "--rope_scaling dynamic_ntk: the extension study compares scalings at a fixed s = "
            "--factor, and dynamic "
            "NTK scales with the length by itself (s = factor on top would square it); leave it out"
        )
    default = (
        "sweep-extend"
        if args.extend
        else "sweep-synthetic"
        if args.synthetic is not None
        else f"sweep-{args.size}"
    )
    out_dir = Path(args.out_dir or default)
    if out_dir.exists() and not out_dir.is_dir():
        p.error(
            f"--out_dir={out_dir} is a file, not a folder; choose a folder for the runs and "
            "the report"
        )
    if args.extend and out_dir.resolve() in (
        Path(args.sources or f"sweep-{args.size}").resolve(),
        Path(args.task_sources or "sweep-synthetic").resolve(),
    ):
        p.error(
            f"--out_dir={out_dir}: the extension runs need a folder of their own, not their "
            "sources'"
        )
    if problem := cannot_write(out_dir, create=True):
        p.error(f"--out_dir={out_dir}: cannot write there ({problem}); choose another folder")
    args.task_trials = args.task_trials or (400 if args.synthetic is not None or args.extend else 5)
    return args, out_dir


if __name__ == "__main__":
    main(sys.argv[1:])
