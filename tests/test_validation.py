"""Bad input to train.py is a one-line error naming the problem and the fix, raised before any work:
option values, config files, dataset files, the out_dir. These call the checks directly (no
training, no subprocess)."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import train_in_process

import train
from lib import options
from lib.checkpoint import Checkpointer, CheckpointError
from lib.configurator import ConfigError, configure
from lib.datafiles import DataError, load_meta, prepare_text


def resolved(*args: str) -> dict:
    return options.resolve(configure(train.defaults, ["--device=cpu", *args]), train.defaults)


def main(*args: str) -> None:
    """train.main in this process, with the signal handlers it installs put back."""
    train_in_process(
        [
            "--device=cpu",
            "--n_layer=1",
            "--n_head=2",
            "--n_embd=16",
            "--eval_iters=1",
            "--max_iters=2",
            *args,
        ]
    )


@pytest.fixture(scope="module")
def small_data(tmp_path_factory) -> Path:
    """A character-level dataset of a few thousand characters."""
    d = tmp_path_factory.mktemp("data") / "small"
    prepare_text("To be, or not to be, that is the question.\n" * 100, d, "char")
    return d


# --------------------------------------------------------------------------------------------------
# option values


@pytest.mark.parametrize(
    "make, message",
    [
        (
            lambda d: None,
            "does not exist; choose scratch, resume, a run's folder (to extend it), "
            "gpt2, gpt2-medium",
        ),
        (lambda d: d.write_text("a file"), "is a file; choose scratch"),
        (
            lambda d: d.mkdir(),
            "holds neither a run's checkpoint (ckpt.pt or ckpt.dcp) nor Hugging Face GPT-2 weights",
        ),
        (
            lambda d: (
                d.mkdir(),
                (d / "nanope.json").write_text("{}"),
                (d / "config.json").write_text("{}"),
            ),
            "is a Hugging Face export of a nanoPE run (python -m export wrote it), not the run: "
            "give the run's folder",
        ),
        (
            lambda d: (d.mkdir(), (d / "config.json").write_text('{"model_type": "llama"}')),
            "holds Hugging Face 'llama' weights, not GPT-2's",
        ),
    ],
)
def test_init_from_takes_only_what_it_names(make, message, tmp_path):
    """init_from is scratch, resume, a run's folder, GPT-2's names or a folder of GPT-2 weights; a
    missing folder, a file, an export of a run, another model's weights are each a one-line error
    before any work."""
    folder = tmp_path / "init"
    make(folder)
    with pytest.raises(ConfigError, match=re.escape(message)) as e:
        resolved(f"--init_from={folder}")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("option", ["--rope_factor=2", "--rope_original_max_len=128"])
def test_a_rope_option_without_a_scaling_is_refused(option):
    """rope_factor and rope_original_max_len act through rope_scaling alone: given without it, a
    one-line error."""
    explicit: set[str] = set()
    cfg = configure(train.defaults, ["--device=cpu", "--pos_encoding=rope", option], explicit)
    with pytest.raises(
        ConfigError, match="does nothing without a RoPE scaling: add --rope_scaling"
    ):
        options.resolve(cfg, train.defaults, explicit)
    cfg = configure(train.defaults, ["--device=cpu", "--rope_scaling=yarn", option], explicit)
    options.resolve(cfg, train.defaults, explicit)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--grad_clip=-1"], "grad_clip=-1.0 must be at least 0 (0 disables clipping"),
        (
            ["--activation_checkpointing=some"],
            "activation_checkpointing='some': choose none, full (the least memory)",
        ),
        (["--pe_lr_scale=0"], "pe_lr_scale=0.0 must be positive"),
        (["--learning_rate=-1"], "learning_rate=-1.0 must be positive"),
        (["--learning_rate=0"], "learning_rate=0.0 must be positive"),
        (["--device=foo"], "device='foo' is not a device; choose cpu, cuda"),
        (["--max_iters=0"], "max_iters=0 trains nothing"),
        (["--warmup_iters=-5"], "warmup_iters=-5 must be at least 0"),
        (["--lr_decay_iters=-1"], "lr_decay_iters=-1 must be at least 0"),
        (["--min_lr=-1e-4"], "min_lr=-0.0001 must be at least 0"),
        (["--beta1=1"], "beta1=1.0 must be in [0, 1)"),
        (["--beta2=-0.5"], "beta2=-0.5 must be in [0, 1)"),
        (["--weight_decay=-0.1"], "weight_decay=-0.1 must be at least 0"),
        (["--dropout=1"], "dropout=1.0 must be in [0, 1)"),
        (["--backend=mpich"], "backend='mpich': choose nccl"),
        (["--seed=-1"], "seed=-1 must be in [0, 2**62)"),
        (["--rope_scaling=foo"], "rope_scaling='foo' is not a RoPE scaling"),
        (["--rope_factor=0.5"], "rope_factor=0.5 must be a number >= 1"),
        (["--n_head=5"], "n_embd=384 must be divisible by n_head=5"),
        (["--batch_size"], "--batch_size needs a value, e.g. --batch_size=64"),
        (
            ["--batch_size=2.5"],
            "batch_size=2.5 in the command line: expected an integer like the default 64",
        ),
        (["--batch_size=True"], "expected an integer"),
        (
            ["--pos_encoding=cope", "--cope_p_max=1000000000", "--block_size=64"],
            "cope_p_max=1000000000 must be at most 1024",
        ),
        (
            ["--pos_encoding=fox", "--fox_gate_bias=1e39", "--block_size=64"],
            "fox_gate_bias=1e+39 must be at most 5.317e+36",
        ),
        (
            ["--pos_encoding=fox", "--fox_gate_bias=-1e37", "--block_size=64"],
            "fox_gate_bias=-1e+37 must be at least -5.3",
        ),
    ],
)
def test_bad_values_are_config_errors(args, message):
    """Out-of-range values, unknown devices and bare value options are ConfigErrors naming the value
    and the rule."""
    with pytest.raises(ConfigError) as e:
        resolved(*args)
    assert message in str(e.value)


@pytest.mark.parametrize("arg", ["--cope", "--alibi=True"])
def test_an_encoding_written_as_a_key_points_to_pos_encoding(arg):
    """train.py --cope (an encoding's name written as an option) is one line that points to
    --pos_encoding=cope, not to the closest key's spelling (--compile)."""
    from conftest import run_cli

    r = run_cli(train.cli, [arg])
    name = arg[2:].partition("=")[0]
    assert r.returncode == 1 and f"did you mean --pos_encoding={name}?" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "compile" not in r.stderr


def test_legal_values_pass_and_odd_ones_are_noted():
    """grad_clip=0, the RoPE scaling keys and max_iters=0 with eval_only are legal; odd schedules
    get one note each."""
    cfg = resolved(
        "--grad_clip=0", "--rope_scaling=yarn", "--rope_factor=4", "--rope_original_max_len=128"
    )
    assert (cfg["rope_scaling"], cfg["rope_factor"], cfg["rope_original_max_len"]) == (
        "yarn",
        4.0,
        128,
    )
    assert options.odd_values(cfg) == []
    resolved("--max_iters=0", "--eval_only=True")
    notes = options.odd_values(resolved("--min_lr=1e-2", "--warmup_iters=6000"))
    assert (
        len(notes) == 2
        and "min_lr=0.01 > learning_rate=0.001" in notes[0]
        and "whole run is warmup" in notes[1]
    )


def test_config_file_errors_are_one_line(tmp_path):
    """A config file with a syntax or runtime error is a ConfigError naming the file and the
    line."""
    (tmp_path / "syntax.py").write_text("batch_size = 32\nn_layer = = 4\n")
    (tmp_path / "name.py").write_text("device = cpu\n")
    with pytest.raises(ConfigError, match=r"syntax.py, line 2: invalid syntax"):
        configure(train.defaults, [str(tmp_path / "syntax.py")])
    with pytest.raises(ConfigError, match=r"name.py, line 1: NameError: name 'cpu' is not defined"):
        configure(train.defaults, [str(tmp_path / "name.py")])


def test_help_lists_every_key(capsys):
    """train.py --help prints every option with its default."""
    main("--help")
    out = capsys.readouterr().out
    assert all(f"\n{key}=" in out for key in train.defaults)


# --------------------------------------------------------------------------------------------------
# dataset files


def corrupt(src: Path, dst: Path, how: str) -> Path:
    shutil.copytree(src, dst)
    meta = json.loads((dst / "meta.json").read_text())
    if how == "truncated":
        np.fromfile(dst / "train.bin", dtype=np.uint16)[:500].tofile(dst / "train.bin")
    elif how == "odd":
        with open(dst / "val.bin", "ab") as f:
            f.write(b"\0")
    elif how == "empty":
        (dst / "train.bin").write_bytes(b"")
        del meta["tokens"]  # an older meta.json: no counts to compare with
    elif how == "chars":
        meta["tokenizer"]["chars"] = meta["tokenizer"]["chars"][:-1]
    elif how == "no tokenizer":
        del meta["tokenizer"]
    (dst / "meta.json").write_text(json.dumps(meta))
    return dst


@pytest.mark.parametrize(
    "how, message",
    [
        (
            "truncated",
            "train.bin holds 500 tokens but meta.json records 3,870: the file is truncated",
        ),
        ("odd", "val.bin has an odd size (861 bytes) for 2-byte tokens"),
        ("empty", "train.bin is empty"),
        ("chars", "its character list has 16 characters but vocab_size is 17"),
        ("no tokenizer", "it has no 'tokenizer' entry"),
    ],
)
def test_dataset_files_are_checked_against_meta(small_data, tmp_path, how, message):
    """load_meta catches truncated, odd-sized and empty token files and a tokenizer that disagrees
    with the vocab."""
    d = corrupt(small_data, tmp_path / "d", how)
    with pytest.raises(DataError) as e:
        load_meta(d)
    assert message in str(e.value) and "re-run the script that prepared it" in str(e.value)


def test_dataset_errors_come_before_training(small_data, tmp_path):
    """train.main stops on a bad dataset or one shorter than a block before building a model or
    writing anything."""
    d = corrupt(small_data, tmp_path / "d", "no tokenizer")
    with pytest.raises(DataError, match="no 'tokenizer' entry"):
        main(f"--dataset={d}", f"--out_dir={tmp_path / 'out'}")
    with pytest.raises(DataError, match="too few for block_size=1024"):
        main(f"--dataset={small_data}", "--block_size=1024", f"--out_dir={tmp_path / 'out'}")
    assert list((tmp_path / "out").iterdir()) == []
    assert load_meta(small_data, block_size=256)["tokens"] == {"train": 3870, "val": 430}


# --------------------------------------------------------------------------------------------------
# out_dir


def prepare(cfg: dict) -> list[str]:
    """What train.py does to out_dir before any work (the Checkpointer's checks, lock and clean-up),
    lock released."""
    checkpointer = Checkpointer(cfg["out_dir"], sharded=cfg["parallel"] == "fsdp")
    try:
        return checkpointer.prepare(cfg["init_from"], cfg["overwrite"])
    finally:
        checkpointer.release()


def test_unwritable_out_dir_is_an_error(tmp_path):
    """An out_dir that is a file or cannot be written (/proc) is an error before any work."""
    (tmp_path / "file").write_text("")
    with pytest.raises(CheckpointError, match="is a file, not a folder"):
        prepare(resolved(f"--out_dir={tmp_path / 'file'}"))
    with pytest.raises(CheckpointError, match="cannot write checkpoints to out_dir='/proc/nanope'"):
        prepare(resolved("--out_dir=/proc/nanope"))
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        prepare(resolved("--init_from=resume", f"--out_dir={tmp_path / 'none'}"))
    assert not (tmp_path / "none").exists()


def test_a_finished_run_is_not_overwritten(small_data, tmp_path):
    """Training from scratch into an out_dir holding a run refuses, naming the options, and changes
    nothing; --overwrite=True or --init_from=resume go ahead."""
    (tmp_path / "ckpt.pt").write_bytes(b"a finished run")
    for init in ("scratch", "gpt2"):
        with pytest.raises(CheckpointError) as e:
            main(f"--dataset={small_data}", f"--init_from={init}", f"--out_dir={tmp_path}")
        for option in ("--init_from=resume", "--out_dir=", "--overwrite=True"):
            assert option in str(e.value)
    assert (tmp_path / "ckpt.pt").read_bytes() == b"a finished run"
    prepare(resolved("--overwrite=True", f"--out_dir={tmp_path}"))
    prepare(resolved("--init_from=resume", f"--out_dir={tmp_path}"))


@pytest.mark.parametrize(
    "kind", ["folder", "dangling link", "link into another folder", "link to a folder"]
)
def test_a_lock_that_is_not_a_file_is_named_and_never_followed(tmp_path, kind):
    """out_dir/.lock that is a folder or a link (dangling, to a missing file in a folder elsewhere,
    or to a folder) is a one-line error naming it and the fix, before any work; the lock is never
    made through the link, and nothing there is removed."""
    out = tmp_path / "out"
    elsewhere = tmp_path / "elsewhere"
    out.mkdir()
    (out / "ckpt.pt").write_bytes(b"a run")
    lock = out / ".lock"
    target = elsewhere if kind == "link to a folder" else elsewhere / "lock"
    if kind == "folder":
        lock.mkdir()
        (lock / "notes.txt").write_text("mine")
    else:
        if kind != "dangling link":
            # where following the link would create the lock file, or open a folder
            elsewhere.mkdir()
        lock.symlink_to(target)
    with pytest.raises(CheckpointError) as e:
        prepare(resolved("--init_from=resume", f"--out_dir={out}"))
    what = "a folder" if kind == "folder" else f"a link (to {target})"
    assert (
        f"{lock} is {what}" in str(e.value)
        and "remove it (rm" in str(e.value)
        and "\n" not in str(e.value)
    )
    assert (lock / "notes.txt").read_text() == "mine" if kind == "folder" else lock.is_symlink()
    assert not elsewhere.exists() or list(elsewhere.iterdir()) == []


def test_a_model_too_large_for_memory_names_the_option(tmp_path):
    """An absurd task_vocab (or width) is a one-line error naming the option and the fix before the
    model is built, not torch's allocation error."""
    with pytest.raises(
        ConfigError,
        match=r"task_vocab=1,000,000,000,000 makes a model of .* "
        r"lower --task_vocab",
    ):
        main(
            "--task=needle",
            "--block_size=64",
            "--task_vocab=1000000000000",
            f"--out_dir={tmp_path / 'task'}",
        )
    with pytest.raises(
        ConfigError,
        match=r"n_layer=1, n_embd=1,000,000,000 make a model .* "
        r"lower --n_layer or",
    ):
        main(
            "--task=needle",
            "--block_size=64",
            "--n_head=1",
            "--n_embd=1000000000",
            f"--out_dir={tmp_path / 'w'}",
        )


def test_stale_checkpoint_temporaries_are_removed(tmp_path):
    """The temporary file of a save killed mid-write is removed by the next run; a live process's
    file stays."""
    dead = subprocess.Popen([sys.executable, "-c", ""])
    dead.wait()
    stale = tmp_path / f".ckpt.pt.{dead.pid}.tmp"
    live = tmp_path / f".ckpt_best.pt.{os.getpid()}.tmp"
    stale.write_bytes(b"half")
    live.write_bytes(b"half")
    removed = f"removed {stale.name}, left by a save that was killed mid-write"
    assert prepare(resolved(f"--out_dir={tmp_path}")) == [removed]
    assert not stale.exists() and live.exists()


@pytest.mark.parametrize(
    "package, args, message",
    [
        (
            "wandb",
            ["--wandb_log=True"],
            "wandb_log=True needs wandb, which is not installed: pip install -r ",
        ),
        (
            "transformers",
            ["--init_from=gpt2"],
            "init_from='gpt2' needs transformers, which is not installed",
        ),
    ],
)
def test_a_missing_optional_package_is_one_line_naming_the_install(
    package, args, message, monkeypatch
):
    """make demo installs requirements.txt alone: an option that needs a package of
    requirements-full.txt says which one and how to install it, before any work, where it is
    missing."""
    import importlib.util

    find = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == package else find(name, *a)
    )
    with pytest.raises(ConfigError, match=re.escape(message)):
        resolved(*args)


@pytest.mark.parametrize("name", ["openwebtext", "tinystories", "wikitext103"])
def test_a_hugging_face_recipe_without_datasets_is_one_line(name, monkeypatch, capsys):
    """data/<name>/prepare.py, where datasets is not installed, says so and how to install it,
    before any download."""
    import importlib.util
    import runpy

    find = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "datasets" else find(n, *a)
    )
    monkeypatch.setattr(sys, "argv", ["prepare.py"])
    with pytest.raises(
        SystemExit,
        match=re.escape("needs datasets, which is not installed: pip install -r requirem"),
    ):
        runpy.run_path(
            str(Path(__file__).resolve().parents[1] / "data" / name / "prepare.py"),
            run_name="__main__",
        )
