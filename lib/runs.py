"""
A trained run as other work reads it: the evaluation scripts load its model (load_run), and a run
extended from it (train.py --init_from=<its folder>) starts from its weights: which options the
extension may change, and the model it starts from. Either way the run's latest checkpoint is read
once, in either format (checkpoint.latest).
"""

import argparse
import json
from dataclasses import dataclass, fields, replace
from pathlib import Path

from lib.checkpoint import CheckpointError, latest, load_checkpoint, model_from_checkpoint
from lib.configurator import ConfigError
from lib.datafiles import dataset_dir, other_data, task_meta
from model import GPT, POS_ENCODINGS, GPTConfig

# --------------------------------------------------------------------------------------------------
# The evaluation scripts' reader


class FoldersComeAsArguments(argparse.Action):
    """--out_dir, as train.py and sample.py take it, where a tool takes the runs' folders as its
    arguments: an error that shows the command without it."""

    def __call__(self, parser, namespace, values, option_string=None):
        folders = " ".join(values) or "out-rope"
        parser.error(
            f"{option_string} is train.py's and sample.py's; here the folders come as arguments: "
            f"{parser.prog} {folders} ..."
        )


def add_run_folders(p: argparse.ArgumentParser, name: str = "out_dirs", **kw) -> None:
    """The runs' folders, each holding train.py's ckpt.pt, as p's arguments (one: name out_dir)."""
    kw.setdefault("help", "folders holding ckpt.pt (train.py's out_dir)")
    p.add_argument(name, **kw)
    p.add_argument(
        "--out_dir",
        nargs="*",
        action=FoldersComeAsArguments,
        dest="misplaced",
        help=argparse.SUPPRESS,
    )


@dataclass
class TrainedRun:
    """What the evaluation scripts read from a run's folder: its checkpoint and its model (eval
    mode, on the device)."""

    ckpt: dict
    model: GPT
    path: Path | None = None  # the checkpoint read: ckpt.pt, or the sharded ckpt.dcp


def load_run(out_dir: str | Path, device: str = "cpu", text: bool = False) -> TrainedRun:
    """Load out_dir's checkpoint and build its model. text: the caller reads text, which a run
    trained on a synthetic task does not. Raises CheckpointError naming the fix."""
    out_dir = Path(out_dir)
    if out_dir.is_file():
        raise CheckpointError(
            f"{out_dir} is a file; give the run's folder (train.py's out_dir), "
            f"e.g. {out_dir.parent}"
        )
    path = latest(out_dir)
    if path is None:
        what = (
            f"{out_dir} holds no checkpoint (ckpt.pt)"
            if out_dir.is_dir()
            else f"the folder {out_dir} does not exist"
        )
        raise CheckpointError(
            f"{what}; give a run's folder (train.py's out_dir, where it wrote ckpt.pt)"
        )
    ckpt = load_checkpoint(path)
    cfg = ckpt.get("config") or {}
    # its tokens are a synthetic task's ids: no text means anything to it
    if text and cfg.get("task"):
        raise CheckpointError(
            f"{out_dir} was trained on the synthetic task {cfg['task']!r}, not on text; score it "
            "with "
            f"python -m compare.synthetic {out_dir}"
        )
    return TrainedRun(ckpt, model_from_checkpoint(ckpt).to(device).eval(), path)


# --------------------------------------------------------------------------------------------------
# An extension: a new run from the weights of a finished one, which may train longer (block_size at
# least its source's), with another dropout and RoPE scaling; its other model options are its
# source's

EXTENSION_OPTIONS = (
    "block_size",
    "dropout",
    "rope_scaling",
    "rope_factor",
    "rope_original_max_len",
)


@dataclass
class Source:
    """The run an extension starts from: its folder and its latest checkpoint, read once."""

    folder: str
    ckpt: dict

    @property
    def model_config(self) -> GPTConfig:
        # derived defaults (rpe_max_distance...) as it built them
        return GPTConfig(**self.ckpt["model_args"])

    def check_data(self, cfg: dict, tokenizer: dict | None, error: type[Exception]) -> None:
        """The new run's data (cfg's, in tokenizer's ids) is in the token ids the source was trained
        on."""
        old = self.ckpt.get("config") or {}  # nanoGPT's checkpoints keep none
        if problem := other_data(old, self.ckpt.get("tokenizer"), cfg, tokenizer, same_task=False):
            if old.get("task"):
                hint = (
                    f" (drop --task_vocab: its is {old.get('task_vocab')})"
                    if cfg["task"]
                    else f" (config/{old['task']}.py)"
                )
            else:
                hint = " (drop --task)" if cfg["task"] else ""
            raise error(f"{self.folder} {problem}: extend it on data of its own kind{hint}")


def source(init_from: str) -> Source | None:
    """The run init_from names (a folder with ckpt.pt or ckpt.dcp), read; None for scratch, resume,
    GPT-2's names and a folder of Hugging Face GPT-2 weights."""
    if init_from in ("scratch", "resume") or not Path(init_from).is_dir():
        return None
    path = latest(init_from)
    return None if path is None else Source(init_from, load_checkpoint(path))


def extend_from(cfg: dict, explicit: set[str] | frozenset[str], src: Source) -> None:
    """Set cfg's model options to the source's, but for EXTENSION_OPTIONS; a config file or the
    command line setting one to something else is an error. A RoPE scaling's L0
    (rope_original_max_len) defaults to the length the source was trained at (its own L0 if it was
    scaled already), and its factor to block_size / L0 (1 for dynamic_ntk)."""
    folder = src.folder
    trained = src.model_config
    for f in fields(GPTConfig):
        k = f.name
        if k in EXTENSION_OPTIONS or k not in cfg:  # vocab_size comes with the data
            continue
        if k in explicit and cfg[k] != getattr(trained, k):
            raise ConfigError(
                f"{k}={cfg[k]!r} contradicts {folder}, the run this one extends "
                f"({k}={getattr(trained, k)!r}): an "
                f"extension keeps its source's model, but for {', '.join(EXTENSION_OPTIONS)}; drop "
                "it"
            )
        cfg[k] = getattr(trained, k)
    if cfg["task"]:
        tokenizer = task_meta(cfg["task_vocab"])["tokenizer"]
    # a text's, where it is prepared already (else load_data prepares it, and the model's build
    # checks again)
    else:
        meta = dataset_dir(cfg["dataset"] or "shakespeare_char") / "meta.json"
        try:
            tokenizer = json.loads(meta.read_text()).get("tokenizer")
        # not prepared, or not JSON: load_data names what is wrong
        except (OSError, ValueError, AttributeError):
            tokenizer = (
                None if (src.ckpt.get("config") or {}).get("task") else src.ckpt.get("tokenizer")
            )
    src.check_data(dict(cfg, dataset=cfg["dataset"] or "shakespeare_char"), tokenizer, ConfigError)
    if cfg["block_size"] < trained.block_size:
        raise ConfigError(
            f"block_size={cfg['block_size']} is shorter than {folder}'s {trained.block_size}: an "
            "extension trains at "
            f"least as long as the run it extends; set --block_size={trained.block_size} or more"
        )
    rope = POS_ENCODINGS[trained.pos_encoding]
    if rope.rope_scalable:
        if "rope_scaling" not in explicit:
            cfg["rope_scaling"] = trained.rope_scaling  # a scaled source stays scaled
        scaled = cfg["rope_scaling"] != "none"
        # the length the source was trained at: its L0 if it was scaled
        if "rope_original_max_len" not in explicit:
            L0 = (
                (trained.rope_original_max_len or trained.block_size)
                if trained.rope_scaling != "none"
                else None
            )
            cfg["rope_original_max_len"] = (
                (L0 or trained.block_size) if scaled else trained.rope_original_max_len
            )
        if "rope_factor" not in explicit:
            L0 = cfg["rope_original_max_len"] or cfg["block_size"]
            cfg["rope_factor"] = (
                rope.default_factor(cfg["rope_scaling"], cfg["block_size"], L0) if scaled else 1.0
            )
    try:  # the extended model's own checks (a factor below 1, ...)
        replace(trained, **{k: cfg[k] for k in EXTENSION_OPTIONS})
    except ValueError as e:
        raise ConfigError(str(e)) from e


def extended_model(src: Source, cfg: dict, tokenizer: dict | None, log=print) -> GPT:
    """The model an extension starts from: the source's, at cfg's block_size (a learned table
    interpolated) and with cfg's other EXTENSION_OPTIONS (extend_from resolved them), built as any
    reader of the new run's checkpoints rebuilds it. Its data (cfg's, in tokenizer's ids) must be in
    the token ids the source was trained on."""
    src.check_data(cfg, tokenizer, CheckpointError)
    base = model_from_checkpoint(src.ckpt)
    T0 = base.config.block_size
    base.extend_block_size(cfg["block_size"])
    model = GPT(replace(base.config, **{k: cfg[k] for k in EXTENSION_OPTIONS}))
    model.load_state_dict(base.state_dict())
    c = model.config
    scaled = (
        f", rope_scaling={c.rope_scaling} (factor {c.rope_factor:g}, L0 {c.rope_original_max_len})"
    )
    interpolated = model.encoding.position_params() and c.block_size > T0
    log(
        f"extending {src.folder} (trained at {T0} tokens) to block_size={c.block_size}"
        + (scaled if c.rope_scaling != "none" else "")
        + (", its position table interpolated" if interpolated else "")
    )
    return model


def check_resumed_data(checkpoint, cfg: dict, tokenizer: dict) -> None:
    """A resume trains on the data its checkpoint did: the same task (or text), in token ids that
    mean the same. Another text dataset of the same tokenizer is fine-tuning, and goes ahead
    (restore notes its other validation)."""
    old = checkpoint.config
    if not (
        problem := other_data(old, checkpoint.meta.get("tokenizer"), cfg, tokenizer, same_task=True)
    ):
        return
    if old.get("task") and old["task"] != cfg["task"]:
        fix = f"resume with its task's config, config/{old['task']}.py"
    elif old.get("task"):
        fix = f"resume with its --task_vocab={old.get('task_vocab')}"
    elif cfg["task"]:
        fix = "drop the task's config (--task)"
    else:
        fix = f"resume on its dataset (--dataset={old.get('dataset')})"
    raise CheckpointError(
        f"{cfg['out_dir']} {problem}: {fix}, or train on this in another --out_dir"
    )
