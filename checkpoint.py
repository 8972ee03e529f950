"""
Checkpoints with nanoGPT's keys (`model`, `optimizer`, `model_args`, `iter_num`, `best_val_loss`, `config`) plus
`tokenizer` (see tokenizer.py) and what exact resumption needs. Written atomically; loaded with weights_only=True,
so nothing loaded can run code.
"""

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

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
    dir_fd = os.open(path.parent, os.O_RDONLY)  # make the rename itself durable
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


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
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:
        raise CheckpointError(f"{path} is not a readable checkpoint (truncated or corrupt?): {e}") from e
    missing = [k for k in ("model", "model_args") if not isinstance(ckpt, dict) or k not in ckpt]
    if missing:
        raise CheckpointError(f"{path} is not a nanoPE/nanoGPT checkpoint: it lacks {', '.join(missing)}")
    return ckpt


def model_from_checkpoint(ckpt: dict) -> GPT:
    """Rebuild the model a checkpoint describes. Accepts nanoGPT's checkpoints too (learned positions, and the
    `_orig_mod.` prefix its compiled runs leave)."""
    model = GPT(GPTConfig(**ckpt["model_args"]))
    state = {k.removeprefix("_orig_mod."): v for k, v in ckpt["model"].items()}
    model.load_state_dict(state)
    return model


@dataclass
class TrainedRun:
    """What the evaluation scripts read from a run's folder: its checkpoint, its model (eval mode, on the device)
    and, where asked for, the validation split of the dataset it trained on."""

    ckpt: dict
    model: GPT
    val: np.ndarray | None = None  # (N,) uint16 token ids
    dataset: str = ""


def load_run(out_dir: str | Path, device: str = "cpu", val: bool = False, data_dir: str | None = None) -> TrainedRun:
    """Load out_dir/ckpt.pt and build its model; with val, also the validation split of its dataset (data_dir, a
    prepared folder, overrides the checkpoint's). Raises CheckpointError or DataError naming the fix."""
    ckpt = load_checkpoint(Path(out_dir) / "ckpt.pt")
    run = TrainedRun(ckpt, model_from_checkpoint(ckpt).to(device).eval())
    if val:
        path = Path(data_dir) if data_dir else dataset_dir(ckpt.get("config", {}).get("dataset", "shakespeare_char"))
        load_meta(path)  # names a missing or unprepared dataset and how to prepare it
        run.val, run.dataset = np.memmap(path / "val.bin", dtype=np.uint16, mode="r"), path.name
    return run
