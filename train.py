"""
Train a GPT with any positional encoding, with nanoGPT's config keys.
    python train.py config/rope.py                        # one GPU (bf16 + torch.compile), or the CPU
    python train.py config/rope.py config/cpu.py          # a CPU-sized run (minutes on a laptop)
    python train.py config/rope.py config/passkey.py      # a synthetic retrieval task (synthetic.py), on a CPU
    python train.py config/rope.py --init_from=resume     # continue a run exactly where it stopped
    torchrun --standalone --nproc_per_node=8 train.py config/gpt2.py                  # DDP: a copy per GPU
    torchrun --standalone --nproc_per_node=8 train.py config/gpt2.py --parallel=fsdp  # FSDP: the model sharded
Ctrl-C (or SIGTERM) saves a checkpoint after the current iteration, then exits; press it twice to quit at once.
"""

import math
import os
import runpy
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import synthetic
from checkpoint import (
    LINKS,
    CheckpointError,
    adopt_copied_links,
    load_checkpoint,
    load_sharded_meta,
    load_training_state,
    model_from_checkpoint,
    remove_stale_temporaries,
    remove_unlinked_shards,
    save_checkpoint,
    save_sharded,
    sharded_folder,
    training_state,
)
from configurator import (
    ConfigError,
    autocast,
    check_device,
    configure,
    default_device,
    default_dtype,
    peak_flops,
    script_usage,
)
from datafiles import SPLITS, DataError, dataset_dir, get_batch, load_meta
from model import ENCODING_OPTIONS, GPT, POS_ENCODINGS, GPTConfig
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
    dataset="",  # a folder of data/, or a path to a prepared one; default shakespeare_char (it and shakespeare are
    # prepared automatically the first time)
    gradient_accumulation_steps=1,  # micro-steps per iteration, over all processes
    batch_size=64,  # sequences per micro-step and process
    block_size=256,
    task_fraction=0.0,  # the fraction of training sequences that are retrieval tasks (tasks.py: passkey, recall,
    # copy; answers-only targets), e.g. 0.05; validation stays text
    task_seed=None,  # seeds the task sequences with the iteration (default: seed)
    # synthetic token-level tasks instead of text (synthetic.py; config/<task>.py have their recipes)
    task="",  # needle | passkey | mqar | offset | copy: train on the task's sequences, loss on the answers only
    task_vocab=128,  # the task's vocabulary: 3 special tokens, then three equal ranges of keys, values and filler
    task_pairs=8,  # mqar: key-value pairs per sequence
    task_queries=4,  # mqar: keys asked per sequence, each one trial
    task_layout="scattered",  # mqar: scattered (pairs at random places in filler, the queries at the end) | zoology
    # (the pairs together first, the queries at random places after them)
    task_mix=0.0,  # the fraction of training rows that are needle rows (a curriculum: the lookup is learned on them,
    # then found through the marker); validation has the task's rows alone
    task_prev_tokens=False,  # training rows also ask, at every position that is not an answer, for the token before
    # it (a curriculum that builds the previous-token head retrieval by key needs); validation has the answers alone
    # model
    pos_encoding="rope",  # one of the encodings (--help lists them); each encoding's own options follow this block
    gelu="exact",  # exact (nanoGPT's) | tanh (GPT-2's; GPT-2 checkpoints bring their own)
    n_layer=6,
    n_head=6,
    n_embd=384,
    dropout=0.2,  # 0 for pretraining, 0.1+ for finetuning and small data
    bias=False,  # biases in Linears and LayerNorms (GPT-2 has them)
    # AdamW
    learning_rate=1e-3,
    pe_lr_scale=None,  # the positional encoding's parameters learn this many times faster; None: the encoding's own
    # (30 for a table of biases that starts at zero, which Adam moves about learning_rate per step; else 1)
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
    parallel="ddp",  # under torchrun: ddp (a full copy of the model, gradients and AdamW's state per process) | fsdp
    # (each process holds 1/N of them: FSDP2; checkpoints go to ckpt.dcp, which resumes at any number of processes)
    backend="",  # the processes' backend: nccl | gloo; default nccl on GPU, gloo on CPU
    device=default_device(),  # cuda, cuda:1, mps, cpu; default the best available
    dtype="",  # float32 | bfloat16 | float16; default bfloat16 where the GPU has it, else float16; float32 on CPU
    compile=None,  # torch.compile the model; default on for CUDA
    seed=1337,
)
defaults |= {name: opt.default for name, (_, opt) in ENCODING_OPTIONS.items()}  # rpe_max_distance, rope_base, ...
EMBEDDED_DATASETS = ("shakespeare_char", "shakespeare")  # prepared from files in the repository, offline
# what decides which batches a validation estimate averages over: val losses compare only when these agree
ESTIMATE_AFTER = 10  # iterations timed before the whole run's time is estimated
CPU_SIZED_FLOPS = 1e11  # training FLOPs per iteration above which a CPU takes seconds per iteration
PROGRESS_SECONDS = float(os.environ.get("NANOPE_PROGRESS_SECONDS", 10))  # longer work between log lines shows progress
TASK_OPTIONS = ("task_vocab", "task_pairs", "task_queries", "task_layout", "task_mix", "task_prev_tokens")
MQAR_OPTIONS = ("task_pairs", "task_queries", "task_layout")
EVAL_SETUP_KEYS = ("dataset", "task", "block_size", "batch_size", "eval_iters", "seed", "world_size")


class TrainError(Exception):
    pass


def resolve(cfg: dict) -> dict:
    """Fill in the defaults that depend on other keys, and check the values no type check catches, so that a bad
    value is a one-line error before any work."""
    cfg = dict(cfg)
    check_task(cfg)
    check_encoding_options(cfg)
    cfg["dataset"] = cfg["dataset"] or ("" if cfg["task"] else "shakespeare_char")
    cfg["out_dir"] = cfg["out_dir"] or "-".join(filter(None, ["out", cfg["pos_encoding"], cfg["task"]]))
    cfg["wandb_run_name"] = cfg["wandb_run_name"] or cfg["pos_encoding"]
    cfg["task_seed"] = cfg["seed"] if cfg["task_seed"] is None else cfg["task_seed"]
    cfg["wandb_group"] = cfg["wandb_group"] or (
        f"{cfg['task'] or cfg['dataset']}-{cfg['n_layer']}L-{cfg['n_embd']}d-T{cfg['block_size']}"
    )
    check_device(cfg["device"])
    cfg["dtype"] = cfg["dtype"] or default_dtype(cfg["device"])
    if cfg["compile"] is None:
        cfg["compile"] = cfg["device"].startswith("cuda")
    if cfg["dtype"] not in ("float32", "bfloat16", "float16"):
        raise ConfigError(f"dtype={cfg['dtype']!r}: choose float32, bfloat16 or float16")
    if not isinstance(cfg["compile"], bool):
        raise ConfigError(f"compile={cfg['compile']!r}: expected True or False")
    if cfg["pe_lr_scale"] is not None:  # None (the encoding's own) is resolved with the model
        if not isinstance(cfg["pe_lr_scale"], int | float) or isinstance(cfg["pe_lr_scale"], bool):
            raise ConfigError(f"pe_lr_scale={cfg['pe_lr_scale']!r}: expected a number, e.g. 30, or None")
        cfg["pe_lr_scale"] = float(cfg["pe_lr_scale"])
    if cfg["parallel"] not in ("ddp", "fsdp"):
        raise ConfigError(f"parallel={cfg['parallel']!r}: choose ddp (the default) or fsdp (sharded)")
    if cfg["parallel"] == "fsdp" and cfg["dtype"] == "float16":
        raise ConfigError(
            "dtype=float16 with parallel=fsdp: sharded training runs in float32 or bfloat16 (no loss scaling); "
            "use --dtype=bfloat16"
        )
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


def check_encoding_options(cfg: dict) -> None:
    """An option of another encoding than the chosen one (--rpe_max_distance with rope) does nothing: an error."""
    if cfg["init_from"] != "scratch":  # a checkpoint or GPT-2 decides the encoding
        return
    for name, (owner, opt) in ENCODING_OPTIONS.items():
        if owner != cfg["pos_encoding"] and cfg[name] != opt.default:
            raise ConfigError(
                f"{name}={cfg[name]!r} is an option of pos_encoding={owner!r}, not of {cfg['pos_encoding']!r}: drop "
                f"it, or train with --pos_encoding={owner}"
            )


def check_task(cfg: dict) -> None:
    """A synthetic task makes its own sequences: it cannot also read a text dataset or mix tasks into text, and it
    must fit the block size and its vocabulary. An option of the synthetic tasks that the chosen task does not read (any
    of them on a text run, task_pairs with needle) would do nothing: an error."""
    for key in TASK_OPTIONS:
        task = cfg["task"]
        if cfg[key] != defaults[key] and (not task or key in MQAR_OPTIONS and task != "mqar"):
            reads = "task=mqar" if key in MQAR_OPTIONS else "a synthetic task (--task=...)"
            runs = f"task={task!r}" if task else "a text run"
            raise ConfigError(f"{key}={cfg[key]!r} is read by {reads} and this is {runs}: drop it, or train on {reads}")
    if not cfg["task"]:
        return
    for key, text_only in (("dataset", cfg["dataset"]), ("task_fraction", cfg["task_fraction"])):
        if text_only:
            raise ConfigError(
                f"task={cfg['task']!r} trains on synthetic sequences alone, and {key}={text_only!r} is for text: "
                f"drop --{key} for the synthetic task, or drop --task to train on text"
            )
    try:
        synthetic.check(cfg["task"], cfg["block_size"], cfg["task_vocab"], **synthetic.task_options(cfg))
    except synthetic.SyntheticError as e:
        raise ConfigError(str(e)) from e


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
    need(cfg["pe_lr_scale"] is None or cfg["pe_lr_scale"] > 0, "pe_lr_scale", "must be positive (1: the same rate)")
    need(cfg["min_lr"] >= 0, "min_lr", "must be at least 0 (about learning_rate / 10)")
    need(cfg["warmup_iters"] >= 0, "warmup_iters", "must be at least 0 (0: no warmup)")
    need(cfg["lr_decay_iters"] >= 0, "lr_decay_iters", "must be at least 0 (about max_iters)")
    need(cfg["weight_decay"] >= 0, "weight_decay", "must be at least 0 (0 disables it; 0.1 is usual)")
    need(0 <= cfg["beta1"] < 1, "beta1", "must be in [0, 1) (0.9 is usual)")
    need(0 <= cfg["beta2"] < 1, "beta2", "must be in [0, 1) (0.95 or 0.99 are usual)")
    need(0 <= cfg["dropout"] < 1, "dropout", "must be in [0, 1) (0 for pretraining, 0.1-0.2 for small data)")
    need(0 <= cfg["seed"] < 2**62, "seed", "must be in [0, 2**62) (torch's generators take 64-bit seeds)")
    need(0 <= cfg["task_fraction"] < 1, "task_fraction", "must be in [0, 1) (0: text only; 0.05-0.1 is usual)")
    need(0 <= cfg["task_mix"] < 1, "task_mix", "must be in [0, 1) (0: the task's rows alone; 0.25 is usual)")
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
    if cfg["parallel"] == "fsdp" and int(os.environ.get("WORLD_SIZE", 1)) == 1:
        notes.append(
            "parallel=fsdp in one process: it trains unsharded, and saves sharded checkpoints (ckpt.dcp) that resume "
            "at any number of processes (torchrun --nproc_per_node=N shards it)"
        )
    if cfg["learning_rate"] > 0.1:
        notes.append(f"learning_rate={cfg['learning_rate']} is far above AdamW's usual 1e-4 to 1e-3")
    return notes


_out_dir_lock = None  # the open file whose lock holds this process's out_dir (see hold_out_dir)


def hold_out_dir(out_dir: Path) -> None:
    """Lock out_dir/.lock for this run, or say which process holds it: two runs in one folder would overwrite each
    other's checkpoints (and delete each other's half-written saves). The kernel drops the lock when the process
    ends, killed or not, so a folder is never left stuck; a run that ends normally also removes the file. Not on
    Windows (no flock): there runs are not guarded."""
    global _out_dir_lock
    try:
        import fcntl
    except ImportError:
        return
    release_out_dir()  # one this process took without main(), which releases its own (tests call prepare_out_dir)
    path = out_dir / ".lock"
    while True:
        f = open(path, "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "unknown"
            f.close()
            raise TrainError(
                f"out_dir={str(out_dir)!r} is in use by another training run (process {holder}); wait for it to end, "
                "or train elsewhere with --out_dir=<new folder>"
            ) from None
        except OSError:  # a filesystem without locks (some network mounts): the run goes on unguarded
            f.close()
            return
        try:  # the holder removes the file as it ends: a lock on a removed file holds nothing, so take the new one
            if os.stat(path).st_ino == os.fstat(f.fileno()).st_ino:
                break
        except FileNotFoundError:
            pass
        f.close()
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    _out_dir_lock = f


def release_out_dir() -> None:
    global _out_dir_lock
    if _out_dir_lock is not None:
        Path(_out_dir_lock.name).unlink(missing_ok=True)  # while locked: the folder is left as it was found
        _out_dir_lock.close()  # closing the file drops its lock
        _out_dir_lock = None


def prepare_out_dir(cfg: dict) -> list[Path]:
    """Before any work: out_dir must take checkpoints, no other run may be training in it, a resume must have a
    checkpoint, and a fresh start must not replace a run there unless told to (--overwrite=True). Clears the
    temporary files of saves killed mid-write (returned)."""
    out_dir = Path(cfg["out_dir"])
    if cfg["init_from"] == "resume":
        check_resumable(out_dir, sharded=cfg["parallel"] == "fsdp")
    if out_dir.exists() and not out_dir.is_dir():
        raise TrainError(f"out_dir={str(out_dir)!r} is a file, not a folder; choose another --out_dir")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        probe = out_dir / f".write_test.{os.getpid()}.tmp"  # the one sure test: /proc, read-only mounts, permissions
        probe.write_bytes(b"0")
        probe.unlink()
        if cfg["parallel"] == "fsdp":  # ckpt.dcp is a link to the latest folder of shards
            probe.symlink_to("shards")
            probe.unlink()
    except OSError as e:
        raise TrainError(
            f"cannot write checkpoints to out_dir={str(out_dir)!r} ({e.strerror}); choose another --out_dir"
        ) from e
    hold_out_dir(out_dir)  # before the checks below and before clearing temporaries: a live run's are not stale
    for link in adopt_copied_links(out_dir):
        print(f"note: {link} was a folder (copied without its link?): moved under shards/ and linked, as saves do")
    found = [name for name in ("ckpt.pt", "ckpt_best.pt", *LINKS) if os.path.lexists(out_dir / name)]
    if found and cfg["init_from"] != "resume" and not cfg["overwrite"]:
        raise TrainError(
            f"{out_dir} already holds a run ({', '.join(found)}), which starting from {cfg['init_from']} would "
            "overwrite. Continue it with --init_from=resume, train elsewhere with --out_dir=<new folder>, or "
            "replace it with --overwrite=True"
        )
    return remove_stale_temporaries(out_dir) + remove_unlinked_shards(out_dir)


def check_resumable(out_dir: Path, sharded: bool) -> None:
    """A resume needs the checkpoint its strategy writes: ckpt.dcp (whole: every shard) for fsdp, else ckpt.pt."""
    mine, other = ("ckpt.dcp", "ckpt.pt") if sharded else ("ckpt.pt", "ckpt.dcp")
    if os.path.lexists(out_dir / mine):
        if sharded:
            sharded_folder(out_dir / mine)  # names what is missing
        return
    if sharded and os.path.lexists(out_dir / other):
        raise CheckpointError(
            f"{out_dir} holds an unsharded checkpoint (ckpt.pt), and parallel=fsdp resumes from a sharded one "
            "(ckpt.dcp): resume it with --parallel=ddp (the default), or start a sharded run in another --out_dir"
        )
    if os.path.lexists(out_dir / other):
        raise CheckpointError(
            f"{out_dir} holds a sharded checkpoint (ckpt.dcp, from parallel=fsdp): resume it with --parallel=fsdp "
            f"(at any number of processes), or turn it into a ckpt.pt first: python checkpoint.py {out_dir}"
        )
    raise CheckpointError(f"no checkpoint at {out_dir / mine} to resume from; check --out_dir")


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


def non_finite(loss: torch.Tensor, norm: torch.Tensor, check_norm: bool, distributed: bool) -> str | None:
    """'loss' or 'gradient norm' if any process saw a non-finite one, else None. Every process gets the same answer:
    under torchrun the losses differ per rank, and one rank stopping alone leaves the others waiting in all_reduce."""
    flags = torch.stack([~torch.isfinite(loss), ~torch.isfinite(norm) & check_norm]).float()
    if distributed:
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
    """--help: the module docstring, the defaults block of this file (comments and all), the encodings and each
    encoding's options from the registry."""
    encodings = "\n".join(f"  {name}: {cls.summary}" for name, cls in POS_ENCODINGS.items())
    options = "\n".join(
        f"{name}={opt.default!r}  # {owner}: {opt.help}" for name, (owner, opt) in ENCODING_OPTIONS.items()
    )
    return (
        f"{script_usage(__file__, __doc__)}\n\npos_encoding, one of:\n{encodings}\n\n"
        f"Each encoding's options (another encoding's is an error):\n{options}"
    )


# -----------------------------------------------------------------------------------------------------------------
# The run's pieces: its processes, its data, its model and state. main() puts them together and runs the loop.


@dataclass
class Processes:
    """This process's place in the run: alone, or one of torchrun's processes (DDP or FSDP)."""

    distributed: bool
    rank: int
    local_rank: int
    world_size: int
    device: str  # cuda:<local_rank> for each of torchrun's GPU processes

    @property
    def master(self) -> bool:
        return self.rank == 0  # the one that logs and writes checkpoints

    @property
    def device_type(self) -> str:
        return "cuda" if self.device.startswith("cuda") else self.device.split(":")[0]

    def log(self, *args) -> None:
        if self.master:
            print(*args, flush=True)


def start_processes(cfg: dict) -> Processes:
    """Join torchrun's process group if there is one (a GPU each), seed this process, allow TF32 matmuls."""
    distributed = int(os.environ.get("RANK", -1)) != -1
    device, rank, local_rank, world_size = cfg["device"], 0, 0, 1
    if distributed:
        dist.init_process_group(backend=cfg["backend"] or ("nccl" if device.startswith("cuda") else "gloo"))
        rank, local_rank, world_size = dist.get_rank(), int(os.environ["LOCAL_RANK"]), dist.get_world_size()
        if device.startswith("cuda"):
            device = f"cuda:{local_rank}"
            torch.cuda.set_device(device)
    torch.manual_seed(cfg["seed"] + rank)
    if device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    return Processes(distributed, rank, local_rank, world_size, device)


@dataclass
class Data:
    dir: Path | None  # None for a synthetic task, whose sequences are generated
    meta: dict  # meta.json: the dataset's vocab_size and tokenizer
    vocab_size: int  # the model's: GPT-2's 50257 tokens padded to a multiple of 64 (faster matmuls), a char one as is
    task_tok: object | None  # the tokenizer that writes the task sequences (task_fraction > 0)


def load_data(cfg: dict, procs: Processes) -> Data:
    """The dataset, prepared on first use where it is embedded and checked (meta.json, the token files) before any
    training; the tasks checked against its vocabulary and the block size. A synthetic task has no files."""
    if cfg["task"]:
        V = cfg["task_vocab"]
        return Data(None, {"vocab_size": V, "tokenizer": {"kind": "ids", "vocab_size": V}}, V, None)
    data_dir = dataset_dir(cfg["dataset"])
    if cfg["dataset"] in EMBEDDED_DATASETS and not (data_dir / "meta.json").is_file():
        if procs.master:
            procs.log(f"preparing the {cfg['dataset']} dataset (first run only)")
            runpy.run_path(str(data_dir / "prepare.py"), run_name="__main__")
        if procs.distributed:
            dist.barrier()
    meta = load_meta(data_dir, block_size=cfg["block_size"])
    n = meta["vocab_size"]
    task_tok = tokenizer_from_meta(meta["tokenizer"]) if cfg["task_fraction"] else None
    if task_tok is not None:
        try:
            check_tasks(task_tok, cfg["block_size"])
        except TaskError as e:
            raise ConfigError(f"task_fraction={cfg['task_fraction']}: {e}") from e
    return Data(data_dir, meta, n if n < 1024 else -(-n // 64) * 64, task_tok)


def build_model(cfg: dict, data: Data, log) -> tuple[GPT, dict | None]:
    """The model from scratch, from out_dir/ckpt.pt (also returned, to restore the rest of the run), or from GPT-2's
    weights. The checkpoint or GPT-2 decides the architecture: cfg follows it, with a note where it disagreed."""
    # block_size is the model's capacity (it may be larger: RoPE, ALiBi... resumed at a smaller T), the rest its shape
    model_keys = [f.name for f in fields(GPTConfig) if f.name in cfg and f.name != "block_size"]
    ckpt = None
    if cfg["init_from"] == "scratch":
        try:
            model = GPT(
                GPTConfig(vocab_size=data.vocab_size, block_size=cfg["block_size"], **{k: cfg[k] for k in model_keys})
            )
        except ValueError as e:  # GPTConfig names the bad field and the valid choices
            raise ConfigError(str(e)) from e
    elif cfg["init_from"] == "resume" and cfg["parallel"] == "fsdp":  # the weights load once sharded: restore()
        ckpt = load_sharded_meta(Path(cfg["out_dir"]) / "ckpt.dcp")
        model = GPT(GPTConfig(**ckpt["model_args"]))
    elif cfg["init_from"] == "resume":
        ckpt = load_checkpoint(Path(cfg["out_dir"]) / "ckpt.pt")
        model = model_from_checkpoint(ckpt)
    else:
        try:
            model = GPT.from_pretrained(cfg["init_from"], dropout=cfg["dropout"])
        except (OSError, ImportError, ValueError) as e:  # offline, a misspelled name, no transformers
            raise TrainError(f"cannot load GPT-2 weights from {cfg['init_from']!r}: {e}") from e
        if cfg["block_size"] < model.config.block_size:
            model.crop_block_size(cfg["block_size"])
    for k in model_keys:
        if getattr(model.config, k) != cfg[k]:
            log(f"note: {k}={getattr(model.config, k)!r} from {cfg['init_from']} (config says {cfg[k]!r})")
            cfg[k] = getattr(model.config, k)
    if data.meta["vocab_size"] > model.config.vocab_size:
        raise TrainError(
            f"dataset {cfg['dataset']!r} has {data.meta['vocab_size']} tokens but the model only "
            f"{model.config.vocab_size}"
        )
    if cfg["block_size"] > model.config.block_size:
        raise TrainError(f"block_size={cfg['block_size']} is longer than the model's {model.config.block_size}")
    if cfg["pe_lr_scale"] is None:  # a resumed run keeps its own; else the encoding's
        cfg["pe_lr_scale"] = (ckpt or {}).get("config", {}).get("pe_lr_scale") or model.encoding.lr_scale
    return model, ckpt


@dataclass
class Run:
    """A training run: what the loop reads and updates, and what a checkpoint saves."""

    cfg: dict
    procs: Processes
    data: Data
    model: GPT  # the module itself, whose state_dict is saved
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    data_rng: torch.Generator  # the training batches' sampler; its state is saved
    net: torch.nn.Module | None = None  # what the loop calls: the model, compiled and/or wrapped in DDP
    iter_num: int = 0
    best_val_loss: float = float("inf")
    wandb_run_id: str | None = None
    history: list = field(default_factory=list)  # every evaluation: {"iter", "train", "val"[, "acc"]}

    @property
    def sharded(self) -> bool:
        """FSDP's run: sharded over torchrun's processes (unsharded when alone), its checkpoints in ckpt.dcp."""
        return self.cfg["parallel"] == "fsdp"

    @property
    def eval_setup(self) -> dict:
        return {k: self.cfg[k] for k in EVAL_SETUP_KEYS if k in self.cfg} | {"world_size": self.procs.world_size}

    @property
    def tokens_per_iter(self) -> int:
        return self.cfg["gradient_accumulation_steps"] * self.cfg["batch_size"] * self.cfg["block_size"]

    def autocast(self):
        return autocast(self.procs.device, self.cfg["dtype"])

    def batch(self, split: str, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """This process's share of a batch x, y (B, T). A synthetic task's rows come from a seed that generator
        draws (so the sampler's state is still one generator state), the split and the rank."""
        p, cfg, B, T = self.procs, self.cfg, self.cfg["batch_size"], self.cfg["block_size"]
        if cfg["task"]:
            seed = int(torch.randint(2**62, (1,), generator=generator))
            rng = np.random.default_rng([seed, SPLITS.index(split), p.rank])
            # validation reads the rows the evaluation scores (no curriculum, the full task), so that "learned" and
            # the 1x column of synthetic.py measure one distribution
            train = split == "train"
            mix, previous = (cfg["task_mix"], cfg["task_prev_tokens"]) if train else (0.0, False)
            opts = synthetic.task_options(cfg)
            x, y = synthetic.batch(cfg["task"], cfg["task_vocab"], B, T, rng, train, mix, previous, **opts)
            return x.to(p.device), y.to(p.device)
        return get_batch(self.data.dir, split, B, T, generator, self.data.vocab_size, p.device, p.rank, p.world_size)


def restore(run: Run, ckpt: dict) -> None:
    """Continue a checkpoint's run exactly: iteration, best loss (if it still compares), optimizer, grad scaler, data
    sampler, RNG states and wandb run."""
    log = run.procs.log
    run.iter_num, run.best_val_loss, run.wandb_run_id = (
        ckpt["iter_num"],
        ckpt["best_val_loss"],
        ckpt.get("wandb_run_id"),
    )
    run.history = [h for h in ckpt.get("history", []) if h["iter"] < run.iter_num]  # this iteration is evaluated again
    path = Path(run.cfg["out_dir"]) / ("ckpt.dcp" if run.sharded else "ckpt.pt")
    log(f"resuming from {path} at iteration {run.iter_num}")
    changed = changed_eval_setup(ckpt, run.eval_setup)
    if changed and run.best_val_loss < float("inf"):
        log(
            f"note: validation differs from the checkpoint's ({', '.join(changed)}), so its best val loss "
            f"{run.best_val_loss:.4f} does not compare; ckpt_best goes to this run's best evaluation"
        )
        run.best_val_loss = float("inf")
    groups_hint = (  # another number of parameter groups: pe_lr_scale moved to or from 1
        f"resume with the run's own pe_lr_scale={ckpt.get('config', {}).get('pe_lr_scale', 1.0)}"
    )
    if run.sharded:  # the model's weights too; each process reads what its shards cover
        try:
            load_training_state(run.model, run.optimizer, path)
        except (ValueError, KeyError) as e:
            raise TrainError(f"the checkpoint's optimizer does not fit this run ({e!r}); {groups_hint}") from e
    else:
        try:
            run.optimizer.load_state_dict(ckpt["optimizer"])
        except ValueError as e:
            raise TrainError(f"the checkpoint's optimizer does not fit this run ({e}); {groups_hint}") from e
    if ckpt.get("scaler") and run.scaler.is_enabled():  # empty from a float32/bf16 run: fp16 starts a fresh scaler
        run.scaler.load_state_dict(ckpt["scaler"])
    if "data_rng" in ckpt:
        run.data_rng.set_state(ckpt["data_rng"])
    if len(ckpt.get("rng", [])) == run.procs.world_size:
        set_rng_state(ckpt["rng"][run.procs.rank])
    else:
        log("note: the checkpoint has no RNG state for this number of processes; dropout will not replay exactly")


def shard(model: GPT, dtype: str) -> None:
    """FSDP2: each block's attention and MLP (one group a block), then the rest (embeddings, the encoding's tables,
    MLPs and slopes, the norms, the tied head) sharded over the processes: each holds 1/N of every parameter, its
    gradient and AdamW's state, and gathers a block's weights just before the block runs. In bfloat16 those weights
    are gathered in bf16 (half the traffic) for autocast's bf16 matmuls; the rest stays float32, as do the residual
    stream, the RoPE angles (bf16 inputs would round them) and the norms (a CPU's layer_norm takes no bf16 weights
    with float32 inputs); the master weights, AdamW and the gradient reductions are float32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # here: a second to import

    with torch.no_grad():  # every process starts from the first one's weights (each seeded its own), as DDP does
        for t in model.state_dict().values():
            dist.broadcast(t, src=0)
    mp = MixedPrecisionPolicy()  # float32 throughout
    if dtype == "bfloat16":
        mp = MixedPrecisionPolicy(torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False)
    for block in model.transformer.h:
        fully_shard([block.attn, block.mlp], mp_policy=mp)
    fully_shard(model)


def held_bytes(tensors, whole: bool = False) -> int:
    """The bytes of these tensors that this process holds (its own shards of FSDP's DTensors, which have to_local),
    or with whole, the bytes of the whole tensors."""
    local = [t.to_local() if hasattr(t, "to_local") and not whole else t for t in tensors]
    return sum(t.numel() * t.element_size() for t in local)


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def wrap(run: Run) -> torch.nn.Module:
    """The module the loop calls: compiled (cfg compile) and, under torchrun, in DDP (FSDP shards the model itself)."""
    net = torch.compile(run.model) if run.cfg["compile"] else run.model
    if run.procs.distributed and not run.sharded:
        net = DDP(net, device_ids=[run.procs.local_rank] if run.procs.device_type == "cuda" else None)
    return net


# -----------------------------------------------------------------------------------------------------------------
# What the loop does: evaluate, save, one iteration of training


@torch.no_grad()
def estimate_loss(run: Run, stop: torch.Tensor | None = None) -> dict[str, float] | None:
    """Mean loss over eval_iters batches per split: the same batches at every eval (seeded), split over ranks. For a
    synthetic task also "acc", the validation accuracy: exact match (argmax) at the answer tokens. A long evaluation
    (a GPU-sized one on a CPU) shows its progress and ETA; a stop request (the flag `stop`) ends it at the next batch,
    returning None, except under DDP, where every rank must finish the same batches."""
    out = {}
    run.net.eval()
    n, done, t0 = len(SPLITS) * run.cfg["eval_iters"], 0, time.time()
    shown = t0
    for split in SPLITS:
        g = torch.Generator().manual_seed(run.cfg["seed"] + 1)
        losses = torch.zeros(run.cfg["eval_iters"], device=run.procs.device)
        hits = torch.zeros(2, device=run.procs.device)  # right answers, answers
        for k in range(run.cfg["eval_iters"]):
            if stop is not None and stop.item() and not run.procs.distributed:
                run.net.train()
                return None
            X, Y = run.batch(split, g)
            with run.autocast():
                logits, losses[k] = run.net(X, Y)
            if run.cfg["task"] and split == "val":
                answers = Y >= 0
                hits += torch.stack([(logits.argmax(-1) == Y)[answers].sum(), answers.sum()])
            done += 1
            if (now := time.time()) - shown > PROGRESS_SECONDS and done < n:
                shown = now
                eta = (now - t0) / done * (n - done)
                run.procs.log(f"evaluating: {done}/{n} batches, eta {format_duration(eta)}")
        mean = losses.mean()
        if run.procs.distributed:
            dist.all_reduce(mean, op=dist.ReduceOp.AVG)
            dist.all_reduce(hits)
        out[split] = mean.item()
        if run.cfg["task"] and split == "val":
            out["acc"] = (hits[0] / hits[1]).item()
    run.net.train()
    return out


def save(run: Run, best: bool) -> None:
    """Every process calls this (its RNG state is gathered); the first one writes ckpt.pt, and ckpt_best.pt if best.
    A sharded run's processes each write their shards of ckpt.dcp (and link ckpt_best.dcp to it if best)."""
    procs = run.procs
    states = [None] * procs.world_size
    if procs.distributed:
        dist.all_gather_object(states, rng_state(procs.device))
    else:
        states = [rng_state(procs.device)]
    meta = {
        "model_args": asdict(run.model.config),
        "iter_num": run.iter_num,
        "best_val_loss": run.best_val_loss,
        "config": run.cfg,
        "tokenizer": run.data.meta["tokenizer"],
        "eval_setup": run.eval_setup,
        "rng": states,
        "data_rng": run.data_rng.get_state(),
        "scaler": run.scaler.state_dict(),
        "wandb_run_id": run.wandb_run_id,
        "history": run.history,
    }
    out_dir = Path(run.cfg["out_dir"])
    names = ["ckpt", "ckpt_best"] if best else ["ckpt"]
    if run.sharded:
        save_sharded(training_state(run.model, run.optimizer), meta, out_dir, tuple(f"{n}.dcp" for n in names))
    elif procs.master:
        ckpt = {"model": run.model.state_dict(), "optimizer": run.optimizer.state_dict(), **meta}
        for n in names:
            save_checkpoint(ckpt, out_dir / f"{n}.pt")
    if procs.master:  # the other strategy's checkpoint of the same name is older now: readers must not find it
        for n in names:
            (out_dir / f"{n}.{'pt' if run.sharded else 'dcp'}").unlink(missing_ok=True)
        if not run.sharded:  # the shards the removed links named (save_sharded clears its own)
            remove_unlinked_shards(out_dir)


def train_iteration(run: Run) -> torch.Tensor:
    """One optimizer step over gradient_accumulation_steps micro-batches (gradients synchronized on the last);
    returns the loss (a 0-d tensor: reading it would wait for the GPU)."""
    cfg, procs = run.cfg, run.procs
    grad_accum = cfg["gradient_accumulation_steps"] // procs.world_size
    loss_sum = torch.zeros((), device=procs.device)
    for micro_step in range(grad_accum):
        X, Y = run.batch("train", run.data_rng)
        # task rows seeded by the iteration, not a saved state: a resumed run draws the same tasks
        seed = (cfg["task_seed"], run.iter_num, micro_step, procs.rank)
        X, Y = mix_tasks(X, Y, cfg["task_fraction"], run.data.task_tok, seed)
        if procs.distributed and run.sharded:
            run.model.set_requires_gradient_sync(micro_step == grad_accum - 1)
        elif procs.distributed:
            run.net.require_backward_grad_sync = micro_step == grad_accum - 1
        with run.autocast():
            loss = run.net(X, Y)[1] / grad_accum
        loss_sum += loss.detach()
        run.scaler.scale(loss).backward()
    run.scaler.unscale_(run.optimizer)
    norm = torch.nn.utils.clip_grad_norm_(run.model.parameters(), cfg["grad_clip"] or float("inf"))
    # fp16's GradScaler skips steps with inf gradients by design; a non-finite loss is always fatal
    if hasattr(norm, "full_tensor"):  # FSDP's DTensor: the norm over every shard, the same on each process
        norm = norm.full_tensor()
    bad = non_finite(loss_sum, norm, check_norm=not run.scaler.is_enabled(), distributed=procs.distributed)
    if bad:
        raise TrainError(
            f"non-finite {bad} at iteration {run.iter_num}: stopped before the optimizer step; the last good "
            f"checkpoint is in {cfg['out_dir']} (try a lower learning_rate, grad_clip, or dtype=bfloat16)"
        )
    run.scaler.step(run.optimizer)
    run.scaler.update()
    run.optimizer.zero_grad(set_to_none=True)
    return loss_sum


def compiler_failure(e: BaseException | None) -> bool:
    """Whether e, or an exception it came from, is the compiler's (Dynamo's backend, Inductor, Triton): a kernel that
    could not be built for these shapes on this GPU, not a mistake in the model or its inputs."""
    from torch._dynamo.exc import BackendCompilerFailed
    from torch._inductor import exc as inductor_exc  # imported here: torch does not load inductor until it compiles

    kinds = (BackendCompilerFailed, getattr(inductor_exc, "InductorError", BackendCompilerFailed))
    while e is not None:
        name = f"{type(e).__module__}.{type(e).__name__}"
        if isinstance(e, kinds) or name.startswith("triton.") or name.endswith("NoTritonConfigsError"):
            return True
        e = e.__cause__ or e.__context__
    return False


# What a training step falls back to, in order, when the compiler cannot build the fused attention kernel: first the
# same kernel with one pipeline stage (less shared memory per block: on an H100 bias-RPE's first backward needed
# 245,760 bytes of 232,448 with the defaults and compiled with this), then a materialized bias (always compiles).
KERNEL_FALLBACKS = [
    (
        "FlexAttention retries with kernel_options num_stages=1 (less shared memory)",
        {"flex_kernel_options": {"num_stages": 1}},
    ),
    (
        "attention adds a materialized bias instead (slower, memory quadratic in the context)",
        {"fused_attention": False},
    ),
]


def with_fallback(run: Run, step):
    """step(), and if the fused attention kernel cannot be compiled for this model on this GPU (Triton's shared
    memory, an unsupported shape), step() again with each of KERNEL_FALLBACKS in turn, one log line each: slower,
    never a crash. The training sampler and the gradients are put back first, so the retried step is the step that
    failed. A fallback that worked stays for the rest of the run."""
    model = run.model
    can_fall_back = run.cfg["compile"] and model.fused_attention is None and model.encoding.has_bias
    sampler = run.data_rng.get_state()
    fallbacks = [f for f in KERNEL_FALLBACKS if any(getattr(model, k) != v for k, v in f[1].items())]
    while True:
        try:
            return step()
        except Exception as e:
            if not (can_fall_back and fallbacks and compiler_failure(e)):
                raise
            what, settings = fallbacks.pop(0)
            first_line = next((ln for ln in str(e).splitlines() if ln.strip()), type(e).__name__)[:200]
            run.procs.log(f"note: the fused attention kernel (FlexAttention) failed to compile ({first_line}); {what}")
            for k, v in settings.items():
                setattr(model, k, v)
            run.optimizer.zero_grad(set_to_none=True)
            run.data_rng.set_state(sampler)
            run.net = wrap(run)


def start_wandb(run: Run):
    """wandb, logging this run (resumed where the checkpoint's left off), or None when wandb_log is off."""
    if not (run.cfg["wandb_log"] and run.procs.master):
        return None
    import wandb

    cfg = run.cfg
    wrun = wandb.init(
        project=cfg["wandb_project"],
        name=cfg["wandb_run_name"],
        group=cfg["wandb_group"],
        config=cfg,
        id=run.wandb_run_id,
        resume="allow",
    )
    run.wandb_run_id = wrun.id
    wandb.define_metric("*", step_metric="iter")
    return wandb


def stop_on_signals(procs: Processes, trained: Callable[[], bool]) -> torch.Tensor:
    """A flag that Ctrl-C or SIGTERM raises (the loop then saves and stops); a second signal quits at once. Before
    this process has trained an iteration (the first evaluation, the first compile), there is nothing to save: it
    quits at once, and the checkpoint it started from (if any) stays."""
    stop = torch.zeros(1, device=procs.device if procs.distributed and procs.device_type == "cuda" else "cpu")

    def on_signal(signum, frame):
        name = signal.Signals(signum).name
        if stop.item():
            raise KeyboardInterrupt
        if not trained():
            procs.log(f"\n{name}: nothing trained yet in this run, so nothing to save: stopping now")
            raise SystemExit(128 + signum)
        stop.fill_(1)
        procs.log(f"\n{name}: saving a checkpoint after this iteration or evaluation (again to quit at once)")

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    return stop


# -----------------------------------------------------------------------------------------------------------------
# main: set up, then the loop


def main(argv: list[str]) -> None:
    try:
        _main(argv)
    finally:
        release_out_dir()  # a second main() in this process, or another run, may use the folder now


def _main(argv: list[str]) -> None:
    if "--help" in argv or "-h" in argv:
        print(usage())
        return
    cfg = resolve(configure(defaults, argv))
    if int(os.environ.get("RANK", 0)) == 0:  # known before the process group: errors come before any work
        if cfg["init_from"] == "resume" and cfg["eval_only"]:  # prepare_out_dir checks it for a training run
            check_resumable(Path(cfg["out_dir"]), sharded=cfg["parallel"] == "fsdp")
        if not cfg["eval_only"]:  # eval_only writes nothing
            for tmp in prepare_out_dir(cfg):
                print(f"removed {tmp.name}, left by a save that was killed mid-write")
        for note in odd_values(cfg):
            print(f"note: {note}")
    procs = start_processes(cfg)
    log = procs.log
    data = load_data(cfg, procs)
    model, ckpt = build_model(cfg, data, log)
    if ckpt is not None and ckpt["iter_num"] >= cfg["max_iters"] and not cfg["eval_only"]:
        log(
            f"the run in {cfg['out_dir']} already reached max_iters={cfg['max_iters']}: nothing to train, nothing "
            "written; raise --max_iters to train on, or evaluate it with --eval_only=True"
        )
        if procs.distributed:
            dist.destroy_process_group()
        return
    model.to(procs.device)
    if cfg["parallel"] == "fsdp" and procs.distributed:
        shard(model, cfg["dtype"])  # before the optimizer, which takes the sharded parameters
    betas = (cfg["beta1"], cfg["beta2"])
    run = Run(
        cfg,
        procs,
        data,
        model,
        optimizer=model.configure_optimizers(
            cfg["weight_decay"], cfg["learning_rate"], betas, procs.device_type, cfg["pe_lr_scale"]
        ),
        scaler=torch.amp.GradScaler(procs.device_type, enabled=cfg["dtype"] == "float16"),
        data_rng=torch.Generator().manual_seed(cfg["seed"]),
    )
    if ckpt is not None:
        restore(run, ckpt)
        del ckpt
    start_iter = run.iter_num
    stop = stop_on_signals(procs, trained=lambda: run.iter_num > start_iter)  # from here, Ctrl-C is answered
    log(
        f"{cfg['pos_encoding']} GPT: {model.get_num_params() / 1e6:.2f}M parameters; {run.tokens_per_iter:,} tokens "
        f"per iteration on {procs.world_size} process(es)"
        + (f" ({cfg['parallel']})" if procs.distributed else "")
        + f", {held_bytes(model.parameters()) / 2**20:,.2f} MiB of parameters per process"
        + f", {procs.device}, {cfg['dtype']}"
        + (", compiled" if cfg["compile"] else "")
    )
    if cfg["task_fraction"]:
        log(
            f"retrieval tasks (passkey, recall, copy) in {cfg['task_fraction']:.0%} of the training rows, "
            f"seed {cfg['task_seed']}"
        )
    if cfg["task"]:
        log(
            f"synthetic task {cfg['task']} at {cfg['block_size']} tokens, vocabulary {cfg['task_vocab']}: loss on the "
            "answers only"
        )
    if (note := model.fused_attention_note(procs.device_type)) and model.encoding.has_bias:
        log(f"note: {note}")  # a shape the fused kernel cannot take: a slower path, not a crash
    if procs.device_type == "cpu" and 6 * model.get_num_params() * run.tokens_per_iter > CPU_SIZED_FLOPS:
        log(
            f"note: a GPU-sized run on a CPU: each iteration takes seconds here. For a CPU-sized run (minutes), add "
            f"config/cpu.py: python train.py config/{cfg['pos_encoding']}.py config/cpu.py"
        )
    run.net = wrap(run)
    wandb = start_wandb(run)
    max_iters, out_dir = cfg["max_iters"], cfg["out_dir"]
    dt_avg, eval_dt = None, 0.0
    flops = peak_flops(procs.device)
    t0 = time.time()
    while True:
        if procs.distributed:
            dist.all_reduce(stop, op=dist.ReduceOp.MAX)  # every process stops at the same iteration
        if stop.item():
            save(run, best=False)
            log(f"stopped at iteration {run.iter_num}; resume with --init_from=resume --out_dir={out_dir}")
            break
        lr = get_lr(run.iter_num, cfg)
        for group in run.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)
        if run.iter_num % cfg["eval_interval"] == 0 or run.iter_num >= max_iters or cfg["eval_only"]:
            te = time.time()
            losses = with_fallback(run, lambda: estimate_loss(run, stop))
            if losses is None:  # stopped mid-evaluation: the top of the loop saves
                continue
            eval_dt = time.time() - te
            improved = losses["val"] < run.best_val_loss
            run.best_val_loss = min(run.best_val_loss, losses["val"])
            acc = f", val accuracy {losses['acc']:.1%}" if "acc" in losses else ""
            log(
                f"step {run.iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f} "
                f"(best {run.best_val_loss:.4f}){acc}, eval {eval_dt:.1f}s"
            )
            if "acc" in losses and synthetic.learned_at(run.history) is None and losses["acc"] >= synthetic.LEARNED:
                log(f"learned {cfg['task']} at step {run.iter_num} (val accuracy >= {synthetic.LEARNED:.0%})")
            run.history.append({"iter": run.iter_num, **losses})
            if wandb:
                metrics = {"iter": run.iter_num, "train/loss": losses["train"], "val/loss": losses["val"], "lr": lr}
                wandb.log(metrics | ({"val/accuracy": losses["acc"]} if "acc" in losses else {}))
            if cfg["eval_only"]:
                break
            if cfg["always_save_checkpoint"] or improved or run.iter_num >= max_iters:
                save(run, best=improved)
            t0 = time.time()
        if run.iter_num >= max_iters:
            break

        if run.iter_num == start_iter and cfg["compile"]:
            log("compiling the model (the first iterations; once per run) ...")
        loss = with_fallback(run, lambda: train_iteration(run))
        t1 = time.time()
        dt, t0 = t1 - t0, t1
        if run.iter_num > start_iter + 1:  # skip the first iterations (compilation, warm-up) in the average
            dt_avg = dt if dt_avg is None else 0.9 * dt_avg + 0.1 * dt
        if run.iter_num == start_iter and procs.distributed:  # AdamW's state exists from the first step
            (p, p_all), (o, o_all) = [
                (held_bytes(ts) / 2**20, held_bytes(ts, whole=True) / 2**20)
                for ts in (list(model.parameters()), optimizer_tensors(run.optimizer))
            ]
            peak = torch.cuda.max_memory_allocated(procs.device) / 2**20 if procs.device_type == "cuda" else None
            log(
                f"memory per process ({cfg['parallel']}): parameters {p:,.2f} MiB of {p_all:,.2f}, AdamW's state "
                f"{o:,.2f} MiB of {o_all:,.2f}" + (f", peak allocated {peak:,.0f} MiB" if peak is not None else "")
            )
        if run.iter_num == start_iter + ESTIMATE_AFTER and run.iter_num < max_iters - 1:
            left = max_iters - run.iter_num - 1
            evals = left // cfg["eval_interval"] + 1
            log(
                f"this run: about {format_duration(dt_avg * left + eval_dt * evals)} more ({left:,} iterations at "
                f"{dt_avg * 1000:.0f} ms, {evals} evaluations at {eval_dt:.1f} s)"
            )
        if run.iter_num % cfg["log_interval"] == 0 and procs.master:
            left = max_iters - run.iter_num - 1
            eta = (dt_avg or dt) * left + eval_dt * (left // cfg["eval_interval"] + 1)
            tok_s = run.tokens_per_iter / dt
            mfu = model.estimate_mfu(run.tokens_per_iter // procs.world_size, dt_avg or dt, flops) if flops else None
            log(
                f"iter {run.iter_num}: loss {loss.item():.4f}, time {dt * 1000:.1f}ms, {tok_s:,.0f} tok/s"
                + (f", mfu {mfu * 100:.1f}%" if mfu is not None else "")
                + f", eta {format_duration(eta)}"
            )
            if wandb:
                metrics = {"iter": run.iter_num, "train/loss_step": loss.item(), "lr": lr, "tokens_per_sec": tok_s}
                wandb.log(metrics | ({"mfu": mfu} if mfu is not None else {}))
        run.iter_num += 1

    if wandb:
        wandb.finish()
    if procs.distributed:
        # wait for every process (rank 0 may still be writing the checkpoint) before tearing gloo/NCCL down: a rank
        # that destroys its group while a peer still talks to it can abort in gloo's worker threads
        dist.barrier()
        dist.destroy_process_group()


def cli(argv: list[str]) -> None:
    """main as a command: a problem the user can fix is one line on stderr and exit status 1, never a traceback."""
    try:
        main(argv)
    except (ConfigError, CheckpointError, DataError, TrainError) as e:
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:  # before the run's handler is installed (data, model), or a second Ctrl-C
        sys.exit("interrupted")


if __name__ == "__main__":
    cli(sys.argv[1:])
