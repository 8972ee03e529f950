"""
Train short, test long: validation loss and perplexity of checkpoints at several context lengths.

    python -m compare.eval_length out-rope out-alibi out-sinusoidal --lengths 256 512 1024 2048
    python -m compare.eval_length out-* --lengths 64 128 256 512 1024 --rope_scaling yarn ntk \
        --plot length.png
    python -m compare.eval_length out-* --wandb_log

Two ways, as in the ALiBi paper (Press et al. 2021, §4): `nonoverlapping` cuts the validation text
into windows of L tokens and scores every token (early tokens of each window see little context);
`sliding` moves a window of L tokens by `stride` and scores only the last `stride` tokens of each,
so every scored token has at least L - stride tokens of context (the first L - stride tokens of the
text, which cannot have that much, are not scored). Every length scores (nearly) the same stretch of
text, the first --eval_tokens validation tokens. Also the loss at each position of the window (the
non-overlapping windows), where an encoding breaks.

`learned` has no position past its block size: n/a there. --rope_scaling adds rows for RoPE
checkpoints evaluated with a scaling, by default with the factor s matched to each length (s = L /
training length, as YaRN is meant to be used: at the training length and below, no scaling), or one
fixed --rope_factor for every length. dynamic_ntk takes s = 1 by default: it scales with the length
by itself (its NTK ratio s·L/L0 - (s-1) is L/L0). Writes a markdown table (stdout and --out_md), the
numbers (--out_json) and a plot (--plot).
"""

import argparse
import json
import math
import sys
import time
from pathlib import Path

if not __package__:  # run by its path, where the project's modules are not importable
    sys.exit("run it from the repository's root as: python -m compare.eval_length")

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from lib.checkpoint import CheckpointError, model_from_checkpoint
from lib.configurator import ConfigError
from lib.datafiles import DataError, dataset_dir, load_meta, validation_tokens
from lib.devices import DTYPES, autocast, check_device, device_memory, forward_bytes, gb, missing
from lib.options import idle_option
from lib.outputs import PLOT_FORMATS, OutputError, check_output, save_figure, write_atomic
from lib.runs import add_run_folders, load_run
from model import GPT, ROPE_SCALINGS
from shape import PACKINGS

MODES = ("nonoverlapping", "sliding")


def windows(n_tokens: int, L: int, mode: str, stride: int) -> list[tuple[int, int]]:
    """(start, first scored offset) of each window of L tokens over n_tokens + 1 tokens (inputs and
    targets). nonoverlapping scores every target of each window; sliding only the last `stride` ones
    of each, a contiguous stretch from target L - stride on, each scored once with at least L -
    stride tokens of context."""
    step, first = (L, 0) if mode == "nonoverlapping" else (stride, L - stride)
    return [(s, first) for s in range(0, n_tokens - L + 1, step)]


def sliding_stride(L: int, stride: int | None) -> int:
    """--stride, or by default a quarter of the length."""
    return stride or max(1, L // 4)


def rope_factor(
    model: GPT, scaling: str, L: int, train_len: int, factor: float | None = None
) -> float:
    """The factor s a RoPE scaling gets at evaluation length L: a fixed factor if given, else the
    encoding's default (L / train_len; 1 for dynamic_ntk, which scales with L itself)."""
    return factor or model.encoding.default_factor(scaling, L, train_len)


def window_batch(model: GPT, L: int, budget_bytes: float) -> int:
    """Windows per forward that fit in budget_bytes: logits (fp32, with the loss's copy),
    activations, and the (nh, L, L) attention bias or mask that the reference attention path
    materializes."""
    c = model.config
    per_window = L * (8 * c.vocab_size + 64 * c.n_embd * c.n_layer) + 8 * c.n_head * L * L
    return max(1, int(budget_bytes // per_window))


@torch.no_grad()
def evaluate(
    model: GPT,
    data: np.ndarray,
    L: int,
    mode: str,
    stride: int,
    budget_bytes: float,
    device: str,
    ctx,
    bar: tqdm,
) -> dict:
    """Mean loss and perplexity over the scored tokens, and (nonoverlapping) the mean loss at each
    window position."""
    n = len(data) - 1
    spans = windows(n, L, mode, stride)
    B = window_batch(model, L, budget_bytes)
    total = 0.0
    count = 0
    per_pos = torch.zeros(L, dtype=torch.float64)
    i = 0
    while i < len(spans):
        chunk = spans[i : i + B]
        x = torch.from_numpy(np.stack([data[s : s + L] for s, _ in chunk]).astype(np.int64)).to(
            device
        )
        y = torch.from_numpy(
            np.stack([data[s + 1 : s + 1 + L] for s, _ in chunk]).astype(np.int64)
        ).to(device)
        try:
            with ctx:
                logits, _ = model(x)
            loss = F.cross_entropy(
                logits.float().flatten(0, 1), y.flatten(), reduction="none"
            ).view(len(chunk), L)
        except torch.OutOfMemoryError:
            if B == 1:
                sys.exit(
                    f"error: out of memory at one window of {L} tokens on {device}; evaluate "
                    "shorter lengths"
                )
            B = max(1, B // 2)  # shrink and retry this batch, not silently fail
            torch.cuda.empty_cache()
            tqdm.write(f"out of memory at {len(chunk)} windows of {L} tokens: retrying with {B}")
            continue
        loss = loss.double().cpu()
        for row, (_, first) in zip(loss, chunk, strict=True):
            total += row[first:].sum().item()
            count += L - first
        per_pos += loss.sum(0)
        i += len(chunk)
        bar.update(len(chunk) * L)
    mean = total / count
    return {
        "loss": mean,
        "ppl": math.exp(mean),
        "tokens": count,
        "per_position": (per_pos / len(spans)).tolist(),
    }


def dataset_meta(ckpt: dict, data_dir: str | None) -> dict:
    """meta.json of the dataset the evaluation reads (data_dir, else the one the checkpoint trained
    on)."""
    trained_on = (ckpt.get("config") or {}).get("dataset") or "shakespeare_char"
    return load_meta(Path(data_dir) if data_dir else dataset_dir(trained_on))


def evaluate_packed(model: GPT, packing: str, meta: dict, out_dir: str) -> None:
    """Set the model's rule for this evaluation: documents apart at the data's end-of-text token, or
    one stream."""
    if packing == "documents" and meta.get("eot") is None:
        raise DataError(
            f"{out_dir}: --packing=documents evaluates inside the data's documents, and its "
            "dataset marks none (no "
            "'eot' in its meta.json); evaluate on a dataset prepared with documents (--data_dir)"
        )
    model.config.packing = packing
    model.config.eot_token = meta.get("eot") if packing == "documents" else None


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every option in its range, before any work: p.error prints usage and one line, and exits
    2."""
    for L in args.lengths:
        if L < 2:
            p.error(f"--lengths {L}: every length must be >= 2")
    if args.stride is not None and not 1 <= args.stride <= min(args.lengths):
        p.error(
            f"--stride={args.stride}: must be between 1 and the shortest length, "
            f"{min(args.lengths)}"
        )
    if args.names is not None and len(args.names) != len(args.out_dirs):
        p.error(
            f"--names: {len(args.names)} labels for {len(args.out_dirs)} checkpoints; give "
            "one per checkpoint"
        )
    if args.eval_tokens < 1:
        p.error(f"--eval_tokens={args.eval_tokens}: must be >= 1")
    if args.rope_factor is not None and not 1 <= args.rope_factor < math.inf:
        p.error(
            f"--rope_factor={args.rope_factor}: must be a number >= 1 (how many times longer "
            "than training)"
        )
    if args.memory_gb is not None and not 0 < args.memory_gb < math.inf:
        p.error(f"--memory_gb={args.memory_gb}: must be a positive number")
    if args.dtype not in (None, *DTYPES):
        p.error(f"--dtype={args.dtype}: choose float32, bfloat16 or float16")
    try:
        check_device(args.device)
        for flag, suffixes in (("out_json", ()), ("out_md", ()), ("plot", PLOT_FORMATS)):
            if getattr(args, flag):  # empty: not written
                check_output(getattr(args, flag), f"--{flag}", suffixes)
    except (ConfigError, OutputError) as e:
        p.error(str(e))
    memory = device_memory(args.device)
    if args.memory_gb is not None and memory and args.memory_gb * 2**30 > memory:
        p.error(f"--memory_gb={args.memory_gb}: more than the {gb(memory)} of {args.device}")
    if args.wandb_log and (problem := missing("wandb", "--wandb_log")):
        p.error(f"{problem}, or leave out --wandb_log")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m compare.eval_length",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_run_folders(p, nargs="+")
    p.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024, 2048])
    p.add_argument(
        "--names", nargs="+", default=None, help="a label per checkpoint (default: its encoding)"
    )
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument(
        "--stride", type=int, default=None, help="sliding stride (default: a quarter of the length)"
    )
    p.add_argument(
        "--eval_tokens", type=int, default=32768, help="validation tokens scored at every length"
    )
    p.add_argument(
        "--rope_scaling", nargs="*", default=[], choices=[s for s in ROPE_SCALINGS if s != "none"]
    )
    p.add_argument(
        "--rope_factor", type=float, default=None, help="default: each length / the training length"
    )
    p.add_argument(
        "--data_dir",
        default=None,
        help="a prepared dataset folder (default: the checkpoint's dataset)",
    )
    p.add_argument(
        "--packing",
        choices=PACKINGS,
        default=None,
        help="evaluate every checkpoint under this rule (documents: inside the data's documents, "
        "which it must mark; "
        "stream: across them); default: the rule each was trained with",
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--dtype", default=None, help="float32 | bfloat16 (default: bfloat16 on CUDA, else float32)"
    )
    p.add_argument(
        "--memory_gb",
        type=float,
        default=None,
        help="memory for one batch (default: 2, or 1/2 the GPU's)",
    )
    p.add_argument("--out_json", default="eval_length.json", help="the numbers ('': none)")
    p.add_argument("--out_md", default=None, help="the table, as stdout shows it")
    p.add_argument(
        "--plot", default="eval_length.png", help=f"{', '.join(PLOT_FORMATS)} ('': none)"
    )
    p.add_argument("--wandb_log", action="store_true")
    p.add_argument("--wandb_project", default="nanope")
    p.add_argument("--wandb_run_name", default="eval_length")
    return p


def main(argv: list[str] | None = None) -> dict:
    p = parser()
    args = p.parse_args(argv)
    check_args(p, args)
    return evaluate_args(args)


def evaluate_runs(out_dirs: list[str], **options) -> dict:
    """The command from Python (compare/sweep.py): the same checks, evaluation and report, with the
    options by the names of its flags (lengths=[64, 128], plot="" for none, ...) instead of an argv
    to build."""
    p = parser()
    args = p.parse_args([str(d) for d in out_dirs])
    unknown = sorted(set(options) - set(vars(args)))
    if unknown:
        raise TypeError(f"evaluate_runs: no option {', '.join(unknown)}")
    vars(args).update(options)
    check_args(p, args)
    return evaluate_args(args)


def evaluate_args(args: argparse.Namespace) -> dict:
    """Evaluate every checkpoint at every length, print the table, write the outputs; returns the
    report."""
    lengths = sorted(set(args.lengths))
    # once
    args.modes = list(dict.fromkeys(args.modes))
    args.rope_scaling = list(dict.fromkeys(args.rope_scaling))
    device = args.device
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.startswith("cuda") else "float32"))
    ctx = autocast(device, dtype)
    if args.memory_gb is None:
        args.memory_gb = torch.cuda.mem_get_info()[0] / 2**31 if device.startswith("cuda") else 2.0
    budget = args.memory_gb * 2**30

    # every checkpoint, and a scaled copy of each RoPE one per --rope_scaling
    runs = []
    for n, out_dir in enumerate(args.out_dirs):
        try:
            run = load_run(out_dir, device, text=True)
            data, dataset = validation_tokens(
                run.ckpt, run.model.config.vocab_size, out_dir, args.data_dir
            )
            if args.packing is not None:
                evaluate_packed(
                    run.model, args.packing, dataset_meta(run.ckpt, args.data_dir), out_dir
                )
        except (CheckpointError, DataError) as e:
            sys.exit(f"error: {e}")
        ckpt = run.ckpt
        model = run.model
        label = args.names[n] if args.names else model.config.pos_encoding
        T = model.config.block_size
        packing = model.config.packing  # its own, or --packing's
        own = dict(
            name=label,
            out_dir=out_dir,
            model=model,
            data=data,
            dataset=dataset,
            train_len=T,
            packing=packing,
        )
        runs.append(own)
        for scaling in args.rope_scaling if model.encoding.rope_scalable else []:
            scaled = model_from_checkpoint(ckpt).to(device).eval()
            scaled.config.packing = model.config.packing
            scaled.config.eot_token = model.config.eot_token
            if args.rope_factor:
                name = f"{label}+{scaling} (s={args.rope_factor:g})"
            else:  # dynamic_ntk: s = 1, its ratio grows as L / T by itself
                name = (
                    f"{label}+{scaling}"
                    if scaling == "dynamic_ntk"
                    else f"{label}+{scaling} (s=L/{T})"
                )
            runs.append(own | dict(name=name, model=scaled, scaling=scaling))
    given = ({"rope_scaling": args.rope_scaling[0]} if args.rope_scaling else {}) | (
        {"rope_factor": args.rope_factor} if args.rope_factor is not None else {}
    )
    # refused where no checkpoint reads it, as train.py refuses it
    for name, value in given.items():
        problems = {idle_option(r["model"].config.pos_encoding, name, value, given) for r in runs}
        if None not in problems:
            sys.exit(f"error: {sorted(problems)[0]}")
    need = max(lengths) + 1
    for r in runs:
        if len(r["data"]) < need:
            sys.exit(
                f"error: {r['out_dir']}: the validation set has {len(r['data'])} tokens, fewer "
                "than the longest "
                f"length + 1 = {need}; evaluate shorter lengths"
            )
        r["data"] = np.asarray(r["data"][: max(args.eval_tokens, max(lengths)) + 1])

    def feasible(r, L):
        return L <= r["model"].encoding.max_length

    if not any(feasible(r, L) for r in runs for L in lengths):
        longest = max(r["model"].config.block_size for r in runs)
        sys.exit(
            f"error: every length is past what the checkpoints' positions reach ({longest}); "
            "add lengths up to it"
        )
    memory = device_memory(device)
    for r in runs:
        L = max((L for L in lengths if feasible(r, L)), default=0)
        need = forward_bytes(r["model"], L)
        if memory and L and need > memory:
            sys.exit(
                f"error: {r['out_dir']}: one window of {L} tokens needs at least {gb(need)}, more "
                "than the "
                f"{gb(memory)} of {device}; evaluate shorter lengths"
            )

    work = sum(
        len(r["data"]) * (1 if m == "nonoverlapping" else L / sliding_stride(L, args.stride))
        for r in runs
        for L in lengths
        if feasible(r, L)
        for m in args.modes
    )
    bar = tqdm(total=int(work), unit="tok", desc="eval_length", dynamic_ncols=True)
    t0 = time.time()
    for r in runs:
        r["results"] = {m: {} for m in args.modes}
        for L in lengths:
            if r.get("scaling"):
                r["model"].set_rope_scaling(
                    r["scaling"],
                    rope_factor(r["model"], r["scaling"], L, r["train_len"], args.rope_factor),
                )
            for mode in args.modes:
                if not feasible(r, L):
                    r["results"][mode][L] = None  # learned: no position past block_size
                    continue
                bar.set_postfix_str(f"{r['name']} L={L} {mode}")
                stride = sliding_stride(L, args.stride)
                r["results"][mode][L] = evaluate(
                    r["model"], r["data"], L, mode, stride, budget, device, ctx, bar
                )
    bar.close()

    report = {
        "lengths": lengths,
        "modes": args.modes,
        "stride": args.stride or "length/4",
        "eval_tokens": args.eval_tokens,
        "seconds": round(time.time() - t0, 1),
        "runs": [{k: v for k, v in r.items() if k not in ("model", "data")} for r in runs],
    }
    table = markdown_table(report)
    print(table)
    if args.out_md:
        write_atomic(args.out_md, table + "\n")
    if args.out_json:
        write_atomic(args.out_json, json.dumps(report, indent=1))
    if args.plot:
        plot(report, args.plot)
    if args.wandb_log:
        import wandb

        run = wandb.init(
            project=args.wandb_project, name=args.wandb_run_name, config=vars(args), job_type="eval"
        )
        cols = ["name", "out_dir", "mode", "length", "loss", "ppl"]
        rows = [
            [r["name"], r["out_dir"], m, L, *((res["loss"], res["ppl"]) if res else (None, None))]
            for r in report["runs"]
            for m, by_len in r["results"].items()
            for L, res in by_len.items()
        ]
        log = {"eval_length": wandb.Table(columns=cols, data=rows)}
        if args.plot:
            log["eval_length_plot"] = wandb.Image(args.plot)
        run.log(log)
        run.finish()
    return report


def markdown_table(report: dict) -> str:
    out = []
    for mode in report["modes"]:
        out.append(f"\nPerplexity, {mode} windows (train length in brackets):\n")
        out.append("| encoding | " + " | ".join(str(L) for L in report["lengths"]) + " |")
        out.append("|---|" + "---:|" * len(report["lengths"]))
        for r in report["runs"]:
            cells = [
                ("n/a" if res is None else f"{res['ppl']:.2f}")
                for res in r["results"][mode].values()
            ]
            out.append(f"| {r['name']} [{r['train_len']}] | " + " | ".join(cells) + " |")
    inside = [r["name"] for r in report["runs"] if r.get("packing") == "documents"]
    if inside:  # a window's tokens attend within their documents, positions from each start
        out.append(
            f"\n{', '.join(inside)}: evaluated inside documents (packing=documents: a token sees "
            "only its document's "
            "tokens in the window)"
        )
    return "\n".join(out)


def line_styles():
    """Ten colours, solid then dashed: a line each for up to 20 rows (the default cycle repeats
    after 10)."""
    import matplotlib.pyplot as plt
    from cycler import cycler

    return cycler(linestyle=["-", "--"]) * cycler(color=plt.get_cmap("tab10").colors)


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    for ax in axes:
        ax.set_prop_cycle(line_styles())
    mode = "sliding" if "sliding" in report["modes"] else report["modes"][0]
    for r in report["runs"]:
        pts = [(L, res["ppl"]) for L, res in r["results"][mode].items() if res is not None]
        if pts:  # none where every length is past a learned table's block size
            axes[0].plot(*zip(*pts, strict=True), marker="o", label=r["name"])
    axes[0].set(
        xscale="log",
        yscale="log",
        xlabel="evaluation length (tokens)",
        ylabel=f"perplexity ({mode})",
    )
    axes[0].set_title("Train short, test long")
    train_len = min(r["train_len"] for r in report["runs"])
    axes[0].axvline(train_len, color="gray", ls=":", lw=1)
    if "nonoverlapping" in report["modes"]:  # the loss at each position of the longest windows
        for r in report["runs"]:
            res = [v for v in r["results"]["nonoverlapping"].values() if v is not None]
            if res:
                curve = np.array(res[-1]["per_position"])
                k = max(1, len(curve) // 64)  # smooth over k positions
                smooth = np.convolve(curve, np.ones(k) / k, mode="valid")
                axes[1].plot(
                    np.arange(len(smooth)) + k // 2, smooth, label=f"{r['name']} (L={len(curve)})"
                )
        axes[1].axvline(train_len, color="gray", ls=":", lw=1)
        axes[1].set(
            xlabel="position in the window",
            ylabel="loss (nats)",
            title="Loss by position, longest windows",
        )
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)


if __name__ == "__main__":
    main()
