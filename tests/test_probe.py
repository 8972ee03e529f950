"""Tests for compare/probe.py: the attention probabilities it reads equal a softmax computed by
hand, the far-attention share equals its formula, the bias curves equal the published ALiBi slopes,
and the CLI writes its table, JSON and plot."""

import json

import numpy as np
import pytest
import torch
from conftest import VOCAB, close, run_cli, tiny, tokens, train_in_process
from test_eval_length import save_run, save_synthetic_run

from compare import probe
from lib.datafiles import prepare_text, read_embedded_corpus
from model import POS_ENCODINGS, alibi_slopes, apply_rotary


def by_hand(model, idx: torch.Tensor) -> torch.Tensor:
    """Layer 0's attention probabilities (B, nh, T, T) from the weights: scores, bias, causal mask,
    softmax."""
    c = model.config
    B, T = idx.shape
    hs = c.n_embd // c.n_head
    pos = torch.arange(T)
    x = model.transformer.wte(idx)
    emb = model.encoding.embed(pos)
    x = x if emb is None else x + emb
    block = model.transformer.h[0]
    q, k, _ = block.attn.c_attn(block.ln_1(x)).split(c.n_embd, dim=2)
    q, k = (t.view(B, T, c.n_head, hs).transpose(1, 2) for t in (q, k))
    rope = model.encoding.rotary(pos)
    if rope is not None:
        q = apply_rotary(q, *rope)
        k = apply_rotary(k, *rope)
    s = q @ k.transpose(-2, -1) / hs**0.5
    bias = model.encoding.score_bias(
        torch.arange(c.n_head)[:, None, None], pos[:, None], pos[None, :]
    )
    s = s if bias is None else s + bias
    return s.masked_fill(pos[:, None] < pos[None, :], float("-inf")).softmax(-1)


@pytest.mark.parametrize("pe", ["alibi", "bias_rpe", "rope", "sinusoidal", "none"])
def test_attention_probs_equal_a_softmax_by_hand(pe):
    """What probe reads through the model's own attention (V = I) is layer 0's softmax(q·kᵀ/√hs +
    bias), causal."""
    model = tiny(pe, block_size=32).eval()
    if pe == "bias_rpe":  # a table that is not all zero
        torch.nn.init.normal_(model.encoding.weight)
    idx = tokens(2, 48)
    before = dict(vars(model))
    probs = probe.attention_probs(model, idx)
    assert len(probs) == model.config.n_layer and probs[0].shape == (2, model.config.n_head, 48, 48)
    close(probs[0], by_hand(model, idx))
    for p in probs:
        close(p.sum(-1), torch.ones(p.shape[:-1]))
    assert vars(model) == before  # the instance is left as it was


@pytest.mark.parametrize("pe", list(POS_ENCODINGS))
def test_probing_leaves_the_forward_unchanged(pe):
    """Every encoding's probabilities are causal rows summing to 1, and probing does not change the
    logits."""
    model = tiny(pe, block_size=32).eval()
    idx = tokens(1, 32)
    with torch.no_grad():
        expected = model(idx)[0]
    probs = probe.attention_probs(model, idx)
    for p in probs:
        close(p.sum(-1), torch.ones(p.shape[:-1]))
        assert p.triu(1).abs().max() == 0
    with torch.no_grad():
        close(model(idx)[0], expected)


def test_far_share_of_uniform_attention():
    """Uniform attention over keys 0 … i puts (i - far + 1) / (i + 1) of query i's attention at
    distance >= far."""
    T, far, first = 20, 6, 15
    p = torch.tril(torch.ones(T, T)) / torch.arange(1, T + 1)[:, None]
    share = probe.far_share(p[None, None].expand(2, 3, T, T), far, first)
    i = torch.arange(first, T, dtype=torch.float32)
    close(share, ((i - far + 1) / (i + 1)).mean().expand(3))


def test_bias_curves_are_alibi_slopes_times_distance():
    """ALiBi's curves are -m_h·d with m_h = 2^(-8h/n) (Press et al. 2021): for 4 heads 1/4, 1/16,
    1/64, 1/256."""
    model = tiny("alibi", n_head=4, n_embd=32)
    curves = probe.bias_by_distance(model, 100)
    close(alibi_slopes(4), torch.tensor([1 / 4, 1 / 16, 1 / 64, 1 / 256]))
    expected = -alibi_slopes(4)[:, None] * torch.arange(100.0)[None]
    close(torch.from_numpy(curves), expected)
    assert probe.bias_by_distance(tiny("rope"), 100) is None
    fire = tiny("fire", n_layer=3)  # per layer: a row per layer and head
    assert probe.bias_by_distance(fire, 50).shape == (3 * fire.config.n_head, 50)


def test_cli_writes_table_json_and_plot(tmp_path, capsys):
    """compare/probe.py on trained checkpoints: a row per layer, shares in [0, 1], bias curves for a
    bias encoding only; a length within the training length and learned positions past their block
    are one-line errors."""
    data = tmp_path / "tiny"
    prepare_text(read_embedded_corpus()[:50_000], data, "char")
    common = [
        "--device=cpu",
        "--compile=False",
        f"--dataset={data}",
        "--block_size=32",
        "--batch_size=4",
    ]
    common += [
        "--n_layer=2",
        "--n_head=2",
        "--n_embd=32",
        "--max_iters=3",
        "--eval_iters=1",
        "--eval_interval=3",
    ]
    for pe in ("alibi", "rope", "learned"):
        train_in_process([*common, f"--pos_encoding={pe}", f"--out_dir={tmp_path / pe}"])
    capsys.readouterr()
    out = tmp_path / "probe.json"
    argv = [str(tmp_path / "alibi"), str(tmp_path / "rope"), "--length=128", "--windows=2"]
    probe.main([*argv, f"--out_json={out}", f"--plot={tmp_path / 'probe.png'}"])
    table = capsys.readouterr().out
    assert table.count("| alibi | ") == 2 and table.count("| rope | ") == 2
    report = json.loads(out.read_text())
    shares = np.array([report["checkpoints"][n]["far_share"] for n in ("alibi", "rope")])
    assert shares.shape == (2, 2, 2) and (shares >= 0).all() and (shares <= 1).all()
    assert (
        len(report["checkpoints"]["alibi"]["bias"]) == 2
        and report["checkpoints"]["rope"]["bias"] is None
    )
    assert (tmp_path / "probe.png").stat().st_size > 1000
    for argv, message in [
        ([str(tmp_path / "alibi"), "--length=32"], "must exceed the training length 32"),
        (
            [str(tmp_path / "learned"), "--length=64"],
            "learned has no positions past its block size",
        ),
    ]:
        with pytest.raises(SystemExit, match=message):
            probe.main([*argv, f"--out_json={out}", f"--plot={tmp_path / 'p.png'}"])
    capsys.readouterr()
    # two folders of one name (sweeps' <enc>-seed<seed>) need --names
    with pytest.raises(SystemExit):
        probe.main([str(tmp_path / "alibi"), str(tmp_path / "rope"), "--names", "x", "x"])
    assert "one distinct label per checkpoint" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        probe.main([str(tmp_path / "alibi"), "--device=foo"])
    assert "device='foo' is not a device" in capsys.readouterr().err


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Random checkpoints (block 16) on a small character dataset, a synthetic-task run, and a
    dataset in another character vocabulary."""
    root = tmp_path_factory.mktemp("probe")
    text = read_embedded_corpus()[:20_000]
    prepare_text(text, root / "data", "char")
    prepare_text(text.upper(), root / "upper", "char")
    meta = json.loads((root / "data" / "meta.json").read_text())
    for pe in ("alibi", "learned"):
        save_run(
            root / pe, meta["tokenizer"], meta["vocab_size"], {"dataset": str(root / "data")}, pe
        )
    save_synthetic_run(root / "passkey")
    return {name: root / name for name in ("alibi", "learned", "passkey", "upper")}


def probe_here(*args: str):
    return run_cli(probe.main, ["--device=cpu", *args])


def test_mistakes_stop_before_any_probing(runs, tmp_path, monkeypatch):
    """Each mistake is one line (status 2 for an option, 1 for a checkpoint or dataset) naming it
    and the fix, before any checkpoint is probed and with nothing written: another tokenizer's
    dataset, a synthetic-task run, a second checkpoint that cannot be probed, lengths and counts out
    of range or beyond memory, bad output paths."""
    monkeypatch.setattr(probe, "probe", lambda *a: pytest.fail("probed before every check"))
    folder = tmp_path / "plots"
    folder.mkdir()
    out = tmp_path / "p.json"
    alibi = str(runs["alibi"])
    cases = [
        (
            [alibi, "--data_dir", str(runs["upper"])],
            1,
            "is tokenized with a character vocabulary of",
        ),
        (
            [str(runs["passkey"])],
            1,
            "synthetic task 'passkey', not on text; score it with python -m compare.synthetic "
            f"{runs['passkey']}",
        ),
        ([alibi, str(runs["learned"])], 1, "learned has no positions past its block size"),
        ([alibi, "--length=8"], 1, "must exceed the training length 16"),
        ([alibi, "--length=-3"], 2, "--length -3: must be past the training length"),
        ([alibi, "--windows=100000"], 1, "--windows 100000: the validation split has"),
        ([alibi, "--length=100000"], 1, "fewer than --length 100000 + 1; use a shorter --length"),
        ([alibi, f"--plot={folder}"], 2, f"--plot='{folder}' is a folder"),
        ([alibi, "--plot=p.xyz"], 2, "--plot='p.xyz': the file name must end in .png"),
        (
            [alibi, f"--out_json={tmp_path / 'missing' / 'p.json'}"],
            2,
            "does not exist; create it, or write elsewhere",
        ),
        ([alibi, "--device=foo"], 2, "device='foo' is not a device"),
    ]
    for argv, code, message in cases:
        # later options win: argv's --length, --out_json
        r = probe_here(f"--out_json={out}", "--length=32", *argv)
        assert r.returncode == code and message in r.stderr and "Traceback" not in r.stderr, (
            argv,
            r.stderr,
        )
    monkeypatch.setattr(probe, "device_memory", lambda device: 2**20)  # 1 MB
    r = probe_here(alibi, "--length=512", f"--out_json={out}")
    assert r.returncode == 1 and "probing 512 tokens needs at least" in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plots"] and not any(folder.iterdir())


def test_outputs_are_written_whole_and_optional(runs, tmp_path, monkeypatch):
    """--out_json and --plot get whole files (a PDF here: the suffix picks the format) and no
    temporary files; an empty value writes none (not even the default name in the working
    folder)."""
    out = tmp_path / "p.json"
    plot = tmp_path / "p.pdf"
    r = probe_here(
        str(runs["alibi"]), "--length=32", "--windows=2", f"--out_json={out}", f"--plot={plot}"
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(out.read_text())["length"] == 32 and plot.read_bytes()[:4] == b"%PDF"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.json", "p.pdf"]
    (tmp_path / "empty").mkdir()
    monkeypatch.chdir(tmp_path / "empty")
    r = probe_here(str(runs["alibi"]), "--length=32", "--windows=1", "--out_json=", "--plot=")
    assert (
        r.returncode == 0
        and "| alibi | 0 |" in r.stdout
        and not any((tmp_path / "empty").iterdir())
    )


@pytest.mark.parametrize("pe", ["fox", "cope"])
def test_content_read_is_what_the_bias_reads(pe):
    """FoX's forget rates are the mean of exp(forget) over the window, with the share above 0.9;
    CoPE's counts of the last query grow with the distance (sums of gates in (0, 1)), from its own
    gate (< 1) to at most p_max - 1."""
    from compare.probe import content_read

    model = tiny(pe, block_size=32, cope_p_max=8)
    idx = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))
    read = content_read(model, idx)
    assert len(read) == model.config.n_layer
    x = model.transformer.h[0].ln_1(model.transformer.wte(idx))
    if pe == "fox":
        f = model.encoding.forget(0, x).exp()  # (B, nh, T)
        expected = torch.stack([f.mean((0, 2)), (f > 0.9).double().mean((0, 2))], -1)
        torch.testing.assert_close(
            torch.tensor(read[0], dtype=torch.float64), expected, rtol=1e-6, atol=1e-6
        )
    else:
        counts = torch.tensor(read[0])  # (nh, T) by distance 0 … T - 1
        assert counts.shape == (model.config.n_head, 24)
        assert (
            (counts.diff(dim=-1) >= -1e-6).all()
            and (counts[:, 0] < 1).all()
            and (counts <= 7 + 1e-6).all()
        )
