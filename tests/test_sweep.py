"""sweep.py end to end at a tiny size: trains every requested encoding and seed, evaluates, writes the report; a
second run reuses finished runs instead of training them again."""

import json
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from conftest import run_cli
from test_train import TINY, tiny_data  # noqa: F401 (a fixture)

import sweep
from checkpoint import save_checkpoint
from datafiles import load_meta, prepare_text, read_embedded_corpus
from model import GPT, GPTConfig
from tasks import DIGITS


@pytest.mark.slow
def test_sweep_trains_evaluates_and_reports(tiny_data, tmp_path):  # noqa: F811
    """Every encoding and seed trained (but a finished run), evaluated at each length with the RoPE scalings, and
    reported with the seeds' spread; a second run trains nothing."""
    out = tmp_path / "sweep"
    cmd = [
        "--size=cpu",
        "--encodings",
        "rope",
        "learned",
        "--seeds",
        "1",
        "2",
        "--lengths",
        "16",
        "32",
        "64",
        "--eval_tokens=512",
        f"--out_dir={out}",
        "--train",
        *TINY,
        "--max_iters=4",
        "--eval_interval=4",
        f"--dataset={tiny_data}",
    ]
    finished_run(out, "rope", 2, tiny_data)  # as a run trained earlier leaves it: three runs left to train
    r = run_cli(sweep.main, cmd)  # in this process; its training runs are train.py processes
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stdout.count("finished earlier, not trained again") == 1
    runs = json.loads((out / "runs.json").read_text())
    assert sorted((x["enc"], x["seed"]) for x in runs) == sorted((e, s) for e in ("rope", "learned") for s in (1, 2))
    report = (out / "report.md").read_text()
    for row in ("| rope | ", "| rope+yarn (s=L/32) | ", "| rope+dynamic_ntk | ", "| learned | "):
        assert row in report
    assert " ± " in report  # two seeds: mean ± spread
    learned = next(line for line in report.splitlines() if line.startswith("| learned | ") and "n/a" in line)
    assert learned.count("n/a") == 1  # 64 is past its block size of 32
    assert (out / "length.png").stat().st_size > 10_000 and (out / "position.png").stat().st_size > 10_000
    again = run_cli(sweep.main, cmd)
    assert again.returncode == 0 and again.stdout.count("finished earlier, not trained again") == 4
    assert "up to date: no run or setting changed" in again.stdout  # nothing evaluated again


@pytest.fixture(scope="module")
def task_data(tmp_path_factory) -> Path:
    """A character-level dataset from the first 50k characters of the embedded corpus, and the digits (which that
    part lacks, and the passkey and recall tasks write)."""
    d = tmp_path_factory.mktemp("data") / "tasks"
    prepare_text(read_embedded_corpus()[:50_000] + DIGITS, d, "char")
    return d


@pytest.mark.slow
def test_sweep_with_tasks_side_by_side(task_data, tmp_path):
    """Runs trained with retrieval tasks, two at a time (--jobs 2, each with its own log), are scored on passkey,
    recall and copy at every length: a summary row per encoding, the task tables and the passkey heatmaps."""
    out = tmp_path / "sweep"
    cmd = ["--size=cpu", "--encodings", "alibi", "learned", "--seeds", "3"]
    cmd += ["--lengths", "96", "384", "--jobs", "2", "--task_trials", "2", "--task_depths", "3", f"--out_dir={out}"]
    cmd += ["--train", *TINY, "--max_iters=2", "--eval_interval=2", "--block_size=96", "--task_fraction=0.5"]
    r = run_cli(sweep.main, [*cmd, f"--dataset={task_data}"])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for enc in ("alibi", "learned"):
        assert (
            "retrieval tasks (passkey, recall, copy) in 50% of the training rows"
            in (out / f"{enc}-seed3" / "train.log").read_text()
        )
        assert json.loads((out / f"{enc}-seed3" / "sweep.json").read_text())["parallel"] == 2
    results = json.loads((out / "tasks.json").read_text())
    alibi = results["runs"][str(out / "alibi-seed3")]
    assert len(alibi["passkey_grid"]["384"]) == 3 and 0 <= alibi["copy_tokens"]["384"] <= 1
    assert results["runs"][str(out / "learned-seed3")]["recall"]["384"] is None  # no positions past 96
    report = (out / "report.md").read_text()
    summary = report[report.index("## Summary") : report.index("## Validation loss")]
    assert "passkey k_max | recall 384 | copy 384 (chars)" in summary
    assert "| learned | " in summary and "| n/a | n/a |" in summary.split("| learned | ")[1].splitlines()[0]
    assert "## Retrieval tasks" in report and "| copy (characters) | 96 | 384 |" in report
    assert (out / "passkey.png").stat().st_size > 10_000


def finished_run(out_dir: Path, enc: str, seed: int, data: Path) -> GPT:
    """A checkpoint as train.py leaves a finished run (iter_num = max_iters), so sweep.py only evaluates it."""
    meta = load_meta(data)
    torch.manual_seed(seed)
    config = GPTConfig(block_size=16, vocab_size=meta["vocab_size"], n_layer=1, n_head=2, n_embd=16, pos_encoding=enc)
    model = GPT(config)
    ckpt = {
        "model": model.state_dict(),
        "model_args": asdict(config),
        "config": {"dataset": str(data), "max_iters": 4},
        "tokenizer": meta["tokenizer"],
        "iter_num": 4,
        "best_val_loss": 3.0,
    }
    save_checkpoint(ckpt, sweep.run_dir(out_dir, enc, seed) / "ckpt.pt")
    return model


def test_parameter_column_counts_each_parameter_once(tiny_data, tmp_path, capsys):  # noqa: F811
    """The parameters column counts the tied token embedding / lm_head once and leaves out learned's position
    table (GPT.get_num_params), where the state_dict holds the tied matrix twice. The report is kept while no run
    or setting changes, and made again when a checkpoint does."""
    out = tmp_path / "sweep"
    models = {enc: finished_run(out, enc, 1, tiny_data) for enc in ("rope", "learned")}
    argv = ["--encodings", "rope", "learned", "--seeds", "1", "--lengths", "8", "16", f"--out_dir={out}"]
    sweep.main([*argv, "--rope_scaling"])
    sweep.main([*argv, "--rope_scaling"])
    assert "up to date" in capsys.readouterr().out
    finished_run(out, "rope", 1, tiny_data)  # trained again: a new checkpoint
    sweep.main([*argv, "--rope_scaling"])
    assert "up to date" not in capsys.readouterr().out
    runs = {r["enc"]: r["params"] for r in json.loads((out / "runs.json").read_text())}
    for enc, model in models.items():
        unique = sum(p.numel() for p in model.parameters())  # parameters() yields a tied tensor once
        if enc == "learned":
            unique -= model.encoding.weight.numel()
        assert runs[enc] == unique
        assert runs[enc] <= sum(v.numel() for v in model.state_dict().values()) - model.transformer.wte.weight.numel()


def test_unreadable_checkpoint_is_not_trained_over(tiny_data, tmp_path, capsys):  # noqa: F811
    """A truncated ckpt.pt stops the sweep with a message naming it, and stays as it was (no training over it)."""
    out = tmp_path / "sweep"
    finished_run(out, "rope", 1, tiny_data)
    ckpt = sweep.run_dir(out, "rope", 1) / "ckpt.pt"
    ckpt.write_bytes(ckpt.read_bytes()[:1000])
    before = ckpt.read_bytes()
    with pytest.raises(SystemExit, match="(?s)not a readable checkpoint.*not training over it: move"):
        sweep.main(["--encodings", "rope", "--seeds", "1", f"--out_dir={out}"])
    assert ckpt.read_bytes() == before and sorted(p.name for p in ckpt.parent.iterdir()) == ["ckpt.pt"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--seeds", "-1"], "--seeds: seeds must be >= 0"),
        (["--seeds", "1", "1"], "--seeds 1 1: each may appear once"),
        (["--encodings", "rope", "rope"], "--encodings rope rope: each may appear once"),
        (["--lengths", "1", "64"], "--lengths: every length must be >= 2"),
        (["--rope_scaling", "foo"], "invalid choice: 'foo'"),
        (["--out_dir", "FILE"], "is a file, not a folder"),
    ],
)
def test_bad_options_are_one_line_errors(tmp_path, capsys, args, message):
    """Bad sweep options stop before any training with a one-line error naming the option."""
    (tmp_path / "FILE").write_text("")
    args = [str(tmp_path / "FILE") if a == "FILE" else a for a in args]
    with pytest.raises(SystemExit) as e:
        sweep.main([f"--out_dir={tmp_path / 'sweep'}", *args])
    assert e.value.code == 2 and message in capsys.readouterr().err
    assert not list(tmp_path.glob("sweep/*"))
