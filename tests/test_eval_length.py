"""compare/eval_length.py on tiny checkpoints made here: window arithmetic, losses against direct
computation, n/a for learned past its block size, RoPE scaling rows, the plot, wandb offline."""

import json
import math
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import run_cli

from compare import eval_length
from lib.checkpoint import save_checkpoint
from lib.datafiles import load_meta, prepare_text, read_embedded_corpus
from model import GPT, GPTConfig


def save_run(
    out_dir: Path,
    tokenizer: dict,
    vocab_size: int,
    config: dict,
    pos_encoding: str = "rope",
    seed: int = 0,
):
    """A random checkpoint (block 16) as train.py writes one: config holds the dataset, or a
    synthetic task."""
    torch.manual_seed(seed)
    model_config = GPTConfig(
        block_size=16,
        vocab_size=vocab_size,
        n_layer=2,
        n_head=2,
        n_embd=16,
        pos_encoding=pos_encoding,
        bias=False,
    )
    ckpt = {
        "model": GPT(model_config).state_dict(),
        "model_args": vars(model_config).copy(),
        "config": config,
        "tokenizer": tokenizer,
        "iter_num": 0,
        "best_val_loss": 0.0,
    }
    save_checkpoint(ckpt, out_dir / "ckpt.pt")


def save_synthetic_run(out_dir: Path) -> None:
    """A checkpoint of a run trained on the synthetic passkey task: token ids, no text dataset."""
    save_run(
        out_dir,
        {"kind": "ids", "vocab_size": 128},
        128,
        {"dataset": "", "task": "passkey", "task_vocab": 128},
    )


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    """One random checkpoint per encoding (block 16) on a small character dataset, as train.py
    writes them; a run of a synthetic task; and datasets in another character vocabulary and in
    GPT-2's BPE."""
    root = tmp_path_factory.mktemp("eval")
    data = root / "data"
    text = read_embedded_corpus()[:60_000]
    prepare_text(text, data, "char")
    meta = load_meta(data)
    out = {}
    for i, enc in enumerate(["rope", "alibi", "learned", "sinusoidal"]):
        save_run(
            root / f"out-{enc}",
            meta["tokenizer"],
            meta["vocab_size"],
            {"dataset": str(data)},
            enc,
            seed=i,
        )
        out[enc] = root / f"out-{enc}"
    save_synthetic_run(root / "out-passkey")
    prepare_text(text[:20_000].upper(), root / "upper", "char")
    prepare_text(text[:20_000], root / "bpe", "gpt2")
    out |= {
        "data": data,
        "passkey": root / "out-passkey",
        "upper": root / "upper",
        "bpe": root / "bpe",
    }
    return out


@pytest.mark.parametrize(
    "n, L, stride", [(100, 16, 4), (100, 16, 16), (64, 16, 5), (17, 16, 1), (50, 7, 3)]
)
def test_every_target_is_scored_once(n, L, stride):
    """Every target of one contiguous stretch is scored once; sliding scores from L - stride on,
    nearly to the end."""
    for mode in eval_length.MODES:
        scored = [
            s + j for s, first in eval_length.windows(n, L, mode, stride) for j in range(first, L)
        ]
        assert len(scored) == len(set(scored))  # never twice
        start = 0 if mode == "nonoverlapping" else L - stride
        assert scored == list(range(start, start + len(scored)))  # a contiguous stretch
        # nearly all of it
        assert start + len(scored) > n - (L if mode == "nonoverlapping" else stride)


@pytest.mark.parametrize("n, L, stride", [(100, 16, 4), (64, 16, 5), (1000, 64, 16)])
def test_sliding_context_is_at_least_window_minus_stride(n, L, stride):
    """Sliding windows give every scored target, the first window's included, at least L - stride
    tokens of context: the README's 'at least three quarters of the window' at the default stride
    L/4."""
    contexts = [
        j + 1 for _, first in eval_length.windows(n, L, "sliding", stride) for j in range(first, L)
    ]
    assert min(contexts) >= L - stride


def direct_loss(model: GPT, data: np.ndarray, start: int, L: int, j: int) -> float:
    """The loss of target data[start + j + 1] from a forward over the window data[start : start +
    L]."""
    x = torch.from_numpy(data[start : start + L].astype(np.int64))[None]
    logits, _ = model(x)
    return F.cross_entropy(logits[0, j][None], torch.tensor([int(data[start + j + 1])])).item()


def test_losses_equal_direct_computation(ckpts):
    ckpt = torch.load(ckpts["alibi"] / "ckpt.pt", weights_only=False)
    model = GPT(GPTConfig(**ckpt["model_args"]))
    model.load_state_dict(ckpt["model"])
    model.eval()
    data = np.fromfile(ckpts["data"] / "val.bin", dtype=np.uint16)[:301]
    bar = eval_length.tqdm(disable=True)
    with torch.no_grad():
        for mode, stride in [("nonoverlapping", 8), ("sliding", 8), ("sliding", 3)]:
            L = 24  # past the block size of 16: ALiBi extrapolates
            res = eval_length.evaluate(model, data, L, mode, stride, 1e9, "cpu", nullcontext(), bar)
            expected = [
                direct_loss(model, data, s, L, j)
                for s, first in eval_length.windows(300, L, mode, stride)
                for j in range(first, L)
            ]
            assert res["tokens"] == len(expected)
            assert abs(res["loss"] - sum(expected) / len(expected)) < 1e-5
            assert abs(res["ppl"] - math.exp(res["loss"])) < 1e-9
            tiny_batch = eval_length.evaluate(
                model, data, L, mode, stride, 1.0, "cpu", nullcontext(), bar
            )
            # one window per forward: same numbers
            assert abs(tiny_batch["loss"] - res["loss"]) < 1e-6
        # the per-position curve: the mean over windows of the loss at each offset
        res = eval_length.evaluate(
            model, data, 24, "nonoverlapping", 24, 1e9, "cpu", nullcontext(), bar
        )
        starts = [s for s, _ in eval_length.windows(300, 24, "nonoverlapping", 24)]
        for j in (0, 23):
            assert (
                abs(
                    res["per_position"][j]
                    - np.mean([direct_loss(model, data, s, 24, j) for s in starts])
                )
                < 1e-5
            )


def test_window_batch_shrinks_with_length():
    model = GPT(GPTConfig(block_size=16, vocab_size=65, n_layer=2, n_head=2, n_embd=16))
    sizes = [eval_length.window_batch(model, L, 2**26) for L in (64, 256, 1024, 4096)]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > sizes[-1] >= 1


def test_command_table_plot_json_and_wandb(ckpts, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    out_json = tmp_path / "r.json"
    plot = tmp_path / "r.png"
    md = tmp_path / "r.md"
    dirs = [str(ckpts[e]) for e in ("rope", "alibi", "learned", "sinusoidal")]
    report = eval_length.main(
        [
            *dirs,
            "--lengths",
            "8",
            "16",
            "48",
            "--eval_tokens",
            "500",
            "--rope_scaling",
            "yarn",
            "--out_json",
            str(out_json),
            "--plot",
            str(plot),
            "--out_md",
            str(md),
            "--wandb_log",
        ]
    )
    names = [r["name"] for r in report["runs"]]
    assert names == ["rope", "rope+yarn (s=L/16)", "alibi", "learned", "sinusoidal"]
    learned = report["runs"][3]["results"]
    # n/a past block_size
    assert learned["sliding"][48] is None and learned["nonoverlapping"][16] is not None
    table = capsys.readouterr().out
    assert "| learned [16] |" in table and "n/a" in table
    assert md.read_text().strip() == table.strip()
    saved = json.loads(out_json.read_text())
    assert saved["runs"][2]["results"]["sliding"]["48"]["ppl"] > 1
    assert plot.stat().st_size > 10_000 and plot.read_bytes()[:4] == b"\x89PNG"
    assert list(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))
    # YaRN with s = L / 16 changes the RoPE model's numbers past the training length, and none up to
    # it (s = 1)
    rope = report["runs"][0]["results"]["sliding"]
    yarn = report["runs"][1]["results"]["sliding"]
    assert rope[48]["loss"] != yarn[48]["loss"]
    assert rope[16]["loss"] == yarn[16]["loss"] and rope[8]["loss"] == yarn[8]["loss"]


def test_names_label_the_rows(ckpts, tmp_path, capsys):
    """--names labels each checkpoint's rows (two runs of one encoding, e.g. bias-RPE with two
    r_max), scalings too; a scaling or a mode given twice is one row, one table."""
    argv = [
        str(ckpts["rope"]),
        str(ckpts["alibi"]),
        "--names",
        "rope A",
        "alibi B",
        "--lengths",
        "8",
        "16",
    ]
    argv += [
        "--eval_tokens",
        "200",
        "--rope_scaling",
        "yarn",
        "yarn",
        "--modes",
        "sliding",
        "sliding",
    ]
    report = eval_length.main([*argv, "--plot", "", "--out_json", str(tmp_path / "r.json")])
    assert [r["name"] for r in report["runs"]] == ["rope A", "rope A+yarn (s=L/16)", "alibi B"]
    out = capsys.readouterr().out
    assert "| alibi B [16] |" in out and out.count("Perplexity, sliding windows") == 1


def test_errors_name_the_problem(ckpts, tmp_path):
    with pytest.raises(SystemExit, match="ckpt.pt"):
        eval_length.main([str(tmp_path / "nowhere"), "--lengths", "8"])
    with pytest.raises(SystemExit, match="fewer than the longest length"):
        eval_length.main([str(ckpts["rope"]), "--lengths", "100000", "--plot", ""])


def test_dynamic_ntk_is_not_scaled_twice(ckpts, monkeypatch):
    """At 4x the training length, eval's dynamic NTK uses Hugging Face's ratio L/L0 = 4 (base ·
    4^(d/(d-2))), not s·L/L0 - (s-1) = 13 from s = L/L0; YaRN still gets s = L/L0 = 4."""
    seen = {}

    def spy(model, data, L, *args):
        pe = model.encoding
        seen[(pe.scaling, L)] = (pe.factor, pe.inv_freq(torch.device("cpu"), torch.tensor(L)))
        return real(model, data, L, *args)

    real = eval_length.evaluate
    monkeypatch.setattr(eval_length, "evaluate", spy)
    args = ["--lengths", "16", "64", "--modes", "nonoverlapping", "--eval_tokens", "100"]
    args += ["--plot", "", "--out_json", ""]
    report = eval_length.main([str(ckpts["rope"]), *args, "--rope_scaling", "dynamic_ntk", "yarn"])
    assert [r["name"] for r in report["runs"]] == ["rope", "rope+dynamic_ntk", "rope+yarn (s=L/16)"]
    d, base = 8, 10000.0  # head dim 16 / 2 heads
    k = torch.arange(d // 2, dtype=torch.float32)
    expected = (base * 4 ** (d / (d - 2))) ** (-2 * k / d)
    factor, inv_freq = seen[("dynamic_ntk", 64)]
    assert factor == 1.0 and torch.allclose(inv_freq, expected, rtol=1e-5)
    # the training length: unscaled
    assert torch.equal(seen[("dynamic_ntk", 16)][1], base ** (-2 * k / d))
    assert seen[("yarn", 64)][0] == 4.0 and seen[("yarn", 16)][0] == 1.0


@pytest.mark.parametrize(
    "args, message",
    [
        (["--stride", "-3"], "--stride=-3: must be between 1 and the shortest length"),
        (["--stride", "0"], "--stride=0"),
        (["--stride", "9"], "--stride=9"),  # longer than the shortest length, 8
        (["--lengths", "1"], "--lengths 1: every length must be >= 2"),
        (["--eval_tokens", "0"], "--eval_tokens=0"),
        (["--rope_factor", "0.5"], "--rope_factor=0.5"),
        (["--rope_factor", "1e400"], "--rope_factor=inf: must be a number >= 1"),
        (["--memory_gb", "-1"], "--memory_gb=-1"),
        (["--dtype", "float8"], "--dtype=float8"),
        (["--device", "foo"], "device='foo' is not a device"),
        (
            ["--out_json", "/nowhere/r.json"],
            "--out_json='/nowhere/r.json': the folder /nowhere does not exist",
        ),
        (["--out_json", "."], "--out_json='.' is a folder; give a file name"),
        (["--plot", "."], "--plot='.' is a folder; give a file name"),
        (["--plot", "e.xyz"], "--plot='e.xyz': the file name must end in .png"),
        (["--memory_gb", "1e9"], "--memory_gb=1000000000.0: more than the"),
        (["--names", "a", "b"], "--names: 2 labels for 1 checkpoints"),
    ],
)
def test_bad_options_are_one_line_errors(ckpts, capsys, args, message):
    """Out-of-range options stop at once with a one-line error naming the option, before any
    evaluation (a negative stride used to loop until memory ran out)."""
    with pytest.raises(SystemExit) as e:
        eval_length.main([str(ckpts["rope"]), "--lengths", "8", "16", "--plot", "", *args])
    assert e.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize(
    "runs, args, message",
    [
        (
            ["alibi"],
            ["--rope_scaling", "yarn"],
            "rope_scaling='yarn' is an option of pos_encoding='rope', not of 'alibi'",
        ),
        (
            ["alibi"],
            ["--rope_factor", "2"],
            "rope_factor=2.0 is an option of pos_encoding='rope', not of 'alibi'",
        ),
        (
            ["rope", "alibi"],
            ["--rope_factor", "2"],
            "rope_factor=2.0 does nothing without a RoPE scaling",
        ),
    ],
)
def test_an_option_no_checkpoint_reads_is_refused(ckpts, runs, args, message):
    """An option that does nothing for every checkpoint evaluated (RoPE's on runs of other
    encodings, a factor without a scaling) is one line in train.py's words, before any evaluation;
    one a checkpoint reads is kept (ALiBi beside RoPE with --rope_scaling)."""
    r = eval_here(
        *[str(ckpts[run]) for run in runs],
        "--lengths",
        "8",
        "16",
        "--plot",
        "",
        "--out_json",
        "",
        *args,
    )
    assert r.returncode == 1 and message in r.stderr and len(r.stderr.strip().splitlines()) == 1, (
        r.stderr
    )


def eval_here(*args: str):
    """eval_length's command in this process: its exit status and stderr, as the command would give
    them."""
    return run_cli(eval_length.main, list(args))


@pytest.mark.parametrize(
    "dataset, message",
    [("upper", "(they differ in '4', '5', 'X', 'Z', 'a'"), ("bpe", "tokenized with GPT-2's BPE")],
)
def test_dataset_of_another_tokenizer_is_refused(ckpts, tmp_path, dataset, message):
    """--data_dir written in another tokenizer than the checkpoint's (another character vocabulary,
    GPT-2's BPE) is a one-line error naming both and the fix, before any evaluation; it used to
    score remapped text, or crash."""
    out = tmp_path / "r.json"
    r = eval_here(
        str(ckpts["rope"]),
        "--data_dir",
        str(ckpts[dataset]),
        "--lengths",
        "8",
        "--out_json",
        str(out),
    )
    assert (
        r.returncode == 1
        and "Traceback" not in r.stderr
        and len(r.stderr.strip().splitlines()) == 1
    )
    assert message in r.stderr and "the model reads a character vocabulary of" in r.stderr
    assert "leave out --data_dir" in r.stderr and not out.exists()


@pytest.mark.parametrize("data_dir", [[], ["--data_dir", "data"]])
def test_synthetic_task_run_points_to_synthetic_py(ckpts, tmp_path, data_dir):
    """A run trained on a synthetic task is scored by compare/synthetic.py, which the error names
    with the command, with or without --data_dir (it used to say the dataset 'data' was not
    prepared, or give a perplexity of 128)."""
    if data_dir:
        data_dir = ["--data_dir", str(ckpts["data"])]
    out = tmp_path / "r.json"
    r = eval_here(str(ckpts["passkey"]), *data_dir, "--lengths", "8", "--out_json", str(out))
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "trained on the synthetic task 'passkey'" in r.stderr
    assert f"python -m compare.synthetic {ckpts['passkey']}" in r.stderr and not out.exists()


def test_output_paths_are_checked_before_work(ckpts, tmp_path, monkeypatch):
    """--plot naming a folder writes nothing beside it (it used to write FOLDER.png), and a bad
    --plot stops the command before the evaluation, as a bad --out_json or --out_md does; good paths
    get whole files."""
    monkeypatch.setattr(
        eval_length, "evaluate", lambda *a: pytest.fail("evaluated before the paths were checked")
    )
    folder = tmp_path / "plots"
    folder.mkdir()
    out = tmp_path / "r.json"
    for flag, value in [
        ("--plot", folder),
        ("--out_md", folder),
        ("--out_json", tmp_path / "missing" / "r.json"),
    ]:
        r = eval_here(
            str(ckpts["rope"]), "--lengths", "8", "--out_json", str(out), flag, str(value)
        )
        assert r.returncode == 2 and f"{flag}='{value}'" in r.stderr and "Traceback" not in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plots"] and not any(folder.iterdir())
    monkeypatch.undo()
    r = eval_here(
        str(ckpts["rope"]),
        "--lengths",
        "8",
        "--eval_tokens",
        "100",
        "--out_json",
        str(out),
        "--plot",
        str(folder / "l.svg"),
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(out.read_text())["lengths"] == [8] and (
        folder / "l.svg"
    ).read_text().startswith("<?xml")
    # no temporary file left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plots", "r.json"]


def test_lengths_beyond_memory_or_positions_are_refused(ckpts, tmp_path, monkeypatch):
    """A length whose one window needs more memory than the device has, or lengths all past a
    learned table's block size, stop before any evaluation with a one-line error (they used to fail
    allocating, or plot nothing)."""
    monkeypatch.setattr(
        eval_length, "evaluate", lambda *a: pytest.fail("evaluated a length that cannot run")
    )
    out = tmp_path / "r.json"
    monkeypatch.setattr(eval_length, "device_memory", lambda device: 2**20)  # 1 MB
    r = eval_here(str(ckpts["alibi"]), "--lengths", "8", "1000", "--out_json", str(out))
    assert r.returncode == 1 and "one window of 1000 tokens needs at least" in r.stderr
    assert "evaluate shorter lengths" in r.stderr and not out.exists()
    monkeypatch.setattr(eval_length, "device_memory", lambda device: None)
    r = eval_here(str(ckpts["learned"]), "--lengths", "32", "64", "--out_json", str(out))
    assert (
        r.returncode == 1
        and "past what the checkpoints' positions reach (16)" in r.stderr
        and not out.exists()
    )


def test_run_folders_that_hold_no_run_are_named(ckpts, tmp_path):
    """A missing folder, a folder without a checkpoint and the checkpoint file itself are each a
    one-line error saying what to give."""
    for out_dir, message in [
        (tmp_path / "nowhere", "does not exist; give a run's folder"),
        (tmp_path, "holds no checkpoint (ckpt.pt); give a run's folder"),
        (
            ckpts["rope"] / "ckpt.pt",
            f"is a file; give the run's folder (train.py's out_dir), e.g. {ckpts['rope']}",
        ),
    ]:
        r = eval_here(str(out_dir), "--lengths", "8", "--out_json", str(tmp_path / "r.json"))
        assert r.returncode == 1 and message in r.stderr and "Traceback" not in r.stderr
