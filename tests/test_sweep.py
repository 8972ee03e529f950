"""compare/sweep.py end to end at a tiny size: trains every requested encoding and seed, evaluates,
writes the report; a second run reuses finished runs instead of training them again."""

import json
import re
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from conftest import run_cli
from test_synthetic import synthetic_checkpoint
from test_train import TINY, tiny_data  # noqa: F401 (a fixture)

from compare import sweep, sweep_report
from compare.sweep_report import Cell
from lib.checkpoint import load_checkpoint, save_checkpoint
from lib.datafiles import load_meta, prepare_text, read_embedded_corpus
from lib.text_tasks import DIGITS
from model import GPT, GPTConfig


@pytest.mark.slow
def test_sweep_trains_evaluates_and_reports(tiny_data, tmp_path):  # noqa: F811
    """Every encoding and seed trained (but a finished run), evaluated at each length with the RoPE
    scalings, and reported with the seeds' spread; a second run trains nothing."""
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
    # as a run trained earlier leaves it: three runs left to train
    finished_run(out, "rope", 2, tiny_data)
    r = run_cli(sweep.main, cmd)  # in this process; its training runs are train.py processes
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stdout.count("finished earlier, not trained again") == 1
    runs = json.loads((out / "runs.json").read_text())
    assert sorted((x["enc"], x["seed"]) for x in runs) == sorted(
        (e, s) for e in ("rope", "learned") for s in (1, 2)
    )
    trained = [Path(x["dir"]) for x in runs if (Path(x["dir"]) / "code.txt").is_file()]
    # the runs this sweep trained record the code each start ran (one had finished before)
    assert len(trained) == 3
    assert all(sweep_report.commit() in (d / "code.txt").read_text() for d in trained)
    report = (out / "report.md").read_text()
    for row in ("| rope | ", "| rope+yarn (s=L/32) | ", "| rope+dynamic_ntk | ", "| learned | "):
        assert row in report
    assert " ± " in report  # two seeds: mean ± spread
    learned = next(
        line for line in report.splitlines() if line.startswith("| learned | ") and "n/a" in line
    )
    assert learned.count("n/a") == 1  # 64 is past its block size of 32
    assert (out / "length.png").stat().st_size > 10_000 and (
        out / "position.png"
    ).stat().st_size > 10_000
    again = run_cli(sweep.main, cmd)
    assert again.returncode == 0 and again.stdout.count("finished earlier, not trained again") == 4
    assert "up to date: no run or setting changed" in again.stdout  # nothing evaluated again


@pytest.fixture(scope="module")
def task_data(tmp_path_factory) -> Path:
    """A character-level dataset from the first 50k characters of the embedded corpus, and the
    digits (which that part lacks, and the passkey and recall tasks write)."""
    d = tmp_path_factory.mktemp("data") / "tasks"
    prepare_text(read_embedded_corpus()[:50_000] + DIGITS, d, "char")
    return d


@pytest.mark.slow
@pytest.mark.usefixtures("forked_train_py")
def test_sweep_with_tasks_side_by_side(task_data, tmp_path):
    """Runs trained with retrieval tasks, two at a time (--jobs 2, each with its own log), are
    scored on passkey, recall and copy at every length: a summary row per encoding, the task tables
    and the passkey heatmaps."""
    out = tmp_path / "sweep"
    cmd = ["--size=cpu", "--encodings", "alibi", "learned", "--seeds", "3"]
    cmd += [
        "--lengths",
        "96",
        "384",
        "--jobs",
        "2",
        "--task_trials",
        "2",
        "--task_depths",
        "3",
        f"--out_dir={out}",
    ]
    cmd += [
        "--train",
        *TINY,
        "--max_iters=2",
        "--eval_interval=2",
        "--block_size=96",
        "--task_fraction=0.5",
    ]
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
    # no positions past 96
    assert results["runs"][str(out / "learned-seed3")]["recall"]["384"] is None
    report = (out / "report.md").read_text()
    summary = report[report.index("## Summary") : report.index("## Validation loss")]
    assert "passkey k_max | recall 384 | copy 384 (chars)" in summary
    assert (
        "| learned | " in summary
        and "| n/a | n/a |" in summary.split("| learned | ")[1].splitlines()[0]
    )
    assert "## Retrieval tasks" in report and "| copy (characters) | 96 | 384 |" in report
    assert (out / "passkey.png").stat().st_size > 10_000


def as_trained(data: Path) -> list[str]:
    """The sweep's --train options under which finished_run's checkpoints are runs trained as
    asked."""
    return ["--train", "--max_iters=4", f"--dataset={data}"]


def finished_run(out_dir: Path, enc: str, seed: int, data: Path) -> GPT:
    """A checkpoint as train.py leaves a finished run (iter_num = max_iters), so compare/sweep.py
    only evaluates it."""
    meta = load_meta(data)
    torch.manual_seed(seed)
    config = GPTConfig(
        block_size=16,
        vocab_size=meta["vocab_size"],
        n_layer=1,
        n_head=2,
        n_embd=16,
        pos_encoding=enc,
    )
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
    """The parameters column counts the tied token embedding / lm_head once and leaves out learned's
    position table (GPT.get_num_params), where the state_dict holds the tied matrix twice. The
    report is kept while no run or setting changes, and made again when a checkpoint does."""
    out = tmp_path / "sweep"
    models = {enc: finished_run(out, enc, 1, tiny_data) for enc in ("rope", "learned")}
    argv = [
        "--encodings",
        "rope",
        "learned",
        "--seeds",
        "1",
        "--lengths",
        "8",
        "16",
        f"--out_dir={out}",
    ]
    argv += ["--rope_scaling", *as_trained(tiny_data)]
    sweep.main(argv)
    sweep.main(argv)
    assert "up to date" in capsys.readouterr().out
    finished_run(out, "rope", 1, tiny_data)  # trained again: a new checkpoint
    sweep.main(argv)
    assert "up to date" not in capsys.readouterr().out
    runs = {r["enc"]: r["params"] for r in json.loads((out / "runs.json").read_text())}
    for enc, model in models.items():
        # parameters() yields a tied tensor once
        unique = sum(p.numel() for p in model.parameters())
        if enc == "learned":
            unique -= model.encoding.weight.numel()
        assert runs[enc] == unique
        assert (
            runs[enc]
            <= sum(v.numel() for v in model.state_dict().values())
            - model.transformer.wte.weight.numel()
        )


def test_unreadable_checkpoint_is_not_trained_over(tiny_data, tmp_path, capsys):  # noqa: F811
    """A truncated ckpt.pt stops the sweep with a message naming it, and stays as it was (no
    training over it)."""
    out = tmp_path / "sweep"
    finished_run(out, "rope", 1, tiny_data)
    ckpt = sweep.run_dir(out, "rope", 1) / "ckpt.pt"
    ckpt.write_bytes(ckpt.read_bytes()[:1000])
    before = ckpt.read_bytes()
    with pytest.raises(
        SystemExit, match="(?s)not a readable checkpoint: it is damaged.*not training over it: move"
    ):
        sweep.main(["--encodings", "rope", "--seeds", "1", f"--out_dir={out}"])
    assert ckpt.read_bytes() == before and sorted(p.name for p in ckpt.parent.iterdir()) == [
        "ckpt.pt"
    ]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--seeds", "-1"], "--seeds: seeds must be >= 0"),
        (["--seeds", "1", "1"], "--seeds 1 1: each may appear once"),
        (["--encodings", "rope", "rope"], "--encodings rope rope: each may appear once"),
        (["--lengths", "1", "64"], "--lengths: every length must be >= 2"),
        (["--rope_scaling", "foo"], "invalid choice: 'foo'"),
        (["--out_dir", "FILE"], "is a file, not a folder"),
        (["--synthetic", "needle", "--out_dir", "FILE"], "is a file, not a folder"),
        (["--task_trials", "0"], "--task_trials=0: must be at least 1"),
        (["--eval_tokens", "0"], "--eval_tokens=0: must be at least 1"),
        (["--task_depths", "1"], "--task_depths=1: must be at least 2"),
        (
            ["--seeds", "1", "2", "--train", "--seed=5"],
            "--train --seed=5: the sweep sets seed for each run itself",
        ),
        (["--train", "--out_dir=x"], "--train --out_dir=x: the sweep sets out_dir"),
        (["--synthetic", "needle", "needle"], "--synthetic needle needle: each may appear once"),
        (["--lengths", "64", "64"], "--lengths 64 64: each may appear once"),
        (["--rope_scaling", "yarn", "yarn"], "--rope_scaling yarn yarn: each may appear once"),
        (
            ["--synthetic", "--eval_tokens", "100"],
            "--eval_tokens: the synthetic suite does not use it",
        ),
        (
            ["--synthetic", "needle", "--rope_scaling", "yarn"],
            "--rope_scaling: the synthetic suite does not use it",
        ),
        (["--synthetic", "--rope_scaling"], "--rope_scaling: the synthetic suite does not use it"),
        (["--synthetic", "--size=cpu"], "--size: the synthetic suite does not use it"),
        (["--synthetic", "--task_depths=3"], "--task_depths: the synthetic suite does not use it"),
        (
            ["--synthetic", "mqar", "--recipes", "--seeds", "7", "--train", "--learning_rate=0.01"],
            "--train --learning_rate=0.01: the recipes differ in learning_rate (the grid compares "
            "them)",
        ),
        (
            ["--extend", "--rope_scaling", "dynamic_ntk"],
            "--rope_scaling dynamic_ntk: the extension study compares",
        ),
        (
            ["--synthetic", "needle", "--train", "--task=passkey"],
            "--train --task=passkey: each run's config sets task",
        ),
        (
            ["--train", "--task=needle"],
            "--train --task=needle: each run's config sets task, which the study compares",
        ),
        (
            ["--train", "--pos_encoding=alibi"],
            "--train --pos_encoding=alibi: each run's config sets pos_encoding",
        ),
        (
            ["--extend", "--extend_task", "none", "--task_seeds", "2"],
            "--task_seeds: --extend_task none extends no",
        ),
        (
            ["--extend", "--extend_task", "none", "--task_trials", "5"],
            "--task_trials: --extend_task none extends",
        ),
        (
            ["--extend", "--extend_task", "none", "--task_sources", "x"],
            "--task_sources: --extend_task none extends",
        ),
        (
            ["--extend", "--task_depths", "3"],
            "--task_depths: it scores no passkey depths (the text sweep's)",
        ),
        (
            ["--packing", "documents", "documents"],
            "--packing documents documents: each may appear once",
        ),
        (["--packing", "docs"], "invalid choice: 'docs'"),
        (
            ["--packing", "documents", "--train", "--task_fraction=0.1"],
            "--packing documents with --train --task_frac",
        ),
        (
            ["--synthetic", "--packing", "documents"],
            "--packing: the synthetic suite does not use it",
        ),
        (
            ["--extend", "--packing", "documents"],
            "--packing: only the text sweep trains both packings",
        ),
        (
            ["--train", "--packing=documents"],
            "--train --packing=documents: each run's config sets packing",
        ),
        (
            ["--extend", "--encodings", "fox", "--rope_scaling", "yarn"],
            "rope_scaling='yarn' is an option of pos_en",
        ),
        (
            ["--encodings", "cope", "alibi", "--rope_scaling", "yarn"],
            "rope_scaling='yarn' is an option of pos_enco",
        ),
    ],
)
def test_bad_options_are_one_line_errors(tmp_path, capsys, monkeypatch, args, message):
    """Bad sweep options, and options that the synthetic suite would ignore, stop before any
    training with a one-line error naming the option."""
    monkeypatch.setattr(sweep, "train_all", lambda *a: pytest.fail("trained before the checks"))
    (tmp_path / "FILE").write_text("")
    args = [str(tmp_path / "FILE") if a == "FILE" else a for a in args]
    with pytest.raises(SystemExit) as e:
        sweep.main([f"--out_dir={tmp_path / 'sweep'}", *args])
    assert e.value.code == 2 and message in capsys.readouterr().err
    assert not list(tmp_path.glob("sweep/*"))


def test_a_study_checks_every_runs_options_before_the_first(tmp_path, monkeypatch):
    """--train's options that one encoding's run would refuse (CoPE's --cope_p_max on the FoX run)
    stop the study before the first run, in train.py's words, rather than after the CoPE run has
    trained."""
    monkeypatch.setattr(sweep, "train_all", lambda *a: pytest.fail("trained before the checks"))
    with pytest.raises(SystemExit) as e:
        sweep.main(
            [f"--out_dir={tmp_path / 'sweep'}", "--encodings", "cope", "fox", "--seeds", "1"]
            + ["--train", "--cope_p_max=8"]
        )
    assert "cope_p_max=8 is an option of pos_encoding='cope', not of 'fox'" in str(e.value.code)
    assert not list(tmp_path.glob("sweep/*"))


def test_a_documents_study_checks_its_data_before_any_run(tmp_path, capsys, monkeypatch):
    """--packing stream documents on a prepared dataset that marks no documents stops before the
    first run (the stream one would train and save, then the documents one fail), with the line
    train.py gives."""
    monkeypatch.setattr(sweep, "train_all", lambda *a: pytest.fail("trained before the checks"))
    prepare_text(read_embedded_corpus()[:20000], tmp_path / "plain", "char")
    with pytest.raises(SystemExit) as e:
        sweep.main(
            [f"--out_dir={tmp_path / 'sweep'}", "--packing", "stream", "documents"]
            + ["--train", f"--dataset={tmp_path / 'plain'}"]
        )
    assert (
        e.value.code == 2
        and "packing='documents' needs data that marks its documents" in capsys.readouterr().err
    )
    assert not list(tmp_path.glob("sweep/*"))


@pytest.mark.slow
def test_sweep_with_and_without_document_packing(tmp_path):
    """--packing stream documents trains each encoding both ways on one dataset that marks its
    documents, the documents runs in their own folders and rows, and the report's table of what the
    packing changes."""
    from lib.datafiles import prepare_documents, scenes

    data = tmp_path / "scenes"
    prepare_documents(scenes(read_embedded_corpus())[:30], data, "char")
    out = tmp_path / "sweep"
    cmd = [
        "--size=cpu",
        "--encodings",
        "rope",
        "sinusoidal",
        "--packing",
        "stream",
        "documents",
        "--seeds",
        "1",
    ]
    cmd += ["--lengths", "32", "64", "--eval_tokens=512", f"--out_dir={out}", "--rope_scaling"]
    cmd += ["--train", *TINY, "--max_iters=2", "--eval_interval=2", f"--dataset={data}"]
    r = run_cli(sweep.main, cmd)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for enc in ("rope", "sinusoidal"):
        assert load_checkpoint(out / f"{enc}-seed1" / "ckpt.pt")["config"]["packing"] == "stream"
        assert (
            load_checkpoint(out / f"{enc}-documents-seed1" / "ckpt.pt")["config"]["packing"]
            == "documents"
        )
    report = (out / "report.md").read_text()
    table = report[report.index("## Document packing: what changes per encoding") :]
    assert "| val loss stream | val loss documents |" in table
    assert "| rope | " in table and "| sinusoidal | " in table
    assert "| rope documents | " in report[: report.index("## Document packing")]


def test_options_after_train_are_train_pys():
    """Everything after --train goes to train.py, also an option that abbreviates one of the sweep's
    own (--task_s is the start of --task_seeds and --task_sources) or is named as one: no "ambiguous
    option"."""
    args, _ = sweep.parse_args(
        ["--synthetic", "needle", "--train", "--task_s=1", "--task_mix=0.1", "--seeds=3"]
    )
    assert args.train == ["--task_s=1", "--task_mix=0.1", "--seeds=3"] and args.seeds == [1337]


def test_a_reused_runs_refusal_names_every_difference_task_first():
    """A run trained otherwise than a study asks is refused naming every option that differs, the
    task first (a needle run in a passkey suite's folder differs in its task_seed too, and is a
    needle run above all)."""
    trained = {"task": "needle", "task_seed": 1, "max_iters": 4, "out_dir": "a"}
    asked = {"max_iters": 8, "task_seed": 2, "task": "passkey", "out_dir": "b"}
    assert sweep.trained_differently({"config": trained}, asked) == (
        "task='needle', max_iters=4 and task_seed=1, and this study asks task='passkey', "
        "max_iters=8 and task_seed=2"
    )
    assert sweep.trained_differently({"config": trained}, trained | {"out_dir": "c"}) is None


@pytest.mark.parametrize(
    "train, message",
    [
        (["--max_iters=8"], "was trained with max_iters=4, and this study asks max_iters=8"),
        (
            ["--max_iters=4", "--learning_rate=0.002"],
            "was trained with learning_rate=0.001, and this study asks ",
        ),
        (
            ["--max_iters=4", "--dataset=shakespeare_char"],
            "and this study asks dataset='shakespeare_char'",
        ),
    ],
)
def test_a_run_trained_otherwise_is_not_reused(train, message, tiny_data, tmp_path, monkeypatch):  # noqa: F811
    """A run in the study's folder that was trained otherwise than the study asks (steps, rate,
    data...) is never reported under its labels: the sweep stops before any training, naming the
    option that differs and the fix; a run trained as asked is reused."""
    out = tmp_path / "sweep"
    finished_run(out, "rope", 1, tiny_data)
    ckpt_path = sweep.run_dir(out, "rope", 1) / "ckpt.pt"
    ckpt = load_checkpoint(ckpt_path)
    save_checkpoint(ckpt | {"config": ckpt["config"] | {"learning_rate": 0.001}}, ckpt_path)
    monkeypatch.setattr(sweep, "train_all", lambda *a: pytest.fail("trained before the check"))
    argv = [
        "--encodings",
        "rope",
        "--seeds",
        "1",
        f"--out_dir={out}",
        "--train",
        f"--dataset={tiny_data}",
    ]
    with pytest.raises(
        SystemExit, match=re.escape(message) + ".*give this study another --out_dir, or move"
    ):
        sweep.main(argv + train)
    assert (
        sweep.train_command(
            "rope", 1, sweep.run_dir(out, "rope", 1), *parsed(argv + ["--max_iters=4"])
        )
        is None
    )


def parsed(argv: list[str]) -> tuple:
    """(args, configs) as the text sweep passes them to train_command."""
    args, _ = sweep.parse_args(argv)
    return args, sweep.SIZES[args.size]["train"]


def fake_training(d: Path, script: str) -> list[str]:
    """A command that stands in for train.py in train_all: python running script (with `d`, the
    run's folder)."""
    return [sys.executable, "-c", f"from pathlib import Path; d = Path({str(d)!r}); " + script]


def test_a_run_stopped_before_max_iters_stops_the_sweep(tiny_data, tmp_path):  # noqa: F811
    """A run that exits 0 short of max_iters (stopped by a signal from outside: it saved and quit)
    is not reported as trained: the sweep stops, names it and says how to resume, writes no timing
    for it; the report refuses it too."""
    d = sweep.run_dir(tmp_path, "rope", 1)
    finished_run(tmp_path, "rope", 1, tiny_data)
    ckpt = load_checkpoint(d / "ckpt.pt") | {"iter_num": 2}  # saved at iteration 2 of 4
    save_checkpoint(ckpt, d / "stopped.pt")
    (d / "ckpt.pt").unlink()
    cmd = fake_training(d, "(d / 'stopped.pt').rename(d / 'ckpt.pt')")  # 'trains', exit status 0
    with pytest.raises(
        SystemExit, match="rope-seed1 stopped before max_iters.*re-run the same command to resume"
    ):
        sweep.train_all([(d, cmd)], 1)
    assert not (d / "sweep.json").exists()
    with pytest.raises(
        SystemExit, match="rope-seed1 stopped at iteration 2 of 4 .*re-run the same command"
    ):
        sweep.finished_checkpoint(d)


def test_ctrl_c_stops_each_run_once_and_is_one_line(tmp_path, monkeypatch):
    """Ctrl-C in the sweep sends each run in progress one SIGTERM (train.py's signal to save and
    stop; a second would make it quit without saving) and waits for it; the command ends with one
    line, no traceback."""
    d = tmp_path / "run"
    d.mkdir()
    script = (
        "import signal, time; n = []; signal.signal(signal.SIGTERM, lambda *a: n.append(1)); "
        "(d / 'started').touch(); t = time.time()\n"
        "while time.time() - t < 3: time.sleep(0.05)\n"
        "(d / 'signals').write_text(str(len(n)))"
    )
    real_sleep = sweep.time.sleep

    def ctrl_c_once_started(seconds):
        real_sleep(seconds)
        if (d / "started").exists():
            raise KeyboardInterrupt

    monkeypatch.setattr(sweep.time, "sleep", ctrl_c_once_started)
    with pytest.raises(KeyboardInterrupt):
        sweep.train_all([(d, fake_training(d, script))], 1)
    assert (d / "signals").read_text() == "1"  # the run got one SIGTERM and was waited for
    monkeypatch.setattr(sweep, "_main", lambda argv: (_ for _ in ()).throw(KeyboardInterrupt))
    r = run_cli(sweep.main, [])
    assert r.returncode == 1 and r.stderr.strip().startswith(
        "[sweep] interrupted; run the same command again"
    )


def test_unreadable_sweep_files_are_made_again(tiny_data, tmp_path, capsys):  # noqa: F811
    """An empty or truncated sweep.json (a run's timing) and report_inputs.json, left by a kill
    mid-write in an older version, are read as missing: the report is made, no traceback."""
    out = tmp_path / "sweep"
    finished_run(out, "rope", 1, tiny_data)
    (sweep.run_dir(out, "rope", 1) / "sweep.json").write_text("")
    (out / "report_inputs.json").write_text('{"eval": [')
    (out / "report.md").write_text("old")
    argv = [
        "--encodings",
        "rope",
        "--seeds",
        "1",
        "--lengths",
        "8",
        "16",
        f"--out_dir={out}",
        "--rope_scaling",
    ]
    sweep.main(argv + as_trained(tiny_data))
    assert "up to date" not in capsys.readouterr().out and (out / "report.md").read_text() != "old"
    assert json.loads((out / "report_inputs.json").read_text())["eval"]


def test_a_run_without_ckpt_pt_gets_advice_the_sweep_takes(tiny_data, tmp_path, monkeypatch):  # noqa: F811
    """A run whose ckpt.pt was deleted but whose ckpt_best.pt remains stops the sweep before any
    training, with advice that works with the sweep (move the folder aside), not train.py's
    (--init_from=resume, --overwrite=True: options the sweep sets itself); the folder is left as it
    was."""
    out = tmp_path / "sweep"
    finished_run(out, "rope", 1, tiny_data)
    d = sweep.run_dir(out, "rope", 1)
    (d / "ckpt.pt").rename(d / "ckpt_best.pt")
    monkeypatch.setattr(sweep, "train_all", lambda *a: pytest.fail("trained before the check"))
    with pytest.raises(
        SystemExit, match="holds ckpt_best.pt but no ckpt.pt .*move the folder aside .*re-run"
    ):
        sweep.main(["--encodings", "rope", "--seeds", "1", f"--out_dir={out}"])
    assert sorted(p.name for p in d.iterdir()) == ["ckpt_best.pt"]


def test_text_report_is_made_again_after_a_synthetic_one(tiny_data, tmp_path, capsys):  # noqa: F811
    """A text sweep run again after the synthetic suite wrote its report.md into the same out_dir
    makes its report again instead of calling the synthetic one up to date."""
    out = tmp_path / "sweep"
    finished_run(out, "rope", 1, tiny_data)
    text = [
        "--encodings",
        "rope",
        "--seeds",
        "1",
        "--lengths",
        "8",
        "16",
        f"--out_dir={out}",
        "--rope_scaling",
    ]
    text += as_trained(tiny_data)
    sweep.main(text)
    # the synthetic suite's report, made in this process (its evaluation pool, forked after this
    # process's OpenMP threads ran, would hang)
    d = out / "needle" / "alibi-seed1"
    synthetic_checkpoint(d)
    sweep.synthetic_report(
        out, {"needle": [Cell("alibi", [sweep.evaluate_synthetic(d, [64], 5)])]}, [], 0.0, 5
    )
    assert (out / "report.md").read_text().startswith("# Synthetic tasks")
    capsys.readouterr()
    sweep.main(text)
    assert "up to date" not in capsys.readouterr().out
    assert (out / "report.md").read_text().startswith("# Positional encodings")


def test_recipe_study_statistics_against_published_values():
    """Wilson's interval, Fisher's exact test and the exact permutation test against published
    values: Wilson 0 of 5 is [0, 43.4%] and 3 of 5 [23.1%, 88.2%] (Newcombe 1998's method 3);
    Fisher's lady tasting tea, 3 of 4 against 1 of 4, p = 0.486, and 4 of 4 against 0 of 4, p =
    0.0286 (Fisher 1935); five seeds all above five others, p = 2 / 252."""
    from compare.sweep_report import fisher_exact, permutation_p, wilson

    assert wilson(0, 5)[0] == 0 and wilson(0, 5)[1] == pytest.approx(0.4345, abs=1e-4)
    assert wilson(3, 5) == pytest.approx((0.2307, 0.8824), abs=1e-4)
    assert wilson(5, 5)[0] == pytest.approx(0.5655, abs=1e-4) and wilson(5, 5)[1] == 1
    assert fisher_exact(3, 4, 1, 4) == pytest.approx(0.4857, abs=1e-4)
    assert fisher_exact(4, 4, 0, 4) == pytest.approx(0.0286, abs=1e-4)
    assert fisher_exact(2, 3, 2, 3) == 1
    assert permutation_p([0.9, 0.8, 1.0, 0.95, 0.85], [0.1, 0.2, 0.3, 0.25, 0.15]) == pytest.approx(
        2 / 252
    )
    # 4 of the 6 splits differ as much
    assert permutation_p([0.5, 0.6], [0.55, 0.45]) == pytest.approx(4 / 6)
    assert permutation_p([0.5, 0.5], [0.5, 0.5]) == 1


def test_recipe_choice_and_grid():
    """Each task's grid: the curriculum on and off at each rate, the suite's recipe first; the
    choice is the best mean final validation accuracy, a tie within a point going to the earlier
    recipe."""
    assert list(sweep.recipes("mqar")) == [
        "cur1-lr3e-3",
        "cur0-lr3e-3",
        "cur1-lr1e-3",
        "cur0-lr1e-3",
    ]
    assert sweep.recipes("mqar")["cur0-lr1e-3"][:3] == [
        "--task_prev_tokens=False",
        "--learning_rate=0.001",
        "--min_lr=0.0001",
    ]
    assert sweep.recipes("offset")["cur1-lr3e-3"][0] == "--task_mix=0.25" and list(
        sweep.recipes("needle")
    ) == [
        "lr3e-3",
        "lr1e-3",
    ]
    order = list(sweep.recipes("mqar"))
    grid = {
        "cur1-lr3e-3": [0.5, 0.7],
        "cur0-lr3e-3": [0.605, 0.6],
        "cur1-lr1e-3": [0.2, 0.2],
        "cur0-lr1e-3": [0.9, 0.1],
    }
    # 0.6 against 0.6025: within a point, the earlier
    assert sweep.choose(grid, order) == "cur1-lr3e-3"
    grid["cur0-lr3e-3"] = [0.7, 0.7]
    assert sweep.choose(grid, order) == "cur0-lr3e-3"


@pytest.mark.slow
@pytest.mark.usefixtures("forked_train_py")
def test_recipe_study_end_to_end(tmp_path):
    """compare/sweep.py --synthetic --recipes: the grid on the selection seed, each encoding's
    choice, the chosen recipe on the fresh seeds (and only those evaluated and reported), the
    learned counts with their intervals, the floor with its band; a second run trains nothing. Seeds
    shared between the two sets are refused."""
    out = tmp_path / "study"
    cmd = [
        "--synthetic",
        "needle",
        "--recipes",
        "--encodings",
        "alibi",
        "rope",
        "--selection_seeds",
        "5",
    ]
    cmd += [
        "--seeds",
        "6",
        "7",
        "--jobs",
        "2",
        "--task_trials",
        "20",
        "--lengths",
        "64",
        "128",
        f"--out_dir={out}",
    ]
    # after the recipe's own budget: this one wins
    cmd += ["--train", "--eval_interval=10", "--max_iters=20"]
    r = run_cli(sweep.main, cmd)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert sorted(p.name for p in (out / "grid").iterdir()) == ["lr1e-3", "lr3e-3"]
    results = json.loads((out / "results.json").read_text())
    chosen = results["chosen"]["needle"]
    assert set(chosen) == {"alibi", "rope"} and set(chosen.values()) <= {"lr3e-3", "lr1e-3"}
    for enc, recipe in chosen.items():
        assert sorted(
            p.name for p in (out / "final" / recipe / "needle").iterdir() if enc in p.name
        ) == [
            f"{enc}-seed6",
            f"{enc}-seed7",
        ]
    report = (out / "report.md").read_text()
    assert "## The grid" in report and "| encoding | lr3e-3 | lr1e-3 | chosen |" in report
    assert "| *floor: chance among the keys* | | | | *2 ± " in report and " of 2 (" in report
    assert "Told apart at 2 seeds" in report and (out / "recipes.png").stat().st_size > 10_000
    again = run_cli(sweep.main, cmd)
    assert (
        again.returncode == 0 and again.stdout.count("finished earlier, not trained again") == 8
    )  # 4 of the grid, 4 final
    shared = run_cli(sweep.main, [*cmd[:7], "6", *cmd[8:]])
    assert shared.returncode == 2 and "reported seeds must be fresh" in shared.stderr


def test_a_finished_run_with_derived_options_is_reused():
    """The options an encoding derives (bias-RPE's rpe_max_distance None: block_size // 2; T5's far
    bucket) are asked as the model builds them and the checkpoint records them, so a finished
    bias-RPE or T5 run is reused, not refused as trained otherwise."""
    for enc, name in (("bias_rpe", "rpe_max_distance"), ("t5", "t5_max_distance")):
        asked = sweep.asked_config([f"config/{enc}.py", "config/cpu.py", "--block_size=128"])
        assert asked[name] == getattr(GPTConfig(block_size=128, pos_encoding=enc), name) == 64
        assert sweep.trained_differently({"config": dict(asked)}, asked) is None


def test_the_report_names_the_code_it_ran(tmp_path, monkeypatch):
    """The report's commit is marked where the tree holds changes the commit does not (an edited
    file, a new one git does not ignore), and plain where it holds none."""
    git = lambda *a: subprocess.run(
        ["git", "-C", str(tmp_path), *a], check=True, capture_output=True
    )  # noqa: E731
    git("init", "-q")
    (tmp_path / ".gitignore").write_text("out*/\n")
    (tmp_path / "model.py").write_text("# the model\n")
    git("add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "a commit")
    monkeypatch.setattr(sweep_report, "ROOT", tmp_path)
    (tmp_path / "out-rope").mkdir()
    (tmp_path / "out-rope" / "ckpt.pt").write_text("")  # ignored: a run's output
    assert sweep_report.commit() and "uncommitted" not in sweep_report.commit()
    (tmp_path / "sandwich.py").write_text('pos_encoding = "sandwich"\n')  # an encoding being tried
    assert sweep_report.commit().endswith("with uncommitted changes")
