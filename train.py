"""
Train a GPT with any positional encoding, with nanoGPT's config keys.
    python train.py config/rope.py                        # one GPU (bf16 + torch.compile), or the CPU
    python train.py config/rope.py config/cpu.py          # a CPU-sized run (minutes on a laptop)
    python train.py config/rope.py --init_from=resume     # continue a run exactly where it stopped
    torchrun --standalone --nproc_per_node=8 train.py config/gpt2.py
Ctrl-C (or SIGTERM) saves a checkpoint after the current iteration, then exits; press it twice to quit at once.
"""

import math
import os
import runpy
import signal
import sys
import time
from dataclasses import asdict, fields
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from checkpoint import (
    CheckpointError,
    load_checkpoint,
    model_from_checkpoint,
    remove_stale_temporaries,
    save_checkpoint,
)
from configurator import ConfigError, autocast, configure, default_device, default_dtype
from datafiles import SPLITS, DataError, dataset_dir, get_batch, load_meta
from model import GPT, GPTConfig
from tasks import TaskError, check_tasks, mix_tasks
from tokenizer import tokenizer_from_meta

# -----------------------------------------------------------------------------------------------------------------
# Defaults: the comparison experiment of config/<encoding>.py, a ~10M-parameter character-level GPT on the complete
# works of Shakespeare at block 256 (nanoGPT's shakespeare_char sizes; minutes on one GPU).
defaults = dict(
    # I/O
    out_dir="",  # default: out-<pos_encoding>
    eval_interval=250,
    log_interval=10,
    eval_iters=200,  # batches per split for each validation estimate (the same batches every time)
    eval_only=False,  # evaluate once and exit
    always_save_checkpoint=True,  # save ckpt.pt at every eval; False: only when val loss improves, and at the end
    init_from="scratch",  # scratch | resume (from out_dir/ckpt.pt) | gpt2 | gpt2-medium | gpt2-large | gpt2-xl | a
    # local Hugging Face GPT-2 folder
    overwrite=False,  # True: start afresh in an out_dir that holds a run, replacing its checkpoints
    # wandb
    wandb_log=False,
    wandb_project="nanope",
    wandb_run_name="",  # default: <pos_encoding>
    wandb_group="",  # default: <dataset>-<n_layer>L-<n_embd>d-T<block_size>, so one experiment's encodings sit together
    # data
    dataset="shakespeare_char",  # a folder of data/, or a path to a prepared one (shakespeare_char and shakespeare
    # are prepared automatically the first time)
    gradient_accumulation_steps=1,  # micro-steps per iteration, over all processes
    batch_size=64,  # sequences per micro-step and process
    block_size=256,
    task_fraction=0.0,  # the fraction of training sequences that are retrieval tasks (tasks.py: passkey, recall,
    # copy; answers-only targets), e.g. 0.05; validation stays text
    task_seed=None,  # seeds the task sequences with the iteration (default: seed)
    # model
    pos_encoding="rope",  # sinusoidal | learned | bias_rpe | t5 | kerple | rope | alibi | fire | none
    rpe_max_distance=128,  # bias_rpe: distances clamp to ±(r_max - 1)
    t5_num_buckets=32,  # t5: half exact distances, half log-spaced up to t5_max_distance
    t5_max_distance=128,  # t5: farther distances share the last bucket
    rope_base=10000.0,  # rope: θ_k = base^(-2k/d)
    rope_fraction=1.0,  # rope: the fraction of each head's pairs that rotate (the fastest; p-RoPE)
    rope_scaling="none",  # rope, to run past block_size: none | linear | ntk | dynamic_ntk | yarn | llama3
    rope_factor=1.0,  # rope_scaling's s: the context is stretched s times
    rope_original_max_len=None,  # rope_scaling's L0, the original training length (None: block_size)
    gelu="exact",  # exact (nanoGPT's) | tanh (GPT-2's; GPT-2 checkpoints bring their own)
    n_layer=6,
    n_head=6,
    n_embd=384,
    dropout=0.2,  # 0 for pretraining, 0.1+ for finetuning and small data
    bias=False,  # biases in Linears and LayerNorms (GPT-2 has them)
    # AdamW
    learning_rate=1e-3,
    pe_lr_scale=1.0,  # the positional encoding's parameters learn this many times faster (a bias table from zero moves
    # about learning_rate per step under Adam)
    max_iters=5000,
    weight_decay=1e-1,
    beta1=0.9,
    beta2=0.99,
    grad_clip=1.0,  # clip gradients at this norm, 0 to disable
    # learning-rate schedule: linear warmup, then cosine decay to min_lr
    decay_lr=True,
    warmup_iters=100,
    lr_decay_iters=5000,  # ~= max_iters (Chinchilla)
    min_lr=1e-4,  # ~= learning_rate / 10 (Chinchilla)
    # system
    backend="",  # DDP backend: nccl | gloo; default nccl on GPU, gloo on CPU
    device=default_device(),  # cuda, cuda:1, mps, cpu; default the best available
    dtype="",  # float32 | bfloat16 | float16; default bfloat16 where the GPU has it, else float16; float32 on CPU
    compile=None,  # torch.compile the model; default on for CUDA
    seed=1337,
)
EMBEDDED_DATASETS = ("shakespeare_char", "shakespeare")  # prepared from files in the repository, offline
# what decides which batches a validation estimate averages over: val losses compare only when these agree
EVAL_SETUP_KEYS = ("dataset", "block_size", "batch_size", "eval_iters", "seed", "world_size")
GPU_PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12, "L4": 121e12, "A10": 125e12}


class TrainError(Exception):
    pass


def resolve(cfg: dict) -> dict:
    """Fill in the defaults that depend on other keys, and check the values no type check catches, so that a bad
    value is a one-line error before any work."""
    cfg = dict(cfg)
    cfg["out_dir"] = cfg["out_dir"] or f"out-{cfg['pos_encoding']}"
    cfg["wandb_run_name"] = cfg["wandb_run_name"] or cfg["pos_encoding"]
    cfg["task_seed"] = cfg["seed"] if cfg["task_seed"] is None else cfg["task_seed"]
    cfg["wandb_group"] = cfg["wandb_group"] or (
        f"{cfg['dataset']}-{cfg['n_layer']}L-{cfg['n_embd']}d-T{cfg['block_size']}"
    )
    check_device(cfg["device"])
    cfg["dtype"] = cfg["dtype"] or default_dtype(cfg["device"])
    if cfg["compile"] is None:
        cfg["compile"] = cfg["device"].startswith("cuda")
    if cfg["dtype"] not in ("float32", "bfloat16", "float16"):
        raise ConfigError(f"dtype={cfg['dtype']!r}: choose float32, bfloat16 or float16")
    if not isinstance(cfg["compile"], bool):
        raise ConfigError(f"compile={cfg['compile']!r}: expected True or False")
    if cfg["backend"] not in ("", "nccl", "gloo", "mpi", "ucc"):
        raise ConfigError(f"backend={cfg['backend']!r}: choose nccl (GPUs) or gloo (CPUs), or leave it empty")
    init = cfg["init_from"]
    if init not in ("scratch", "resume") and not init.startswith("gpt2") and not Path(init).is_dir():
        raise ConfigError(f"init_from={init!r}: choose scratch, resume, a GPT-2 name like gpt2-medium, or a folder")
    check_ranges(cfg)
    world_size = int(os.environ.get("WORLD_SIZE", 1))  # torchrun's, known before the process group starts
    if cfg["gradient_accumulation_steps"] % world_size:
        raise ConfigError(
            f"gradient_accumulation_steps={cfg['gradient_accumulation_steps']} must be a multiple of the "
            f"{world_size} processes"
        )
    if init == "scratch":  # the model's own checks (GPTConfig), before the data is prepared or the model built
        try:
            GPTConfig(**{f.name: cfg[f.name] for f in fields(GPTConfig) if f.name in cfg})
        except ValueError as e:  # GPTConfig names the bad field and the valid choices
            raise ConfigError(str(e)) from e
    return cfg


def check_device(device: str) -> None:
    """device is one this machine has: cpu, cuda, cuda:N (N below the GPU count) or mps."""
    try:
        kind, index = torch.device(device).type, torch.device(device).index
    except RuntimeError:
        kind, index = None, None
    if kind not in ("cpu", "cuda", "mps"):
        raise ConfigError(f"device={device!r} is not a device; choose cpu, cuda, cuda:N (the Nth GPU) or mps")
    if kind == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"device={device!r} but CUDA is not available here (no GPU, or a CPU-only PyTorch); use --device=cpu"
        )
    if kind == "cuda" and index is not None and index >= torch.cuda.device_count():
        raise ConfigError(f"device={device!r} but this machine has {torch.cuda.device_count()} GPU(s), cuda:0 and up")
    if kind == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"device={device!r} but MPS (Apple GPUs) is not available here; use --device=cpu")


def check_ranges(cfg: dict) -> None:
    """The numeric ranges of the training options; each error names the value, the rule and the usual setting."""

    def need(ok: bool, key: str, rule: str) -> None:
        if not ok:  # NaN fails every comparison, so it lands here too
            raise ConfigError(f"{key}={cfg[key]!r} {rule}")

    for key in (
        "eval_interval",
        "log_interval",
        "eval_iters",
        "batch_size",
        "block_size",
        "gradient_accumulation_steps",
    ):
        need(cfg[key] >= 1, key, "must be at least 1")
    need(
        cfg["max_iters"] >= 1 or cfg["eval_only"],
        "max_iters",
        "trains nothing (it would only save an untrained model); give a positive number, or --eval_only=True to "
        "evaluate without training",
    )
    need(cfg["learning_rate"] > 0, "learning_rate", "must be positive (1e-3 for small models, 6e-4 for GPT-2)")
    need(cfg["pe_lr_scale"] > 0, "pe_lr_scale", "must be positive (1: the same rate as the rest)")
    need(cfg["min_lr"] >= 0, "min_lr", "must be at least 0 (about learning_rate / 10)")
    need(cfg["warmup_iters"] >= 0, "warmup_iters", "must be at least 0 (0: no warmup)")
    need(cfg["lr_decay_iters"] >= 0, "lr_decay_iters", "must be at least 0 (about max_iters)")
    need(cfg["weight_decay"] >= 0, "weight_decay", "must be at least 0 (0 disables it; 0.1 is usual)")
    need(0 <= cfg["beta1"] < 1, "beta1", "must be in [0, 1) (0.9 is usual)")
    need(0 <= cfg["beta2"] < 1, "beta2", "must be in [0, 1) (0.95 or 0.99 are usual)")
    need(0 <= cfg["dropout"] < 1, "dropout", "must be in [0, 1) (0 for pretraining, 0.1-0.2 for small data)")
    need(0 <= cfg["seed"] < 2**62, "seed", "must be in [0, 2**62) (torch's generators take 64-bit seeds)")
    need(0 <= cfg["task_fraction"] < 1, "task_fraction", "must be in [0, 1) (0: text only; 0.05-0.1 is usual)")
    need(isinstance(cfg["task_seed"], int) and cfg["task_seed"] >= 0, "task_seed", "must be an integer at least 0")
    need(
        cfg["grad_clip"] >= 0, "grad_clip", "must be at least 0 (0 disables clipping; a negative norm trains backwards)"
    )


def odd_values(cfg: dict) -> list[str]:
    """Values that are legal but probably not meant: training goes ahead, and the log says so once."""
    notes = []
    if cfg["decay_lr"] and cfg["min_lr"] > cfg["learning_rate"]:
        notes.append(f"min_lr={cfg['min_lr']} > learning_rate={cfg['learning_rate']}: the decay raises the rate")
    if cfg["decay_lr"] and cfg["warmup_iters"] >= cfg["max_iters"] and not cfg["eval_only"]:
        notes.append(f"warmup_iters={cfg['warmup_iters']} >= max_iters={cfg['max_iters']}: the whole run is warmup")
    elif cfg["decay_lr"] and cfg["lr_decay_iters"] < cfg["warmup_iters"]:
        notes.append(
            f"lr_decay_iters={cfg['lr_decay_iters']} < warmup_iters={cfg['warmup_iters']}: the rate drops to min_lr "
            "right after warmup"
        )
    if cfg["learning_rate"] > 0.1:
        notes.append(f"learning_rate={cfg['learning_rate']} is far above AdamW's usual 1e-4 to 1e-3")
    return notes


def prepare_out_dir(cfg: dict) -> list[Path]:
    """Before any work: out_dir must take checkpoints, a resume must have one, and a fresh start must not replace
    a run there unless told to (--overwrite=True). Clears the temporary files of saves killed mid-write (returned)."""
    out_dir = Path(cfg["out_dir"])
    if cfg["init_from"] == "resume" and not (out_dir / "ckpt.pt").is_file():
        raise CheckpointError(f"no checkpoint at {out_dir / 'ckpt.pt'} to resume from; check --out_dir")
    if out_dir.exists() and not out_dir.is_dir():
        raise TrainError(f"out_dir={str(out_dir)!r} is a file, not a folder; choose another --out_dir")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        probe = out_dir / f".write_test.{os.getpid()}.tmp"  # the one sure test: /proc, read-only mounts, permissions
        probe.write_bytes(b"0")
        probe.unlink()
    except OSError as e:
        raise TrainError(
            f"cannot write checkpoints to out_dir={str(out_dir)!r} ({e.strerror}); choose another --out_dir"
        ) from e
    found = [name for name in ("ckpt.pt", "ckpt_best.pt") if (out_dir / name).exists()]
    if found and cfg["init_from"] != "resume" and not cfg["overwrite"]:
        raise TrainError(
            f"{out_dir} already holds a run ({', '.join(found)}), which starting from {cfg['init_from']} would "
            "overwrite. Continue it with --init_from=resume, train elsewhere with --out_dir=<new folder>, or "
            "replace it with --overwrite=True"
        )
    return remove_stale_temporaries(out_dir)


def get_lr(it: int, cfg: dict) -> float:
    """Linear warmup for warmup_iters, then cosine decay to min_lr at lr_decay_iters."""
    if not cfg["decay_lr"]:
        return cfg["learning_rate"]
    if it < cfg["warmup_iters"]:
        return cfg["learning_rate"] * (it + 1) / (cfg["warmup_iters"] + 1)
    if it > cfg["lr_decay_iters"]:
        return cfg["min_lr"]
    ratio = (it - cfg["warmup_iters"]) / max(1, cfg["lr_decay_iters"] - cfg["warmup_iters"])
    return cfg["min_lr"] + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (cfg["learning_rate"] - cfg["min_lr"])


def changed_eval_setup(ckpt: dict, setup: dict) -> list[str]:
    """How this run's validation differs from the checkpoint's, as 'key old -> new'; older checkpoints without
    eval_setup are read from their config and RNG states."""
    old = ckpt.get("eval_setup") or (
        {k: ckpt.get("config", {}).get(k) for k in EVAL_SETUP_KEYS} | {"world_size": len(ckpt.get("rng", []))}
    )
    return [f"{k} {old.get(k)!r} -> {v!r}" for k, v in setup.items() if old.get(k) != v]


def non_finite(loss: torch.Tensor, norm: torch.Tensor, check_norm: bool, ddp: bool) -> str | None:
    """'loss' or 'gradient norm' if any process saw a non-finite one, else None. Every process gets the same answer:
    under DDP the losses differ per rank, and one rank stopping alone leaves the others waiting in all_reduce."""
    flags = torch.stack([~torch.isfinite(loss), ~torch.isfinite(norm) & check_norm]).float()
    if ddp:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    loss_bad, norm_bad = flags.tolist()
    return "loss" if loss_bad else "gradient norm" if norm_bad else None


def format_duration(seconds: float) -> str:
    seconds = int(seconds)
    h, m, s = seconds // 3600, seconds // 60 % 60, seconds % 60
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def rng_state(device: str) -> dict:
    return {"torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state() if device.startswith("cuda") else None}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None:
        torch.cuda.set_rng_state(state["cuda"])


def usage() -> str:
    """The module docstring and the defaults block of this file, comments and all: every key with its choices."""
    src = Path(__file__).read_text()
    block = src[src.index("defaults = dict(\n") : src.index("\n)\n", src.index("defaults = dict(\n"))]
    keys = "\n".join(line.strip() for line in block.splitlines()[1:])
    return f"{__doc__.strip()}\n\nOptions (--key=value, or key = value in a config file), with their defaults:\n{keys}"


def main(argv: list[str]) -> None:
    if "--help" in argv or "-h" in argv:
        print(usage())
        return
    cfg = resolve(configure(defaults, argv))
    master = int(os.environ.get("RANK", 0)) == 0  # known before the process group: errors come before any work
    if master and not cfg["eval_only"]:  # eval_only writes nothing
        for tmp in prepare_out_dir(cfg):
            print(f"removed {tmp.name}, left by a save that was killed mid-write")
    if master:
        for note in odd_values(cfg):
            print(f"note: {note}")

    # -------------------------------------------------------------------------------------------------------------
    # processes and devices
    ddp = int(os.environ.get("RANK", -1)) != -1
    device = cfg["device"]
    if ddp:
        backend = cfg["backend"] or ("nccl" if device.startswith("cuda") else "gloo")
        dist.init_process_group(backend=backend)
        rank, local_rank, world_size = dist.get_rank(), int(os.environ["LOCAL_RANK"]), dist.get_world_size()
        if device.startswith("cuda"):
            device = f"cuda:{local_rank}"
            torch.cuda.set_device(device)
    else:
        rank, world_size = 0, 1
    log = print if master else (lambda *a, **k: None)
    grad_accum = cfg["gradient_accumulation_steps"] // world_size
    B, T = cfg["batch_size"], cfg["block_size"]
    tokens_per_iter = grad_accum * world_size * B * T
    device_type = "cuda" if device.startswith("cuda") else device.split(":")[0]
    torch.manual_seed(cfg["seed"] + rank)
    if device_type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[cfg["dtype"]]
    ctx = autocast(device, ptdtype)
    out_dir = Path(cfg["out_dir"])

    # -------------------------------------------------------------------------------------------------------------
    # data
    data_dir = dataset_dir(cfg["dataset"])
    if cfg["dataset"] in EMBEDDED_DATASETS and not (data_dir / "meta.json").is_file():
        if master:
            log(f"preparing the {cfg['dataset']} dataset (first run only)")
            runpy.run_path(str(data_dir / "prepare.py"), run_name="__main__")
        if ddp:
            dist.barrier()
    meta = load_meta(data_dir, block_size=T)  # checks meta.json and the token files before any training
    data_vocab = meta["vocab_size"]
    # GPT-2's 50257 tokens padded up to a multiple of 64 (faster matmuls); a char vocabulary as it is
    vocab_size = data_vocab if data_vocab < 1024 else -(-data_vocab // 64) * 64
    task_tok = tokenizer_from_meta(meta["tokenizer"]) if cfg["task_fraction"] else None
    if task_tok is not None:
        try:  # the tasks' characters are in the vocabulary and their phrases fit in a block
            check_tasks(task_tok, T)
        except TaskError as e:
            raise ConfigError(f"task_fraction={cfg['task_fraction']}: {e}") from e

    # -------------------------------------------------------------------------------------------------------------
    # model, optimizer and state
    # block_size is the model's capacity (it may be larger: RoPE, ALiBi... resumed at a smaller T), the rest its shape
    model_keys = [f.name for f in fields(GPTConfig) if f.name in cfg and f.name != "block_size"]
    eval_setup = {k: cfg[k] for k in EVAL_SETUP_KEYS if k in cfg} | {"world_size": world_size}
    iter_num, best_val_loss, ckpt, wandb_run_id = 0, float("inf"), None, None
    if cfg["init_from"] == "scratch":
        try:
            model = GPT(GPTConfig(vocab_size=vocab_size, block_size=T, **{k: cfg[k] for k in model_keys}))
        except ValueError as e:  # GPTConfig names the bad field and the valid choices
            raise ConfigError(str(e)) from e
    elif cfg["init_from"] == "resume":
        ckpt = load_checkpoint(out_dir / "ckpt.pt")
        model = model_from_checkpoint(ckpt)
        iter_num, best_val_loss = ckpt["iter_num"], ckpt["best_val_loss"]
        wandb_run_id = ckpt.get("wandb_run_id")
        log(f"resuming from {out_dir / 'ckpt.pt'} at iteration {iter_num}")
        changed = changed_eval_setup(ckpt, eval_setup)
        if changed and best_val_loss < float("inf"):
            log(
                f"note: validation differs from the checkpoint's ({', '.join(changed)}), so its best val loss "
                f"{best_val_loss:.4f} does not compare; ckpt_best.pt goes to this run's best evaluation"
            )
            best_val_loss = float("inf")
        if iter_num >= cfg["max_iters"] and not cfg["eval_only"]:
            log(
                f"the run in {out_dir} already reached max_iters={cfg['max_iters']}: nothing to train, nothing "
                "written; raise --max_iters to train on, or evaluate it with --eval_only=True"
            )
            if ddp:
                dist.destroy_process_group()
            return
    else:
        try:
            model = GPT.from_pretrained(cfg["init_from"], dropout=cfg["dropout"])
        except (OSError, ImportError, ValueError) as e:  # offline, a misspelled name, no transformers
            raise TrainError(f"cannot load GPT-2 weights from {cfg['init_from']!r}: {e}") from e
        if T < model.config.block_size:
            model.crop_block_size(T)
    model_args = asdict(model.config)
    for k in model_keys:  # the checkpoint or GPT-2 decides the architecture; say so where the config disagrees
        if model_args[k] != cfg[k]:
            log(f"note: {k}={model_args[k]!r} from {cfg['init_from']} (config says {cfg[k]!r})")
            cfg[k] = model_args[k]
    if data_vocab > model.config.vocab_size:
        raise TrainError(
            f"dataset {cfg['dataset']!r} has {data_vocab} tokens but the model only {model.config.vocab_size}"
        )
    if T > model.config.block_size:
        raise TrainError(f"block_size={T} is longer than the model's {model.config.block_size}")
    model.to(device)
    scaler = torch.amp.GradScaler(device_type, enabled=cfg["dtype"] == "float16")
    optimizer = model.configure_optimizers(
        cfg["weight_decay"], cfg["learning_rate"], (cfg["beta1"], cfg["beta2"]), device_type, cfg["pe_lr_scale"]
    )
    data_rng = torch.Generator().manual_seed(cfg["seed"])  # the training sampler; its state is saved
    if ckpt is not None:
        try:
            optimizer.load_state_dict(ckpt["optimizer"])
        except ValueError as e:  # another number of parameter groups: pe_lr_scale moved to or from 1
            raise TrainError(
                f"the checkpoint's optimizer does not fit this run ({e}); resume with the run's own pe_lr_scale="
                f"{ckpt.get('config', {}).get('pe_lr_scale', 1.0)}"
            ) from e
        if ckpt.get("scaler") and scaler.is_enabled():  # empty from a float32/bf16 run: fp16 starts a fresh scaler
            scaler.load_state_dict(ckpt["scaler"])
        if "data_rng" in ckpt:
            data_rng.set_state(ckpt["data_rng"])
        if len(ckpt.get("rng", [])) == world_size:
            set_rng_state(ckpt["rng"][rank])
        else:
            log("note: the checkpoint has no RNG state for this number of processes; dropout will not replay exactly")
        del ckpt
    raw_model = model
    log(
        f"{cfg['pos_encoding']} GPT: {model.get_num_params() / 1e6:.2f}M parameters; {tokens_per_iter:,} tokens per "
        f"iteration on {world_size} process(es), {device}, {cfg['dtype']}{', compiled' if cfg['compile'] else ''}"
    )
    if (note := model.fused_attention_note(device_type)) and model.transformer.wpe.has_bias:
        log(f"note: {note}")  # a shape the fused kernel cannot take: a slower path, not a crash
    if cfg["compile"]:
        model = torch.compile(model)
    if ddp:
        model = DDP(model, device_ids=[local_rank] if device_type == "cuda" else None)
    peak_flops = (
        next((v for k, v in GPU_PEAK_FLOPS.items() if k in torch.cuda.get_device_name(device)), None)
        if device_type == "cuda"
        else None
    )

    @torch.no_grad()
    def estimate_loss() -> dict[str, float]:
        """Mean loss over eval_iters batches per split: the same batches at every eval (seeded), split over ranks."""
        out = {}
        model.eval()
        for split in SPLITS:
            g = torch.Generator().manual_seed(cfg["seed"] + 1)
            losses = torch.zeros(cfg["eval_iters"], device=device)
            for k in range(cfg["eval_iters"]):
                X, Y = get_batch(data_dir, split, B, T, g, vocab_size, device, rank, world_size)
                with ctx:
                    losses[k] = model(X, Y)[1]
            mean = losses.mean()
            if ddp:
                dist.all_reduce(mean, op=dist.ReduceOp.AVG)
            out[split] = mean.item()
        model.train()
        return out

    def save(best: bool) -> None:
        """Every process calls this (its RNG state is gathered); the first one writes."""
        states = [None] * world_size
        if ddp:
            dist.all_gather_object(states, rng_state(device))
        else:
            states = [rng_state(device)]
        if not master:
            return
        ckpt = {
            "model": raw_model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "model_args": model_args,
            "iter_num": iter_num,
            "best_val_loss": best_val_loss,
            "config": cfg,
            "tokenizer": meta["tokenizer"],
            "eval_setup": eval_setup,
            "rng": states,
            "data_rng": data_rng.get_state(),
            "scaler": scaler.state_dict(),
            "wandb_run_id": wandb_run_id,
        }
        save_checkpoint(ckpt, out_dir / "ckpt.pt")
        if best:
            save_checkpoint(ckpt, out_dir / "ckpt_best.pt")

    # -------------------------------------------------------------------------------------------------------------
    # logging and stopping
    wandb = None
    if cfg["wandb_log"] and master:
        import wandb

        run = wandb.init(
            project=cfg["wandb_project"],
            name=cfg["wandb_run_name"],
            group=cfg["wandb_group"],
            config=cfg,
            id=wandb_run_id,
            resume="allow",
        )
        wandb_run_id = run.id
        wandb.define_metric("*", step_metric="iter")
    stop_requested = torch.zeros(1, device=device if ddp and device_type == "cuda" else "cpu")

    def on_signal(signum, frame):
        if stop_requested.item():
            raise KeyboardInterrupt
        stop_requested.fill_(1)
        log(f"\n{signal.Signals(signum).name}: saving a checkpoint after this iteration (again to quit at once)")

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)

    # -------------------------------------------------------------------------------------------------------------
    # training loop
    model.train()
    max_iters = cfg["max_iters"]
    dt_avg, eval_dt, start_iter = None, 0.0, iter_num
    t0 = time.time()
    while True:
        if ddp:
            dist.all_reduce(stop_requested, op=dist.ReduceOp.MAX)  # every process stops at the same iteration
        if stop_requested.item():
            save(best=False)
            log(f"stopped at iteration {iter_num}; resume with --init_from=resume --out_dir={out_dir}")
            break
        lr = get_lr(iter_num, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)
        if iter_num % cfg["eval_interval"] == 0 or iter_num >= max_iters or cfg["eval_only"]:
            te = time.time()
            losses = estimate_loss()
            eval_dt = time.time() - te
            improved = losses["val"] < best_val_loss
            best_val_loss = min(best_val_loss, losses["val"])
            log(
                f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f} "
                f"(best {best_val_loss:.4f}), eval {eval_dt:.1f}s"
            )
            if wandb:
                wandb.log({"iter": iter_num, "train/loss": losses["train"], "val/loss": losses["val"], "lr": lr})
            if cfg["eval_only"]:
                break
            if cfg["always_save_checkpoint"] or improved or iter_num >= max_iters:
                save(best=improved)
            t0 = time.time()
        if iter_num >= max_iters:
            break

        # one iteration: grad_accum micro-steps, gradients synchronized on the last
        loss_sum = torch.zeros((), device=device)
        for micro_step in range(grad_accum):
            X, Y = get_batch(data_dir, "train", B, T, data_rng, vocab_size, device, rank, world_size)
            # task rows seeded by the iteration, not a saved state: a resumed run draws the same tasks
            X, Y = mix_tasks(X, Y, cfg["task_fraction"], task_tok, (cfg["task_seed"], iter_num, micro_step, rank))
            if ddp:
                model.require_backward_grad_sync = micro_step == grad_accum - 1
            with ctx:
                _, loss = model(X, Y)
                loss = loss / grad_accum
            loss_sum += loss.detach()
            scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), cfg["grad_clip"] or float("inf"))
        # fp16's GradScaler skips steps with inf gradients by design; a non-finite loss is always fatal
        bad = non_finite(loss_sum, norm, check_norm=not scaler.is_enabled(), ddp=ddp)
        if bad:
            raise TrainError(
                f"non-finite {bad} at iteration {iter_num}: "
                f"stopped before the optimizer step; the last good checkpoint is in {out_dir} "
                "(try a lower learning_rate, grad_clip, or dtype=bfloat16)"
            )
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)

        t1 = time.time()
        dt, t0 = t1 - t0, t1
        if iter_num > start_iter + 1:  # skip the first iterations (compilation, warm-up) in the average
            dt_avg = dt if dt_avg is None else 0.9 * dt_avg + 0.1 * dt
        if iter_num % cfg["log_interval"] == 0 and master:
            lossf = loss_sum.item()
            left = max_iters - iter_num - 1
            eta = (dt_avg or dt) * left + eval_dt * (left // cfg["eval_interval"] + 1)
            mfu = (
                raw_model.estimate_mfu(tokens_per_iter // world_size, dt_avg or dt, peak_flops) if peak_flops else None
            )
            log(
                f"iter {iter_num}: loss {lossf:.4f}, time {dt * 1000:.1f}ms, {tokens_per_iter / dt:,.0f} tok/s"
                + (f", mfu {mfu * 100:.1f}%" if mfu is not None else "")
                + f", eta {format_duration(eta)}"
            )
            if wandb:
                wandb.log(
                    {"iter": iter_num, "train/loss_step": lossf, "lr": lr, "tokens_per_sec": tokens_per_iter / dt}
                    | ({"mfu": mfu} if mfu is not None else {})
                )
        iter_num += 1

    if wandb:
        wandb.finish()
    if ddp:
        # wait for every process (rank 0 may still be writing the checkpoint) before tearing gloo/NCCL down: a rank
        # that destroys its group while a peer still talks to it can abort in gloo's worker threads
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except (ConfigError, CheckpointError, DataError, TrainError) as e:
        sys.exit(f"error: {e}")
