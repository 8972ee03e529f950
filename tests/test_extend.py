"""Extending a run (train.py --init_from=<a run's folder>): a new run from its weights at a longer
block size, with a RoPE scaling or a learned table interpolated; the options it may and may not
change, its one-line errors before any work, the source never written to, exact resume, and the
readers (the KV cache, compare/eval_length.py, sample.py, export/hf.py) taking the scaling from the
checkpoint unasked."""

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import cached_logits, close, run_cli, train_in_process
from test_train import TINY, tiny_data  # noqa: F401 (a fixture)

import sample
import train
from compare import eval_length
from lib.checkpoint import CheckpointError, load_checkpoint, model_from_checkpoint, save_checkpoint
from lib.configurator import configure
from lib.runs import extended_model, source
from model import GPT, GPTConfig

# test_train's tiny run at 16 tokens (a source the tests extend to 64, 4x), without dropout
SMALL = [*TINY, "--block_size=16", "--eval_interval=3", "--warmup_iters=2", "--dropout=0.0"]


def trained(out: Path, *args: str) -> dict:
    train_in_process([*SMALL, *args, f"--out_dir={out}"])
    return load_checkpoint(out / "ckpt.pt")


@pytest.fixture(scope="module")
def sources(tiny_data, tmp_path_factory) -> dict[str, Path]:  # noqa: F811
    """A finished 4-iteration run of rope, learned and alibi at 16 tokens."""
    root = tmp_path_factory.mktemp("sources")
    for pe in ("rope", "learned", "alibi"):
        trained(
            root / pe,
            f"--dataset={tiny_data}",
            f"--pos_encoding={pe}",
            "--max_iters=4",
            "--lr_decay_iters=4",
        )
    return {pe: root / pe for pe in ("rope", "learned", "alibi")} | {"data": tiny_data}


def extend(sources: dict, pe: str, out: Path, *args: str) -> dict:
    return trained(out, f"--dataset={sources['data']}", f"--init_from={sources[pe]}", *args)


def tree(root: Path) -> dict[str, tuple[bytes, int]]:
    return {
        str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in root.rglob("*")
        if p.is_file()
    }


@pytest.fixture(scope="module")
def yarn_run(sources, tmp_path_factory) -> Path:
    """The RoPE source extended to 64 tokens with YaRN (factor and L0 by default), 6 iterations, the
    source's folder recorded before and after."""
    out = tmp_path_factory.mktemp("yarn") / "run"
    before = tree(sources["rope"])
    extend(
        sources,
        "rope",
        out,
        "--block_size=64",
        "--rope_scaling=yarn",
        "--max_iters=6",
        "--lr_decay_iters=6",
    )
    assert tree(sources["rope"]) == before  # the source is never written to
    return out


def test_configure_records_the_keys_files_and_the_command_line_set(tmp_path):
    """explicit: every key a config file or --key=value set, the default's value too; none other."""
    (tmp_path / "c.py").write_text("n_layer = 6\nbatch_size = 3\n")
    explicit = set()
    cfg = configure(
        train.defaults, [str(tmp_path / "c.py"), "--dropout=0.2", "--compile"], explicit
    )
    assert explicit == {"n_layer", "batch_size", "dropout", "compile"}
    assert cfg["n_layer"] == 6 and cfg["dropout"] == 0.2  # 6 and 0.2 are the defaults, yet set


def test_learned_table_is_interpolated_as_positions_are():
    """extend_block_size on a learned table: row s·k of the new table is row k of the old, the rows
    between on the line between them, the last s - 1 the old last row; the other encodings keep
    their weights."""
    torch.manual_seed(0)
    model = GPT(
        GPTConfig(
            block_size=8, vocab_size=16, n_layer=1, n_head=2, n_embd=8, pos_encoding="learned"
        )
    )
    old = model.encoding.weight.detach().clone()
    model.extend_block_size(32)
    new = model.encoding.weight.detach()
    assert new.shape == (32, 8) and model.config.block_size == 32
    assert model.encoding.max_length == 32
    assert torch.equal(new[::4], old)
    close(new[4 * 2 + 1], old[2] + (old[3] - old[2]) / 4, tol=1e-6)
    close(new[4 * 5 + 3], old[5] + 3 * (old[6] - old[5]) / 4, tol=1e-6)
    assert torch.equal(new[-3:], old[-1].expand(3, -1))
    rope = GPT(
        GPTConfig(block_size=8, vocab_size=16, n_layer=1, n_head=2, n_embd=8, pos_encoding="rope")
    )
    state = {k: v.clone() for k, v in rope.state_dict().items()}
    rope.extend_block_size(32)
    assert all(torch.equal(state[k], v) for k, v in rope.state_dict().items())


def test_extension_keeps_the_model_and_scales_rope(sources, yarn_run):
    """The new run starts at iteration 0 with a fresh AdamW from the source's weights: before
    training it is the source read with YaRN (factor 64 / 16, L0 16, the defaults); its checkpoint
    records the scaling."""
    ckpt = load_checkpoint(yarn_run / "ckpt.pt")
    args = ckpt["model_args"]
    assert (
        args["block_size"],
        args["rope_scaling"],
        args["rope_factor"],
        args["rope_original_max_len"],
    ) == (
        64,
        "yarn",
        4.0,
        16,
    )
    assert ckpt["iter_num"] == 6 and ckpt["history"][0]["iter"] == 0
    # fresh: 6 steps, not 4 + 6
    assert all(int(s["step"]) == 6 for s in ckpt["optimizer"]["state"].values())
    source_ckpt = load_checkpoint(sources["rope"] / "ckpt.pt")
    changes = {k: ckpt["config"][k] for k in ("block_size", "dropout", "task")} | {
        k: args[k] for k in ("rope_scaling", "rope_factor", "rope_original_max_len")
    }
    extended = extended_model(
        source(str(sources["rope"])), changes, source_ckpt["tokenizer"]
    ).eval()
    reference = model_from_checkpoint(source_ckpt).eval()
    reference.set_rope_scaling("yarn", 4.0, 16)
    idx = torch.randint(0, 60, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(extended(idx)[0], reference(idx)[0])
        unscaled = model_from_checkpoint(source_ckpt).eval()(idx)[0]
    assert not torch.allclose(extended(idx)[0].detach(), unscaled, atol=1e-3)


def test_learned_positions_extend_by_interpolation(sources, tmp_path):
    """A learned source extends: its table interpolated to the new block, then fine-tuned;
    evaluation past it is still n/a (a table has no row past its block)."""
    ckpt = extend(
        sources,
        "learned",
        tmp_path / "ft",
        "--block_size=64",
        "--max_iters=3",
        "--lr_decay_iters=3",
    )
    source_ckpt = load_checkpoint(sources["learned"] / "ckpt.pt")
    assert (
        ckpt["model"]["transformer.encoding.weight"].shape == (64, 32)
        and ckpt["model_args"]["block_size"] == 64
    )
    before = extended_model(
        source(str(sources["learned"])), ckpt["config"], source_ckpt["tokenizer"]
    )
    assert torch.equal(
        before.encoding.weight[::4], source_ckpt["model"]["transformer.encoding.weight"]
    )


def test_resuming_an_extension_is_exact(sources, yarn_run, tmp_path):
    """Half the iterations, then --init_from=resume with the same options: the weights of the
    straight run, bit for bit (the source's folder is not read again: it may be gone)."""
    out = tmp_path / "split"
    opts = ["--block_size=64", "--rope_scaling=yarn", "--lr_decay_iters=6"]
    extend(sources, "rope", out, *opts, "--max_iters=3")
    trained(out, f"--dataset={sources['data']}", *opts, "--max_iters=6", "--init_from=resume")
    a = load_checkpoint(yarn_run / "ckpt.pt")
    b = load_checkpoint(out / "ckpt.pt")
    assert a["model_args"] == b["model_args"]
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k


def test_an_extension_extends_again_from_its_own_original_length(yarn_run, sources, tmp_path):
    """Extending an extended (scaled) run keeps its L0, the length the model was first trained at:
    to 128 tokens, YaRN's factor is 128 / 16 by default; set explicitly, the factor is the one
    given."""
    ckpt = trained(
        tmp_path / "again",
        f"--dataset={sources['data']}",
        f"--init_from={yarn_run}",
        "--block_size=128",
        "--max_iters=1",
        "--eval_interval=1",
    )
    args = ckpt["model_args"]
    assert (args["rope_scaling"], args["rope_factor"], args["rope_original_max_len"]) == (
        "yarn",
        8.0,
        16,
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["--n_layer=3"], "n_layer=3 contradicts {src}, the run this one extends (n_layer=2)"),
        (["--pos_encoding=alibi"], "pos_encoding='alibi' contradicts {src}"),
        (["--rope_base=500"], "rope_base=500.0 contradicts {src}"),
        (["--block_size=8"], "block_size=8 is shorter than {src}'s 16"),
        (["--rope_factor=0.5"], "rope_factor=0.5 must be a number >= 1"),
        (
            ["--out_dir={src}"],
            "is inside init_from={src!r}, the run this one extends, which is never written to",
        ),
        (["--out_dir={src}/sub"], "is inside init_from"),
        (["--task=needle", "--dataset="], "was trained on the text of dataset"),
    ],
)
def test_bad_extensions_are_one_line_errors_before_any_work(sources, tmp_path, args, message):
    """Each contradiction with the source, a shorter block, a bad scaling, an out_dir in the source
    and data of another kind: one line naming the option, nothing written anywhere."""
    src = str(sources["rope"])
    before = tree(sources["rope"])
    argv = [
        *SMALL,
        f"--dataset={sources['data']}",
        f"--init_from={src}",
        f"--out_dir={tmp_path / 'out'}",
    ]
    r = run_cli(train.cli, argv + [a.format(src=src) for a in args])
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert message.format(src=src) in r.stderr, r.stderr
    assert not (tmp_path / "out").exists() and tree(sources["rope"]) == before


def test_another_encodings_option_and_a_folder_without_a_run_are_errors(sources, tmp_path):
    """A RoPE scaling on an ALiBi source names the source's encoding; a folder that holds no run's
    checkpoint nor GPT-2's weights is named; the same options set to the source's values are
    fine."""
    base = [*SMALL, f"--dataset={sources['data']}", f"--out_dir={tmp_path / 'out'}"]
    r = run_cli(train.cli, [*base, f"--init_from={sources['alibi']}", "--rope_scaling=yarn"])
    assert (
        r.returncode == 1
        and "rope_scaling='yarn' is an option of pos_encoding='rope', not of 'alibi'" in r.stderr
    )
    (tmp_path / "empty").mkdir()
    r = run_cli(train.cli, [*base, f"--init_from={tmp_path / 'empty'}"])
    assert (
        r.returncode == 1 and "holds neither a run's checkpoint (ckpt.pt or ckpt.dcp)" in r.stderr
    )
    assert not (tmp_path / "out").exists()
    from lib.options import resolve

    explicit = set()
    argv = [
        *base,
        f"--init_from={sources['rope']}",
        "--pos_encoding=rope",
        "--n_layer=2",
        "--block_size=32",
    ]
    cfg = resolve(configure(train.defaults, argv, explicit), train.defaults, explicit)
    assert (cfg["n_layer"], cfg["n_embd"], cfg["block_size"], cfg["rope_scaling"]) == (
        2,
        32,
        32,
        "none",
    )


def test_another_tokenizer_is_refused(sources, tmp_path):
    """Text in other token ids (a GPT-2-tokenized dataset for a character-level source): one line,
    nothing written."""
    from lib.datafiles import prepare_text, read_embedded_corpus

    bpe = tmp_path / "bpe"
    prepare_text(read_embedded_corpus()[:20_000], bpe, "gpt2")
    argv = [
        *SMALL,
        f"--dataset={bpe}",
        f"--init_from={sources['rope']}",
        f"--out_dir={tmp_path / 'out'}",
    ]
    r = run_cli(train.cli, argv + ["--block_size=64"])
    assert r.returncode == 1 and "whose token ids mean other things" in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1 and not (tmp_path / "out").exists()
    # and where the data is loaded, later
    tokenizer = json.loads((bpe / "meta.json").read_text())["tokenizer"]
    with pytest.raises(CheckpointError, match="whose token ids mean other things"):
        extended_model(
            source(str(sources["rope"])),
            {"block_size": 64, "task": "", "dataset": str(bpe)},
            tokenizer,
        )


@pytest.mark.parametrize("run", ["yarn", "learned"])
def test_kv_cache_equals_the_full_forward_past_the_new_block(run, yarn_run, sources, tmp_path):
    """A fine-tuned, scaled model (and an interpolated learned one, within its table) decodes
    through the KV cache with the logits of its full forward: past the new block size of 64 where
    the encoding reaches."""
    if run == "yarn":
        model = model_from_checkpoint(load_checkpoint(yarn_run / "ckpt.pt")).eval()
        T = 200
        chunks = [50, 1, 1, 60, 1, 87]
    else:
        ckpt = extend(
            sources,
            "learned",
            tmp_path / "ft",
            "--block_size=64",
            "--max_iters=2",
            "--lr_decay_iters=2",
        )
        model = model_from_checkpoint(ckpt).eval()
        T = 64
        chunks = [20, 1, 1, 42]
    idx = torch.randint(
        0, model.config.vocab_size, (2, T), generator=torch.Generator().manual_seed(3)
    )
    with torch.no_grad():
        close(cached_logits(model, idx, chunks), model(idx)[0], tol=1e-5)


def test_eval_length_and_sample_read_the_scaling_unasked(yarn_run, tmp_path):
    """eval_length's loss of the extended run is that of its scaled model computed here (and not the
    unscaled model's); sample.py's greedy tokens are the scaled model's."""
    ckpt = load_checkpoint(yarn_run / "ckpt.pt")
    # weights moved off a 10-step model's, so that positions (and their scaling) matter
    torch.manual_seed(0)
    ckpt["model"] = {k: v + torch.randn_like(v) * 0.3 for k, v in ckpt["model"].items()}
    run = tmp_path / "run"
    save_checkpoint(ckpt, run / "ckpt.pt")
    model = model_from_checkpoint(ckpt).eval()
    L = 128  # past the new block
    report = eval_length.evaluate_runs(
        [run], lengths=[L], modes=["nonoverlapping"], eval_tokens=L, out_json="", plot=""
    )
    data = np.fromfile(Path(ckpt["config"]["dataset"]) / "val.bin", dtype=np.uint16)[
        : L + 1
    ].astype(np.int64)
    x = torch.from_numpy(data[:-1])[None]
    y = torch.from_numpy(data[1:])[None]
    with torch.no_grad():
        logits, ours = model(x, y)
        model.set_rope_scaling("none")
        unscaled = model(x)[0]
    assert report["runs"][0]["results"]["nonoverlapping"][L]["loss"] == pytest.approx(
        ours.item(), abs=1e-5
    )
    # the scaling matters
    assert abs(F.cross_entropy(unscaled[0], y[0]).item() - ours.item()) > 1e-2
    r = run_cli(
        sample.cli,
        [
            f"--out_dir={run}",
            "--start=ab",
            "--max_new_tokens=100",
            "--temperature=0",
            "--max_context=102",
            "--num_samples=1",
            "--device=cpu",
        ],
    )
    assert r.returncode == 0, r.stderr
    scaled = model_from_checkpoint(ckpt).eval()
    from lib.tokenizer import tokenizer_from_meta

    tok = tokenizer_from_meta(ckpt["tokenizer"])
    expected = scaled.generate(
        torch.tensor([tok.encode("ab")]), 100, temperature=0, max_context=102
    )
    assert r.stdout.startswith(tok.decode(expected[0].tolist()))


@pytest.mark.parametrize(
    "scaling, remote", [("yarn", False), ("yarn", True), ("linear", False), ("ntk", False)]
)
def test_export_of_an_extension_computes_its_logits(scaling, remote, yarn_run, sources, tmp_path):
    """An extended run exported (GPT-NeoX with its scaling in config.json's rope parameters: YaRN's
    and linear's factor and L0, NTK's base; and nanoPE's own code) gives its logits past the new
    block size."""
    transformers = pytest.importorskip("transformers")
    from export import hf as export

    run = yarn_run
    if scaling != "yarn":
        run = tmp_path / scaling
        extend(
            sources,
            "rope",
            run,
            "--block_size=64",
            f"--rope_scaling={scaling}",
            "--max_iters=2",
            "--lr_decay_iters=2",
        )
    ckpt = load_checkpoint(run / "ckpt.pt")
    out = export.export(ckpt, tmp_path / "hf", remote_code=remote)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=remote).eval()
    rope = json.loads((out / "config.json").read_text()).get("rope_parameters", {})
    if scaling == "yarn" and not remote:
        assert (rope["rope_type"], rope["factor"], rope["original_max_position_embeddings"]) == (
            "yarn",
            4.0,
            16,
        )
    if scaling == "linear":
        assert (rope["rope_type"], rope["factor"]) == ("linear", 4.0)
    if scaling == "ntk":  # static NTK is a larger base: base · s^(d/(d-2)), head dim 16
        assert rope["rope_type"] == "default" and rope["rope_theta"] == pytest.approx(
            10000 * 4 ** (16 / 14)
        )
    model = model_from_checkpoint(ckpt).eval()
    idx = torch.randint(
        0, model.config.vocab_size, (2, 160), generator=torch.Generator().manual_seed(4)
    )
    with torch.no_grad():
        close(hf(idx).logits, model(idx)[0], tol=1e-5)


def task_source(folder: Path, pe: str, seed: int) -> None:
    """A passkey run as the synthetic suite leaves one finished (config/passkey.py's model, random
    weights)."""
    from dataclasses import asdict

    torch.manual_seed(seed)
    config = GPTConfig(
        block_size=64, vocab_size=128, n_layer=2, n_head=2, n_embd=32, bias=False, pos_encoding=pe
    )
    # config/passkey.py's: the suite's command asks it, and a run trained otherwise is not reused
    steps = 1500
    cfg = {
        "task": "passkey",
        "task_vocab": 128,
        "task_pairs": 8,
        "task_queries": 4,
        "block_size": 64,
    }
    cfg |= {"max_iters": steps}
    ckpt = {
        "model": GPT(config).state_dict(),
        "model_args": asdict(config),
        "config": cfg,
        "iter_num": steps,
    }
    ckpt |= {"tokenizer": {"kind": "ids", "vocab_size": 128}, "best_val_loss": 4.0}
    save_checkpoint(ckpt, folder / "passkey" / f"{pe}-seed{seed}" / "ckpt.pt")


@pytest.mark.slow
@pytest.mark.usefixtures("forked_train_py")
def test_sweep_extend_trains_fine_tunes_evaluates_and_reports(tiny_data, tmp_path):  # noqa: F811
    """compare/sweep.py --extend: the text sources trained where missing (the text sweep's command),
    every source fine-tuned at 4x (RoPE per scaling), evaluated as trained and fine-tuned at 1x to
    16x and reported in pairs with the fine-tunes' losses, the passkey runs too; a second run trains
    and evaluates nothing."""

    from compare import sweep

    for pe in ("rope", "alibi"):
        task_source(tmp_path / "tasks", pe, 5)
    cmd = [
        "--extend",
        "--encodings",
        "rope",
        "alibi",
        "--rope_scaling",
        "yarn",
        "--seeds",
        "5",
        "--steps",
        "2",
    ]
    cmd += [
        f"--sources={tmp_path / 'text'}",
        f"--task_sources={tmp_path / 'tasks'}",
        f"--out_dir={tmp_path / 'ext'}",
    ]
    cmd += [
        "--eval_tokens=600",
        "--task_trials=4",
        "--train",
        *TINY,
        "--max_iters=4",
        f"--dataset={tiny_data}",
    ]
    r = run_cli(sweep.main, cmd)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = tmp_path / "ext"
    for run in (
        "rope-none-seed5",
        "rope-yarn-seed5",
        "alibi-seed5",
        "passkey/rope-yarn-seed5",
        "passkey/alibi-seed5",
    ):
        ckpt = load_checkpoint(out / run / "ckpt.pt")
        assert ckpt["iter_num"] == 2 and ckpt["config"]["block_size"] == 4 * (
            64 if "passkey" in run else 32
        )
        assert ckpt["model_args"]["rope_scaling"] == ("yarn" if "yarn" in run else "none")
        # its evaluations read the tokens its source's did: 2 batches at 32, 1 at 128
        if "passkey" not in run:
            assert ckpt["config"]["eval_iters"] == 1
    # trained as a source
    assert load_checkpoint(tmp_path / "text" / "rope-seed5" / "ckpt.pt")["iter_num"] == 4
    report = (out / "report.md").read_text()
    for row in (
        "| rope · none | no |",
        "| rope · yarn (s=4) | 2 steps |",
        "| alibi | no |",
        "| alibi | 2 steps |",
    ):
        assert row in report, row
    assert "| 32 (1×) | 128 (4×) | 256 (8×) | 512 (16×) |" in report and " → " in report
    assert (
        "## Retrieval after extension: passkey" in report
        and "| 64 (1×) | 256 (4×) | 512 (8×) | 1024 (16×) |" in report
    )
    assert (out / "extension.png").stat().st_size > 10_000
    results = json.loads((out / "results.json").read_text())
    assert len(results["runs"]) == 6 and results["tasks"]["scores"]
    again = run_cli(sweep.main, cmd)
    assert again.returncode == 0 and again.stdout.count("finished earlier, not trained again") == 10
    assert "eval_length" not in again.stderr  # the evaluations were kept
    # a second text seed, the task's runs on the first alone (--task_seeds), of
    seed = cmd.index("--seeds") + 1
    # one encoding (the study reports the runs its command names), which takes no RoPE scaling: none
    # is given
    more = cmd[:2] + ["alibi"] + cmd[6:seed] + ["5", "6", "--task_seeds", "5"] + cmd[seed + 1 :]
    more = run_cli(sweep.main, more)
    assert more.returncode == 0, more.stdout[-3000:] + more.stderr[-3000:]
    assert (out / "alibi-seed6" / "ckpt.pt").is_file() and not (
        out / "passkey" / "alibi-seed6"
    ).exists()
    report = (out / "report.md").read_text()
    assert (
        "seeds [5, 6]; each fine-tuned" in report
        and "seeds [5] (mean ± std where there are several)" in report
    )
    # and its plot, without RoPE's runs
    assert "| alibi | 2 steps |" in report and "| rope" not in report
    assert (out / "extension.png").stat().st_mtime > (
        out / "rope-yarn-seed5" / "ckpt.pt"
    ).stat().st_mtime
    # fine-tuned at the training length (--factor 1): each length once, in the tables and the plot
    # (it ended in a traceback where the task's lengths and its floors disagreed)
    once = [
        a.replace(str(tmp_path / "ext"), str(tmp_path / "ext1"))
        for a in cmd[:2] + ["rope", *cmd[4:]]
    ]
    r = run_cli(
        sweep.main,
        once[: once.index("--train")] + ["--factor", "1"] + once[once.index("--train") :],
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = (tmp_path / "ext1" / "report.md").read_text()
    assert (
        "| 32 (1×) | 64 (2×) | 128 (4×) |" in report
        and "| 64 (1×) | 128 (2×) | 256 (4×) |" in report
    )
    assert (tmp_path / "ext1" / "extension.png").stat().st_size > 10_000


@pytest.mark.parametrize(
    "args, message",
    [
        (["--steps", "5"], "--steps: only the extension study (--extend) has it"),
        (["--extend", "--synthetic"], "--extend is a study of its own"),
        (["--extend", "--steps", "0"], "--steps=0: must be at least 1"),
        (["--task_seeds", "1"], "--task_seeds: only the extension study (--extend) has it"),
        (["--extend", "--task_seeds", "1", "1"], "--task_seeds 1 1: each may appear once"),
        (
            ["--extend", "--out_dir", "S", "--sources", "S"],
            "the extension runs need a folder of their own",
        ),
    ],
)
def test_sweep_extend_options_are_checked(tmp_path, monkeypatch, args, message, capsys):
    """--extend's options are its own, and its folder is not its sources': one line, before any
    work."""
    from compare import sweep

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit):
        sweep.parse_args(args)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "task, vocab, hint",
    [
        ("needle", 64, "(drop --task_vocab: its is 128)"),  # the same task in another vocabulary
        ("passkey", 64, "(drop --task_vocab: its is 128)"),
        ("", None, "(config/needle.py)"),  # text, from a task's run
    ],
)
def test_an_extension_on_other_token_ids_says_which_option_to_drop(task, vocab, hint):
    """An extension of a synthetic task's run on ids that mean other things names the fix that
    applies to the command given: drop --task_vocab where the task is there already, add the task's
    config where it is not."""
    from lib.configurator import ConfigError
    from lib.runs import Source

    src = Source(
        "out-needle",
        {"config": {"task": "needle", "task_vocab": 128}, "tokenizer": ids_tokenizer(128)},
    )
    tokenizer = ids_tokenizer(vocab) if task else {"kind": "char", "chars": "ab"}
    with pytest.raises(ConfigError, match=re.escape(f"extend it on data of its own kind {hint}")):
        src.check_data(
            {"task": task, "task_vocab": vocab, "dataset": "shakespeare_char"},
            tokenizer,
            ConfigError,
        )
    # same ids
    src.check_data(
        {"task": "passkey", "task_vocab": 128, "dataset": ""}, ids_tokenizer(128), ConfigError
    )


def ids_tokenizer(vocab: int) -> dict:
    from lib.datafiles import task_meta

    return task_meta(vocab)["tokenizer"]


def test_a_run_resumed_longer_points_to_an_extension(sources, tmp_path):
    """Resuming a run with a longer --block_size is one line that names the extension to run instead
    (--init_from=<the run> --out_dir=<new>); that command, as written, trains the longer run."""
    from shutil import copytree

    run = copytree(sources["alibi"], tmp_path / "alibi")
    longer = [
        *SMALL,
        f"--dataset={sources['data']}",
        "--block_size=32",
        "--max_iters=6",
        "--lr_decay_iters=6",
    ]
    r = run_cli(train.cli, [*longer, "--init_from=resume", f"--out_dir={run}"])
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    fix = f"--init_from={run} --out_dir=<a new folder> --block_size=32"
    assert "block_size=32 is longer than the model's 16" in r.stderr and fix in r.stderr, r.stderr
    r = run_cli(
        train.cli, [*longer, *fix.replace("<a new folder>", str(tmp_path / "longer")).split()]
    )
    assert (
        r.returncode == 0
        and load_checkpoint(tmp_path / "longer" / "ckpt.pt")["model_args"]["block_size"] == 32
    )
