"""compare/bench.py runs on a CPU and prints its tables (a smoke test at tiny settings: it measures,
nothing is timed here)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_cli

from compare import bench
from model import POS_ENCODINGS

BIASED = [e for e, c in POS_ENCODINGS.items() if c.has_score_bias]


def table_rows(out: str, first_cell: str) -> list[list[str]]:
    """The cells of the markdown rows whose first cell matches first_cell (a regex)."""
    rows = [
        [c.strip() for c in line.strip("|").split("|")]
        for line in out.splitlines()
        if line.startswith("| ")
    ]
    return [r for r in rows if re.fullmatch(first_cell, r[0])]


@pytest.mark.parametrize(
    "args, first_cell, n_rows",
    [
        (["--only=train", "--steps=1", "--warmup=0", "--rounds=1"], r"nanoPE \(learned\)", 1),
        # a row per registered encoding, and per bias encoding: a missing one fails the count
        (
            ["--only=encodings", "--steps=1", "--warmup=0", "--rounds=1"],
            "|".join(POS_ENCODINGS),
            len(POS_ENCODINGS),
        ),
        (
            ["--only=attention", "--steps=1", "--attention_lengths", "32"],
            "|".join(BIASED),
            len(BIASED),
        ),
    ],
)
def test_bench_prints_its_tables_on_cpu(args, first_cell, n_rows):
    # the command: its cells fork from a server that must preload what they need, and
    if "--only=attention" in args:
        # a test process may have started its one server already, for other modules
        cmd = [sys.executable, "-m", "compare.bench", "--device=cpu", *args]
        r = subprocess.run(
            cmd, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1]
        )
    else:
        r = run_cli(bench.main, ["--device=cpu", *args])
    assert r.returncode == 0, r.stderr[-3000:]
    rows = table_rows(r.stdout, first_cell)
    assert len(rows) == n_rows, r.stdout
    for row in rows:
        # a measured ms/step
        assert float(row[1 if "attention" not in args[0] else 2].replace(",", "")) > 0, row
    if "--only=attention" in args:
        assert [row[0] for row in rows] == BIASED and all(row[1] == "32" for row in rows)
        assert all(re.fullmatch(r"[\d,]+ MiB", cell) for row in rows for cell in row[4:]), rows


def test_bench_shapes_runs_train_py_per_cell():
    """--only=shapes runs train.py for each encoding and shape and prints whether it trains, with
    its step time."""
    cmd = ["--device=cpu", "--only=shapes", "--shapes", "head_dim-8", "--shape_iters=2"]
    cmd += ["--shape_encodings", "alibi", "--shape_train", "--block_size=64", "--batch_size=2"]
    r = run_cli(bench.main, cmd)
    assert r.returncode == 0, r.stderr[-3000:]
    (row,) = table_rows(r.stdout, "alibi")
    assert row[1:3] == ["head_dim-8", "trains"] and float(row[3]) > 0, row


def test_bench_memory_table_and_longest_block():
    """--only=memory prints, per encoding and block, each checkpointing mode's measured peak beside
    its estimate and its step time, then the longest block each mode fits in the budget (longer with
    full checkpointing). Two layers: the fewer, the less a block's recomputation saves, and at two
    it still doubles the block."""
    cmd = [
        sys.executable,
        "-m",
        "compare.bench",
        "--device=cpu",
        "--only=memory",
        "--memory_encodings",
        "alibi",
    ]
    cmd += [
        "--memory_blocks",
        "64",
        "--memory_steps",
        "1",
        "--memory_batch",
        "2",
        "--memory_n_layer",
        "2",
    ]
    cmd += ["--memory_budget_gb", "0.1"]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 0, r.stderr[-3000:]
    cells = table_rows(r.stdout, "alibi")
    measured = [row for row in cells if len(row) == 8]
    assert [row[:2] for row in measured] == [["alibi", "64"]]
    for row in measured:
        assert all(re.fullmatch(r"[\d,]+ \([\d,]+\)", row[i]) for i in (2, 4, 6)), row
        assert all(float(row[i].replace(",", "")) > 0 for i in (3, 5, 7)), row
    longest = {row[0]: [int(c.replace(",", "")) for c in row[1:]] for row in cells if len(row) == 4}
    assert longest.keys() == {"alibi"} and all(full > none for none, full, _ in longest.values()), (
        longest
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["--decode_encodings", "copy"], "argument --decode_encodings: invalid choice: 'copy'"),
        (["--threads=-1"], "--threads=-1: must be at least 1"),
        (["--device=cuda:99"], "device='cuda:99' but"),  # no CUDA here, or not 100 GPUs
        (["--device=bogus"], "device='bogus' is not a device"),
        (["--decode_tokens", "0"], "--decode_tokens=0: must be at least 1"),
        (["--steps", "0"], "--steps=0: must be at least 1"),
        (["--rounds", "0"], "--rounds=0: must be at least 1"),
        (
            ["--only=encodings", "--encoding_blocks", "512"],
            "--encoding_blocks 512: this device's table has blocks",
        ),
        (["--memory_budget_gb=0"], "--memory_budget_gb=0.0: must be a positive number of GB"),
    ],
)
def test_bad_options_are_one_line_errors(args, message):
    """compare/bench.py refuses an option out of its range, an unknown encoding, a device this
    machine lacks and block sizes its table does not measure, in one line naming the option, before
    measuring anything (they were tracebacks, a division by zero, or a table-less exit 0)."""
    r = run_cli(
        bench.main,
        [*args, "--device=cpu"] if not any(a.startswith("--device") for a in args) else args,
    )
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert "nanoPE bench" not in r.stdout
