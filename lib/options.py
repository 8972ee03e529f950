"""
train.py's options, checked: the values no type check catches (ranges, choices, options that would
do nothing), the defaults that depend on other options, and the values that are legal but probably
not meant. Each problem is a one-line ConfigError naming the value and the fix, before any work.
"""

import json
import os
from dataclasses import fields
from functools import partial
from pathlib import Path

from lib import runs, synthetic_tasks
from lib.configurator import ConfigError, require
from lib.devices import DTYPES, check_device, default_dtype, device_memory, gb, missing
from lib.parallel import STRATEGIES
from lib.runs import Source, extend_from
from model import ENCODING_OPTIONS, GPTConfig
from shape import ACTIVATION_CHECKPOINTING

TASK_OPTIONS = (
    "task_vocab",
    "task_pairs",
    "task_queries",
    "task_layout",
    "task_mix",
    "task_prev_tokens",
)
MQAR_OPTIONS = ("task_pairs", "task_queries", "task_layout")


def resolve(
    cfg: dict,
    defaults: dict,
    explicit: set[str] | frozenset[str] = frozenset(),
    source: Source | None = None,
) -> dict:
    """Fill in the defaults that depend on other keys, and check the values no type check catches,
    so that a bad value is a one-line error before any work. explicit: the keys a config file or the
    command line set (an extension's source decides the others of its model); source: the run
    init_from names, read (else read here)."""
    cfg = dict(cfg)
    source = source or runs.source(cfg["init_from"])
    if source is not None:
        extend_from(cfg, explicit, source)
    check_task(cfg, defaults)
    check_encoding_options(cfg, defaults, extension=source is not None)
    cfg["dataset"] = cfg["dataset"] or ("" if cfg["task"] else "shakespeare_char")
    cfg["out_dir"] = cfg["out_dir"] or "-".join(
        filter(None, ["out", cfg["pos_encoding"], cfg["task"]])
    )
    if source is not None:
        src = Path(cfg["init_from"]).resolve()
        out = Path(cfg["out_dir"]).resolve()
        if out == src or src in out.parents:
            raise ConfigError(
                f"out_dir={cfg['out_dir']!r} is inside init_from={cfg['init_from']!r}, the run "
                "this one extends, which "
                "is never written to: give the new run its own --out_dir"
            )
    cfg["wandb_run_name"] = cfg["wandb_run_name"] or cfg["pos_encoding"]
    cfg["task_seed"] = cfg["seed"] if cfg["task_seed"] is None else cfg["task_seed"]
    cfg["wandb_group"] = cfg["wandb_group"] or (
        f"{cfg['task'] or cfg['dataset']}-{cfg['n_layer']}L-{cfg['n_embd']}d-T{cfg['block_size']}"
    )
    check_device(cfg["device"])
    if cfg["wandb_log"] and (problem := missing("wandb", "wandb_log=True")):
        raise ConfigError(problem)
    cfg["dtype"] = cfg["dtype"] or default_dtype(cfg["device"])
    if cfg["compile"] is None:
        cfg["compile"] = cfg["device"].startswith("cuda")
    if cfg["dtype"] not in DTYPES:
        raise ConfigError(f"dtype={cfg['dtype']!r}: choose float32, bfloat16 or float16")
    if not isinstance(cfg["compile"], bool):
        raise ConfigError(f"compile={cfg['compile']!r}: expected True or False")
    if cfg["pe_lr_scale"] is not None:  # None (the encoding's own) is resolved with the model
        if not isinstance(cfg["pe_lr_scale"], int | float) or isinstance(cfg["pe_lr_scale"], bool):
            raise ConfigError(
                f"pe_lr_scale={cfg['pe_lr_scale']!r}: expected a number, e.g. 30, or None"
            )
        cfg["pe_lr_scale"] = float(cfg["pe_lr_scale"])
    if cfg["activation_checkpointing"] not in ACTIVATION_CHECKPOINTING:
        raise ConfigError(
            f"activation_checkpointing={cfg['activation_checkpointing']!r}: choose none, full (the "
            "least memory) or "
            "selective (each block's attention alone)"
        )
    if cfg["parallel"] not in STRATEGIES:
        raise ConfigError(
            f"parallel={cfg['parallel']!r}: choose ddp (the default) or fsdp (sharded)"
        )
    if cfg["parallel"] == "fsdp" and cfg["dtype"] == "float16":
        raise ConfigError(
            "dtype=float16 with parallel=fsdp: sharded training runs in float32 or bfloat16 (no "
            "loss scaling); "
            "use --dtype=bfloat16"
        )
    if cfg.get("packing") == "documents" and (cfg["task"] or cfg["task_fraction"]):
        what = f"task={cfg['task']!r}" if cfg["task"] else f"task_fraction={cfg['task_fraction']}"
        raise ConfigError(
            f"packing='documents' with {what}: a task's row is one sequence, with no documents to "
            "keep apart; "
            "train tasks with --packing=stream"
        )
    if cfg["backend"] not in ("", "nccl", "gloo", "mpi", "ucc"):
        raise ConfigError(
            f"backend={cfg['backend']!r}: choose nccl (GPUs) or gloo (CPUs), or leave it empty"
        )
    if check_init_from(cfg["init_from"], source) and (
        problem := missing("transformers", f"init_from={cfg['init_from']!r}")
    ):
        raise ConfigError(problem)
    check_idle_options(cfg, explicit)
    check_ranges(cfg)
    # torchrun's, known before the process group starts
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if cfg["gradient_accumulation_steps"] % world_size:
        raise ConfigError(
            f"gradient_accumulation_steps={cfg['gradient_accumulation_steps']} must be a multiple "
            "of the "
            f"{world_size} processes"
        )
    # the model's own checks (GPTConfig), before the data or the model
    if cfg["init_from"] == "scratch":
        try:
            model = {f.name: cfg[f.name] for f in fields(GPTConfig) if f.name in cfg}
            # the end-of-text token comes with the data (build_model)
            GPTConfig(**model, eot_token=0)
        except ValueError as e:  # GPTConfig names the bad field and the valid choices
            raise ConfigError(str(e)) from e
    return cfg


# GPT-2's checkpoints on the Hugging Face hub
GPT2_NAMES = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")


def check_init_from(init: str, source: Source | None) -> bool:
    """init_from names what it can start from: scratch, resume, a run's folder (source, read),
    GPT-2's names, or a folder of Hugging Face GPT-2 weights; anything else (a missing folder, an
    export of this project, another model's weights) is a one-line error. True where it names
    GPT-2's weights (transformers loads them)."""
    choices = (
        "scratch, resume, a run's folder (to extend it), "
        + ", ".join(GPT2_NAMES)
        + " or a GPT-2 folder"
    )
    if init in ("scratch", "resume") or source is not None:
        return False
    if init in GPT2_NAMES:
        return True
    folder = Path(init)
    if not folder.is_dir():
        what = "is a file" if folder.exists() else "does not exist"
        raise ConfigError(f"init_from={init!r}: {what}; choose {choices}")
    if (folder / "nanope.json").is_file():
        raise ConfigError(
            f"init_from={init!r} is a Hugging Face export of a nanoPE run (python -m export wrote "
            "it), not the "
            "run: give the run's folder (its out_dir, with ckpt.pt) to extend it"
        )
    try:
        model_type = json.loads((folder / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        model_type = None
    if model_type != "gpt2":
        found = (
            f"Hugging Face {model_type!r} weights, not GPT-2's"
            if model_type
            else "neither a run's checkpoint (ckpt.pt or ckpt.dcp) nor Hugging Face GPT-2 weights "
            "(config.json)"
        )
        raise ConfigError(f"init_from={init!r} holds {found}; choose {choices}")
    return True


def check_idle_options(cfg: dict, explicit: set[str] | frozenset[str]) -> None:
    """An option of the chosen encoding that the user gave and that does nothing with the rest
    (RoPE's factor without a scaling: the encoding's Option.idle says so) is an error."""
    for name, (owner, opt) in ENCODING_OPTIONS.items():
        if owner == cfg["pos_encoding"] and name in explicit and cfg[name] != opt.default:
            if problem := idle_option(cfg["pos_encoding"], name, cfg[name], cfg):
                raise ConfigError(problem)


def idle_option(pos_encoding: str, name: str, value, options: dict) -> str | None:
    """Why an encoding's option, given as value, does nothing for a model of pos_encoding (another
    encoding's, or idle without the other options: its Option.idle), in train.py's words for every
    command; None where it is read."""
    owner, opt = ENCODING_OPTIONS[name]
    if owner != pos_encoding:
        return (
            f"{name}={value!r} is an option of pos_encoding={owner!r}, not of {pos_encoding!r}: "
            "drop it"
        )
    defaults = {n: o.default for n, (_, o) in ENCODING_OPTIONS.items()}
    return (
        f"{name}={value!r} {why}, or drop --{name}"
        if (why := opt.idle(defaults | options))
        else None
    )


def check_encoding_options(cfg: dict, defaults: dict, extension: bool = False) -> None:
    """An option of another encoding than the chosen one (--rpe_max_distance with rope) does
    nothing: an error. On a resume or GPT-2's weights the checkpoint decides the encoding; on an
    extension its source did (extend_from)."""
    if cfg["init_from"] != "scratch" and not extension:
        return
    for name, (owner, _) in ENCODING_OPTIONS.items():
        if owner != cfg["pos_encoding"] and cfg[name] != defaults[name]:
            fix = (
                f"its source {cfg['init_from']} is"
                if extension
                else f"or train with --pos_encoding={owner}"
            )
            raise ConfigError(
                f"{name}={cfg[name]!r} is an option of pos_encoding={owner!r}, not of "
                f"{cfg['pos_encoding']!r}: drop "
                + (f"it ({fix} {cfg['pos_encoding']})" if extension else f"it, {fix}")
            )


def check_task(cfg: dict, defaults: dict) -> None:
    """A synthetic task makes its own sequences: it cannot also read a text dataset or mix tasks
    into text, and it must fit the block size and its vocabulary. An option of the synthetic tasks
    that the chosen task does not read (any of them on a text run, task_pairs with needle) would do
    nothing: an error."""
    for key in TASK_OPTIONS:
        task = cfg["task"]
        if cfg[key] != defaults[key] and (not task or key in MQAR_OPTIONS and task != "mqar"):
            reads = "task=mqar" if key in MQAR_OPTIONS else "a synthetic task (--task=...)"
            runs = f"task={task!r}" if task else "a text run"
            raise ConfigError(
                f"{key}={cfg[key]!r} is read by {reads} and this is {runs}: drop "
                f"it, or train on {reads}"
            )
    if not cfg["task"]:
        return
    for key, text_only in (("dataset", cfg["dataset"]), ("task_fraction", cfg["task_fraction"])):
        if text_only:
            raise ConfigError(
                f"task={cfg['task']!r} trains on synthetic sequences alone, and "
                f"{key}={text_only!r} is for text: "
                f"drop --{key} for the synthetic task, or drop --task to train on text"
            )
    try:
        synthetic_tasks.check(
            cfg["task"], cfg["block_size"], cfg["task_vocab"], **synthetic_tasks.task_options(cfg)
        )
    except synthetic_tasks.SyntheticError as e:
        raise ConfigError(str(e)) from e


def check_ranges(cfg: dict) -> None:
    """The numeric ranges of the training options; each error names the value, the rule and the
    usual setting."""

    need = partial(require, cfg)

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
        "trains nothing (it would only save an untrained model); give a positive number, or "
        "--eval_only=True to "
        "evaluate without training",
    )
    need(
        cfg["learning_rate"] > 0,
        "learning_rate",
        "must be positive (1e-3 for small models, 6e-4 for GPT-2)",
    )
    need(
        cfg["pe_lr_scale"] is None or cfg["pe_lr_scale"] > 0,
        "pe_lr_scale",
        "must be positive (1: the same rate)",
    )
    need(cfg["min_lr"] >= 0, "min_lr", "must be at least 0 (about learning_rate / 10)")
    need(cfg["warmup_iters"] >= 0, "warmup_iters", "must be at least 0 (0: no warmup)")
    need(cfg["lr_decay_iters"] >= 0, "lr_decay_iters", "must be at least 0 (about max_iters)")
    need(
        cfg["weight_decay"] >= 0, "weight_decay", "must be at least 0 (0 disables it; 0.1 is usual)"
    )
    need(0 <= cfg["beta1"] < 1, "beta1", "must be in [0, 1) (0.9 is usual)")
    need(0 <= cfg["beta2"] < 1, "beta2", "must be in [0, 1) (0.95 or 0.99 are usual)")
    need(
        0 <= cfg["dropout"] < 1,
        "dropout",
        "must be in [0, 1) (0 for pretraining, 0.1-0.2 for small data)",
    )
    need(
        0 <= cfg["seed"] < 2**62,
        "seed",
        "must be in [0, 2**62) (torch's generators take 64-bit seeds)",
    )
    need(
        0 <= cfg["task_fraction"] < 1,
        "task_fraction",
        "must be in [0, 1) (0: text only; 0.05-0.1 is usual)",
    )
    need(
        0 <= cfg["task_mix"] < 1,
        "task_mix",
        "must be in [0, 1) (0: the task's rows alone; 0.25 is usual)",
    )
    need(
        isinstance(cfg["task_seed"], int) and cfg["task_seed"] >= 0,
        "task_seed",
        "must be an integer at least 0",
    )
    need(
        cfg["grad_clip"] >= 0,
        "grad_clip",
        "must be at least 0 (0 disables clipping; a negative norm trains backwards)",
    )


def check_fits(config: GPTConfig, cfg: dict, shards: int, defaults: dict) -> None:
    """Refuse, before building it, a model that cannot train in the device's memory (torch's
    allocation error would name no option). Every process builds its float32 weights whole (4 bytes
    a parameter), then training holds them with their gradients and AdamW's two moments (16 bytes),
    which FSDP splits over its processes. The parameters are counted as integers from the shape, not
    by building the model (of an absurd size, that would overflow or hang): at least the token table
    (vocab_size x n_embd, tied to lm_head) and 12 n_embd^2 a layer (attention 4, MLP 8)."""
    table = config.vocab_size * config.n_embd
    n = table + 12 * config.n_layer * config.n_embd**2
    per_param = max(4, 16 // shards)
    memory = device_memory(cfg["device"])
    if not memory or n * per_param <= memory:
        return
    if cfg["task"] and 2 * table > n:  # most of it is the task's vocabulary
        what = f"task_vocab={cfg['task_vocab']:,} makes"
        fix = f"lower --task_vocab (default {defaults['task_vocab']})"
    else:
        what = f"n_layer={config.n_layer}, n_embd={config.n_embd:,} make"
        fix = "lower --n_layer or --n_embd"
    raise ConfigError(
        f"{what} a model of at least {n:,} parameters, which needs at least {gb(n * per_param)} to "
        "train (float32 "
        f"weights, gradients and AdamW's two moments), more than the {gb(memory)} of "
        f"{cfg['device']}: {fix}"
    )


def odd_values(cfg: dict) -> list[str]:
    """Values that are legal but probably not meant: training goes ahead, and the log says so
    once."""
    notes = []
    if cfg["decay_lr"] and cfg["min_lr"] > cfg["learning_rate"]:
        notes.append(
            f"min_lr={cfg['min_lr']} > learning_rate={cfg['learning_rate']}: the decay "
            "raises the rate"
        )
    if cfg["decay_lr"] and cfg["warmup_iters"] >= cfg["max_iters"] and not cfg["eval_only"]:
        notes.append(
            f"warmup_iters={cfg['warmup_iters']} >= max_iters={cfg['max_iters']}: the "
            "whole run is warmup"
        )
    elif cfg["decay_lr"] and cfg["lr_decay_iters"] < cfg["warmup_iters"]:
        notes.append(
            f"lr_decay_iters={cfg['lr_decay_iters']} < warmup_iters={cfg['warmup_iters']}: the "
            "rate drops to min_lr "
            "right after warmup"
        )
    if cfg["parallel"] == "fsdp" and int(os.environ.get("WORLD_SIZE", 1)) == 1:
        notes.append(
            "parallel=fsdp in one process: it trains unsharded, and saves sharded checkpoints "
            "(ckpt.dcp) that resume "
            "at any number of processes (torchrun --nproc_per_node=N shards it)"
        )
    if cfg["learning_rate"] > 0.1:
        notes.append(
            f"learning_rate={cfg['learning_rate']} is far above AdamW's usual 1e-4 to 1e-3"
        )
    return notes
