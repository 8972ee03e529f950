"""
Checkpoints with nanoGPT's keys (`model`, `optimizer`, `model_args`, `iter_num`, `best_val_loss`, `config`) plus
`tokenizer` (see tokenizer.py) and what exact resumption needs. Written atomically; loaded with weights_only=True,
so nothing loaded can run code.

A sharded run (train.py --parallel=fsdp) writes ckpt.dcp instead: every process its own shards, through
torch.distributed.checkpoint, which loads them back at any number of processes. Every reader here loads either
kind; `python checkpoint.py OUT_DIR` turns ckpt.dcp into a ckpt.pt (for a run resumed without sharding).
"""

import contextlib
import os
import shutil
import sys
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from datafiles import dataset_dir, load_meta
from model import GPT, GPTConfig


class CheckpointError(Exception):
    pass


def save_checkpoint(ckpt: dict, path: str | Path) -> None:
    """Write ckpt to a temporary file beside path, flush it to disk, then rename it over path: a crash at any
    moment leaves either the old checkpoint or the new one, never half of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(ckpt, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)  # make the rename itself durable


def remove_stale_temporaries(directory: str | Path) -> list[Path]:
    """Delete the `.<name>.<pid>.tmp` files save_checkpoint leaves when its process is killed mid-write (each up to a
    checkpoint's size, so they pile up); a live process's file, a save in progress, stays. Returns what went."""
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


def load_checkpoint(path: str | Path, map_location: str = "cpu") -> dict:
    """A checkpoint, ckpt.pt or (where only that exists) its sharded ckpt.dcp, with the model's full weights and no
    optimizer state."""
    path = Path(path)
    if not path.is_file() and os.path.lexists(path.with_suffix(".dcp")):
        return load_sharded_model(path.with_suffix(".dcp"))
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}")
    ckpt = _load(path, map_location)
    missing = [k for k in ("model", "model_args") if not isinstance(ckpt, dict) or k not in ckpt]
    if missing:
        raise CheckpointError(f"{path} is not a nanoPE/nanoGPT checkpoint: it lacks {', '.join(missing)}")
    return ckpt


def _load(path: Path, map_location: str) -> dict:
    """torch.load with weights_only (tensors and plain data: nothing in the file can run code). A file it cannot read
    is named as damaged or not a checkpoint; torch's own advice to retry with weights_only=False is not passed on, as
    that would run whatever code the file holds."""
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:
        what = (
            "it is not a file torch.save wrote (check the path)"
            if path.stat().st_size and not _zip_or_pickle(path)
            else "it is damaged (truncated by a full disk or an interrupted copy?)"
        )
        raise CheckpointError(
            f"{path} is not a readable checkpoint: {what} ({type(e).__name__}); restore it from a copy, or train again"
        ) from None


def _zip_or_pickle(path: Path) -> bool:
    """Whether the file starts as torch.save writes: a zip archive (PK), or an older pickle (protocol 2+, 0x80)."""
    with open(path, "rb") as f:
        head = f.read(2)
    return head == b"PK" or head[:1] == b"\x80"


def model_from_checkpoint(ckpt: dict) -> GPT:
    """Rebuild the model a checkpoint describes. Accepts nanoGPT's checkpoints too (learned positions, and the
    `_orig_mod.` prefix its compiled runs leave)."""
    model = GPT(GPTConfig(**ckpt["model_args"]))
    state = {k.removeprefix("_orig_mod."): v for k, v in ckpt["model"].items()}
    model.load_state_dict(state)
    return model


# -----------------------------------------------------------------------------------------------------------------
# Sharded checkpoints. out_dir/ckpt.dcp (and ckpt_best.dcp) is a link to a folder out_dir/shards/<iter>-<id>/ that
# holds torch.distributed.checkpoint's files (.metadata and one .distcp per process) and meta.pt (the rest of a
# checkpoint: iteration, config, RNG states...). A save writes a new folder and only then moves the link to it, so a
# save killed at any moment leaves the last good checkpoint; folders no link names are removed. torch.distributed's
# checkpoint and state_dict modules are imported where used: a second to load, which other runs need not pay.
SHARDS = "shards"
LINKS = ("ckpt.dcp", "ckpt_best.dcp")


def save_sharded(state: dict, meta: dict, out_dir: str | Path, links: tuple[str, ...]) -> None:
    """Every process calls this: each writes its shards of state (training_state's) into a new folder; then the first
    process writes meta, checks the folder whole (every process's shards are there: on several machines out_dir must
    be a folder they share) and points each of links (ckpt.dcp, ckpt_best.dcp) at it."""
    import torch.distributed.checkpoint as dcp

    meta = meta | {"optimizer_saved": "optimizer" in state}
    out_dir, distributed = Path(out_dir), dist.is_initialized()
    name = [f"{meta['iter_num']:08d}-{uuid.uuid4().hex[:8]}"]
    if distributed:
        dist.broadcast_object_list(name, src=0)  # one folder for all processes
    folder = out_dir / SHARDS / name[0]
    with single_process_quiet():
        dcp.save(state, checkpoint_id=folder, no_dist=not distributed)
    if not distributed or dist.get_rank() == 0:
        if not folder.is_dir():
            raise CheckpointError(f"{folder} vanished while the checkpoint was written; the last good one stays")
        save_checkpoint(meta, folder / "meta.pt")  # last: a folder without it is a save that did not finish
        try:
            sharded_folder(folder)
        except CheckpointError as e:
            raise CheckpointError(
                f"{e}. Not linked: the last good checkpoint stays. If the processes run on several machines, "
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


def fsync_dir(path: Path) -> None:
    """Make the names in a folder durable (a rename, a new entry), as fsync does a file's bytes."""
    dir_fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def adopt_copied_links(out_dir: str | Path) -> list[str]:
    """A copy that followed the links (scp -r, rsync -L) turns ckpt.dcp into a folder, which a save could not replace
    with a link: move such folders under shards/ and link them, as a save would have. Returns the names adopted."""
    out_dir, adopted = Path(out_dir), []
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
    """Without a process group, torch.distributed.checkpoint warns at every call that it assumes one process: it
    does, on purpose here (a sharded run alone, a reader, the consolidation)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def remove_unlinked_shards(out_dir: str | Path) -> list[Path]:
    """Delete the folders under out_dir/shards that no link names: replaced checkpoints, and saves killed before
    they finished. Returns what went. Only while no save is in progress (the run holds its out_dir)."""
    out_dir = Path(out_dir)
    kept = {os.path.realpath(out_dir / link) for link in LINKS if os.path.lexists(out_dir / link)}
    removed = []
    for folder in sorted((out_dir / SHARDS).glob("*")):
        if os.path.realpath(folder) not in kept:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def sharded_folder(link: str | Path) -> Path:
    """The folder a ckpt.dcp link names (or the folder itself), checked whole: its meta.pt, .metadata and every shard
    file .metadata lists. Raises CheckpointError naming what is missing."""
    import torch.distributed.checkpoint as dcp

    link = Path(link)
    folder = link.resolve()
    if not folder.is_dir():
        raise CheckpointError(f"no sharded checkpoint at {link} (it names {folder}, which is missing)")
    missing = [n for n in ("meta.pt", ".metadata") if not (folder / n).is_file()]
    if not missing:
        try:
            metadata = dcp.FileSystemReader(folder).read_metadata()
        except Exception as e:
            raise CheckpointError(f"{folder}/.metadata is not readable (truncated or corrupt?): {e}") from e
        ends: dict[str, int] = {}  # each shard file's size as .metadata describes it: its last record's end
        for info in metadata.storage_data.values():
            ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
        missing = sorted(f for f in ends if not (folder / f).is_file())
        short = sorted(f for f in ends if f not in missing and (folder / f).stat().st_size < ends[f])
        if short:
            raise CheckpointError(
                f"the sharded checkpoint {link} is damaged: in {folder}, {', '.join(short)} is shorter than its "
                ".metadata says (truncated by a copy or a full disk?); copy the whole folder again"
            )
    if missing:
        raise CheckpointError(
            f"the sharded checkpoint {link} is incomplete: {folder} lacks {', '.join(missing)}; copy the whole "
            "folder again (every process's shards)"
        )
    return folder


def load_sharded_meta(link: str | Path) -> dict:
    """A sharded checkpoint's meta.pt (ckpt.dcp or its folder): every key of a ckpt.pt but the model and optimizer
    states."""
    return _read_meta(sharded_folder(link))


def _read_meta(folder: Path) -> dict:
    """meta.pt of a folder sharded_folder has checked (its .metadata is read once, there)."""
    return _load(folder / "meta.pt", "cpu")


def load_sharded_state(state: dict, link: str | Path) -> None:
    """Fill state (get_state_dict's {"model": ..., "optimizer": ...}, sharded or not) from a sharded checkpoint
    (ckpt.dcp or its folder), in place: each process reads the parts of every shard that its own shards cover,
    whatever the process count that wrote them."""
    _read_state(state, sharded_folder(link))


def _read_state(state: dict, folder: Path) -> None:
    """load_sharded_state from a folder sharded_folder has checked."""
    import torch.distributed.checkpoint as dcp

    try:
        with single_process_quiet():
            dcp.load(state, checkpoint_id=folder, no_dist=not dist.is_initialized())
    except FileNotFoundError as e:  # a running training replaced this checkpoint while it was read
        raise CheckpointError(
            f"{folder} went away while it was read (a newer checkpoint replaced it): try again"
        ) from e
    except dcp.api.CheckpointException as e:  # a shard that its size check let through, yet cannot be read
        raise CheckpointError(
            f"the sharded checkpoint in {folder} cannot be read: a shard file is damaged (its bytes are not what was "
            "saved); copy the whole folder again from where the run wrote it"
        ) from None


def load_sharded_model(link: str | Path) -> dict:
    """A sharded checkpoint as load_checkpoint returns a ckpt.pt: meta.pt's keys and the model's full weights."""
    folder = sharded_folder(link)  # once: a save may move the link meanwhile
    ckpt = _read_meta(folder)
    with torch.device("meta"):  # shapes only, no initialisation: every value is read from the shards
        model = GPT(GPTConfig(**ckpt["model_args"]))
    state = {"model": model.to_empty(device="cpu").state_dict()}
    _read_state(state, folder)
    return ckpt | state


def training_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """{"model": ..., "optimizer": ...} as torch.distributed.checkpoint saves and loads them: by parameter name, and
    under FSDP each process's own shards. Before AdamW's first step it has no state, and only the model is there
    (get_state_dict would make one up by taking a step of rate 0, which counts in Adam's bias correction)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if not optimizer.state:
        return {"model": get_model_state_dict(model)}
    msd, osd = get_state_dict(model, optimizer)
    return {"model": msd, "optimizer": osd}


def load_training_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, link: str | Path) -> None:
    """The model's weights and (if it was saved) AdamW's state from a sharded checkpoint, into model and optimizer as
    they are now: sharded over any number of processes, or not at all."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    folder = sharded_folder(link)
    if _read_meta(folder)["optimizer_saved"]:
        msd, osd = get_state_dict(model, optimizer)  # the optimizer's made-up state is overwritten just below
        state = {"model": msd, "optimizer": osd}
        _read_state(state, folder)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    else:
        state = {"model": get_model_state_dict(model)}
        _read_state(state, folder)
        set_model_state_dict(model, state["model"])


def consolidate(out_dir: str | Path) -> Path:
    """Write out_dir/ckpt.pt from out_dir/ckpt.dcp: the model, AdamW's state and the rest, as an unsharded run
    (--parallel=ddp, or one process) resumes from it. Returns the path written."""
    if not os.path.lexists(Path(out_dir) / "ckpt.dcp"):
        raise CheckpointError(
            f"no sharded checkpoint {Path(out_dir) / 'ckpt.dcp'} to consolidate (train.py --parallel=fsdp writes one)"
        )
    probe = Path(out_dir) / f".write_test.{os.getpid()}.tmp"  # before reading: the one sure test of permissions
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise CheckpointError(
            f"cannot write {Path(out_dir) / 'ckpt.pt'} ({e.strerror}); copy the run's folder somewhere writable "
            "(cp -r keeps ckpt.dcp's link) and consolidate the copy"
        ) from None
    folder = sharded_folder(Path(out_dir) / "ckpt.dcp")  # once; load_training_state checks the folder itself again
    ckpt = _read_meta(folder)
    cfg = ckpt["config"]
    model = GPT(GPTConfig(**ckpt["model_args"]))
    betas = (cfg["beta1"], cfg["beta2"])
    optimizer = model.configure_optimizers(cfg["weight_decay"], cfg["learning_rate"], betas, "cpu", cfg["pe_lr_scale"])
    load_training_state(model, optimizer, folder)
    path = Path(out_dir) / "ckpt.pt"
    save_checkpoint(ckpt | {"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path)
    return path


@dataclass
class TrainedRun:
    """What the evaluation scripts read from a run's folder: its checkpoint, its model (eval mode, on the device)
    and, where asked for, the validation split of the dataset it trained on."""

    ckpt: dict
    model: GPT
    val: np.ndarray | None = None  # (N,) uint16 token ids
    dataset: str = ""


def load_run(
    out_dir: str | Path, device: str = "cpu", val: bool = False, data_dir: str | None = None, text: bool = False
) -> TrainedRun:
    """Load out_dir/ckpt.pt and build its model; with val, also the validation split of its dataset (data_dir, a
    prepared folder, overrides the checkpoint's), which must be written with the model's tokenizer. text (implied by
    val): the caller reads text, which a run trained on a synthetic task does not. Raises CheckpointError or
    DataError naming the fix."""
    from datafiles import DataError, tokenizer_difference

    out_dir = Path(out_dir)
    if out_dir.is_file():
        raise CheckpointError(f"{out_dir} is a file; give the run's folder (train.py's out_dir), e.g. {out_dir.parent}")
    if not any(os.path.lexists(out_dir / name) for name in ("ckpt.pt", "ckpt.dcp")):
        what = (
            f"{out_dir} holds no checkpoint (ckpt.pt)" if out_dir.is_dir() else f"the folder {out_dir} does not exist"
        )
        raise CheckpointError(f"{what}; give a run's folder (train.py's out_dir, where it wrote ckpt.pt)")
    ckpt = load_checkpoint(out_dir / "ckpt.pt")
    cfg = ckpt.get("config") or {}
    if (val or text) and cfg.get("task"):  # its tokens are a synthetic task's ids: no text means anything to it
        raise CheckpointError(
            f"{out_dir} was trained on the synthetic task {cfg['task']!r}, not on text; synthetic.py scores it: "
            f"python synthetic.py {out_dir}"
        )
    run = TrainedRun(ckpt, model_from_checkpoint(ckpt).to(device).eval())
    if val:
        trained_on = cfg.get("dataset") or "shakespeare_char"
        path = Path(data_dir) if data_dir else dataset_dir(trained_on)
        meta = load_meta(path)  # names a missing or unprepared dataset and how to prepare it
        V, tok = run.model.config.vocab_size, ckpt.get("tokenizer")
        if tok:  # else a nanoGPT checkpoint: at least every token id must be in its vocabulary
            problem = tokenizer_difference(meta["tokenizer"], tok)
        else:
            problem = (
                f"has {meta['vocab_size']} token ids, more than the model's {V}" if meta["vocab_size"] > V else None
            )
        if problem:
            fix = (
                f"leave out --data_dir to use the dataset it trained on ({trained_on}), or give one prepared with "
                "the same tokenizer"
                if data_dir
                else "the dataset was prepared again since the run trained on it: prepare it as it was, or give "
                "--data_dir a dataset prepared with the run's tokenizer"
            )
            raise DataError(f"{out_dir}: {path} {problem}; {fix}")
        run.val, run.dataset = np.memmap(path / "val.bin", dtype=np.uint16, mode="r"), path.name
    return run


def main(argv: list[str]) -> None:
    """python checkpoint.py OUT_DIR: consolidate a sharded checkpoint into OUT_DIR/ckpt.pt."""
    if len(argv) != 1 or argv[0].startswith("-"):
        sys.exit("usage: python checkpoint.py OUT_DIR  (writes OUT_DIR/ckpt.pt from the sharded OUT_DIR/ckpt.dcp)")
    try:
        print(f"wrote {consolidate(argv[0])}")
    except CheckpointError as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main(sys.argv[1:])
