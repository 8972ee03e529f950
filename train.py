"""
Train a GPT with any positional encoding, with nanoGPT's config keys.
    python train.py config/rope.py                     # one GPU (bf16 + torch.compile), or the CPU
    python train.py config/rope.py config/cpu.py       # a CPU-sized run (minutes on a laptop)
    python train.py config/rope.py config/passkey.py   # a synthetic retrieval task, on a CPU
    python train.py config/rope.py --init_from=resume  # continue a run exactly where it stopped
    # extend a run: fine-tune its weights at 4x its length
    python train.py config/rope.py --init_from=out-rope --out_dir=out-rope-yarn --block_size=1024 \
        --rope_scaling=yarn
    # DDP (a copy per GPU), FSDP (the model sharded)
    torchrun --standalone --nproc_per_node=8 train.py config/gpt2.py
    torchrun --standalone --nproc_per_node=8 train.py config/gpt2.py --parallel=fsdp
Ctrl-C (or SIGTERM) saves a checkpoint after the current iteration, then exits; press it twice to
quit at once.
"""

import math
import os
import sys
import time
from dataclasses import dataclass, fields

import torch

from lib import runs
from lib.batches import Batches
from lib.checkpoint import Checkpoint, Checkpointer, CheckpointError, TrainingState
from lib.configurator import ConfigError, configure, script_usage
from lib.datafiles import (
    SPLITS,
    Data,
    DataError,
    data_name,
    load_data,
    model_data_problem,
    no_documents,
    tokenizer_difference,
    trained_distances,
)
from lib.devices import autocast, check_memory, default_device
from lib.kernel_fallbacks import fused_attention_note, with_kernel_fallbacks
from lib.options import check_fits, odd_values, resolve
from lib.parallel import (
    STRATEGIES,
    Processes,
    Strategy,
    held_bytes,
    start_processes,
    stop_on_signals,
    strategy,
)
from lib.progress import Progress, format_duration
from lib.synthetic_tasks import LEARNED, learned_at
from lib.tokenizer import GPT2Tokenizer
from model import ENCODING_OPTIONS, GPT, POS_ENCODINGS, GPTConfig
from shape import set_activation_checkpointing

# --------------------------------------------------------------------------------------------------
# Defaults: the comparison experiment of config/<encoding>.py, a ~10M-parameter character-level GPT
# on the complete works of Shakespeare at block 256 (nanoGPT's shakespeare_char sizes; minutes on
# one GPU).
defaults = dict(
    # I/O
    out_dir="",  # default: out-<pos_encoding>
    eval_interval=250,
    log_interval=10,
    eval_iters=200,  # batches per split for each validation estimate (the same batches every time)
    eval_only=False,  # evaluate once and exit
    # save ckpt.pt at every eval; False: only when val loss improves, and at the end
    always_save_checkpoint=True,
    # scratch | resume (from out_dir/ckpt.pt) | a run's folder (extend it: a new run from its
    init_from="scratch",
    # weights and model, at a block_size at least its own, dropout and RoPE scaling free) | gpt2 |
    # gpt2-medium | gpt2-large | gpt2-xl | a local Hugging Face GPT-2 folder
    overwrite=False,  # True: start afresh in an out_dir that holds a run, replacing its checkpoints
    # wandb
    wandb_log=False,
    wandb_project="nanope",
    wandb_run_name="",  # default: <pos_encoding>
    # default: <dataset>-<n_layer>L-<n_embd>d-T<block_size>, so one experiment's encodings sit
    # together
    wandb_group="",
    # data
    # a folder of data/ or a prepared one's path; default shakespeare_char (embedded: prepared at
    # once)
    dataset="",
    gradient_accumulation_steps=1,  # micro-steps per iteration, over all processes
    batch_size=64,  # sequences per micro-step and process
    block_size=256,
    # stream (nanoGPT's: documents joined by the end-of-text token, every token sees its whole
    packing="stream",
    # window) | documents (each end-of-text token begins a document: positions restart and attention
    # stays inside it; the dataset must mark its documents, e.g. shakespeare_char_scenes,
    # openwebtext, tinystories, wikitext103)
    # training rows that are retrieval tasks (passkey, recall, copy), e.g. 0.05; val: text
    task_fraction=0.0,
    task_seed=None,  # seeds the task sequences with the iteration (default: seed)
    # synthetic token-level tasks instead of text (config/<task>.py have their recipes)
    # needle | passkey | mqar | offset | copy: train on the task's sequences, loss on the answers
    # only
    task="",
    # the task's vocabulary: 3 special tokens, then three equal ranges of keys, values and filler
    task_vocab=128,
    task_pairs=8,  # mqar: key-value pairs per sequence
    task_queries=4,  # mqar: keys asked per sequence, each one trial
    # mqar: scattered (pairs in filler, queries last) | zoology (pairs first, queries after)
    task_layout="scattered",
    # the fraction of training rows that are needle rows (a curriculum: the lookup is learned on
    # them,
    task_mix=0.0,
    # then found through the marker); validation has the task's rows alone
    # training rows also ask, at every position that is not an answer, for the token before
    task_prev_tokens=False,
    # it (a curriculum that builds the previous-token head retrieval by key needs); validation has
    # the answers alone model
    # one of the encodings (--help lists them); each encoding's own options follow this block
    pos_encoding="rope",
    gelu="exact",  # exact (nanoGPT's) | tanh (GPT-2's; GPT-2 checkpoints bring their own)
    n_layer=6,
    n_head=6,
    n_embd=384,
    dropout=0.2,  # 0 for pretraining, 0.1+ for finetuning and small data
    bias=False,  # biases in Linears and LayerNorms (GPT-2 has them)
    # AdamW
    learning_rate=1e-3,
    # the encoding's parameters learn this many times faster; None: its own (30: zero-started
    # biases)
    pe_lr_scale=None,
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
    # under torchrun: ddp (a full copy of the model, gradients and AdamW's state per process) | fsdp
    parallel="ddp",
    # (each process holds 1/N of them: FSDP2; checkpoints go to ckpt.dcp, which resumes at any
    # number of processes)
    backend="",  # the processes' backend: nccl | gloo; default nccl on GPU, gloo on CPU
    device=default_device(),  # cuda, cuda:1, mps, cpu; default the best available
    # float32 | bfloat16 | float16; default bfloat16 where the GPU has it, else float16; float32 on
    # CPU
    dtype="",
    compile=None,  # torch.compile the model; default on for CUDA
    # none | full (every block's activations computed again in the backward: the
    activation_checkpointing="none",
    # least memory) | selective (each block's attention alone, where a (T, T) tensor lives); the
    # same numbers
    seed=1337,
)
# each encoding's: rpe_max_distance, ...
defaults |= {name: opt.default for name, (_, opt) in ENCODING_OPTIONS.items()}
CPU_SIZED_FLOPS = 1e11  # training FLOPs per iteration above which a CPU takes seconds per iteration
# longer work between log lines shows progress
PROGRESS_SECONDS = float(os.environ.get("NANOPE_PROGRESS_SECONDS", 10))


class TrainError(Exception):
    pass


def usage() -> str:
    """--help: the module docstring, the defaults block of this file (comments and all), the
    encodings and each encoding's options from the registry."""
    encodings = "\n".join(f"  {name}: {cls.summary}" for name, cls in POS_ENCODINGS.items())
    options = "\n".join(
        f"{name}={defaults[name]!r}  # {owner}: {opt.help}"
        for name, (owner, opt) in ENCODING_OPTIONS.items()
    )
    return (
        f"{script_usage(__file__, __doc__)}\n\npos_encoding, one of:\n{encodings}\n\n"
        f"Each encoding's options (another encoding's is an error):\n{options}"
    )


# --------------------------------------------------------------------------------------------------
# main: the options checked, the run set up, then nanoGPT's loop; the helpers follow in the order it
# calls them


def main(argv: list[str]) -> None:
    if "--help" in argv or "-h" in argv:
        print(usage())
        return
    explicit: set[str] = set()
    options = configure(
        defaults, argv, explicit, owners=dict.fromkeys(POS_ENCODINGS, "pos_encoding")
    )
    # the run an extension starts from, read once: its options, its weights
    source = runs.source(options["init_from"])
    cfg = resolve(options, defaults, explicit, source)
    # known before the process group: errors come before any work
    master = int(os.environ.get("RANK", 0)) == 0
    checkpointer = Checkpointer(
        cfg["out_dir"], sharded=STRATEGIES[cfg["parallel"]].sharded, master=master
    )
    try:
        if master:
            # prepare() checks it for a training run
            if cfg["init_from"] == "resume" and cfg["eval_only"]:
                checkpointer.check_resumable()
            if not cfg["eval_only"]:  # eval_only writes nothing
                for line in checkpointer.prepare(cfg["init_from"], cfg["overwrite"]):
                    print(line)
            for note in odd_values(cfg):
                print(f"note: {note}")
        train(cfg, checkpointer, source)
    finally:
        # a second main() in this process, or another run, may use the folder now
        checkpointer.release()


def train(cfg: dict, checkpointer: Checkpointer, source: runs.Source | None = None) -> None:
    """Set up the processes, the data, the model and the run's state; then the loop: evaluate and
    save every eval_interval, train one iteration, log; a signal saves and stops."""
    procs = start_processes(cfg["device"], cfg["backend"], cfg["seed"])
    parallel = strategy(cfg["parallel"], procs)
    log = procs.log
    data = load_data(cfg, procs)
    batches = Batches(cfg, data, procs)  # the rows the loop trains and evaluates on
    resumed = checkpointer.load() if cfg["init_from"] == "resume" else None
    shards = procs.world_size if parallel.sharded else 1  # the processes each weight is split over
    model = build_model(cfg, data, resumed, source, log, shards=shards)
    del source  # its checkpoint, in memory until now
    # a training setting: a resume may change it
    set_activation_checkpointing(model, cfg["activation_checkpointing"])
    model.to(procs.device)
    if not cfg["eval_only"]:
        check_memory(model, cfg, procs, shards)
    # before the optimizer, which takes the (sharded) parameters
    parallel.prepare(model, cfg["dtype"])
    run = Run(
        cfg=cfg,
        tokenizer=data.meta["tokenizer"],
        model=model,
        optimizer=new_optimizer(model, cfg, procs.device_type),
        scaler=torch.amp.GradScaler(procs.device_type, enabled=cfg["dtype"] == "float16"),
        data_rng=torch.Generator().manual_seed(cfg["seed"]),
        procs=procs,
        strategy=parallel,
        checkpointer=checkpointer,
        batches=batches,
    )
    if resumed is not None:
        checkpointer.restore(run, resumed, procs)
        # the run is saved with how it started (scratch, its source...), not with this process's
        # "resume"
        cfg["init_from"] = resumed.config.get("init_from", "resume")
        del resumed  # a ckpt.pt's states, in memory until now
    if run.iter_num >= cfg["max_iters"] and not cfg["eval_only"]:
        log(
            f"the run in {cfg['out_dir']} already reached max_iters={cfg['max_iters']}: nothing to "
            "train, nothing "
            "written; raise --max_iters to train on, or evaluate it with --eval_only=True"
        )
        parallel.finish()
        return
    start_iter = run.iter_num
    # from here, Ctrl-C is answered
    stop = stop_on_signals(procs, trained=lambda: run.iter_num > start_iter)
    log_start(run)
    run.net = parallel.wrap(model, cfg["compile"])
    wandb = start_wandb(run)
    progress = Progress(run)
    if cfg["compile"] and not cfg["eval_only"]:
        log("compiling the model (the first iterations; once per run) ...")
    while True:
        # a signal on any process: every process stops at this iteration
        if parallel.any(stop).item():
            checkpointer.save(run, procs, best=False)
            log(
                f"stopped at iteration {run.iter_num}; resume with --init_from=resume "
                f"--out_dir={cfg['out_dir']}"
            )
            break
        lr = get_lr(run.iter_num, cfg)
        for group in run.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_scale", 1.0)
        if (
            run.iter_num % cfg["eval_interval"] == 0
            or run.iter_num >= cfg["max_iters"]
            or cfg["eval_only"]
        ):
            seconds = evaluate_and_save(run, stop, wandb, lr)
            if seconds is None:  # stopped mid-evaluation: the top of the loop saves
                continue
            progress.evaluated(seconds)
            if cfg["eval_only"]:
                break
        if run.iter_num >= cfg["max_iters"]:
            break

        loss = with_fallback(run, lambda: train_step(run))
        progress.stepped(loss, lr, wandb)
        run.iter_num += 1

    if wandb:
        wandb.finish()
    parallel.finish()


# --------------------------------------------------------------------------------------------------
# Setup: the data, the model, the run's state


def build_model(
    cfg: dict,
    data: Data,
    resumed: Checkpoint | None,
    source: runs.Source | None,
    log,
    shards: int = 1,
) -> GPT:
    """The model from scratch (checked to fit the device, its training state split over `shards`
    processes), the shape of the checkpoint it resumes (its weights load in the Checkpointer's
    restore), the run it extends (its weights: runs.extended_model), or GPT-2's weights. The
    checkpoint or GPT-2 decides the architecture: cfg follows it, with a note where it disagreed.
    What the data is cannot follow it: a resume on other data (check_resumed_data), or an extension
    on tokens that mean other things, is an error."""
    # block_size is the model's capacity (it may be larger: RoPE, ALiBi... resumed at a smaller T),
    # the rest its shape
    model_keys = [f.name for f in fields(GPTConfig) if f.name in cfg and f.name != "block_size"]
    # the model reads documents from it
    eot = data.meta.get("eot") if cfg["packing"] == "documents" else None
    if (
        cfg["packing"] == "documents"
        and eot is None
        and cfg["init_from"] != "resume"
        and source is None
    ):
        raise TrainError(no_documents(cfg))
    if cfg["init_from"] == "scratch":
        try:
            config = GPTConfig(
                vocab_size=data.vocab_size,
                block_size=cfg["block_size"],
                eot_token=eot,
                **{k: cfg[k] for k in model_keys},
            )
        except ValueError as e:  # GPTConfig names the bad field and the valid choices
            raise ConfigError(str(e)) from e
        check_fits(config, cfg, shards, defaults)
        model = GPT(config)
    elif resumed is not None:
        runs.check_resumed_data(resumed, cfg, data.meta["tokenizer"])
        model = GPT(resumed.model_config)
    elif source is not None:
        model = runs.extended_model(source, cfg, data.meta["tokenizer"], log)
    else:
        # before any weights load
        if problem := tokenizer_difference(data.meta["tokenizer"], GPT2Tokenizer.meta):
            raise TrainError(
                f"init_from={cfg['init_from']!r} is GPT-2's weights, and this run's data "
                f"({data_name(cfg)}) {problem}: "
                "its token ids mean other things; fine-tune GPT-2 on data in its BPE (e.g. "
                "--dataset=shakespeare), or "
                "train from scratch (--init_from=scratch)"
            )
        try:
            model = GPT.from_pretrained(cfg["init_from"], dropout=cfg["dropout"])
        # offline, a misspelled name, no transformers
        except (OSError, ImportError, ValueError) as e:
            raise TrainError(f"cannot load GPT-2 weights from {cfg['init_from']!r}: {e}") from e
        if cfg["block_size"] < model.config.block_size:
            model.crop_block_size(cfg["block_size"])
        # an attention rule, not a weight
        model.config.packing = cfg["packing"]
        model.config.eot_token = eot
    for k in model_keys:
        if getattr(model.config, k) != cfg[k]:
            log(
                f"note: {k}={getattr(model.config, k)!r} from {cfg['init_from']} (config says "
                f"{cfg[k]!r})"
            )
            cfg[k] = getattr(model.config, k)
    if problem := model_data_problem(model.config, cfg, data):
        raise TrainError(problem)
    if cfg["pe_lr_scale"] is None:  # a resumed run keeps its own; else the encoding's
        cfg["pe_lr_scale"] = (
            resumed and resumed.config.get("pe_lr_scale")
        ) or model.encoding.lr_scale
    return model


def new_optimizer(model: GPT, cfg: dict, device_type: str) -> torch.optim.Optimizer:
    """AdamW as the options set it up (GPT.configure_optimizers: no decay on biases, norms or a
    score bias)."""
    betas = (cfg["beta1"], cfg["beta2"])
    return model.configure_optimizers(
        cfg["weight_decay"], cfg["learning_rate"], betas, device_type, cfg["pe_lr_scale"]
    )


@dataclass(kw_only=True)
class Run(TrainingState):
    """A training run: its state (TrainingState, what a checkpoint saves), and what the loop works
    with."""

    procs: Processes
    # how the processes share the work (lib/parallel.py): the loop asks it, never its name
    strategy: Strategy
    checkpointer: Checkpointer  # out_dir's checkpoints, in the strategy's format
    batches: Batches  # the rows it trains and evaluates on
    # what the loop calls: the model, compiled and/or wrapped by the strategy
    net: torch.nn.Module | None = None

    @property
    def tokens_per_iter(self) -> int:
        return (
            self.cfg["gradient_accumulation_steps"]
            * self.cfg["batch_size"]
            * self.cfg["block_size"]
        )

    def autocast(self):
        return autocast(self.procs.device, self.cfg["dtype"])


# --------------------------------------------------------------------------------------------------
# The loop's steps: the learning rate, one iteration of training, evaluation and saving, the log


def get_lr(it: int, cfg: dict) -> float:
    """Linear warmup for warmup_iters, then cosine decay to min_lr at lr_decay_iters."""
    if not cfg["decay_lr"]:
        return cfg["learning_rate"]
    if it < cfg["warmup_iters"]:
        return cfg["learning_rate"] * (it + 1) / (cfg["warmup_iters"] + 1)
    if it > cfg["lr_decay_iters"]:
        return cfg["min_lr"]
    ratio = (it - cfg["warmup_iters"]) / max(1, cfg["lr_decay_iters"] - cfg["warmup_iters"])
    return cfg["min_lr"] + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (
        cfg["learning_rate"] - cfg["min_lr"]
    )


def train_step(run: Run) -> torch.Tensor:
    """One optimizer step over gradient_accumulation_steps micro-batches (gradients synchronized on
    the last); returns the loss (a 0-d tensor: reading it would wait for the GPU)."""
    cfg = run.cfg
    strategy = run.strategy
    grad_accum = cfg["gradient_accumulation_steps"] // run.procs.world_size
    loss_sum = torch.zeros((), device=run.procs.device)
    for micro_step in range(grad_accum):
        X, Y = run.batches.batch("train", run.data_rng, step=(run.iter_num, micro_step))
        strategy.sync_gradients(run.net, micro_step == grad_accum - 1)
        with run.autocast():
            loss = run.net(X, Y)[1] / grad_accum
        loss_sum += loss.detach()
        run.scaler.scale(loss).backward()
    run.scaler.unscale_(run.optimizer)
    norm = strategy.clip(run.model, cfg["grad_clip"] or float("inf"))
    # fp16's GradScaler skips steps with inf gradients by design; a non-finite loss is always fatal
    if bad := non_finite(strategy, loss_sum, norm, check_norm=not run.scaler.is_enabled()):
        raise TrainError(
            f"non-finite {bad} at iteration {run.iter_num}: stopped before the optimizer step; the "
            "last good "
            f"checkpoint is in {cfg['out_dir']} (try a lower learning_rate, grad_clip, or "
            "dtype=bfloat16)"
        )
    run.scaler.step(run.optimizer)
    run.scaler.update()
    run.optimizer.zero_grad(set_to_none=True)
    return loss_sum


def non_finite(
    strategy: Strategy, loss: torch.Tensor, norm: torch.Tensor, check_norm: bool
) -> str | None:
    """'loss' or 'gradient norm' if any process saw a non-finite one, else None. Every process gets
    the same answer: one stopping alone would leave the others waiting in their next collective."""
    flags = torch.stack([~torch.isfinite(loss), ~torch.isfinite(norm) & check_norm]).float()
    loss_bad, norm_bad = strategy.any(flags).tolist()
    return "loss" if loss_bad else "gradient norm" if norm_bad else None


@torch.no_grad()
def estimate_loss(run: Run, stop: torch.Tensor | None = None) -> dict[str, float] | None:
    """Mean loss over eval_iters batches per split: the same batches at every eval (seeded), split
    over ranks. For a synthetic task also "acc", the validation accuracy: exact match (argmax) at
    the answer tokens. A long evaluation (a GPU-sized one on a CPU) shows its progress and ETA; a
    stop request (the flag `stop`) ends it at the next batch, returning None, except under torchrun,
    where every rank must finish the same batches."""
    out = {}
    run.net.eval()
    n = len(SPLITS) * run.cfg["eval_iters"]
    done = 0
    t0 = time.time()
    shown = t0
    for split in SPLITS:
        g = torch.Generator().manual_seed(run.cfg["seed"] + 1)
        losses = torch.zeros(run.cfg["eval_iters"], device=run.procs.device)
        hits = torch.zeros(2, device=run.procs.device)  # right answers, answers
        for k in range(run.cfg["eval_iters"]):
            if stop is not None and stop.item() and not run.procs.distributed:
                run.net.train()
                return None
            X, Y = run.batches.batch(split, g)
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
        out[split] = run.procs.reduce(losses.mean(), "avg").item()
        if run.cfg["task"] and split == "val":
            hits = run.procs.reduce(hits, "sum")
            out["acc"] = (hits[0] / hits[1]).item()
    run.net.train()
    return out


def evaluate_and_save(run: Run, stop: torch.Tensor, wandb, lr: float) -> float | None:
    """Estimate the losses, log them (and to wandb), and save a checkpoint: at every evaluation with
    always_save_checkpoint, else when the val loss improves, and at the end; ckpt_best when it
    improves. Returns the evaluation's seconds, or None when a stop request ended it early."""
    cfg = run.cfg
    log = run.procs.log
    t0 = time.time()
    losses = with_fallback(run, lambda: estimate_loss(run, stop))
    if losses is None:
        return None
    seconds = time.time() - t0
    improved = losses["val"] < run.best_val_loss
    run.best_val_loss = min(run.best_val_loss, losses["val"])
    acc = f", val accuracy {losses['acc']:.1%}" if "acc" in losses else ""
    log(
        f"step {run.iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f} "
        f"(best {run.best_val_loss:.4f}){acc}, eval {seconds:.1f}s"
    )
    if "acc" in losses and learned_at(run.history) is None and losses["acc"] >= LEARNED:
        log(f"learned {cfg['task']} at step {run.iter_num} (val accuracy >= {LEARNED:.0%})")
    run.history.append({"iter": run.iter_num, **losses})
    if wandb:
        metrics = {
            "iter": run.iter_num,
            "train/loss": losses["train"],
            "val/loss": losses["val"],
            "lr": lr,
        }
        wandb.log(metrics | ({"val/accuracy": losses["acc"]} if "acc" in losses else {}))
    if not cfg["eval_only"] and (
        cfg["always_save_checkpoint"] or improved or run.iter_num >= cfg["max_iters"]
    ):
        run.checkpointer.save(run, run.procs, best=improved)
    return seconds


def with_fallback(run: Run, step):
    """step(), falling back to another attention kernel where the fused one cannot be compiled
    (lib/kernel_fallbacks.py's KERNEL_FALLBACKS, one log line each). The training sampler and the
    gradients are put back first, so the retried step is the step that failed."""
    sampler = run.data_rng.get_state()

    def retry(options):
        run.model.attention_options = options
        run.optimizer.zero_grad(set_to_none=True)
        run.data_rng.set_state(sampler)
        run.net = run.strategy.wrap(run.model, run.cfg["compile"])

    options = run.model.attention_options if run.model.encoding.has_score_bias else None
    return with_kernel_fallbacks(step, options, retry, run.procs.log)


# --------------------------------------------------------------------------------------------------
# The run's surroundings: wandb, the first log lines


def start_wandb(run: Run):
    """wandb, logging this run (resumed where the checkpoint's left off), or None when wandb_log is
    off."""
    if not (run.cfg["wandb_log"] and run.procs.master):
        return None
    import wandb

    cfg = run.cfg
    names = dict(project=cfg["wandb_project"], name=cfg["wandb_run_name"], group=cfg["wandb_group"])
    wrun = wandb.init(**names, config=cfg, id=run.wandb_run_id, resume="allow")
    run.wandb_run_id = wrun.id
    wandb.define_metric("*", step_metric="iter")
    return wandb


def log_start(run: Run) -> None:
    """The run's first lines: what trains where, and anything about the setup worth a note."""
    cfg = run.cfg
    procs = run.procs
    model = run.model
    log = run.procs.log
    log(
        f"{cfg['pos_encoding']} GPT: {model.get_num_params() / 1e6:.2f}M parameters; "
        f"{run.tokens_per_iter:,} tokens "
        f"per iteration on {procs.world_size} process(es)"
        + (f" ({run.strategy.name})" if procs.distributed else "")
        + f", {held_bytes(model.parameters()) / 2**20:,.2f} MiB of parameters per process"
        + f", {procs.device}, {cfg['dtype']}"
        + (", compiled" if cfg["compile"] else "")
    )
    if cfg["task_fraction"]:
        log(
            f"retrieval tasks (passkey, recall, copy) in {cfg['task_fraction']:.0%} of the "
            "training rows, "
            f"seed {cfg['task_seed']}"
        )
    if cfg["task"]:
        log(
            f"synthetic task {cfg['task']} at {cfg['block_size']} tokens, vocabulary "
            f"{cfg['task_vocab']}: loss on the "
            "answers only"
        )
    if model.config.packing == "documents" and run.batches.data.dir is not None:
        longest, median = trained_distances(
            run.batches.data.dir, cfg["block_size"], model.config.eot_token
        )
        log(
            f"documents: positions restart at each end-of-text token (id {model.config.eot_token}) "
            "and attention stays "
            f"inside a document; trained distances up to {longest}, median {median:g} (64 random "
            "windows)"
        )
    head_dim = model.config.n_embd // model.config.n_head
    note = fused_attention_note(head_dim, procs.device_type, cfg["dropout"], bool(cfg["compile"]))
    if note and model.encoding.has_score_bias:
        log(f"note: {note}")  # what the fused kernel cannot take here: a slower path, not a crash
    if (
        procs.device_type == "cpu"
        and 6 * model.get_num_params() * run.tokens_per_iter > CPU_SIZED_FLOPS
    ):
        log(
            "note: a GPU-sized run on a CPU: each iteration takes seconds here. For a CPU-sized "
            "run (minutes), add "
            f"config/cpu.py: python train.py config/{cfg['pos_encoding']}.py config/cpu.py"
        )


def cli(argv: list[str]) -> None:
    """main as a command: a problem the user can fix is one line on stderr and exit status 1, never
    a traceback."""
    try:
        main(argv)
    except (ConfigError, CheckpointError, DataError, TrainError) as e:
        sys.exit(f"error: {e}")
    # before the run's handler is installed (data, model), or a second Ctrl-C
    except KeyboardInterrupt:
        sys.exit("interrupted")


if __name__ == "__main__":
    cli(sys.argv[1:])
