"""
Look inside checkpoints: the score bias each head adds by distance, and how far back each head
attends.

    python -m compare.probe out-bias_rpe out-alibi --length 1024 --plot probe.png

- **bias by distance**: what each head adds to a score at distance d = i - j, for every encoding
  with a score bias (has_score_bias), for the last query of a window of --length tokens (FIRE's bias
  also depends on the query's position); the training length is marked.
- **what a bias of the content reads** (CoPE, the forgetting gate): CoPE's count p_ij of the
  window's last query at the training length's distance and at the window's start (its positions
  count gates, not tokens); FoX's mean forget rate f of each head over the window, and the share of
  tokens it keeps (f > 0.9).
- **attention past the training length**: over windows of --length validation tokens, for the
  queries in the last quarter of each window, the share of each head's attention on keys at least
  block_size tokens back (distances the model never saw in training). ALiBi's heads near 0 are the
  ones that keep to the training range; a head near 1 spreads its attention over keys it was never
  trained to weigh.

Writes a markdown table (stdout), the numbers (--out_json) and a plot (--plot).
"""

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

if not __package__:  # run by its path, where the project's modules are not importable
    sys.exit("run it from the repository's root as: python -m compare.probe")

import numpy as np
import torch

from lib.checkpoint import CheckpointError
from lib.configurator import ConfigError
from lib.datafiles import DataError, validation_tokens
from lib.devices import check_device, device_memory, forward_bytes, gb
from lib.outputs import PLOT_FORMATS, OutputError, check_output, save_figure, write_atomic
from lib.runs import add_run_folders, load_run
from model import GPT


@torch.no_grad()
def attention_probs(model: GPT, idx: torch.Tensor, reduce=None) -> list:
    """Each layer's attention probabilities (B, nh, T, T) for idx (B, T), from the model's own
    attention: run with V = the identity, attention's output is its probability matrix P (P @ I =
    P), whatever the encoding and kernel. reduce(P), if given, is kept instead of P (a 124M model at
    4096 tokens has 10 GB of them)."""
    probs = []

    def recording(attention):
        def both(q, k, v, x):
            eye = torch.eye(k.size(2), dtype=q.dtype, device=q.device).expand(*k.shape[:2], -1, -1)
            p = attention(q, k, eye, x)
            probs.append(p if reduce is None else reduce(p))
            return attention(q, k, v, x)

        return both

    model.features(idx, wrap_attention=recording)
    return probs


def far_share(p: torch.Tensor, far: int, first_query: int) -> torch.Tensor:
    """The share of attention (nh,) on keys at distance >= far, of queries first_query … T - 1,
    averaged over the batch and those queries. p (B, nh, T, T)."""
    T = p.size(-1)
    i = torch.arange(T, device=p.device)[:, None]
    j = torch.arange(T, device=p.device)[None, :]
    mask = (i - j >= far).to(p.dtype)  # (T, T)
    return (p[:, :, first_query:] * mask[first_query:]).sum(-1).mean((0, 2))


@torch.no_grad()
def bias_by_distance(model: GPT, length: int) -> np.ndarray | None:
    """(heads, length): the bias each head adds at distances 0 … length - 1, for the query at
    position length - 1; None for an encoding without a bias. Per-layer encodings (FIRE) give
    n_layer · n_head rows, layer by layer."""
    pe = model.encoding
    # a bias of the content has none by distance alone
    if not pe.has_score_bias or pe.reads_content:
        return None
    n = model.config.n_head * (model.config.n_layer if pe.per_layer else 1)
    heads = torch.arange(n)[:, None]
    d = torch.arange(length, device=model.lm_head.weight.device)
    bias = pe.score_bias(
        heads.to(d.device), torch.full_like(d, length - 1)[None], (length - 1 - d)[None]
    )
    return bias.float().cpu().numpy()


@torch.no_grad()
def content_read(model: GPT, idx: torch.Tensor) -> list[list] | None:
    """What a bias of the content reads, for idx (B, T), each layer's: FoX's mean forget rate f of
    each head and the share of tokens it keeps (f > 0.9) (nh, 2); CoPE's count p_ij of the last
    query at each distance 0 … T - 1, per head (nh, T), averaged over the batch. None for the
    encodings whose bias reads positions alone."""
    pe = model.encoding
    layers = []
    if not pe.reads_content:
        return None

    def recording(attention):
        def read(q, k, v, x):
            f = pe.forget(len(layers), x)  # (B, nh, T) log f, or None
            if f is not None:
                layers.append(
                    torch.stack([f.exp().mean((0, 2)), (f.exp() > 0.9).float().mean((0, 2))], -1)
                )
            else:  # the last query sees every key
                every = torch.ones(1, 1, k.size(2), dtype=torch.bool, device=k.device)
                layers.append(
                    pe.positions(q[:, :, -1:].float(), k.float(), every, None)[:, :, 0]
                    .mean(0)
                    .flip(-1)
                )
            return attention(q, k, v, x)

        return read

    model.features(idx, wrap_attention=recording)
    return [t.cpu().tolist() for t in layers]


def check_length(model: GPT, length: int) -> None:
    """Raise ValueError where the model cannot be probed at this length: within its training length
    (no key is far yet), or past its positions (learned)."""
    if length <= model.config.block_size:
        raise ValueError(
            f"--length {length} must exceed the training length {model.config.block_size}: no key "
            "is past it before"
        )
    if length > model.encoding.max_length:
        raise ValueError(f"{model.config.pos_encoding} has no positions past its block size")


def probe_bytes(model: GPT, length: int) -> int:
    """The least memory probing one window takes: a forward, and a layer's probabilities (nh, L, L)
    with the products far_share makes of them."""
    return forward_bytes(model, length) + (8 * model.config.n_head + 12) * length * length


def probe(model: GPT, data: np.ndarray, length: int, windows: int, device: str = "cpu") -> dict:
    """Far-attention shares (n_layer, n_head) over `windows` windows of `length` tokens, and the
    bias curves."""
    far = model.config.block_size
    first = length - length // 4
    check_length(model, length)
    starts = np.linspace(0, len(data) - length - 1, windows).astype(int)
    shares = []
    for s in starts:  # one window at a time: a probability matrix per layer is (nh, L, L)
        idx = torch.from_numpy(data[s : s + length].astype(np.int64))[None].to(device)
        shares.append(
            torch.stack(attention_probs(model, idx, lambda p: far_share(p.float(), far, first)))
        )
    bias = bias_by_distance(model, length)
    return {
        "train_len": far,
        "far_share": torch.stack(shares).mean(0).cpu().tolist(),  # (n_layer, n_head)
        "bias": None if bias is None else bias.tolist(),
        "content": content_read(model, idx),  # the last window's
    }


def content_table(report: dict) -> str:
    """The content encodings' rows: FoX's mean forget rate per head and the share of tokens it keeps
    (f > 0.9), CoPE's count at the training length's distance and at the window's start
    (p@distance)."""
    lines = ["| checkpoint | layer | by head |", "|---|---:|---|"]
    for name, r in report["checkpoints"].items():
        for layer, heads in enumerate(r.get("content") or []):
            if len(heads[0]) > 2:  # CoPE: (nh, T) counts by distance
                d = min(r["train_len"], len(heads[0]) - 1)
                cells = " · ".join(f"{h[d]:.1f}@{d} {h[-1]:.1f}@{len(h) - 1}" for h in heads)
            else:  # FoX: (nh, 2)
                cells = " · ".join(f"f {f:.2f}, {kept:.0%} kept" for f, kept in heads)
            lines.append(f"| {name} | {layer} | {cells} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def markdown_table(report: dict) -> str:
    lines = [
        "| checkpoint | layer | share of attention past the training length, by head | mean |",
        "|---|---:|---|---:|",
    ]
    for name, r in report["checkpoints"].items():
        for layer, heads in enumerate(r["far_share"]):
            cells = " ".join(f"{h:.2f}" for h in heads)
            lines.append(f"| {name} | {layer} | {cells} | {np.mean(heads):.2f} |")
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["checkpoints"])
    fig, axes = plt.subplots(
        len(names), 2, figsize=(11, 2.6 * len(names)), squeeze=False, layout="constrained"
    )
    for (ax_b, ax_a), name in zip(axes, names, strict=True):
        r = report["checkpoints"][name]
        if r["bias"] is None:
            ax_b.text(
                0.5, 0.5, f"{name}: no bias (positions enter elsewhere)", ha="center", va="center"
            )
            ax_b.set_axis_off()
        else:
            for h, curve in enumerate(r["bias"]):
                ax_b.plot(curve, lw=1, label=f"head {h}")
            ax_b.axvline(r["train_len"], color="gray", ls=":", lw=1)
            ax_b.set_xscale("symlog", linthresh=1)
            ax_b.set(
                xlim=(0, len(r["bias"][0])),
                xlabel="distance i - j",
                ylabel="bias (logits)",
                title=name,
            )
            ax_b.grid(alpha=0.3)
            if len(r["bias"]) <= 8:
                ax_b.legend(fontsize=7)
        share = np.array(r["far_share"])  # (n_layer, n_head)
        im = ax_a.imshow(share, vmin=0, vmax=1, cmap="magma", aspect="auto")
        for (layer, h), v in np.ndenumerate(share):
            ax_a.text(
                h,
                layer,
                f"{v:.2f}",
                ha="center",
                va="center",
                color="w" if v < 0.6 else "k",
                fontsize=8,
            )
        ax_a.set(
            xlabel="head",
            ylabel="layer",
            title=f"attention past {r['train_len']} tokens (training length)",
        )
        ax_a.set_xticks(range(share.shape[1]))
        ax_a.set_yticks(range(share.shape[0]))
    fig.colorbar(im, ax=axes[:, 1].tolist(), label="share of attention")
    save_figure(fig, path, dpi=110)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(
        prog="python -m compare.probe",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_run_folders(p, nargs="+")
    p.add_argument(
        "--names",
        nargs="+",
        default=None,
        help="a label per checkpoint (default: its folder's name)",
    )
    p.add_argument(
        "--length", type=int, default=1024, help="window length, past the training length"
    )
    p.add_argument("--windows", type=int, default=8, help="validation windows averaged over")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--data_dir",
        default=None,
        help="a prepared dataset folder (default: the checkpoint's dataset)",
    )
    p.add_argument("--out_json", default="probe.json", help="the numbers ('': none)")
    p.add_argument("--plot", default="probe.png", help=f"{', '.join(PLOT_FORMATS)} ('': none)")
    args = p.parse_args(argv)
    if args.length < 2:
        p.error(f"--length {args.length}: must be past the training length (at least 2)")
    if args.windows < 1:
        p.error("--windows must be at least 1")
    try:
        check_device(args.device)
        for flag, suffixes in (("out_json", ()), ("plot", PLOT_FORMATS)):
            if getattr(args, flag):  # empty: not written
                check_output(getattr(args, flag), f"--{flag}", suffixes)
    except (ConfigError, OutputError) as e:
        p.error(str(e))
    names = args.names or [Path(d).name for d in args.out_dirs]
    if len(names) != len(args.out_dirs) or len(set(names)) != len(names):
        p.error(
            "--names: one distinct label per checkpoint (folders with the same name need --names)"
        )
    runs = {}
    memory = device_memory(args.device)
    # every checkpoint checked before any is probed
    for name, out_dir in zip(names, args.out_dirs, strict=True):
        try:
            run = load_run(out_dir, args.device, text=True)
            val, _ = validation_tokens(
                run.ckpt, run.model.config.vocab_size, out_dir, args.data_dir
            )
        except (CheckpointError, DataError) as e:
            sys.exit(f"error: {e}")
        try:
            check_length(run.model, args.length)
        except ValueError as e:
            sys.exit(f"error: {out_dir}: {e}")
        # the reference path: every encoding, any length, any device
        run.model.attention_options = replace(run.model.attention_options, fused=False)
        n = len(val) - args.length  # n: distinct windows
        need = probe_bytes(run.model, args.length)
        if n < 1:
            sys.exit(
                f"error: {out_dir}: the validation split has {len(val)} tokens, fewer than "
                "--length "
                f"{args.length} + 1; use a shorter --length"
            )
        if args.windows > n:
            sys.exit(
                f"error: --windows {args.windows}: the validation split has {n} windows of "
                f"{args.length} tokens"
            )
        if memory and need > memory:
            sys.exit(
                f"error: {out_dir}: probing {args.length} tokens needs at least {gb(need)}, more "
                "than the "
                f"{gb(memory)} of {args.device}; use a shorter --length"
            )
        runs[name] = (out_dir, run.model, val)
    report = {"length": args.length, "windows": args.windows, "checkpoints": {}}
    for name, (out_dir, model, val) in runs.items():
        report["checkpoints"][name] = probe(model, val, args.length, args.windows, args.device)
        print(f"{out_dir}: done", file=sys.stderr)
    print(markdown_table(report))
    if content := content_table(report):  # CoPE's counts (p@distance), FoX's forget rates
        print("\n" + content)
    if args.out_json:
        write_atomic(args.out_json, json.dumps(report))
    if args.plot:
        plot(report, args.plot)
    return report


if __name__ == "__main__":
    main()
