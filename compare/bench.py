"""
Benchmarks: training step time (and MFU on a GPU) for every encoding, decode speed with and without
the KV cache, fused (FlexAttention) vs materialized attention for the bias encodings, and nanoGPT
measured in the same process. Prints markdown tables; BENCHMARKS.md keeps the results. Nothing here
is a test: it measures, it asserts nothing.

    python -m compare.bench                         # every table this device can run (CPU: minutes)
    python -m compare.bench --nanogpt=/tmp/nanoGPT  # + nanoGPT rows (a clone of its repository)
    python -m compare.bench --only=decode           # one table: train, encodings, packing, decode,
                                                    # attention, shapes
    python -m compare.bench --only=parallel         # DDP against FSDP at 2 processes (torchrun)

CPU sizes: nanoGPT's CPU recipe (4 layers, 4 heads, 128 dims, block 64, batch 12) for the step
against nanoGPT; block 256 for the encodings; 6 layers, 384 dims, block 256, batch 1, 512 tokens for
decode. On a GPU: GPT-2 124M at block 1024, bf16, compiled.
"""

import argparse
import importlib.util
import json
import multiprocessing
import re
import resource
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

if not __package__:  # run by its path, where the project's modules are not importable
    sys.exit("run it from the repository's root as: python -m compare.bench")

import torch

from fast_paths import AttentionOptions
from generate import generate
from lib.configurator import ConfigError
from lib.devices import allow_tf32, autocast, check_device, estimate_mfu, peak_flops
from lib.kernel_fallbacks import with_kernel_fallbacks
from lib.parallel import STRATEGIES
from model import GPT, POS_ENCODINGS, GPTConfig
from shape import PACKINGS

ENCODINGS = list(POS_ENCODINGS)
# the attention table's encodings
BIASED = [e for e, c in POS_ENCODINGS.items() if c.has_score_bias]
# train.py options per shape for --only=shapes: the comparison config as it is, GPT-2 124M at 1024
# and 4096 tokens, and the head dims at the ends of FlexAttention's range (Triton's minimum is 16)
GPT2_124M = ["--n_layer=12", "--n_head=12", "--n_embd=768", "--dropout=0.0"]
SHAPES = {
    "config": [],
    "124M-1024": [*GPT2_124M, "--block_size=1024", "--batch_size=16"],
    "124M-4096": [*GPT2_124M, "--block_size=4096", "--batch_size=4"],
    "head_dim-8": ["--n_layer=2", "--n_head=8", "--n_embd=64", "--dropout=0.0"],
    "head_dim-128": ["--n_layer=2", "--n_head=2", "--n_embd=256", "--dropout=0.0"],
}
# HBM bandwidth in bytes/s: the bound for batch-1 decode, which reads every weight once per token
GPU_BANDWIDTH = {"H100 PCIe": 2.0e12, "H100": 3.35e12, "H200": 4.8e12, "A100": 2.0e12}


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: str, steps: int, warmup: int) -> float:
    """Median seconds per call of fn over steps calls, after warmup calls (compilation happens
    there)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def memory_now(device: str) -> int:
    """Bytes in use: CUDA's allocated memory, or on a CPU this process's resident memory (Linux)."""
    if device == "cuda":
        return torch.cuda.memory_allocated()
    return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize()


def peak_above(base: int, device: str) -> str:
    """Peak memory since the last reset_memory, beyond base bytes (what the models and optimizers
    hold)."""
    if device == "cuda":
        peak = torch.cuda.max_memory_allocated()
    else:  # the resident set's high-water mark
        status = Path("/proc/self/status").read_text()
        peak = int(re.search(r"VmHWM:\s*(\d+) kB", status).group(1)) * 1024
    return f"{(peak - base) / 2**20:,.0f} MiB"


def reset_memory(device: str) -> None:
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    else:
        try:  # Linux restarts the resident set's high-water mark (VmHWM) at the current size
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:
            # then the peak counts from the process's start: a fresh process per measurement keeps
            # it honest
            pass


def load_nanogpt(path: str | None):
    """nanoGPT's model.py, imported from a clone at benchmark time (its code is never part of this
    repository)."""
    if path is None:
        return None
    file = Path(path) / "model.py"
    if not file.exists():
        sys.exit(
            f"--nanogpt={path}: no model.py there; clone https://github.com/karpathy/nanoGPT "
            "and pass its folder"
        )
    spec = importlib.util.spec_from_file_location("nanogpt_model", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def train_step_fn(model, cfg: dict, args, device: str):
    """One optimizer step on random tokens: forward with targets, backward, AdamW (what train.py
    does per iteration)."""
    B = cfg["batch_size"]
    T = cfg["block_size"]
    x = torch.randint(0, cfg["vocab_size"], (B, T), device=device)
    y = torch.randint(0, cfg["vocab_size"], (B, T), device=device)
    # a document every DOCUMENT tokens
    if isinstance(model, GPT) and model.config.packing == "documents":
        x = torch.where(torch.arange(T, device=device) % DOCUMENT == 0, model.config.eot_token, x)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
    ctx = autocast(device, torch.bfloat16 if device == "cuda" else torch.float32)
    compiled = [torch.compile(model) if args.compile else model]

    def recompile(options: AttentionOptions):  # after a kernel fallback (as train.py does)
        model.attention_options = options
        opt.zero_grad(set_to_none=True)
        compiled[0] = torch.compile(model) if args.compile else model

    def one_step():
        with ctx:
            _, loss = compiled[0](x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    # nanoGPT's model has no attention options: nothing to fall back to
    if not isinstance(model, GPT):
        return one_step

    # None: no score bias, no fused kernel to fall back from
    def options() -> AttentionOptions | None:
        return model.attention_options if model.encoding.has_score_bias else None

    return lambda: with_kernel_fallbacks(
        one_step, options(), recompile, log=lambda m: print(m, file=sys.stderr)
    )


# tokens per document of the training step's rows under packing="documents" (bench_packing)
DOCUMENT = 100


def sizes(device: str) -> dict:
    if device == "cuda":  # GPT-2 124M
        gpt2 = dict(n_layer=12, n_head=12, n_embd=768, vocab_size=50304, dropout=0.0, bias=False)
        return dict(
            train=dict(gpt2, block_size=1024, batch_size=16),
            encodings=[
                dict(gpt2, block_size=1024, batch_size=16),
                dict(gpt2, block_size=256, batch_size=64),
            ],
            decode=dict(gpt2, block_size=1024, vocab_size=50257),
        )
    tiny = dict(n_layer=4, n_head=4, n_embd=128, vocab_size=65, dropout=0.0, bias=True)
    return dict(
        train=dict(tiny, block_size=64, batch_size=12),
        encodings=[dict(tiny, block_size=256, batch_size=12)],
        decode=dict(
            n_layer=6, n_head=6, n_embd=384, vocab_size=65, dropout=0.0, bias=True, block_size=256
        ),
    )


def model_args(cfg: dict) -> dict:
    return {k: v for k, v in cfg.items() if k != "batch_size"}


def bench_train(args, device: str, nanogpt) -> None:
    """Our learned-position GPT (GPT-2's architecture) against nanoGPT's, same size and data,
    interleaved."""
    cfg = sizes(device)["train"]
    print(f"\n### Training step vs nanoGPT ({cfg})\n")
    torch.manual_seed(0)
    ours = GPT(GPTConfig(**model_args(cfg), pos_encoding="learned")).to(device)
    runs = {"nanoPE (learned)": train_step_fn(ours, cfg, args, device)}
    if nanogpt is not None:
        torch.manual_seed(0)
        theirs = nanogpt.GPT(nanogpt.GPTConfig(**model_args(cfg))).to(device)
        runs["nanoGPT model.py"] = train_step_fn(theirs, cfg, args, device)
    results = {name: [] for name in runs}
    for _ in range(args.rounds):  # alternate so that drift in the machine's speed hits both alike
        for name, fn in runs.items():
            results[name].append(timed(fn, device, args.steps, args.warmup))
    base = statistics.median(results["nanoGPT model.py"]) if nanogpt is not None else None
    print("| model | ms/step | ratio to nanoGPT |\n|---|---:|---:|")
    for name, ts in results.items():
        t = statistics.median(ts)
        print(
            f"| {name} | {t * 1e3:.1f} | {f'{t / base:.3f}' if base else 'n/a (pass --nanogpt)'} |"
        )


def bench_encodings(args, device: str) -> None:
    """Every encoding's training step; the encodings alternate over rounds so that drift in the
    machine's speed hits them alike (the median over rounds is reported)."""
    for cfg in sizes(device)["encodings"]:
        if args.encoding_blocks and cfg["block_size"] not in args.encoding_blocks:
            continue
        how = "compiled" if args.compile else "eager"
        print(f"\n### Training step per encoding, {how} ({cfg})\n")
        peak = peak_flops(device)
        steps = {}
        times = {enc: [] for enc in args.step_encodings}
        memory = {}
        for enc in args.step_encodings:
            torch.manual_seed(0)
            model = GPT(GPTConfig(**model_args(cfg), pos_encoding=enc)).to(device)
            # FlexAttention's Triton options (block sizes, stages) to try
            if args.flex_options is not None:
                model.attention_options = AttentionOptions(flex_kernel_options=args.flex_options)
            steps[enc] = (model, train_step_fn(model, cfg, args, device))
        for _ in range(args.rounds):
            for enc, (_, step) in steps.items():
                reset_memory(device)
                base = memory_now(device)
                times[enc].append(timed(step, device, args.steps, args.warmup))
                # one line per measurement on stderr: a run stopped early still shows what it
                # measured
                print(f"  {enc}: {times[enc][-1] * 1e3:.1f} ms", file=sys.stderr, flush=True)
                # beyond what the models and optimizers hold: activations and temporaries
                if device == "cuda":
                    memory[enc] = peak_above(base, device)
        for enc in args.profile_encodings or []:
            if enc in steps:
                profile(
                    steps[enc][1],
                    device,
                    f"{enc}, one training step ({how}, block {cfg['block_size']})",
                )
        tokens = cfg["batch_size"] * cfg["block_size"]
        rows = {enc: statistics.median(ts) for enc, ts in times.items()}
        fastest = min(rows.values())
        rope = rows.get("rope")
        print(
            "| encoding | ms/step | tokens/s | MFU | peak memory (activations) | vs fastest | "
            "vs rope | kernel |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---|")
        for enc, t in rows.items():
            mfu = f"{100 * estimate_mfu(steps[enc][0], tokens, t, peak):.1f}%" if peak else "—"
            mem = memory.get(enc, "—")
            kernel = fallback_name(steps[enc][0].attention_options)
            vs_rope = f"{t / rope:.2f}x" if rope else "—"
            print(
                f"| {enc} | {t * 1e3:.1f} | {tokens / t:,.0f} | {mfu} | {mem} | {t / fastest:.2f}x "
                f"| {vs_rope} "
                f"| {kernel} |"
            )
        del steps


def bench_packing(args, device: str) -> None:
    """Every encoding's training step with packing="documents" (a document every DOCUMENT tokens)
    against the same step as one stream, alternating over rounds; the median over rounds."""
    for cfg in sizes(device)["encodings"]:
        if args.encoding_blocks and cfg["block_size"] not in args.encoding_blocks:
            continue
        how = "compiled" if args.compile else "eager"
        print(
            f"\n### Training step with document packing, {how} ({cfg}, a document every "
            f"{DOCUMENT} tokens)\n"
        )
        steps = {}
        times = {}
        for enc in args.step_encodings:
            for packing in PACKINGS:
                torch.manual_seed(0)
                model = GPT(
                    GPTConfig(**model_args(cfg), pos_encoding=enc, packing=packing, eot_token=0)
                ).to(device)
                steps[enc, packing] = train_step_fn(model, cfg, args, device)
                times[enc, packing] = []
        for _ in range(args.rounds):
            for key, step in steps.items():
                times[key].append(timed(step, device, args.steps, args.warmup))
                print(
                    f"  {key[0]} {key[1]}: {times[key][-1] * 1e3:.1f} ms",
                    file=sys.stderr,
                    flush=True,
                )
        print(
            "| encoding | stream ms/step | documents ms/step | documents / stream "
            "|\n|---|---:|---:|---:|"
        )
        for enc in args.step_encodings:
            stream, documents = (statistics.median(times[enc, p]) for p in PACKINGS)
            print(
                f"| {enc} | {stream * 1e3:.1f} | {documents * 1e3:.1f} | "
                f"{documents / stream:.2f}x |"
            )
        del steps


def profile(fn, device: str, label: str, rows: int = 12) -> None:
    """Print the kernels fn spends its time in (torch.profiler, one call of fn after the warm-up
    calls already made): the top rows by self device time on a GPU, by self CPU time on a CPU, and
    how many kernels ran."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    sync(device)
    with profiler(activities=activities) as prof:
        fn()
        sync(device)
    events = prof.key_averages()
    key = "self_device_time_total" if device == "cuda" else "self_cpu_time_total"
    kernels = (
        sum(e.count for e in events if e.device_type.name == "CUDA") if device == "cuda" else None
    )
    print(
        "\n#### Profile: "
        f"{label}" + (f" ({kernels} GPU kernels)" if kernels is not None else "") + "\n"
    )
    print("```\n" + events.table(sort_by=key, row_limit=rows, max_name_column_width=70) + "\n```")


def fallback_name(options: AttentionOptions) -> str:
    """Which kernel a model's step ended on: the default, or a fallback after the fused kernel
    failed to compile (or the options --flex_options gave)."""
    if options.fused is False:
        return "materialized bias (fallback)"
    if options.flex_kernel_options:
        return (
            "FlexAttention "
            + ", ".join(f"{k}={v}" for k, v in options.flex_kernel_options.items())
            + " (fallback)"
        )
    return "default"


def bench_decode(args, device: str, nanogpt) -> None:
    cfg = sizes(device)["decode"]
    n = args.decode_tokens
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    print(f"\n### Decode, batch 1, {n} new tokens after an 8-token prompt, {dtype} ({cfg})\n")
    prompt = torch.randint(0, cfg["vocab_size"], (1, 8), device=device)

    def rate(fn) -> float:
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        return n / (time.perf_counter() - t0)

    rows = []
    for enc in args.decode_encodings:
        torch.manual_seed(0)
        model = GPT(GPTConfig(**cfg, pos_encoding=enc)).to(device, dtype).eval()

        def gen(model=model, **kw):
            return generate(model, prompt, n, temperature=0, **kw)

        from torch._dynamo.utils import counters  # here: torch._dynamo takes a second to import

        skips = counters["inductor"]["cudagraph_skips"]
        # seconds: compiles (and records the CUDA graph)
        first = n / rate(lambda: gen(compile=True))
        compiled = rate(lambda: gen(compile=True))
        # a CUDA graph that inductor declined to record (and says why under TORCH_LOGS=perf_hints)
        # runs kernel by kernel: the usual reason a compiled decode step is slow on a GPU
        skipped = counters["inductor"]["cudagraph_skips"] - skips
        rows.append(
            [
                enc,
                rate(gen),
                compiled,
                rate(lambda: gen(use_cache=False)),
                first - n / compiled,
                skipped,
            ]
        )
        print(f"  {enc}: {rows[-1][1:]}", file=sys.stderr, flush=True)
        if enc in (args.profile_encodings or []):  # 16 tokens each way: the kernels a token takes
            ways = {
                "compiled step": dict(compile=True),
                "eager cache": {},
                "no cache": dict(use_cache=False),
            }
            for label, kw in ways.items():
                tokens16 = lambda kw=kw, model=model: generate(
                    model, prompt, 16, temperature=0, **kw
                )  # noqa: E731
                profile(tokens16, device, f"{enc}, 16 tokens, {label}")
    ng = None
    if nanogpt is not None:
        torch.manual_seed(0)
        theirs = nanogpt.GPT(nanogpt.GPTConfig(**cfg)).to(device, dtype).eval()
        with torch.no_grad():
            ng = rate(lambda: theirs.generate(prompt, n, temperature=1.0))
    bound = ""
    if device == "cuda":
        bw = next((v for k, v in GPU_BANDWIDTH.items() if k in torch.cuda.get_device_name()), None)
        n_params = GPT(GPTConfig(**cfg, pos_encoding="rope")).get_num_params(non_embedding=False)
        # mean cache length, in elements
        kv = 2 * cfg["n_layer"] * cfg["n_embd"] * cfg["block_size"] / 2
        # bf16: 2 bytes a weight, all read once per token
        bound = bw / ((n_params + kv) * 2) if bw else None
    print(
        "| encoding | cache, tokens/s | cache + compiled step | no cache (window re-run) | "
        "compiled vs nanoGPT "
        "| compile s (first call - warm call) | CUDA graphs skipped |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for enc, cached, compiled, plain, compile_s, skipped in rows:
        vs = f"{compiled / ng:.1f}x" if ng else "n/a"
        print(
            f"| {enc} | {cached:,.0f} | {compiled:,.0f} | {plain:,.0f} | {vs} | {compile_s:.1f} "
            f"| {skipped} |"
        )
    if ng:
        print(f"| nanoGPT generate | | | {ng:,.0f} | 1.0x | | |")
    if bound:
        best = max(r[2] for r in rows)
        print(
            f"\nbandwidth bound (weights + mean KV cache read once per token): {bound:,.0f} "
            "tokens/s; "
            f"best compiled: {best / bound:.0%} of it"
        )


def attention_cell(
    enc: str, T: int, fused: bool | None, args, device: str, batch: int
) -> tuple[str, str]:
    """ms per training step of one 124M-width layer, and its peak memory beyond the weights and
    AdamW's state: the gradients, the activations and attention's temporaries."""
    cfg = dict(
        n_layer=1, n_head=12, n_embd=768, vocab_size=50304, block_size=T, dropout=0.0, bias=False
    )
    if device == "cpu":
        # the GPT-2 vocabulary's logits and embedding would dwarf attention on a CPU
        cfg["vocab_size"] = 64
    model = GPT(GPTConfig(**cfg, pos_encoding=enc)).to(device)
    model.attention_options = AttentionOptions(fused=fused)
    step = train_step_fn(model, dict(cfg, batch_size=batch), args, device)
    try:
        step()  # compiles, and allocates AdamW's state
        reset_memory(device)
        base = memory_now(device)
        t = timed(step, device, args.steps, 0)
    except torch.OutOfMemoryError:
        return "OOM", "OOM"
    return f"{t * 1e3:.1f}" if device == "cuda" else f"{t * 1e3:.0f}", peak_above(base, device)


def in_a_fresh_process(fn, *args):
    """fn(*args) in a process of its own, so that its peak resident memory is its own: forked from a
    server that has imported torch, torch._dynamo (AdamW's first call imports it) and this file's
    modules once (seconds per process)."""
    fresh = multiprocessing.get_context("forkserver")
    preload = [
        "torch",
        "torch._dynamo",
        "model",
        "lib.devices",
        "fast_paths",
        "generate",
        "lib.parallel",
    ]
    fresh.set_forkserver_preload(preload)
    with ProcessPoolExecutor(1, mp_context=fresh) as pool:
        return pool.submit(fn, *args).result()


def bench_attention(args, device: str) -> None:
    """The bias encodings' attention at long contexts, forward + backward. The reference path is
    SDPA with the materialized (nh, T, T) bias: its math path, or on a CPU its flash kernel where
    the bias needs no gradient. The default is the kernel table's: on a GPU FlexAttention (FIRE: its
    rows a block of queries at a time), on a CPU the table kernel (FIRE past its threshold: by
    rows)."""
    batch = 4 if device == "cuda" else 1
    dtype = "bf16" if device == "cuda" else "float32"
    size = f"1 layer, 768 dims, 12 heads, batch {batch}, {dtype}"
    print(f"\n### Attention for the bias encodings at long contexts ({size})\n")
    print("| encoding | context | reference ms | default ms | reference peak | default peak |")
    print("|---|---:|---:|---:|---:|---:|")
    for enc in args.attention_encodings:
        for T in args.attention_lengths:
            cells = []
            for fused in (False, None):
                if device == "cuda":
                    cells.append(attention_cell(enc, T, fused, args, device, batch))
                else:  # its peak RSS is this cell's alone
                    cells.append(
                        in_a_fresh_process(attention_cell, enc, T, fused, args, device, batch)
                    )
            print(
                f"| {enc} | {T} | {cells[0][0]} | {cells[1][0]} | {cells[0][1]} | {cells[1][1]} |",
                flush=True,
            )


def memory_cell(
    enc: str, T: int, mode: str, B: int, steps: int, n_layer: int = 6, device: str = "cpu"
) -> tuple[float, float, float]:
    """One training step of the comparison model (config/<enc>.py's shape, float32, eager) at B rows
    of T tokens with activation checkpointing `mode`, in a fresh process: its measured peak above
    the model's setup (MiB: the resident high-water mark on a CPU, torch.cuda.max_memory_allocated
    on a GPU), its time (ms, the median of `steps`) and devices.training_bytes's estimate (MiB)."""
    from lib.devices import training_bytes
    from shape import set_activation_checkpointing

    torch.manual_seed(0)
    cfg = GPTConfig(
        block_size=T,
        vocab_size=65,
        n_layer=n_layer,
        n_head=6,
        n_embd=384,
        bias=False,
        pos_encoding=enc,
    )
    model = GPT(cfg).train().to(device)
    set_activation_checkpointing(model, mode)
    estimate = training_bytes(model, B, T, device)
    opt = model.configure_optimizers(0.1, 1e-3, (0.9, 0.99), device)
    x = torch.randint(0, 65, (B, T), device=device)

    def step():
        model(x, x)[1].backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    reset_memory(device)
    base = memory_now(device)
    step()
    peak = float(peak_above(base, device).split()[0].replace(",", ""))
    t = timed(step, device, steps, 0)
    return peak, t * 1e3, (estimate["peak"] - estimate["weights"]) / 2**20


def longest_block(enc: str, mode: str, B: int, budget: float, n_layer: int = 6) -> int:
    """The longest power-of-two block (from 256) whose estimated step fits budget bytes
    (devices.training_bytes)."""
    from lib.devices import training_bytes
    from shape import set_activation_checkpointing

    T = 256
    while True:
        cfg = GPTConfig(
            block_size=2 * T,
            vocab_size=65,
            n_layer=n_layer,
            n_head=6,
            n_embd=384,
            bias=False,
            pos_encoding=enc,
        )
        with torch.device("cpu"):
            model = GPT(cfg).train()
        set_activation_checkpointing(model, mode)
        if training_bytes(model, B, 2 * T, "cpu")["peak"] > budget or T >= 2**20:
            return T
        T *= 2


def bench_memory(args, device: str) -> None:
    """Peak memory and step time of one training step per encoding, block size and activation
    checkpointing mode, in fresh processes (CPU), beside the estimate; then, for a memory budget,
    the longest block each mode trains at."""
    B = args.memory_batch
    L = args.memory_n_layer
    if args.memory_blocks:
        print(
            f"\n### Training step memory (comparison model with {L} layers, batch {B}, float32, "
            f"{device})\n"
        )
        print(
            "| encoding | block | none: peak MiB (estimate) | ms | full: peak MiB (estimate) | ms "
            "| selective: peak MiB (estimate) | ms |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for enc in args.memory_encodings:
        for T in args.memory_blocks:
            cells = []
            for mode in ("none", "full", "selective"):
                peak, ms, est = in_a_fresh_process(
                    memory_cell, enc, T, mode, B, args.memory_steps, L, device
                )
                cells += [f"{peak:,.0f} ({est:,.0f})", f"{ms:,.0f}"]
            print(f"| {enc} | {T} | " + " | ".join(cells) + " |", flush=True)
    budget = args.memory_budget_gb * 2**30
    print(
        f"\n### The longest block that fits {args.memory_budget_gb:g} GiB ({L} layers, "
        f"estimated; batch {B})\n"
    )
    print("| encoding | none | full | selective |\n|---|---:|---:|---:|")
    for enc in args.memory_encodings:
        # a process each: the memory one frees stays with it
        longest = [
            in_a_fresh_process(longest_block, enc, m, B, budget, L)
            for m in ("none", "full", "selective")
        ]
        print(f"| {enc} | " + " | ".join(f"{T:,}" for T in longest) + " |", flush=True)


def run_train_py(cmd: list[str]) -> tuple[str, list[float], str | None]:
    """A train.py command (python train.py ..., or torchrun's) run in a temporary out_dir: its
    stdout, the step times it logged (ms), and if it failed, the last line it wrote."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as out:
        r = subprocess.run(
            [*cmd, f"--out_dir={out}"],
            cwd=Path(__file__).resolve().parents[1],
            capture_output=True,
            text=True,
        )
    times = [float(t) for t in re.findall(r"^iter \d+: .*?time ([\d.]+)ms", r.stdout, re.M)]
    if r.returncode == 0:
        return r.stdout, times, None
    lines = [ln for ln in (r.stderr or r.stdout).strip().splitlines() if ln.strip()]
    return r.stdout, times, lines[-1][:120] if lines else f"exit {r.returncode}"


def bench_shapes(args, device: str) -> None:
    """Does `train.py config/<encoding>.py` train at each shape (compiled in bf16 on a GPU), and on
    which attention path? Each cell is a fresh train.py process of a few iterations, so a crash is a
    cell, not the end of the table."""
    print(f"\n### train.py at every shape, {args.shape_iters} iterations each ({device})\n")
    print("| encoding | shape | result | ms/iteration (last) | notes |")
    print("|---|---|---|---:|---|")
    for enc in args.shape_encodings:
        for shape in args.shapes:
            cmd = [
                sys.executable,
                "train.py",
                f"config/{enc}.py",
                *SHAPES[shape],
                f"--device={device}",
            ]
            cmd += [
                f"--max_iters={args.shape_iters}",
                f"--eval_interval={args.shape_iters}",
                "--eval_iters=1",
            ]
            cmd += ["--log_interval=1", "--warmup_iters=0", *args.shape_train]
            stdout, times, failed = run_train_py(cmd)
            notes = [ln[6:].split(";")[0] for ln in stdout.splitlines() if ln.startswith("note: ")]
            result = f"FAILS: {failed}" if failed else "trains"
            cell = f"{times[-1]:.1f}" if times else "-"
            print(f"| {enc} | {shape} | {result} | {cell} | {'; '.join(notes)[:200]} |", flush=True)


def bench_parallel(args, device: str) -> None:
    """DDP against FSDP (train.py --parallel) at args.parallel_procs processes of torchrun: the
    median step time after the first iterations, and what each process holds of the parameters and
    of AdamW's state (train.py measures its tensors: its shards under FSDP), with the GPU's peak
    allocation where there is one."""
    n = args.parallel_procs
    print(
        f"\n### DDP and FSDP at {n} processes, {args.parallel_iters} iterations each ({device})\n"
    )
    print(
        "| strategy | ms/iteration (median) | parameters per process | AdamW's state per "
        "process | peak (GPU) |"
    )
    print("|---|---:|---:|---:|---:|")
    for strategy in STRATEGIES:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={n}",
            "train.py",
        ]
        cmd += [
            *args.parallel_config,
            f"--device={device}",
            f"--parallel={strategy}",
            "--log_interval=1",
        ]
        cmd += [
            f"--max_iters={args.parallel_iters}",
            f"--eval_interval={args.parallel_iters}",
            "--eval_iters=1",
        ]
        cmd += [f"--gradient_accumulation_steps={n}", *args.parallel_train]
        stdout, times, failed = run_train_py(cmd)
        if failed:
            print(f"| {strategy} | FAILS: {failed} | | | |", flush=True)
            continue
        times = times[2:]  # after compilation and warm-up
        held = re.search(
            r"parameters ([\d.,]+) MiB of ([\d.,]+), AdamW's state ([\d.,]+) "
            r"MiB of ([\d.,]+)",
            stdout,
        )
        peak = re.search(r"peak allocated ([\d.,]+) MiB", stdout)
        p, p_all, o, o_all = held.groups() if held else ("-",) * 4
        cells = [
            f"{statistics.median(times):.1f}" if times else "-",
            f"{p} of {p_all} MiB",
            f"{o} of {o_all} MiB",
        ]
        print(
            f"| {strategy} | {' | '.join(cells)} | {peak.group(1) + ' MiB' if peak else '-'} |",
            flush=True,
        )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m compare.bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--nanogpt",
        default=None,
        help="folder of a nanoGPT clone, to measure its model.py beside ours",
    )
    p.add_argument(
        "--only",
        choices=[
            "train",
            "encodings",
            "packing",
            "decode",
            "attention",
            "shapes",
            "parallel",
            "memory",
        ],
        default=None,
    )
    p.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="torch.compile the training steps (default: on a GPU; --compile on a CPU too)",
    )
    p.add_argument(
        "--steps", type=int, default=20, help="timed steps per measurement (the median is reported)"
    )
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument(
        "--rounds", type=int, default=5, help="interleaved rounds for the nanoGPT comparison"
    )
    p.add_argument(
        "--encoding_blocks",
        type=int,
        nargs="+",
        default=None,
        help="--only=encodings: these block sizes only",
    )
    p.add_argument(
        "--step_encodings",
        nargs="+",
        default=ENCODINGS,
        choices=ENCODINGS,
        help="--only=encodings: which",
    )
    p.add_argument(
        "--profile_encodings",
        nargs="*",
        default=None,
        choices=ENCODINGS,
        help="--only=encodings and decode: print where these encodings' step (and 16 decoded "
        "tokens) spend their time",
    )
    p.add_argument(
        "--flex_options",
        type=json.loads,
        default=None,
        help="--only=encodings: FlexAttention's kernel options to try, JSON, e.g. "
        + """'{"BLOCK_M": 64, "BLOCK_N": 64, "num_stages": 2}' """
        + "(the kernel column then names them)",
    )
    p.add_argument("--decode_tokens", type=int, default=512)
    p.add_argument("--decode_encodings", nargs="+", default=ENCODINGS, choices=ENCODINGS)
    p.add_argument("--attention_lengths", type=int, nargs="+", default=[1024, 4096])
    p.add_argument(
        "--attention_encodings",
        nargs="+",
        default=BIASED,
        choices=BIASED,
        help="--only=attention: which",
    )
    p.add_argument(
        "--shapes",
        nargs="+",
        choices=list(SHAPES),
        default=list(SHAPES),
        help="--only=shapes: which",
    )
    p.add_argument("--shape_encodings", nargs="+", default=ENCODINGS, choices=ENCODINGS)
    p.add_argument("--shape_iters", type=int, default=6, help="--only=shapes: iterations per cell")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: PyTorch's)")
    p.add_argument(
        "--memory_encodings",
        nargs="+",
        default=ENCODINGS,
        choices=ENCODINGS,
        help="--only=memory: which",
    )
    p.add_argument(
        "--memory_blocks",
        type=int,
        nargs="*",
        default=[256, 1024, 2048],
        help="--only=memory (none: the budget alone)",
    )
    p.add_argument("--memory_batch", type=int, default=4, help="--only=memory: rows per step")
    p.add_argument(
        "--memory_n_layer", type=int, default=6, help="--only=memory: the comparison model's depth"
    )
    p.add_argument(
        "--memory_steps", type=int, default=3, help="--only=memory: timed steps per cell"
    )
    p.add_argument(
        "--memory_budget_gb",
        type=float,
        default=8.0,
        help="--only=memory: the longest block's budget",
    )
    p.add_argument(
        "--parallel_procs", type=int, default=2, help="--only=parallel: processes (torchrun)"
    )
    p.add_argument(
        "--parallel_iters", type=int, default=30, help="--only=parallel: iterations per strategy"
    )
    p.add_argument(
        "--parallel_config",
        nargs="+",
        default=["config/rope.py", "config/cpu.py"],
        help="--only=parallel: the configs (CPU: the CPU-sized RoPE model; GPU: config/gpt2.py "
        "for 124M)",
    )
    p.add_argument(
        "--shape_train",
        nargs=argparse.REMAINDER,
        default=[],
        help="--only=shapes: train.py options for every cell",
    )
    p.add_argument(
        "--parallel_train",
        nargs=argparse.REMAINDER,
        default=[],
        help="--only=parallel: train.py options for both",
    )
    args = p.parse_args(argv)
    check_args(p, args)
    device = torch.device(args.device).type  # cuda:N: that GPU, as the current one
    if torch.device(args.device).index is not None:
        torch.cuda.set_device(args.device)
    args.compile = device == "cuda" if args.compile is None else args.compile
    allow_tf32(device)
    if args.threads:
        torch.set_num_threads(args.threads)
    nanogpt = load_nanogpt(args.nanogpt)
    name = (
        torch.cuda.get_device_name()
        if device == "cuda"
        else f"CPU, {torch.get_num_threads()} threads"
    )
    print(f"nanoPE bench: {name}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}")
    tables = {
        "train": lambda: bench_train(args, device, nanogpt),
        "encodings": lambda: bench_encodings(args, device),
        "packing": lambda: bench_packing(args, device),
        "decode": lambda: bench_decode(args, device, nanogpt),
        "attention": lambda: bench_attention(args, device),
        "shapes": lambda: bench_shapes(args, device),
        "parallel": lambda: bench_parallel(args, device),
        "memory": lambda: bench_memory(args, device),
    }
    # shapes, parallel, memory and packing take long: only when asked
    for key, fn in tables.items():
        if args.only == key or (
            args.only is None and key not in ("shapes", "parallel", "memory", "packing")
        ):
            fn()


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Each option in its range, one line naming it (a count of nothing would divide by zero or time
    nothing), the device one this machine has, and the block sizes asked among the table's."""
    try:
        check_device(args.device)
    except ConfigError as e:
        p.error(str(e))
    least = dict(
        steps=1, rounds=1, warmup=0, decode_tokens=1, shape_iters=1, threads=1, memory_batch=1
    )
    least |= dict(memory_n_layer=1, memory_steps=1, parallel_procs=1, parallel_iters=1)
    for name, most in least.items():
        if (value := getattr(args, name)) is not None and value < most:
            p.error(f"--{name}={value}: must be at least {most}")
    if not args.memory_budget_gb > 0:
        p.error(f"--memory_budget_gb={args.memory_budget_gb}: must be a positive number of GB")
    for name in ("attention_lengths", "memory_blocks", "encoding_blocks"):
        if (lengths := getattr(args, name)) and min(lengths) < 1:
            p.error(f"--{name} {' '.join(map(str, lengths))}: every block must be at least 1")
    blocks = [cfg["block_size"] for cfg in sizes(torch.device(args.device).type)["encodings"]]
    if args.encoding_blocks and not set(args.encoding_blocks) & set(blocks):
        p.error(
            f"--encoding_blocks {' '.join(map(str, args.encoding_blocks))}: this device's table "
            f"has blocks {blocks}"
        )


if __name__ == "__main__":
    main()
