"""sweep.py end to end at a tiny size: trains every requested encoding and seed, evaluates, writes the report; a
second run reuses finished runs instead of training them again."""

import json
import subprocess
import sys

from test_train import ENV, ROOT, TINY, tiny_data  # noqa: F401 (a fixture)


def test_sweep_trains_evaluates_and_reports(tiny_data, tmp_path):  # noqa: F811
    out = tmp_path / "sweep"
    cmd = [
        sys.executable,
        "sweep.py",
        "--size=cpu",
        "--encodings",
        "rope",
        "learned",
        "alibi",
        "--seeds",
        "1",
        "2",
        "--lengths",
        "16",
        "32",
        "64",
        f"--out_dir={out}",
        "--train",
        *TINY,
        "--max_iters=4",
        "--eval_interval=4",
        f"--dataset={tiny_data}",
    ]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, env=ENV)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    runs = json.loads((out / "runs.json").read_text())
    assert sorted((x["enc"], x["seed"]) for x in runs) == sorted(
        (e, s) for e in ("rope", "learned", "alibi") for s in (1, 2)
    )
    report = (out / "report.md").read_text()
    for row in ("| rope | ", "| rope+yarn (s=L/32) | ", "| alibi | ", "| learned | "):
        assert row in report
    assert " ± " in report  # two seeds: mean ± spread
    learned = next(line for line in report.splitlines() if line.startswith("| learned | ") and "n/a" in line)
    assert learned.count("n/a") == 1  # 64 is past its block size of 32
    assert (out / "length.png").stat().st_size > 10_000 and (out / "position.png").stat().st_size > 10_000
    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, env=ENV)
    assert again.returncode == 0 and again.stdout.count("finished earlier, not trained again") == 6
