"""
The machine: which device, which dtype, what a GPU can do. One place for what every script asks of
it (train.py, sample.py, the evaluations, the benchmark), so that a rule (TF32 on, float32 on CPUs,
a device's name checked) lives once.
"""

import importlib.util
import os
from contextlib import contextmanager, nullcontext

import torch

from lib.configurator import ConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
GPU_PEAK_FLOPS = {
    "H100": 989e12,
    "H200": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "L4": 121e12,
    "A10": 125e12,
}


def default_device() -> str:
    """The best device here: cuda, then mps, then cpu."""
    if torch.cuda.is_available():
        return "cuda"
    if torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def check_device(device: str) -> None:
    """device is one this machine has: cpu, cuda, cuda:N (N below the GPU count) or mps."""
    try:
        kind = torch.device(device).type
        index = torch.device(device).index
    except RuntimeError:
        kind, index = None, None
    if kind not in ("cpu", "cuda", "mps"):
        raise ConfigError(
            f"device={device!r} is not a device; choose cpu, cuda, cuda:N (the Nth GPU) or mps"
        )
    if kind == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"device={device!r} but CUDA is not available here (no GPU, or a CPU-only PyTorch); "
            "use --device=cpu"
        )
    if kind == "cuda" and index is not None and index >= torch.cuda.device_count():
        raise ConfigError(
            f"device={device!r} but this machine has {torch.cuda.device_count()} "
            "GPU(s), cuda:0 and up"
        )
    if kind == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(
            f"device={device!r} but MPS (Apple GPUs) is not available here; use --device=cpu"
        )


def default_dtype(device: str) -> str:
    """bfloat16 where the GPU supports it, else float16 (with a GradScaler in training); float32 on
    CPU."""
    if device.startswith("cuda"):
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    return "float32"


def autocast(device: str, dtype: str | torch.dtype):
    """The mixed-precision context for device ("cuda:1", "cpu", ...) and dtype: none for float32,
    else autocast (on CPUs too, so the bf16 and fp16 paths run in CI). The one place that rule
    lives."""
    dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    return (
        nullcontext()
        if dtype == torch.float32
        else torch.autocast(device.split(":")[0], dtype=dtype)
    )


def allow_tf32(device: str) -> None:
    """On a GPU, float32 matmuls and convolutions in TF32 (nanoGPT's setting): the tensor cores, at
    10 bits of mantissa where bf16 autocast does not already cover them."""
    if device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def estimate_mfu(model, tokens_per_iter: int, dt: float, peak_flops: float) -> float:
    """Model FLOPs utilization of a model.GPT: 6N per token for the weights plus attention's
    12·L·H·Q·T (PaLM, App. B; H·Q = C)."""
    c = model.config
    flops_per_token = 6 * model.get_num_params() + 12 * c.n_layer * c.n_embd * c.block_size
    return flops_per_token * tokens_per_iter / dt / peak_flops


def peak_flops(device: str | torch.device) -> float | None:
    """The GPU's dense bf16 peak, for MFU; None where it is not known (CPUs, unlisted GPUs)."""
    if torch.device(device).type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in GPU_PEAK_FLOPS.items() if k in name), None)


def device_memory(device: str) -> int | None:
    """The device's memory in bytes (the GPU's, or the machine's for cpu); None where it cannot be
    told."""
    if device.startswith("cuda"):
        return torch.cuda.get_device_properties(torch.device(device)).total_memory
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if device == "cpu" else None
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows) or no such name
        return None


def forward_bytes(model, L: int, B: int = 1, logits: bool = True) -> int:
    """The least memory a forward of a GPT (model.py) over B windows of L tokens takes without
    gradients: the hidden states and the MLP's (fp32, a layer at a time), the logits and the loss's
    copy, and for an encoding with a score bias the (nh, L, L) bias and the (L, L) distances that
    the reference attention materializes (once for the batch). A forward that needs more than the
    device has cannot run at all."""
    c = model.config
    square = (4 * c.n_head + 9) * L * L if model.encoding.has_score_bias else 0
    return B * L * (32 * c.n_embd + (8 * c.vocab_size if logits else 0)) + square


def missing(package: str, needed_for: str) -> str | None:
    """Where an optional package (requirements-full.txt's: wandb, datasets, transformers) is not
    installed, what to do, as one line; None where it is."""
    if importlib.util.find_spec(package) is not None:
        return None
    return (
        f"{needed_for} needs {package}, which is not installed: pip install -r "
        f"requirements-full.txt (or {package})"
    )


def gb(n: float) -> str:
    return f"{n / 2**30:,.1f} GB"


# --------------------------------------------------------------------------------------------------
# A training step's peak memory, estimated before training


def saved_bytes(model, B: int, T: int, device: str, dtype: str = "float32") -> int:
    """The bytes autograd keeps for the backward of one training forward of model (a GPT) on B rows
    of T tokens, on the path this device takes eagerly: every saved tensor's storage once, the
    parameters' left out."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    idx = torch.zeros(B, T, dtype=torch.long, device=device)
    # dropout's draws left as they were
    cuda = [torch.device(device).index or 0] if device.startswith("cuda") else []
    with torch.random.fork_rng(devices=cuda), torch.enable_grad(), autocast(device, dtype):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(idx, targets=idx)
    return sum(storages.values())


def activation_bytes(model, B: int, T: int, device: str, dtype: str = "float32") -> tuple[int, int]:
    """saved_bytes at B rows of T tokens, from six small forwards: what grows with the rows (per
    token, and per pair of a row, as attention's probabilities) and what the rows share (a table of
    the bias, per position, and per pair, as a score bias matrix), each fitted as a + x·n + y·n²
    over three lengths n; and of it, the rows' shared pairs (the score bias matrices)."""
    n1 = max(2, min(32, model.config.block_size // 4, T // 4))
    lengths = (n1, 2 * n1, 4 * n1)
    powers = torch.tensor([[1.0, n, n * n] for n in lengths], dtype=torch.float64)

    # a + x·n + y·n² through three points
    def fit(f: list[float], n: int, square_only: bool = False) -> float:
        a, x, y = torch.linalg.solve(powers, torch.tensor(f, dtype=torch.float64)).tolist()
        return y * n * n if square_only else a + x * n + y * n * n

    one = [saved_bytes(model, 1, n, device, dtype) for n in lengths]
    three = [saved_bytes(model, 3, n, device, dtype) for n in lengths]
    per_row = [(s3 - s1) / 2 for s1, s3 in zip(one, three, strict=True)]
    shared = [s1 - r for s1, r in zip(one, per_row, strict=True)]
    return max(0, round(B * fit(per_row, T) + fit(shared, T))), max(
        0, round(fit(shared, T, square_only=True))
    )


@contextmanager
def checkpointing(model, mode: str):
    """model (a GPT) with every block's activation checkpointing set to mode, then as it was."""
    modes = [block.checkpointing for block in model.transformer.h]
    for block in model.transformer.h:
        block.checkpointing = mode
    try:
        yield
    finally:
        for block, was in zip(model.transformer.h, modes, strict=True):
            block.checkpointing = was


def training_bytes(
    model, B: int, T: int, device: str, dtype: str = "float32", shards: int = 1
) -> dict[str, int]:
    """A training step's peak memory per process, by part: the float32 weights, their gradients and
    AdamW's two moments (the last two split over `shards` processes under FSDP), the activations the
    forward keeps for the backward (as activation checkpointing is set on model), and what the
    backward holds at once on top: one block's activations (recomputed there with checkpointing, and
    the gradients of a block's activations). The peak is the larger of the backward's and AdamW's
    step (gradients and moments, the activations freed)."""
    n = sum(p.numel() for p in model.parameters())
    modes = [block.checkpointing for block in model.transformer.h]
    kept, bias = activation_bytes(model, B, T, device, dtype)
    every, every_bias = kept, bias  # what the forward keeps without checkpointing
    if modes[0] != "none":
        with checkpointing(model, "none"):
            every, every_bias = activation_bytes(model, B, T, device, dtype)
        # the score bias matrices stay alive for the recompute, whether or not they are saved, and
        # the backward recomputes one with its gradient where the bias is trained (ALiBi's is not)
        one = every_bias // (model.config.n_layer if model.encoding.per_layer else 1)
        trained = any(p.requires_grad for p in model.encoding.parameters())
        kept += max(0, every_bias - bias) + (2 * one if trained else 0)
    layer = (every - every_bias) // model.config.n_layer
    # the gradients' temporaries of a block, and its recompute (full)
    recomputed = 2 if modes[0] == "full" else 1
    parts = {
        "weights": 4 * n,
        "gradients": 4 * n // shards,
        "AdamW": 8 * n // shards,
        "activations": kept,
    }
    backward = parts["gradients"] + kept + recomputed * layer
    # AdamW's foreach step makes a copy's worth
    step = parts["gradients"] + parts["AdamW"] + 4 * n // shards
    parts["peak"] = parts["weights"] + max(backward, step)
    return parts


def check_memory(model, cfg: dict, procs, shards: int) -> None:
    """Log the step's estimated peak memory per process (devices.training_bytes); where it exceeds
    the device's, stop before any work, naming the options that bring it under and what each would
    need."""
    B = cfg["batch_size"]
    T = cfg["block_size"]
    dev = procs.device

    def peak(B: int, T: int) -> str:
        return gb(training_bytes(model, B, T, dev, cfg["dtype"], shards)["peak"])

    parts = training_bytes(model, B, T, dev, cfg["dtype"], shards)
    mib = ", ".join(f"{k} {v / 2**20:,.0f} MiB" for k, v in parts.items() if k != "peak")
    procs.log(f"memory: about {gb(parts['peak'])} per process at the step's peak ({mib})")
    memory = device_memory(dev)
    if not memory or parts["peak"] <= memory:
        return
    fixes = []
    mode = cfg["activation_checkpointing"]
    if mode != "full":
        with checkpointing(model, "full"):
            fixes.append(f"--activation_checkpointing=full ({peak(B, T)})")
    if B > 1:
        accum = f"--gradient_accumulation_steps={cfg['gradient_accumulation_steps'] * 2}"
        fixes.append(f"--batch_size={B // 2} {accum} ({peak(B // 2, T)})")
    if T > 1:
        fixes.append(f"--block_size={T // 2} ({peak(B, T // 2)})")
    raise ConfigError(
        f"a training step of this run needs about {gb(parts['peak'])} per process, more than the "
        f"{gb(memory)} of "
        f"{dev}: try {', or '.join(fixes)}"
    )
