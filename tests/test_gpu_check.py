"""The GPU check (.ci/gpu-check), run with its GPU commands stubbed: it fits the device tool's
budget (15 device-minutes, the machine's start included; 10 a call) and runs what matters most
first."""

import os
import re
import subprocess
from pathlib import Path

import pytest

from model import POS_ENCODINGS

ROOT = Path(__file__).resolve().parent.parent


def gpu_check(tmp_path: Path, *stages: str) -> tuple[list[tuple[str, int]], list[str]]:
    """Run .ci/gpu-check with python3 and nvidia-smi stubbed (each records its arguments): each
    stage's name and time limit as stages.txt gives them, and the commands run, in order."""
    stubs = tmp_path / "bin"
    out = tmp_path / "out"
    stubs.mkdir()
    for name in ("python3", "nvidia-smi"):
        stub = stubs / name
        stub.write_text(f'#!/bin/sh\necho "{name} $*" >> "{tmp_path}/calls.txt"\n')
        stub.chmod(0o755)
    env = os.environ | {"PATH": f"{stubs}:{os.environ['PATH']}", "OUT": str(out)}
    subprocess.run(
        ["bash", str(ROOT / ".ci" / "gpu-check"), *stages], env=env, check=True, capture_output=True
    )
    lines = (out / "stages.txt").read_text().splitlines()
    limits = [
        (m[1], int(m[2]))
        for m in (
            re.match(
                r"(\S+): exit 0 after "
                r"\d+ s \(limit (\d+)\)",
                ln,
            )
            for ln in lines
        )
    ]
    return limits, (tmp_path / "calls.txt").read_text().splitlines()


@pytest.mark.parametrize("stages, most", [((), 9 * 60), (("rest",), 200)])
def test_the_gpu_check_fits_its_calls(stages, most, tmp_path):
    """The first call's stages (the default) have at most 9 minutes of limits, leaving the machine's
    start and a margin within 15 device-minutes; the second ("rest") about 3 minutes. Every stage
    writes its log."""
    limits, _ = gpu_check(tmp_path, *stages)
    assert limits and sum(secs for _, secs in limits) <= most, limits
    assert all((tmp_path / "out" / f"{name}.log").exists() for name, _ in limits)


def test_the_gpu_check_runs_the_cuda_tests_then_rope_first(tmp_path):
    """The first call runs the CUDA tests of every encoding (the tests that emulate a GPU on a CPU:
    "cuda", "gpu"), then the compiled training step with RoPE first, then CoPE and FoX, which no GPU
    has run; the second call the step's other encodings and decode, so that the two cover all
    eleven."""
    limits, calls = gpu_check(tmp_path)
    assert [name for name, _ in limits] == ["tests", "encodings"]
    tests, step = [c for c in calls if c.startswith("python3 ")][-2:]
    assert "pytest" in tests and "cuda or gpu" in tests
    first = step.split("--step_encodings ")[1].split()
    assert first[:3] == ["rope", "cope", "fox"]
    (tmp_path / "rest").mkdir()
    _, rest = gpu_check(tmp_path / "rest", "rest")
    second = [c.split("--step_encodings ")[1].split() for c in rest if "--step_encodings" in c]
    assert sorted(first + sum(second, [])) == sorted(POS_ENCODINGS)
    assert any("--only decode" in c for c in rest)
