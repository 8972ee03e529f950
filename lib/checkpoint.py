"""
A training run's checkpoints: what they hold (a TrainingState, written and read back by the
Checkpointer's save() and restore() alone), where they are (`latest`), how they are written
(atomically) and read (weights_only: nothing loaded runs code). A sharded run (train.py
--parallel=fsdp) writes ckpt.dcp instead of ckpt.pt, every process its shards, read back at any
number of processes; `python -m lib.checkpoint OUT_DIR` consolidates it into a ckpt.pt.

It reads top to bottom: one file (ckpt.pt), the sharded folder (ckpt.dcp), the two formats, what a
checkpoint holds, the Checkpointer (a training run's out_dir: its lock, what it may overwrite, its
saves and its resume), and the consolidation.
"""

import contextlib
import os
import shutil
import sys
import uuid
import warnings
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path

import torch
import torch.distributed as dist

from lib.outputs import FolderLock, OutputError, cannot_write, fsync_dir, write_atomic
from lib.parallel import Processes
from model import GPT, POS_ENCODINGS, GPTConfig


class CheckpointError(Exception):
    pass


# the keys a format writes its own way (sharded: each process its shards)
STATES = ("model", "optimizer")


class Checkpoint:
    """A checkpoint as a resume reads it, in either format: `meta`, every key but the model's and
    AdamW's states, and load_into(), which reads those states into a model and optimizer as they are
    now."""

    meta: dict

    def load_into(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        raise NotImplementedError

    @property
    def model_config(self) -> GPTConfig:
        """The architecture of the model it holds (a resume builds it, then load_into fills its
        weights)."""
        return GPTConfig(**self.meta["model_args"])

    @property
    def config(self) -> dict:
        """train.py's options of the run that wrote it ({} for a checkpoint of nanoGPT's, which
        keeps fewer)."""
        return self.meta.get("config") or {}


# --------------------------------------------------------------------------------------------------
# One file: ckpt.pt


def save_checkpoint(ckpt: dict, path: str | Path) -> None:
    """Write ckpt whole (outputs.write_atomic): a crash at any moment leaves the old checkpoint or
    the new one."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, lambda f: torch.save(ckpt, f))


def remove_stale_temporaries(directory: str | Path) -> list[Path]:
    """Delete the `.<name>.<pid>.tmp` files save_checkpoint leaves when its process is killed
    mid-write (each up to a checkpoint's size, so they pile up); a live process's file, a save in
    progress, stays. Returns what went."""
    removed = []
    for tmp in Path(directory).glob(".*.*.tmp"):
        pid = tmp.name.rsplit(".", 2)[-2]
        if pid.isdigit() and int(pid) > 0 and not _alive(int(pid)):
            tmp.unlink(missing_ok=True)
            removed.append(tmp)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0 only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another user
        return True
    return True


def _load(path: Path, map_location: str) -> dict:
    """torch.load with weights_only (tensors and plain data: nothing in the file can run code), its
    model_args as this version reads them (saved_args). A file it cannot read is named as damaged or
    not a checkpoint; torch's own advice to retry with weights_only=False is not passed on, as that
    would run whatever code the file holds."""
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:
        what = (
            "it is not a file torch.save wrote (check the path)"
            if path.stat().st_size and not _zip_or_pickle(path)
            else "it is damaged (truncated by a full disk or an interrupted copy?)"
        )
        raise CheckpointError(
            f"{path} is not a readable checkpoint: {what} ({type(e).__name__}); restore it from a "
            "copy, or train again"
        ) from None
    # as this version reads it
    if isinstance(ckpt, dict) and isinstance(ckpt.get("model_args"), dict):
        ckpt["model_args"] = saved_args(ckpt["model_args"])
    return ckpt


def saved_args(model_args: dict) -> dict:
    """A saved config's arguments as this version reads them: an option the save predates takes what
    it computed."""
    options = getattr(POS_ENCODINGS.get(model_args.get("pos_encoding")), "options", {})
    return {
        n: o.before for n, o in options.items() if o.before is not None and n not in model_args
    } | model_args


def _zip_or_pickle(path: Path) -> bool:
    """Whether the file starts as torch.save writes: a zip archive (PK), or an older pickle
    (protocol 2+, 0x80)."""
    with open(path, "rb") as f:
        head = f.read(2)
    return head == b"PK" or head[:1] == b"\x80"


def load_checkpoint(path: str | Path, map_location: str = "cpu") -> dict:
    """A checkpoint, ckpt.pt or (where only that exists) its sharded ckpt.dcp (path may name either:
    latest's), as one dict; a sharded one with the model's full weights and no optimizer state."""
    path = Path(path)
    if not path.is_file() and os.path.lexists(path.with_suffix(".dcp")):
        return ShardedCheckpoint(path.with_suffix(".dcp")).whole()
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}")
    ckpt = _load(path, map_location)
    missing = [k for k in ("model", "model_args") if not isinstance(ckpt, dict) or k not in ckpt]
    if missing:
        raise CheckpointError(
            f"{path} is not a nanoPE/nanoGPT checkpoint: it lacks {', '.join(missing)}"
        )
    ckpt["model"] = model_state(ckpt["model"])
    return ckpt


ENCODING_KEY = "transformer.encoding."  # the encoding's parameters
EARLIER_KEY = "transformer.wpe."  # the encoding's key until 2026-12-07 (GPT-2's name for its table)


def model_state(state: dict) -> dict:
    """A saved model state under today's keys: nanoGPT's compiled runs leave an `_orig_mod.` prefix
    on each key, and runs before 2026-12-07 saved the encoding under transformer.wpe."""
    state = {k.removeprefix("_orig_mod."): v for k, v in state.items()}
    return renamed(state, EARLIER_KEY, ENCODING_KEY)


def renamed(state, old: str, new: str):
    """A state (nested dicts and lists; tensors are kept, not copied) whose parameter names begin
    with new instead of old: the keys and the optimizer's lists of names."""
    if isinstance(state, dict):
        return {renamed(k, old, new): renamed(v, old, new) for k, v in state.items()}
    if isinstance(state, list):
        return [renamed(v, old, new) for v in state]
    if isinstance(state, str) and state.startswith(old):
        return new + state.removeprefix(old)
    return state


def model_from_checkpoint(ckpt: dict) -> GPT:
    """Rebuild the model a checkpoint describes. Accepts nanoGPT's checkpoints too (learned
    positions, and the `_orig_mod.` prefix its compiled runs leave)."""
    model = GPT(GPTConfig(**ckpt["model_args"]))
    model.load_state_dict(model_state(ckpt["model"]))
    return model


class PlainCheckpoint(Checkpoint):
    """A ckpt.pt as a resume reads it: the whole file, whose states load_into puts into the run's
    model and AdamW."""

    def __init__(self, path: Path):
        self.ckpt = load_checkpoint(path)
        self.meta = {k: v for k, v in self.ckpt.items() if k not in STATES}

    def load_into(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        model.load_state_dict(self.ckpt["model"])  # load_checkpoint gave it today's keys
        optimizer.load_state_dict(self.ckpt["optimizer"])


# --------------------------------------------------------------------------------------------------
# Sharded checkpoints. out_dir/ckpt.dcp (and ckpt_best.dcp) is a link to a folder
# out_dir/shards/<iter>-<id>/ that holds torch.distributed.checkpoint's files (.metadata and one
# .distcp per process) and meta.pt (the rest of a checkpoint: iteration, config, RNG states...). A
# save writes a new folder and only then moves the link to it, so a save killed at any moment leaves
# the last good checkpoint; folders no link names are removed. torch.distributed's checkpoint and
# state_dict modules are imported where used: a second to load, which other runs need not pay.
SHARDS = "shards"
LINKS = ("ckpt.dcp", "ckpt_best.dcp")


def save_sharded(state: dict, meta: dict, out_dir: str | Path, links: tuple[str, ...]) -> None:
    """Every process calls this: each writes its shards of state (training_state's) into a new
    folder; then the first process writes meta, checks the folder whole (every process's shards are
    there: on several machines out_dir must be a folder they share) and points each of links
    (ckpt.dcp, ckpt_best.dcp) at it."""
    import torch.distributed.checkpoint as dcp

    meta = meta | {"optimizer_saved": "optimizer" in state}
    out_dir = Path(out_dir)
    distributed = dist.is_initialized()
    name = [f"{meta['iter_num']:08d}-{uuid.uuid4().hex[:8]}"]
    if distributed:
        dist.broadcast_object_list(name, src=0)  # one folder for all processes
    folder = out_dir / SHARDS / name[0]
    with single_process_quiet():
        dcp.save(state, checkpoint_id=folder, no_dist=not distributed)
    if not distributed or dist.get_rank() == 0:
        if not folder.is_dir():
            raise CheckpointError(
                f"{folder} vanished while the checkpoint was written; the last good one stays"
            )
        # last: a folder without it is a save that did not finish
        save_checkpoint(meta, folder / "meta.pt")
        try:
            sharded_folder(folder)
        except CheckpointError as e:
            raise CheckpointError(
                f"{e}. Not linked: the last good checkpoint stays. If the processes run on several "
                "machines, "
                "out_dir must be a folder that all of them see (a shared filesystem)"
            ) from None
        fsync_dir(folder.parent)
        for link in links:
            tmp = out_dir / f".{link}.{os.getpid()}.tmp"
            tmp.unlink(missing_ok=True)
            tmp.symlink_to(Path(SHARDS) / name[0])  # relative: the run's folder can move
            os.replace(tmp, out_dir / link)
        fsync_dir(out_dir)
        remove_unlinked_shards(out_dir)
    if distributed:
        dist.barrier()  # the checkpoint is whole before any process goes on (or exits)


def adopt_copied_links(out_dir: str | Path) -> list[str]:
    """A copy that followed the links (scp -r, rsync -L) turns ckpt.dcp into a folder, which a save
    could not replace with a link: move such folders under shards/ and link them, as a save would
    have. Returns the names adopted."""
    out_dir = Path(out_dir)
    adopted = []
    for link in LINKS:
        path = out_dir / link
        if path.is_dir() and not path.is_symlink():
            name = f"copied-{link.split('.')[0]}-{uuid.uuid4().hex[:8]}"
            (out_dir / SHARDS).mkdir(exist_ok=True)
            path.rename(out_dir / SHARDS / name)
            path.symlink_to(Path(SHARDS) / name)
            adopted.append(link)
    return adopted


@contextlib.contextmanager
def single_process_quiet():
    """Without a process group, torch.distributed.checkpoint warns at every call that it assumes one
    process: it does, on purpose here (a sharded run alone, a reader, the consolidation)."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="torch.distributed is disabled, unavailable or uninitialized"
        )
        yield


def remove_unlinked_shards(out_dir: str | Path) -> list[Path]:
    """Delete the folders under out_dir/shards that no link names: replaced checkpoints, and saves
    killed before they finished. Returns what went. Only while no save is in progress (the run holds
    its out_dir)."""
    out_dir = Path(out_dir)
    kept = {os.path.realpath(out_dir / link) for link in LINKS if os.path.lexists(out_dir / link)}
    removed = []
    for folder in sorted((out_dir / SHARDS).glob("*")):
        if os.path.realpath(folder) not in kept:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def sharded_folder(link: str | Path) -> Path:
    """The folder a ckpt.dcp link names (or the folder itself), checked whole: its meta.pt,
    .metadata and every shard file .metadata lists. Raises CheckpointError naming what is
    missing."""
    import torch.distributed.checkpoint as dcp

    link = Path(link)
    folder = link.resolve()
    with unless_replaced(link, folder):
        if not folder.is_dir():
            raise CheckpointError(
                f"no sharded checkpoint at {link} (it names {folder}, which is missing)"
            )
        missing = [n for n in ("meta.pt", ".metadata") if not (folder / n).is_file()]
        if not missing:
            try:
                metadata = dcp.FileSystemReader(folder).read_metadata()
            except Exception as e:
                raise CheckpointError(
                    f"{folder}/.metadata is not readable (truncated or corrupt?): {e}"
                ) from e
            # each shard file's size as .metadata describes it: its last record's end
            ends: dict[str, int] = {}
            for info in metadata.storage_data.values():
                ends[info.relative_path] = max(
                    ends.get(info.relative_path, 0), info.offset + info.length
                )
            missing = sorted(f for f in ends if not (folder / f).is_file())
            short = sorted(
                f for f in ends if f not in missing and (folder / f).stat().st_size < ends[f]
            )
            if short:
                raise CheckpointError(
                    f"the sharded checkpoint {link} is damaged: in {folder}, {', '.join(short)} is "
                    "shorter than its "
                    ".metadata says (truncated by a copy or a full disk?); copy the whole folder "
                    "again"
                )
        if missing:
            raise CheckpointError(
                f"the sharded checkpoint {link} is incomplete: {folder} lacks "
                f"{', '.join(missing)}; copy the whole "
                "folder again (every process's shards)"
            )
    return folder


@contextlib.contextmanager
def unless_replaced(link: Path, folder: Path):
    """A read of folder, the checkpoint link (ckpt.dcp) named. Where it fails and link names another
    folder now, the training run saved a newer checkpoint meanwhile (save_sharded moves the link,
    then removes the folder it named): no file is damaged, and the failure is a one-line
    CheckpointError saying so."""
    # torch's read failure, a BaseException
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except (Exception, CheckpointException):
        if link.resolve() != folder:
            raise CheckpointError(
                f"the sharded checkpoint {link} was replaced while it was read (its training run "
                "saved a newer one "
                "and removed this one): run the command again"
            ) from None
        raise


class ShardedCheckpoint(Checkpoint):
    """The one reader of a sharded checkpoint (ckpt.dcp, or its folder): the link is resolved once,
    here (the folder checked whole), so that a save moving the link meanwhile cannot mix two
    checkpoints. Its meta, its states read into any sharding, the whole model for the evaluation
    scripts."""

    def __init__(self, link: str | Path):
        self.link = Path(link)
        self.folder = sharded_folder(link)

    @cached_property
    def meta(self) -> dict:
        """meta.pt: every key of a ckpt.pt but the model and optimizer states."""
        with unless_replaced(self.link, self.folder):
            return _load(self.folder / "meta.pt", "cpu")

    def read(self, state: dict) -> None:
        """Fill state ({"model": ..., "optimizer": ...}, sharded or not) in place: each process
        reads the parts of every shard that its own shards cover, whatever the process count that
        wrote them."""
        import torch.distributed.checkpoint as dcp

        try:
            with single_process_quiet(), unless_replaced(self.link, self.folder):
                # still whole: torch logs a traceback for a .metadata it cannot open
                sharded_folder(self.folder)
                # a checkpoint of the encoding's earlier key is read under it
                saved = dcp.FileSystemReader(self.folder).read_metadata().state_dict_metadata
                earlier = any(EARLIER_KEY in k for k in saved)
                asked = renamed(state, ENCODING_KEY, EARLIER_KEY) if earlier else state
                dcp.load(asked, checkpoint_id=self.folder, no_dist=not dist.is_initialized())
                if earlier:  # what was read, under today's names
                    state.update(renamed(asked, EARLIER_KEY, ENCODING_KEY))
        # a shard that its size check let through, yet cannot be read
        except dcp.api.CheckpointException:
            raise CheckpointError(
                f"the sharded checkpoint in {self.folder} cannot be read: a shard file is damaged "
                "(its bytes are not "
                "what was saved); copy the whole folder again from where the run wrote it"
            ) from None

    def whole(self) -> dict:
        """As load_checkpoint returns a ckpt.pt: meta's keys and the model's full weights (no
        optimizer)."""
        # shapes only, no initialisation: every value is read from the shards
        with torch.device("meta"):
            model = GPT(GPTConfig(**self.meta["model_args"]))
        state = {"model": model.to_empty(device="cpu").state_dict()}
        self.read(state)
        return self.meta | state

    def load_into(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """The model's weights and (if it was saved) AdamW's state, into model and optimizer as they
        are now: sharded over any number of processes, or not at all."""
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_state_dict,
            set_model_state_dict,
            set_state_dict,
        )

        if self.meta["optimizer_saved"]:
            # the optimizer's made-up state is overwritten just below
            msd, osd = get_state_dict(model, optimizer)
            state = {"model": msd, "optimizer": osd}
            self.read(state)
            set_state_dict(
                model,
                optimizer,
                model_state_dict=state["model"],
                optim_state_dict=state["optimizer"],
            )
        else:
            state = {"model": get_model_state_dict(model)}
            self.read(state)
            set_model_state_dict(model, state["model"])


def training_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """{"model": ..., "optimizer": ...} as torch.distributed.checkpoint saves and loads them: by
    parameter name, and under FSDP each process's own shards. Before AdamW's first step it has no
    state, and only the model is there (get_state_dict would make one up by taking a step of rate 0,
    which counts in Adam's bias correction)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if not optimizer.state:
        return {"model": get_model_state_dict(model)}
    msd, osd = get_state_dict(model, optimizer)
    return {"model": msd, "optimizer": osd}


# --------------------------------------------------------------------------------------------------
# The two formats: each answers whether out_dir holds its checkpoint, reads one for a resume and
# writes one. Each save removes the other format's checkpoint of the same name: it is older now, and
# a reader must not find it.


class Format:
    """Where a format keeps a run's checkpoints in out_dir, and whether it holds one."""

    suffix: str  # of out_dir/ckpt<suffix> and out_dir/ckpt_best<suffix>

    def path(self, out_dir: str | Path, name: str = "ckpt") -> Path:
        return Path(out_dir) / f"{name}{self.suffix}"

    def exists(self, out_dir: str | Path, name: str = "ckpt") -> bool:
        # a link counts: a reader names what it lacks
        return os.path.lexists(self.path(out_dir, name))


class PlainFormat(Format):
    """ckpt.pt (and ckpt_best.pt): the whole checkpoint in one file, written by the first
    process."""

    suffix = ".pt"

    def check(self, out_dir: Path) -> None:
        """Before any work: nothing to check that the load would not find as fast."""

    def load(self, out_dir: Path) -> Checkpoint:
        return PlainCheckpoint(self.path(out_dir))

    def save(
        self, out_dir: Path, names: list[str], meta: dict, model, optimizer, master: bool
    ) -> None:
        if not master:
            return
        ckpt = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), **meta}
        for n in names:
            save_checkpoint(ckpt, self.path(out_dir, n))
        for n in names:
            (out_dir / f"{n}.dcp").unlink(missing_ok=True)
        remove_unlinked_shards(out_dir)  # the shards the removed links named

    def advice(self, out_dir: Path) -> str:
        """What a sharded run is told that finds only this format's checkpoint to resume."""
        return (
            f"{out_dir} holds an unsharded checkpoint (ckpt.pt), and parallel=fsdp resumes from a "
            "sharded one "
            "(ckpt.dcp): resume it with --parallel=ddp (the default), or start a sharded run in "
            "another --out_dir"
        )


class ShardedFormat(Format):
    """ckpt.dcp (and ckpt_best.dcp): a link to a folder of every process's shards."""

    suffix = ".dcp"

    def check(self, out_dir: Path) -> None:
        """Before any work: the folder ckpt.dcp names is whole (every shard); an error names what is
        missing."""
        sharded_folder(self.path(out_dir))

    def load(self, out_dir: Path) -> Checkpoint:
        return ShardedCheckpoint(self.path(out_dir))  # the states load once sharded, in load_into

    def save(
        self, out_dir: Path, names: list[str], meta: dict, model, optimizer, master: bool
    ) -> None:
        save_sharded(
            training_state(model, optimizer),
            meta,
            out_dir,
            tuple(self.path(out_dir, n).name for n in names),
        )
        if master:
            for n in names:
                (out_dir / f"{n}.pt").unlink(missing_ok=True)

    def advice(self, out_dir: Path) -> str:
        """What an unsharded run is told that finds only this format's checkpoint to resume."""
        return (
            f"{out_dir} holds a sharded checkpoint (ckpt.dcp, from parallel=fsdp): resume it with "
            "--parallel=fsdp "
            "(at any number of processes), or turn it into a ckpt.pt first: python -m "
            f"lib.checkpoint {out_dir}"
        )


# in the order a reader looks: ckpt.pt first (see latest)
FORMATS = (PlainFormat(), ShardedFormat())


def latest(out_dir: str | Path) -> Path | None:
    """Where the run in out_dir keeps its latest checkpoint, for every reader: ckpt.pt, else the
    sharded ckpt.dcp (where both are there, a consolidation wrote ckpt.pt from it); None where it
    holds neither."""
    return next((f.path(out_dir) for f in FORMATS if f.exists(out_dir)), None)


def checkpoints(out_dir: str | Path) -> list[Path]:
    """Every checkpoint out_dir holds, latest and best, in either format (for errors that name
    them)."""
    return [
        f.path(out_dir, n) for f in FORMATS for n in ("ckpt", "ckpt_best") if f.exists(out_dir, n)
    ]


# --------------------------------------------------------------------------------------------------
# What a checkpoint holds: a TrainingState (train.py's Run is one), which the Checkpointer's save()
# writes as a checkpoint's keys and its restore() reads back, with every process's RNGs: nothing
# else builds or unpacks one.


@dataclass(kw_only=True)
class TrainingState:
    """A training run as its checkpoint holds it: what describes it (its options and its data's
    tokenizer) and what a resume goes on from (the model, AdamW and the grad scaler through their
    state_dict(), the batches' sampler, the loop's counters and its record of evaluations)."""

    cfg: dict  # train.py's options
    tokenizer: dict  # the data's (lib/tokenizer.py), which sample.py rebuilds
    model: torch.nn.Module  # the module itself, whose state_dict is saved
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    data_rng: torch.Generator  # the training batches' sampler
    iter_num: int = 0
    best_val_loss: float = float("inf")
    wandb_run_id: str | None = None
    # every evaluation: {"iter", "train", "val"[, "acc"]}
    history: list = field(default_factory=list)


# what decides which batches a validation estimate averages over: val losses compare only when these
# agree
EVAL_SETUP_KEYS = (
    "dataset",
    "task",
    "block_size",
    "batch_size",
    "eval_iters",
    "seed",
    "world_size",
)


def eval_setup(cfg: dict, world_size: int) -> dict:
    return {k: cfg[k] for k in EVAL_SETUP_KEYS if k in cfg} | {"world_size": world_size}


def changed_eval_setup(meta: dict, setup: dict) -> list[str]:
    """How this run's validation differs from the checkpoint's, as 'key old -> new'; older
    checkpoints without eval_setup are read from their config and RNG states."""
    old = meta.get("eval_setup") or (
        {k: meta.get("config", {}).get(k) for k in EVAL_SETUP_KEYS}
        | {"world_size": len(meta.get("rng", []))}
    )
    return [f"{k} {old.get(k)!r} -> {v!r}" for k, v in setup.items() if old.get(k) != v]


def rng_state(device: str) -> dict:
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if device.startswith("cuda") else None,
    }


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None:
        torch.cuda.set_rng_state(state["cuda"])


# --------------------------------------------------------------------------------------------------
# The Checkpointer: a training run's out_dir


class Checkpointer:
    """Owns a training run's out_dir: it takes checkpoints, one run trains in it, a fresh start
    replaces a run there only when told to, a resume has its checkpoint; then the run's saves and
    restore, in its strategy's format."""

    def __init__(self, out_dir: str | Path, sharded: bool, master: bool = True):
        self.out_dir = Path(out_dir)
        self.sharded = sharded
        # the process that writes what one process writes (ckpt.pt, meta.pt, the links)
        self.master = master
        self.format, self.other = FORMATS[::-1] if sharded else FORMATS
        busy = "wait for it to end, or train elsewhere with --out_dir=<new folder>"
        self._lock = FolderLock(
            self.out_dir, f"out_dir={str(self.out_dir)!r}", "training run", busy
        )

    @property
    def path(self) -> Path:
        """The checkpoint a resume reads: out_dir/ckpt.dcp when sharded, else out_dir/ckpt.pt."""
        return self.format.path(self.out_dir)

    # before any work, in the first process

    def prepare(self, init_from: str, overwrite: bool) -> list[str]:
        """Before any work: out_dir takes checkpoints, no other run trains in it, a resume has its
        checkpoint, and a fresh start replaces a run only when told to (overwrite). Adopts links
        copied as folders and clears the temporary files of saves killed mid-write; returns a line
        for each, for the log."""
        out = self.out_dir
        if init_from == "resume":
            self.check_resumable()
        if out.exists() and not out.is_dir():
            raise CheckpointError(
                f"out_dir={str(out)!r} is a file, not a folder; choose another --out_dir"
            )
        # ckpt.dcp is a link to the latest folder of shards
        if problem := cannot_write(out, links=self.sharded, create=True):
            raise CheckpointError(
                f"cannot write checkpoints to out_dir={str(out)!r} ({problem}); choose another "
                "--out_dir"
            )
        # before the checks below and before clearing temporaries: a live run's are not stale
        self.hold()
        found = [path.name for path in checkpoints(out)]
        if found and init_from != "resume" and not overwrite:
            raise CheckpointError(
                f"{out} already holds a run ({', '.join(found)}), which starting from {init_from} "
                "would "
                "overwrite. Continue it with --init_from=resume, train elsewhere with "
                "--out_dir=<new folder>, or "
                "replace it with --overwrite=True"
            )
        notes = [  # only once the run goes ahead: a refused start changes nothing in the folder
            f"note: {link} was a folder (copied without its link?): moved under shards/ and "
            "linked, as saves do"
            for link in adopt_copied_links(out)
        ]
        removed = remove_stale_temporaries(out) + remove_unlinked_shards(out)
        return notes + [
            f"removed {tmp.name}, left by a save that was killed mid-write" for tmp in removed
        ]

    def check_resumable(self) -> None:
        """A resume needs the checkpoint its format writes: ckpt.dcp (whole: every shard) for fsdp,
        else ckpt.pt."""
        if self.format.exists(self.out_dir):
            self.format.check(self.out_dir)
            return
        if self.other.exists(self.out_dir):
            raise CheckpointError(self.other.advice(self.out_dir))
        raise CheckpointError(f"no checkpoint at {self.path} to resume from; check --out_dir")

    def hold(self) -> None:
        """Lock out_dir for this run (outputs.FolderLock), or say which process holds it: two runs
        in one folder would overwrite each other's checkpoints (and delete each other's half-written
        saves)."""
        try:
            self._lock.acquire()
        except OutputError as e:
            raise CheckpointError(str(e)) from None

    def release(self) -> None:
        """Let another run use out_dir."""
        self._lock.release()

    # the run: what a checkpoint holds, saved and restored

    def load(self) -> Checkpoint:
        """The checkpoint a resume starts from, in the run's format: its meta now, its states in
        restore()."""
        return self.format.load(self.out_dir)

    def save(self, state: TrainingState, procs: Processes, best: bool) -> None:
        """Every process calls this: ckpt (and ckpt_best if best) of state, in the run's format.
        Every process's RNG states are gathered (a resume at the same process count replays dropout
        exactly)."""
        meta = {
            "model_args": asdict(state.model.config),
            "iter_num": state.iter_num,
            "best_val_loss": state.best_val_loss,
            "config": state.cfg,
            "tokenizer": state.tokenizer,
            "eval_setup": eval_setup(state.cfg, procs.world_size),
            "rng": procs.gather(rng_state(procs.device)),
            "data_rng": state.data_rng.get_state(),
            "scaler": state.scaler.state_dict(),
            "wandb_run_id": state.wandb_run_id,
            "history": state.history,
        }
        names = ["ckpt", "ckpt_best"] if best else ["ckpt"]
        self.format.save(self.out_dir, names, meta, state.model, state.optimizer, self.master)

    def restore(self, state: TrainingState, checkpoint: Checkpoint, procs: Processes) -> None:
        """Continue checkpoint's run exactly in state (set up for it: its model built as the
        checkpoint describes): weights, iteration, best loss (if it still compares), optimizer, grad
        scaler, data sampler, RNG states and wandb run."""
        meta = checkpoint.meta
        state.iter_num = meta["iter_num"]
        state.best_val_loss = meta["best_val_loss"]
        state.wandb_run_id = meta.get("wandb_run_id")
        # this iteration is evaluated again
        state.history = [h for h in meta.get("history", []) if h["iter"] < state.iter_num]
        procs.log(f"resuming from {self.path} at iteration {state.iter_num}")
        changed = changed_eval_setup(meta, eval_setup(state.cfg, procs.world_size))
        if changed and state.best_val_loss < float("inf"):
            procs.log(
                f"note: validation differs from the checkpoint's ({', '.join(changed)}), so its "
                "best val loss "
                f"{state.best_val_loss:.4f} does not compare; ckpt_best goes to this run's best "
                "evaluation"
            )
            state.best_val_loss = float("inf")
        try:
            checkpoint.load_into(state.model, state.optimizer)
        # another number of parameter groups: pe_lr_scale moved to or from 1
        except (ValueError, KeyError) as e:
            raise CheckpointError(
                f"the checkpoint's optimizer does not fit this run ({e}); resume with the run's "
                "own "
                f"pe_lr_scale={checkpoint.config.get('pe_lr_scale', 1.0)}"
            ) from e
        # empty from float32/bf16 runs: fp16 starts a fresh one
        if meta.get("scaler") and state.scaler.is_enabled():
            state.scaler.load_state_dict(meta["scaler"])
        if "data_rng" in meta:
            state.data_rng.set_state(meta["data_rng"])
        if len(meta.get("rng", [])) == procs.world_size:
            set_rng_state(meta["rng"][procs.rank])
        else:
            procs.log(
                "note: the checkpoint has no RNG state for this number of processes; dropout will "
                "not replay exactly"
            )


# --------------------------------------------------------------------------------------------------
# The consolidation


def consolidate(out_dir: str | Path, overwrite: bool = False) -> Path:
    """Write out_dir/ckpt.pt from out_dir/ckpt.dcp: the model, AdamW's state and the rest, as an
    unsharded run (--parallel=ddp, or one process) resumes from it. A ckpt.pt there is replaced only
    by a checkpoint at least as new, or with overwrite. Returns the path written."""
    if not os.path.lexists(Path(out_dir) / "ckpt.dcp"):
        raise CheckpointError(
            f"no sharded checkpoint {Path(out_dir) / 'ckpt.dcp'} to consolidate (train.py "
            "--parallel=fsdp writes one)"
        )
    if problem := cannot_write(Path(out_dir)):  # before reading the shards
        raise CheckpointError(
            f"cannot write {Path(out_dir) / 'ckpt.pt'} ({problem}); copy the run's folder "
            "somewhere writable "
            "(cp -r keeps ckpt.dcp's link) and consolidate the copy"
        )
    sharded = ShardedCheckpoint(Path(out_dir) / "ckpt.dcp")
    ckpt = sharded.meta
    path = Path(out_dir) / "ckpt.pt"
    if os.path.lexists(path) and not overwrite:  # before reading the shards
        check_replaceable(path, ckpt["iter_num"])
    model = GPT(GPTConfig(**ckpt["model_args"]))
    # AdamW's groups as the run split its parameters (pe_lr_scale puts the encoding's apart); the
    # groups' settings (rate, betas, decay) are read from the checkpoint with the state
    optimizer = model.configure_optimizers(
        0.0, 0.0, (0.0, 0.0), "cpu", ckpt["config"].get("pe_lr_scale", 1.0)
    )
    sharded.load_into(model, optimizer)
    save_checkpoint(ckpt | {"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path)
    return path


def check_replaceable(path: Path, iter_num: int) -> None:
    """The ckpt.pt at path may give way to a consolidated checkpoint at iter_num: it is a checkpoint
    no newer. A newer one is the run's latest (a plain run resumed after the sharded one), and one
    that cannot be read cannot be told."""
    try:
        theirs = _load(path, "cpu").get("iter_num") if path.is_file() else None
    except (CheckpointError, AttributeError):  # unreadable, or not a checkpoint's dict
        theirs = None
    if isinstance(theirs, int) and theirs <= iter_num:
        return
    what = (
        f"is at iteration {theirs}, newer than the sharded ckpt.dcp's {iter_num}"
        if isinstance(theirs, int)
        else "is not a checkpoint whose iteration can be read"
    )
    raise CheckpointError(
        f"{path} {what}: consolidating would replace it. Keep it (resume from it), or move it "
        "aside, or pass "
        f"--overwrite to replace it: python -m lib.checkpoint {path.parent} --overwrite"
    )


def main(argv: list[str]) -> None:
    """python -m lib.checkpoint OUT_DIR [--overwrite]: consolidate a sharded checkpoint into
    OUT_DIR/ckpt.pt."""
    overwrite = "--overwrite" in argv
    args = [a for a in argv if a != "--overwrite"]
    if len(args) != 1 or args[0].startswith("-"):
        sys.exit(
            "usage: python -m lib.checkpoint OUT_DIR [--overwrite]  (writes OUT_DIR/ckpt.pt from "
            "the sharded "
            "OUT_DIR/ckpt.dcp; --overwrite replaces a ckpt.pt newer than it)"
        )
    try:
        print(f"wrote {consolidate(args[0], overwrite)}")
    except CheckpointError as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main(sys.argv[1:])
