"""export/hf.py: a checkpoint as a transformers directory that computes the same logits (GPT-2 for
learned, sinusoidal and none; GPT-NeoX for RoPE and its scalings; MPT for ALiBi; every encoding as
nanoPE's own code with trust_remote_code), its tokenizer, and the errors before anything is
written."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import close, run_cli
from torch.nn import functional as F

from lib import checkpoint as checkpoint_py
from lib.checkpoint import ShardedCheckpoint, load_checkpoint, save_checkpoint, save_sharded
from model import GPT, POS_ENCODINGS, GPTConfig
from model import from_hf as model_from_hf

transformers = pytest.importorskip("transformers")
from export import hf as export  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
V = 64
CHARS = (
    "\n !'(),-.:;?"
    + "".join(chr(c) for c in range(ord("A"), ord("Z") + 1))
    + "abcdefghijklmnopqrstuvwxyz"
)


def checkpoint(perturb: float = 0.1, **kw) -> tuple[dict, GPT]:
    """A random model's checkpoint (its weights moved off the init, biases and norms too) and the
    model."""
    torch.manual_seed(0)
    args = dict(block_size=32, vocab_size=V, n_layer=2, n_head=4, n_embd=32) | kw
    model = GPT(GPTConfig(**args))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if model.config.bias or not name.endswith(".bias"):
                p.add_(torch.randn_like(p) * perturb)
    ckpt = {
        "model": model.state_dict(),
        "model_args": args,
        "tokenizer": {"kind": "char", "chars": CHARS[:V]},
    }
    return ckpt | {"config": {"dtype": "float32"}}, model.eval()


def exported(ckpt: dict, tmp_path: Path, **kw):
    out = export.export(ckpt, tmp_path / "hf", **kw)
    return transformers.AutoModelForCausalLM.from_pretrained(out).eval(), out


CASES = [
    ("learned", {}),
    ("sinusoidal", {}),
    ("none", {}),
    ("learned", {"bias": False, "gelu": "tanh"}),
    ("rope", {}),
    ("rope", {"bias": False}),
    ("rope", {"rope_fraction": 0.5}),
    ("alibi", {"bias": False}),
    ("alibi", {"bias": False, "n_head": 6, "n_embd": 48}),
    ("alibi", {"bias": False, "n_head": 12, "n_embd": 48}),
]


@pytest.mark.parametrize("pe, kw", CASES)
def test_exported_logits_equal_ours(pe, kw, tmp_path):
    """Over a full sequence (past the training length where the encoding reaches), in float32, to
    1e-5; the class is the architecture the encoding declares, and AutoTokenizer loads the
    directory."""
    ckpt, model = checkpoint(pos_encoding=pe, **kw)
    hf, out = exported(ckpt, tmp_path)
    name = {"gpt2": "GPT2LMHeadModel", "gpt_neox": "GPTNeoXForCausalLM", "mpt": "MptForCausalLM"}
    assert type(hf).__name__ == name[POS_ENCODINGS[pe].hf_architecture]
    T = 32 if pe == "learned" else 96
    idx = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        close(hf(idx).logits, model(idx)[0], tol=1e-5)
    assert transformers.AutoTokenizer.from_pretrained(out).decode([5, 6]) == CHARS[5:7]


@pytest.mark.parametrize("scaling", ["linear", "ntk", "yarn", "llama3", "dynamic_ntk"])
@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_rope_scalings_export_exactly_past_the_training_length(scaling, fraction, tmp_path):
    """Every RoPE scaling GPT-NeoX can express, at 3x the training length; partial RoPE at base b is
    NeoX's at base b^fraction. Dynamic NTK's exponent counts the rotated dims in transformers: with
    partial RoPE it is an error, not an approximation."""
    ckpt, model = checkpoint(
        pos_encoding="rope", rope_fraction=fraction, rope_scaling=scaling, rope_factor=4.0
    )
    if scaling == "dynamic_ntk" and fraction < 1:
        with pytest.raises(
            export.ExportError, match="rope_scaling='dynamic_ntk' with rope_fraction=0.5"
        ):
            exported(ckpt, tmp_path)
        assert not (tmp_path / "hf").exists()
        return
    hf, _ = exported(ckpt, tmp_path)
    idx = torch.randint(0, V, (2, 96), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        close(hf(idx).logits, model(idx)[0], tol=1e-5)


def test_partial_rope_is_neox_at_a_smaller_base():
    """Ours rotates the fastest R of d/2 pairs, θ_k = b^(-2k/d); NeoX spreads 2R rotated dims, θ_k =
    b'^(-2k/2R): the same angles for b' = b^(2R/d)."""
    _, model = checkpoint(pos_encoding="rope", rope_fraction=0.5)
    pe = model.encoding
    params = export.neox_rope(model)
    d = pe.head_dim
    R = pe.rotating
    ours = pe.inv_freq(torch.device("cpu"))[:R]
    theirs = params["rope_theta"] ** (-torch.arange(0, 2 * R, 2).double() / (2 * R))
    close(ours.double(), theirs, tol=1e-7)
    assert params["partial_rotary_factor"] == 2 * R / d


@pytest.mark.parametrize(
    "pe, kw",
    [
        ("learned", {}),
        ("rope", {}),
        ("rope", {"rope_scaling": "yarn", "rope_factor": 4.0}),
        ("alibi", {"bias": False}),
        ("sinusoidal", {}),
    ],
)
def test_generate_with_their_cache_gives_our_tokens(pe, kw, tmp_path):
    """Greedy generation with transformers' own KV cache reproduces ours, past the training length
    where the encoding reaches."""
    ckpt, model = checkpoint(perturb=0.3, pos_encoding=pe, **kw)
    hf, _ = exported(ckpt, tmp_path)
    idx = torch.randint(0, V, (1, 8), generator=torch.Generator().manual_seed(2))
    n = 24 if pe == "learned" else 60
    ours = model.generate(idx, n, temperature=0, max_context=n + 8)
    theirs = hf.generate(idx, max_new_tokens=n, do_sample=False, min_new_tokens=n, pad_token_id=0)
    assert torch.equal(theirs, ours)


def test_gpt2_export_then_import_gives_back_the_weights(tmp_path):
    ckpt, model = checkpoint(pos_encoding="learned", gelu="tanh")
    hf, _ = exported(ckpt, tmp_path)
    back = model_from_hf(hf).state_dict()
    for k, v in model.state_dict().items():
        assert torch.equal(back[k], v), k


def test_tokenizers_round_trip(tmp_path):
    """Text through ours and through the exported tokenizer: the same ids, and decoding gives the
    text back."""
    from lib.tokenizer import tokenizer_from_meta

    text = "First Citizen:\nBefore we proceed any further, hear me speak.  Don't!"
    for meta in ({"kind": "char", "chars": "".join(sorted(set(text)))}, {"kind": "gpt2"}):
        ours = tokenizer_from_meta(meta)
        export.hf_tokenizer(meta).save_pretrained(tmp_path / meta["kind"])
        theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / meta["kind"])
        ids = ours.encode(text)
        assert theirs.encode(text) == ids, meta["kind"]
        assert theirs.decode(ids) == text == ours.decode(ids)


def test_exported_tokenizers_end_of_text_padding_and_unknown_characters(tmp_path):
    """A character-level tokenizer has <|endoftext|> after its characters, as its end of text, start
    of text and padding (on the left), and decoding skips it and keeps every newline; a character
    outside the vocabulary encodes as a space (the first character where there is no space), the
    words "<|endoftext|>" as characters. GPT-2's has its own end of text for all three."""
    toks = {}
    for name, meta in [
        ("chars", {"kind": "char", "chars": CHARS}),
        ("no space", {"kind": "char", "chars": "\nab"}),
    ]:
        export.hf_tokenizer(meta).save_pretrained(tmp_path / name)
        toks[name] = transformers.AutoTokenizer.from_pretrained(tmp_path / name)
    tok = toks["chars"]
    eot = len(CHARS)
    space = CHARS.index(" ")
    assert tok.eos_token == "<|endoftext|>" and tok.convert_tokens_to_ids("<|endoftext|>") == eot
    assert (tok.eos_token_id, tok.bos_token_id, tok.pad_token_id, tok.padding_side) == (
        eot,
        eot,
        eot,
        "left",
    )
    ids = tok.encode("Ab\té\n<|endoftext|>")
    assert ids == [CHARS.index(c) if c in CHARS else space for c in "Ab  \n<|endoftext|>"]
    assert tok.decode([*ids[:5], eot, *ids[:5]], skip_special_tokens=True) == "Ab  \nAb  \n"
    batch = tok(["To be", "Or not to be"], padding=True)
    assert (
        batch["input_ids"][0] == [eot] * 7 + tok.encode("To be")
        and batch["attention_mask"][0] == [0] * 7 + [1] * 5
    )
    assert toks["no space"].encode("a b\n") == [1, 0, 2, 0]
    export.hf_tokenizer({"kind": "gpt2"}).save_pretrained(tmp_path / "gpt2")
    gpt2 = transformers.AutoTokenizer.from_pretrained(tmp_path / "gpt2")
    assert (gpt2.eos_token_id, gpt2.bos_token_id, gpt2.pad_token_id, gpt2.padding_side) == (
        50256,
    ) * 3 + ("left",)


def test_tokenizers_load_without_a_trust_prompt(remote, tmp_path, monkeypatch):
    """AutoTokenizer loads a GPT-2, GPT-NeoX or MPT export as it is, and an export that carries its
    code with trust_remote_code=True, and PreTrainedTokenizerFast either without it, as the
    documentation says, without asking anything."""

    def prompt(*args):
        raise AssertionError("transformers asked whether to trust the folder")

    monkeypatch.setattr("builtins.input", prompt)
    ckpt, _ = checkpoint(pos_encoding="rope")
    native = export.export(ckpt, tmp_path / "hf")
    for folder, trust in [(native, False), (remote["t5"][0], True)]:
        assert (
            transformers.AutoTokenizer.from_pretrained(folder, trust_remote_code=trust).eos_token_id
            == V
        )
        assert transformers.PreTrainedTokenizerFast.from_pretrained(folder).eos_token_id == V


def test_dtype_option_and_default(tmp_path):
    """--dtype writes the weights in that dtype and says so in the config; by default, the run's
    training dtype."""
    ckpt, _ = checkpoint(pos_encoding="rope")
    ckpt["config"]["dtype"] = "bfloat16"
    out = export.export(ckpt, tmp_path / "bf16")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype="auto")
    assert hf.dtype == torch.bfloat16 and '"dtype": "bfloat16"' in (out / "config.json").read_text()
    out = export.export(ckpt, tmp_path / "f32", dtype="float32")
    assert (
        transformers.AutoModelForCausalLM.from_pretrained(out, dtype="auto").dtype == torch.float32
    )


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "export", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_command_and_its_errors(tmp_path):
    """The command writes a directory transformers loads (KERPLE: with its code); each bad input is
    one line before anything is written."""
    for pe, kw in [("rope", {}), ("kerple", {}), ("alibi", {})]:
        ckpt, _ = checkpoint(pos_encoding=pe, **kw)
        save_checkpoint(ckpt, tmp_path / pe / "ckpt.pt")
    ckpt["model_args"]["pos_encoding"] = "xpos"
    save_checkpoint(ckpt, tmp_path / "xpos" / "ckpt.pt")
    r = run(str(tmp_path / "kerple"), "--out", str(tmp_path / "hf-kerple"))
    assert r.returncode == 0 and "trust_remote_code=True" in r.stdout, r.stderr
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hf-kerple", trust_remote_code=True
    )
    assert type(hf).__name__ == "NanoPEForCausalLM"
    assert (
        run_cli(
            export.main, [str(tmp_path / "rope"), "--out", str(tmp_path / "hf-rope")]
        ).returncode
        == 0
    )
    cases = [
        ([str(tmp_path / "missing"), "--out", str(tmp_path / "x")], "no checkpoint at"),
        (
            [str(tmp_path / "xpos"), "--out", str(tmp_path / "x")],
            "pos_encoding='xpos' is not a positional encoding",
        ),
        (
            [str(tmp_path / "alibi"), "--out", str(tmp_path / "x")],
            "MPT has no biases .* changes the logits by up to",
        ),
        ([str(tmp_path / "rope"), "--out", str(tmp_path / "hf-rope")], "exists and is not empty"),
        (
            [str(tmp_path / "kerple"), "--out", str(tmp_path / "hf-kerple")],
            "exists and is not empty",
        ),
    ]
    for args, message in cases:  # in this process (run_cli): the command itself ran above
        refused(args, message)
    assert not (tmp_path / "x").exists()
    (tmp_path / "rope" / "ckpt.pt").write_bytes(b"not a checkpoint")
    r = run_cli(export.main, [str(tmp_path / "rope"), "--out", str(tmp_path / "y")])
    assert (
        r.returncode == 1
        and "not a readable checkpoint" in r.stderr
        and not (tmp_path / "y").exists()
    )
    before = tree(tmp_path / "hf-rope")
    assert run_cli(
        export.main, [str(tmp_path / "alibi"), "--out", str(tmp_path / "hf-rope"), "--overwrite"]
    ).returncode
    # a failed export leaves the old directory as it was
    assert tree(tmp_path / "hf-rope") == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "alibi",
        "hf-kerple",
        "hf-rope",
        "kerple",
        "rope",
        "xpos",
    ]


def tree(root: Path) -> dict[str, bytes | None]:
    """Every file (its bytes) and folder (None) under root, by relative path: what a command must
    leave as it was."""
    return {
        str(p.relative_to(root)): p.read_bytes() if p.is_file() else None
        for p in sorted(root.rglob("*"))
    }


def saved_run(folder: Path, pe: str = "rope", **kw) -> Path:
    """A run's folder as train.py leaves it: ckpt.pt and ckpt_best.pt of a tiny model."""
    ckpt, _ = checkpoint(pos_encoding=pe, **kw)
    for name in ("ckpt.pt", "ckpt_best.pt"):
        save_checkpoint(ckpt, folder / name)
    return folder


def refused(args: list[str], message: str, cli=export.main) -> None:
    """The command exits 1 with one line, 'error: ...' matching message, and no traceback."""
    r = run_cli(cli, args)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert re.search(message, lines[0]), lines[0]


def test_out_never_holds_the_run_being_exported(tmp_path, monkeypatch):
    """--out naming the run's folder, or a folder above it (., .., an absolute parent), is refused
    even with --overwrite, and every file stays: the checkpoints, and a user's file beside the
    run."""
    runs = tmp_path / "runs"
    run = saved_run(runs / "out-rope")
    (runs / "notes.txt").write_text("mine")
    before = tree(tmp_path)
    for cwd, out in [
        (tmp_path, run),
        (tmp_path, runs),
        (tmp_path, tmp_path),
        (runs, "."),
        (run, ".."),
        (run, "."),
    ]:
        monkeypatch.chdir(cwd)
        refused(
            [str(run), "--out", str(out), "--overwrite"],
            r"(is|holds) the run being exported "
            r".* elsewhere",
        )
        refused([str(run), "--out", str(out)], r"(is|holds) the run being exported")
    assert tree(tmp_path) == before


def test_overwrite_replaces_only_an_earlier_export(tmp_path):
    """--overwrite replaces a folder export/hf.py wrote (its nanope.json and only the files it
    lists, or an export's six files from before the list), and refuses any other folder, or an
    export holding a file of the user's, leaving it as it was."""
    run = saved_run(tmp_path / "out-rope")
    sin = saved_run(tmp_path / "out-sin", "sinusoidal")
    hf = tmp_path / "hf"
    user = tmp_path / "mine"
    assert run_cli(export.main, [str(run), "--out", str(hf)]).returncode == 0
    user.mkdir()
    (user / "notes.txt").write_text("mine")
    (hf / "results.json").write_text("{}")  # e.g. an evaluation saved into the export
    before = tree(tmp_path)
    refused(
        [str(sin), "--out", str(user), "--overwrite"],
        "replaces only an earlier export.* no nanope.json",
    )
    refused(
        [str(sin), "--out", str(hf), "--overwrite"],
        r"not one: it holds what no export "
        r"writes \(results.json\)",
    )
    assert tree(tmp_path) == before
    (hf / "results.json").unlink()
    r = run_cli(export.main, [str(sin), "--out", str(hf), "--overwrite"])
    assert r.returncode == 0, r.stderr
    assert '"pos_encoding": "sinusoidal"' in (hf / "nanope.json").read_text()
    info = json.loads((hf / "nanope.json").read_text())
    # an older export
    (hf / "nanope.json").write_text(json.dumps({k: v for k, v in info.items() if k != "files"}))
    assert run_cli(export.main, [str(run), "--out", str(hf), "--overwrite"]).returncode == 0
    assert '"pos_encoding": "rope"' in (hf / "nanope.json").read_text()
    # no folder left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "mine", "out-rope", "out-sin"]


def test_overwrite_deletes_only_what_an_export_writes(tmp_path):
    """--overwrite on an export whose nanope.json lists a file no export writes (the user's
    notes.txt, a path out of the folder), or holds no list of names (null, nested lists, not JSON,
    not an object): one line, nothing deleted."""
    run = saved_run(tmp_path / "out-rope")
    hf = export.export(checkpoint(pos_encoding="rope")[0], tmp_path / "hf", remote_code=True)
    info = json.loads((hf / "nanope.json").read_text())
    # every file it wrote
    assert "model.py" in info["files"] and set(info["files"]) <= export.EXPORT_FILES
    (hf / "notes.txt").write_text("mine")
    cases = [
        (
            {"files": [*info["files"], "notes.txt"]},
            "lists 'notes.txt', which no export writes; choose another --out",
        ),
        (
            {"files": [*info["files"], "../notes.txt", "/notes.txt"]},
            "lists '../notes.txt', '/notes.txt', which no",
        ),
        ({"files": None}, "is not an export's"),
        ({"files": [["config.json"]]}, "is not an export's"),
        ({"files": "config.json"}, "is not an export's"),
        ([], "is not an export's"),
    ]
    for listed, message in [
        *((json.dumps(c), m) for c, m in cases),
        ("{not json", "is not an export's"),
    ]:
        (hf / "nanope.json").write_text(listed)
        before = tree(tmp_path)
        refused(
            [str(run), "--out", str(hf), "--overwrite"],
            re.escape(f"{hf} is not one: its nanope.json ") + message,
        )
        assert tree(tmp_path) == before


def sharded_run(folder: Path, iter_num: int) -> None:
    """A run's folder as train.py --parallel=fsdp saves it: ckpt.dcp, a link to the folder of its
    shards."""
    ckpt, _ = checkpoint(pos_encoding="rope")
    optimizer = {
        "learning_rate": 1e-3,
        "weight_decay": 0.1,
        "beta1": 0.9,
        "beta2": 0.95,
        "pe_lr_scale": 1.0,
    }
    meta = {k: v for k, v in ckpt.items() if k != "model"} | {"iter_num": iter_num}
    save_sharded(
        {"model": ckpt["model"]},
        meta | {"config": ckpt["config"] | optimizer},
        folder,
        ("ckpt.dcp",),
    )


@pytest.mark.parametrize("moment", ["meta.pt", "shards"])
def test_a_sharded_checkpoint_replaced_while_read_says_so(moment, tmp_path, monkeypatch):
    """The training run saving while export/hf.py or lib/checkpoint.py reads its ckpt.dcp (the save
    moves the link, then removes the folder being read) as meta.pt or the shards are read: one line
    saying so and to run the command again, not a damaged shard; run again, each reads the new
    checkpoint."""
    from torch.distributed.checkpoint import FileSystemReader

    run = tmp_path / "run"
    sharded_run(run, 1)
    target, name = (
        (checkpoint_py, "_load") if moment == "meta.pt" else (FileSystemReader, "read_data")
    )
    real = getattr(target, name)
    saves = iter(range(2, 10))

    def save_then_read(*args, **kw):  # the training's next save lands as the reader starts reading
        monkeypatch.setattr(target, name, real)
        # meta.pt is read while the reader builds its model on the meta device
        with torch.device("cpu"):
            sharded_run(run, next(saves))
        return real(*args, **kw)

    for cli, args in [
        (export.main, [str(run), "--out", str(tmp_path / "hf")]),
        (checkpoint_py.main, [str(run)]),
    ]:
        monkeypatch.setattr(target, name, save_then_read)
        refused(args, "ckpt.dcp was replaced while it was read .*: run the command again$", cli)
        assert run_cli(cli, args).returncode == 0
    assert (
        load_checkpoint(run / "ckpt.pt")["iter_num"]
        == ShardedCheckpoint(run / "ckpt.dcp").meta["iter_num"]
        == 3
    )


def test_bad_out_is_refused_before_any_work(tmp_path, monkeypatch):
    """--out . (a folder of the user's), a file, a folder in a missing or read-only folder: one line
    each, nothing written, no temporary folder left."""
    run = saved_run(tmp_path / "out-rope")
    work = tmp_path / "work"
    work.mkdir()
    (work / "data.txt").write_text("mine")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    if os.access(ro, os.W_OK):  # root ignores the mode: sysfs takes no new file from anyone
        ro = (
            Path("/sys")
            if Path("/sys").is_dir()
            else pytest.skip("no read-only folder to write in")
        )
    before = tree(tmp_path)
    monkeypatch.chdir(work)
    refused([str(run), "--out", "."], "exists and is not empty")
    refused([str(run), "--out", ".", "--overwrite"], "replaces only an earlier export")
    refused([str(run), "--out", "data.txt"], "is a file, and an export is a folder")
    refused([str(run), "--out", "data.txt", "--overwrite"], "is a file, and an export is a folder")
    refused([str(run), "--out", "missing/hf"], r"the folder .*missing does not exist")
    refused([str(run), "--out", str(ro / "hf")], r"cannot write in .* write elsewhere")
    (tmp_path / "ro").chmod(0o755)
    assert tree(tmp_path) == before


@pytest.mark.parametrize(
    "pe, kw, n, message",
    [
        ("sinusoidal", {}, 4, "--n_positions=4 is below the training length block_size=32"),
        (
            "alibi",
            {"bias": False},
            31,
            "--n_positions=31 is below the training length block_size=32",
        ),
        ("rope", {}, 7, "this rope export has neither .* drop --n_positions"),
        (
            "sinusoidal",
            {},
            10**12,
            r"position table 1000000000000 x 32 float32 values.* more "
            r"than this machine's",
        ),
        (
            "alibi",
            {"bias": False},
            10**12,
            r"ALiBi buffer 1000000000000 x 4 float32 values.* "
            r"more than this machine's",
        ),
        ("learned", {}, 0, "--n_positions=0 must be at least 1"),
    ],
)
def test_n_positions_is_checked_before_any_work(pe, kw, n, message, tmp_path):
    """An --n_positions the export could not read its training length with, one an encoding has no
    use for, or one too big to build: a one-line error, and nothing written."""
    run = saved_run(tmp_path / "run", pe, **kw)
    refused([str(run), "--out", str(tmp_path / "hf"), f"--n_positions={n}"], message)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


# --------------------------------------------------------------------------------------------------
# Exports that carry their own code (every encoding): each exported once, shared by the tests below


@pytest.fixture(scope="module")
def remote(tmp_path_factory) -> dict[str, tuple[Path, GPT, torch.nn.Module]]:
    """Each encoding's export with --remote_code: its folder, our model, and the model transformers
    loads."""
    root = tmp_path_factory.mktemp("remote")
    exports = {}
    for pe in POS_ENCODINGS:
        ckpt, model = checkpoint(perturb=0.3, pos_encoding=pe)
        out = export.export(ckpt, root / pe, remote_code=True)
        exports[pe] = (
            out,
            model,
            transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True),
        )
    return exports


def length(pe: str) -> int:
    """A sequence past the training length (32), where the encoding reaches."""
    return 80 if POS_ENCODINGS[pe].extrapolates else 32


@pytest.mark.parametrize("pe", list(POS_ENCODINGS))
def test_remote_code_export_computes_our_logits(pe, remote):
    """Every encoding loads as nanoPE's own model through AutoModelForCausalLM (trust_remote_code)
    and gives our logits in float32 to 1e-5, past the training length; AutoTokenizer loads the
    folder."""
    out, model, hf = remote[pe]
    assert type(hf).__name__ == "NanoPEForCausalLM" and hf.dtype == torch.float32
    idx = torch.randint(0, V, (2, length(pe)), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        close(hf(idx).logits, model(idx)[0], tol=1e-5)
    assert (
        transformers.AutoTokenizer.from_pretrained(out, trust_remote_code=True).decode([5, 6])
        == CHARS[5:7]
    )


@pytest.mark.parametrize("pe", list(POS_ENCODINGS))
def test_remote_code_left_padding_gives_each_row_its_own_logits(pe, remote):
    """In a left-padded batch each row's logits are those it has alone: positions and biases count
    from its first real token. Rows of 5, full and 23 tokens; the full one past the training length
    where the encoding reaches."""
    _, model, hf = remote[pe]
    T = length(pe)
    g = torch.Generator().manual_seed(3)
    rows = [torch.randint(0, V, (n,), generator=g) for n in (5, T, 23)]
    idx = torch.zeros(3, T, dtype=torch.long)
    mask = torch.zeros(3, T, dtype=torch.long)
    for b, row in enumerate(rows):
        idx[b, T - len(row) :], mask[b, T - len(row) :] = row, 1
    with torch.no_grad():
        logits = hf(idx, attention_mask=mask).logits
        for b, row in enumerate(rows):
            close(logits[b, T - len(row) :], model(row[None])[0][0], tol=1e-5)


def test_remote_code_reads_the_tokenizers_padding_and_end_of_text(remote):
    """A batch the exported tokenizer pads (on the left, with <|endoftext|>) gives each row its
    logits alone, and <|endoftext|>, past the model's vocabulary, reads as a newline: the harness's
    start of text."""
    out, model, hf = remote["t5"]
    tok = transformers.AutoTokenizer.from_pretrained(out, trust_remote_code=True)
    texts = ["ROMEO:\nHe jests at scars", "To be"]
    batch = tok(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = hf(**batch).logits
        for b, text in enumerate(texts):
            ids = torch.tensor([tok.encode(text)])
            close(logits[b, -ids.size(1) :], model(ids)[0][0])
        close(hf(torch.tensor([[V, *ids[0]]])).logits, model(torch.tensor([[0, *ids[0]]]))[0])


def test_remote_code_generate_carries_its_cache_between_steps(remote):
    """transformers' generate() hands the cache from each step to the next (its name is
    "past_key_values" up to 5.23, "cache" from 5.24): after the prompt, every step feeds the model
    one token, not the whole sequence again."""
    _, _, hf = remote["t5"]
    lengths = []
    forward = hf.forward

    def recording(input_ids, *args, **kwargs):
        lengths.append(input_ids.size(1))
        return forward(input_ids, *args, **kwargs)

    hf.forward = recording
    try:
        hf.generate(torch.tensor([[1, 2, 3, 4, 5]]), max_new_tokens=6, do_sample=False)
    finally:
        del hf.forward
    assert lengths == [5, 1, 1, 1, 1, 1], lengths


def test_remote_code_refuses_what_it_cannot_read(remote):
    """An id past the tokenizer's last (not the end of text, the one id past the model's
    vocabulary), an empty prompt and a prompt row that the attention mask leaves empty are each a
    one-line error naming the problem."""
    _, _, hf = remote["t5"]
    with pytest.raises(
        ValueError,
        match=rf"holds the id {V + 1}, which this model has no "
        r"embedding for",
    ):
        hf(torch.tensor([[1, V + 1, 2]]))
    with pytest.raises(ValueError, match="input_ids is empty"):
        hf.generate(torch.zeros(1, 0, dtype=torch.long), max_new_tokens=2)
    idx = torch.tensor([[1, 2, 3], [4, 5, 6]])
    mask = torch.tensor([[1, 1, 1], [0, 0, 0]])
    with pytest.raises(
        ValueError, match="row 1 of attention_mask is all zeros: its prompt is empty"
    ) as e:
        hf.generate(idx, attention_mask=mask, max_new_tokens=2, do_sample=False)
    assert "\n" not in str(e.value)


def prompts_left_padded() -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Prompts of 8 and 5 tokens, and the batch (2, 8) and mask that pad them on the left."""
    prompts = [
        torch.randint(0, V, (k,), generator=torch.Generator().manual_seed(k)) for k in (8, 5)
    ]
    idx = torch.zeros(2, 8, dtype=torch.long)
    mask = torch.zeros(2, 8, dtype=torch.long)
    for b, p in enumerate(prompts):
        idx[b, 8 - len(p) :], mask[b, 8 - len(p) :] = p, 1
    return prompts, idx, mask


@pytest.mark.parametrize("pe", list(POS_ENCODINGS))
def test_remote_code_generate_is_sample_py_on_our_kv_cache(pe, remote):
    """transformers' generate (greedy) gives sample.py's tokens, within its default window
    (block_size, 32) and past it (the relative encodings' rolling cache, the absolute ones' crop and
    restart), with the cache and without, each row of a left-padded batch as it would be alone; the
    cache it carries is a transformers Cache holding generate.py's KVCache."""
    _, model, hf = remote[pe]
    prompts, idx, mask = prompts_left_padded()
    n = 32  # to 40 and 37 tokens
    for use_cache in (True, False):
        out = hf.generate(
            idx,
            attention_mask=mask,
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            use_cache=use_cache,
            return_dict_in_generate=True,
        )
        for b, p in enumerate(prompts):
            ours = model.generate(p[None], n, temperature=0, use_cache=use_cache)
            assert torch.equal(out.sequences[b, 8:], ours[0, len(p) :]), (use_cache, b)
        if use_cache:
            cache = out.past_key_values
            folder_model = sys.modules[type(hf).__module__]
            # one per padding
            assert isinstance(cache, transformers.Cache) and len(cache.groups) == 2
            assert all(type(rows.kv) is folder_model.KVCache for rows in cache.groups)


@pytest.mark.parametrize(
    "pe, kw", [("alibi", {}), ("rope", {"rope_scaling": "dynamic_ntk", "rope_factor": 2.0})]
)
def test_remote_code_generate_takes_max_context(pe, kw, tmp_path):
    """max_context, given when loading, is sample.py's --max_context: a window longer than the
    training length (48 against 32), and dynamic NTK past its training length, where no cache is
    exact and each step runs the window."""
    ckpt, model = checkpoint(perturb=0.3, pos_encoding=pe, **kw)
    out = export.export(ckpt, tmp_path / "hf", remote_code=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        out, trust_remote_code=True, max_context=48
    )
    idx = torch.randint(0, V, (1, 8), generator=torch.Generator().manual_seed(4))
    theirs = hf.generate(idx, max_new_tokens=70, min_new_tokens=70, do_sample=False)
    assert torch.equal(theirs, model.generate(idx, 70, temperature=0, max_context=48))


def test_remote_code_pipeline_pads_and_samples(remote):
    """transformers' text-generation pipeline, a batch of two prompts (padded): greedy gives our
    text for each, past the training length, newlines kept; sampling (temperature, top_k) runs and
    keeps each prompt."""
    out, model, _ = remote["alibi"]
    pipe = transformers.pipeline(
        "text-generation", model=str(out), trust_remote_code=True, device="cpu"
    )
    prompts = ["ROMEO:\n", "To be, or not"]
    greedy = pipe(prompts, batch_size=2, max_new_tokens=40, do_sample=False)
    for prompt, [result] in zip(prompts, greedy, strict=True):
        ours = model.generate(torch.tensor([[CHARS.index(c) for c in prompt]]), 40, temperature=0)
        assert result["generated_text"] == "".join(CHARS[i] for i in ours[0])
    torch.manual_seed(0)
    sampled = pipe(
        prompts, batch_size=2, max_new_tokens=20, do_sample=True, temperature=0.8, top_k=10
    )
    for prompt, [result] in zip(prompts, sampled, strict=True):
        assert (
            result["generated_text"].startswith(prompt)
            and len(result["generated_text"]) == len(prompt) + 20
        )


def test_bundled_code_is_our_model_and_recorded(remote):
    """The folder's model.py, shape.py, fast_paths.py and generate.py are nanoPE's byte for byte,
    its modeling_nanope.py the repository's wrapper; config.json maps the Auto classes to them and
    records their sha256."""
    import hashlib

    out, _, hf = remote["bias_rpe"]
    assert (out / "model.py").read_bytes() == (ROOT / "model.py").read_bytes()
    assert (out / "shape.py").read_bytes() == (ROOT / "shape.py").read_bytes()
    assert (out / "fast_paths.py").read_bytes() == (ROOT / "fast_paths.py").read_bytes()
    assert (out / "generate.py").read_bytes() == (ROOT / "generate.py").read_bytes()
    assert (out / "modeling_nanope.py").read_bytes() == (
        ROOT / "export" / "modeling_nanope.py"
    ).read_bytes()
    config = json.loads((out / "config.json").read_text())
    assert config["code_sha256"] == {
        name: hashlib.sha256((out / name).read_bytes()).hexdigest()
        for name in ("model.py", "shape.py", "fast_paths.py", "generate.py", "modeling_nanope.py")
    }
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_nanope.NanoPEForCausalLM"
    assert (
        config["model_args"]["pos_encoding"] == "bias_rpe" and (out / "model.safetensors").exists()
    )


def test_other_code_in_the_folder_is_refused_at_load(remote, tmp_path):
    """A folder whose model code was edited, or whose config.json records other code (files mixed
    from another export), is refused at load with a one-line error that names the files and the
    fix."""
    import shutil

    src = remote["fire"][0]
    edited = tmp_path / "edited"
    mixed = tmp_path / "mixed"
    shutil.copytree(src, edited)
    (edited / "model.py").write_text((edited / "model.py").read_text() + "\n# changed\n")
    shutil.copytree(src, mixed)
    config = json.loads((mixed / "config.json").read_text())
    config["code_sha256"]["modeling_nanope.py"] = "0" * 64
    (mixed / "config.json").write_text(json.dumps(config))
    (edited / "fast_paths.py").write_text((edited / "fast_paths.py").read_text() + "\n# changed\n")
    for folder, name in [(edited, "fast_paths.py, model.py"), (mixed, "modeling_nanope.py")]:
        with pytest.raises(
            ValueError, match=rf"this folder's code \({name}\) is not the code it was exported with"
        ) as e:
            transformers.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
        assert "\n" not in str(e.value) and "export the run again" in str(e.value)


def test_bf16_remote_code_export_loads(tmp_path):
    """--dtype bfloat16 writes bf16 weights that load as a bf16 model, whose logits are ours to
    bf16's precision."""
    from safetensors import safe_open

    ckpt, model = checkpoint(pos_encoding="t5")
    out = export.export(ckpt, tmp_path / "hf", dtype="bfloat16")
    with safe_open(out / "model.safetensors", "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    assert hf.dtype == torch.bfloat16
    idx = torch.randint(0, V, (2, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        close(hf(idx).logits.float(), model.to(torch.bfloat16)(idx)[0].float(), tol=0.05)


LOAD_ALONE = """
import importlib.util, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast
nanope = [importlib.util.find_spec(name) for name in ("model", "export")]
assert nanope == [None, None], "nanoPE on the path"
assert sys.stdin.isatty() and sys.stdout.isatty(), "not in a terminal"
folder, native = sys.argv[1], sys.argv[4]
hf = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
ours = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
assert ours.eos_token_id == PreTrainedTokenizerFast.from_pretrained(folder).eos_token_id
AutoModelForCausalLM.from_pretrained(native)
theirs = AutoTokenizer.from_pretrained(native)
assert theirs.eos_token_id == PreTrainedTokenizerFast.from_pretrained(native).eos_token_id
print(sys.modules[type(hf).__module__].__file__)
with torch.no_grad():
    torch.save(hf(torch.load(sys.argv[2])).logits, sys.argv[3])
"""


def in_a_terminal(cmd: list[str], cwd: Path, env: dict[str, str]) -> tuple[int, str]:
    """cmd run with a pseudo-terminal as its stdin, stdout and stderr, stdin left open and
    unanswered, as in a user's terminal: its exit code and what it printed. Stops it at the first
    question it asks (a line ending "[y/N] ")."""
    import pty
    import select

    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=env, stdin=follower, stdout=follower, stderr=follower, close_fds=True
    )
    os.close(follower)
    out = b""
    try:
        while True:
            ready, _, _ = select.select([leader], [], [], 300)
            if not ready:
                break
            try:
                chunk = os.read(leader, 4096)
            except OSError:  # the follower's side closed: the process ended
                break
            if not chunk:
                break
            out += chunk
            if out.rstrip().endswith(b"[y/N]"):
                break
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        os.close(leader)
    return proc.returncode, out.decode(errors="replace")


def logits_alone(folder: Path, idx: torch.Tensor, tmp_path: Path) -> torch.Tensor:
    """The logits of idx that the export in folder computes in a process that cannot import nanoPE
    (cwd and sys.path outside the repository), loaded with trust_remote_code from transformers' own
    copy of its code, in a terminal: loading it and its tokenizer, and a GPT-NeoX export's model and
    tokenizer without the flag, asks nothing."""
    torch.save(idx, tmp_path / "idx.pt")
    native = export.export(checkpoint(pos_encoding="rope")[0], tmp_path / "hf-rope")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")} | {
        "HF_MODULES_CACHE": str(tmp_path / "modules")
    }
    cmd = [
        sys.executable,
        "-I",
        "-c",
        LOAD_ALONE,
        str(folder),
        str(tmp_path / "idx.pt"),
        str(tmp_path / "logits.pt"),
    ]
    code, out = in_a_terminal([*cmd, str(native)], tmp_path, env)
    assert "[y/N]" not in out and code == 0, out[-3000:]
    assert str(tmp_path / "modules") in out, out
    return torch.load(tmp_path / "logits.pt")


def test_remote_code_loads_without_nanope(remote, tmp_path):
    """A process that cannot import nanoPE loads the folder with trust_remote_code and computes our
    logits: the folder carries all the code it needs. In a terminal, nothing it loads asks a
    question."""
    out, model, _ = remote["bias_rpe"]
    idx = torch.randint(0, V, (2, 80), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        close(logits_alone(out, idx, tmp_path), model(idx)[0], tol=1e-5)


def test_an_export_from_before_the_fast_paths_moved_loads(tmp_path):
    """An export written before model.py's fast paths moved to fast_paths.py
    (tests/fixtures/before_redesign/ export_fire: its model.py holds them all) still loads alone,
    and computes today's logits for its weights."""
    folder = Path(__file__).parent / "fixtures" / "before_redesign" / "export_fire"
    assert not (folder / "fast_paths.py").exists()
    _, model = checkpoint(pos_encoding="fire")  # the weights the fixture was exported from
    idx = torch.randint(0, V, (2, 80), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        close(logits_alone(folder, idx, tmp_path), model(idx)[0], tol=1e-5)


# --------------------------------------------------------------------------------------------------
# lm-evaluation-harness: its three kinds of task on the exports, and docs/export.md's commands as
# written

# the harness's max_length (the training length here) and max_gen_toks
HARNESS_WINDOW, GEN_TOKENS = 32, 8


@pytest.fixture(scope="module")
def harness_docs(tmp_path_factory) -> Path:
    """Four documents of Shakespeare (characters outside CHARS included) as the harness's json: the
    text; the text split at the end of a line past its middle, the context and the next line (its
    first 24 characters); and that line's prompt, the line before it (short and of different
    lengths, so that the harness pads them)."""
    pytest.importorskip("lm_eval")
    from lib.datafiles import read_embedded_corpus

    text = read_embedded_corpus()[200_000:202_000]
    rows = []
    for start in range(0, 1_600, 400):
        cut = text.index("\n", start + 200) + 1
        prompt = text[text.rindex("\n", start, cut - 1) + 1 : cut]
        rows.append(
            {
                "text": text[start : start + 400],
                "context": text[start:cut],
                "prompt": prompt,
                # the harness scores at most max_length tokens of it
                "line": text[cut:].split("\n")[0][:24],
            }
        )
    path = tmp_path_factory.mktemp("harness") / "docs.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def harness(folder: Path, docs: Path, until: str = "\n", **model_args) -> dict[str, list[dict]]:
    """lm-eval's loglikelihood_rolling, loglikelihood and generate_until (until a newline) on the
    export in folder, run in this process as its command runs them (batches of 4, so padded): each
    task's samples."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    data = {"data_files": {"test": str(docs)}, "cache_dir": str(docs.parent / "datasets")}
    tasks = [
        {
            "task": "rolling",
            "output_type": "loglikelihood_rolling",
            "doc_to_text": "",
            "doc_to_target": "{{text}}",
        },
        {
            "task": "line",
            "output_type": "loglikelihood",
            "doc_to_text": "{{context}}",
            "doc_to_target": "{{line}}",
        },
        {
            "task": "generate",
            "output_type": "generate_until",
            "doc_to_text": "{{prompt}}",
            "doc_to_target": "{{line}}",
            "generation_kwargs": {"until": [until], "max_gen_toks": GEN_TOKENS, "do_sample": False},
        },
    ]
    tasks = [
        t
        | {
            "dataset_path": "json",
            "dataset_kwargs": data,
            "test_split": "test",
            "target_delimiter": "",
        }
        for t in tasks
    ]
    results = lm_eval.simple_evaluate(
        model="hf",
        model_args={"pretrained": str(folder), "max_length": HARNESS_WINDOW, **model_args},
        tasks=tasks,
        task_manager=TaskManager(include_defaults=False),
        batch_size=4,
        device="cpu",
        bootstrap_iters=0,
    )
    return results["samples"]


def our_loglikelihood(
    model: GPT, context: list[int], continuation: list[int], eot_as: int | None
) -> float:
    """Our model's log-likelihood of continuation after context in the harness's window: the last
    max_length + 1 tokens, the last of them left out of the input; its <|endoftext|> (past the
    vocabulary) read as eot_as."""
    tokens = (context + continuation)[-(HARNESS_WINDOW + 1) :]
    if eot_as is not None:
        tokens = [eot_as if t >= model.config.vocab_size else t for t in tokens]
    with torch.no_grad():
        logp = F.log_softmax(model(torch.tensor([tokens[:-1]]))[0][0].double(), dim=-1)
    n = len(continuation)
    return sum(logp[len(tokens) - 1 - n + k, t].item() for k, t in enumerate(continuation))


def check_harness(
    samples: dict[str, list[dict]], model: GPT, tok, eot_as: int | None, until: str = "\n"
) -> None:
    """The harness's samples against our model: the log-likelihoods of every rolling window and of
    each line, to 1e-4, and the generated text, exactly, up to `until`."""
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    for s in samples["rolling"]:
        ids = tok.encode(s["doc"]["text"])
        windows = get_rolling_token_windows(ids, tok.bos_token_id, HARNESS_WINDOW, 1)
        ours = sum(
            our_loglikelihood(model, c, x, eot_as) for c, x in map(make_disjoint_window, windows)
        )
        assert float(s["resps"][0][0]) == pytest.approx(ours, abs=1e-4)
    for s in samples["line"]:  # the harness moves the context's final newline to the continuation
        context = s["doc"]["context"]
        line = s["doc"]["line"]
        whole = tok.encode(context + line)
        head = tok.encode(context[:-1])
        assert float(s["resps"][0][0][0]) == pytest.approx(
            our_loglikelihood(model, head, whole[len(head) :], eot_as), abs=1e-4
        )
    for s in samples["generate"]:
        context = torch.tensor([tok.encode(s["doc"]["prompt"])[-(HARNESS_WINDOW - GEN_TOKENS) :]])
        ours = tok.decode(model.generate(context, GEN_TOKENS, temperature=0)[0, context.size(1) :])
        assert s["filtered_resps"][0] == ours.split(until)[0], (s["filtered_resps"], ours)


@pytest.mark.parametrize("pe", list(POS_ENCODINGS))
def test_harness_tasks_on_every_encoding(pe, remote, harness_docs):
    """lm-eval runs all three kinds of task on a character-level export of every encoding (one that
    carries its code) with trust_remote_code and max_length alone, batches padded, and its numbers
    and generated lines are our model's, <|endoftext|>, its start of text, read as a newline."""
    out, model, _ = remote[pe]
    tok = transformers.AutoTokenizer.from_pretrained(out, trust_remote_code=True)
    check_harness(
        harness(out, harness_docs, trust_remote_code=True), model, tok, eot_as=CHARS.index("\n")
    )


def test_harness_generations_keep_their_newlines(harness_docs, tmp_path):
    """A model that often writes a newline, generating until a string it never writes: the harness
    returns all it generated, newlines included (with the newline as the tokenizer's end of text, it
    would return none of them)."""
    ckpt, model = checkpoint(perturb=0.3, pos_encoding="kerple")
    with torch.no_grad():
        # the tied row: the checkpoint's, which holds the same tensor
        model.lm_head.weight[CHARS.index("\n")] *= 6
    out = export.export(ckpt, tmp_path / "hf", remote_code=True)
    tok = transformers.AutoTokenizer.from_pretrained(out, trust_remote_code=True)
    samples = harness(out, harness_docs, until="@", trust_remote_code=True)
    check_harness(samples, model, tok, eot_as=CHARS.index("\n"), until="@")
    assert sum("\n" in s["filtered_resps"][0] for s in samples["generate"]) >= 2


def test_harness_tasks_on_a_gpt2_bpe_export(harness_docs, tmp_path):
    """A GPT-2 BPE run's export (GPT-NeoX) needs max_length alone: GPT-2's <|endoftext|> starts
    texts and pads."""
    ckpt, model = checkpoint(perturb=0.3, pos_encoding="rope", vocab_size=50257)
    ckpt["tokenizer"] = {"kind": "gpt2"}
    out = export.export(ckpt, tmp_path / "hf")
    tok = transformers.AutoTokenizer.from_pretrained(out)
    check_harness(harness(out, harness_docs), model, tok, eot_as=None)


def doc_blocks() -> list[tuple[str, str]]:
    """docs/export.md's fenced blocks, (language, text), in the page's order."""
    return re.findall(
        r"^```(\w*)\n(.*?)^```", (ROOT / "docs" / "export.md").read_text(), re.S | re.M
    )


def test_the_export_page_runs_as_written(tmp_path):
    """docs/export.md's commands, Python and task files, run as written in a folder that holds two
    runs (tiny models of the Shakespeare characters, block 64) and the prepared validation split:
    the exports, loading one and generating, writing the documents, and lm_eval's three tasks, which
    score every document and write their results under results/<export>/. Only the commands' python
    and lm_eval are this environment's."""
    pytest.importorskip("lm_eval")
    import numpy as np

    from lib.datafiles import read_embedded_corpus
    from lib.tokenizer import CharTokenizer

    text = read_embedded_corpus()
    chars = CharTokenizer.from_text(text).chars
    data = tmp_path / "data" / "shakespeare_char"
    data.mkdir(parents=True)
    (data / "meta.json").write_text(
        json.dumps({"vocab_size": len(chars), "tokenizer": {"kind": "char", "chars": chars}})
    )
    stoi = {ch: i for i, ch in enumerate(chars)}
    np.array([stoi[ch] for ch in text[-60_000:]], dtype=np.uint16).tofile(data / "val.bin")
    for pe in ("rope", "bias_rpe"):
        ckpt, _ = checkpoint(pos_encoding=pe, vocab_size=len(chars), block_size=64)
        save_checkpoint(
            ckpt | {"tokenizer": {"kind": "char", "chars": chars}},
            tmp_path / f"out-{pe}" / "ckpt.pt",
        )
    bin_dir = Path(sys.executable).parent  # python and lm_eval
    env = os.environ | {
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "HF_HOME": str(tmp_path / "hf-home"),
    }
    env["PYTHONPATH"] = str(ROOT)
    blocks = doc_blocks()
    assert [lang for lang, _ in blocks] == ["", "python", "python", "yaml", "yaml", "yaml", ""]
    for lang, block in blocks:
        if lang == "yaml":  # a task file, named by its first line
            (tmp_path / block.splitlines()[0].removeprefix("# ")).write_text(block)
            continue
        if lang == "python":
            cmd = [sys.executable, "-c", block]
        else:  # python -m export: the repository's, on PYTHONPATH
            cmd = ["bash", "-c", block]
        r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
    [results] = (tmp_path / "results" / "hf-bias_rpe").glob("results_*.json")
    scores = json.loads(results.read_text())["results"]
    assert set(scores) == {"shakespeare_bpb", "shakespeare_line", "shakespeare_generate"}
    assert 0 < scores["shakespeare_bpb"]["bits_per_byte,none"] < 10
    for task in scores:
        [samples] = (tmp_path / "results" / "hf-bias_rpe").glob(f"samples_{task}_*.jsonl")
        assert len(samples.read_text().splitlines()) == 20  # the documents


def test_a_documents_model_exports_its_rule(tmp_path):
    """A model trained with packing=documents exports with its own code (no transformers
    architecture keeps documents apart), also where its encoding has one; loaded outside the
    project, a packed row (documents joined by its end-of-text token, which the tokenizer's
    <|endoftext|> also reads as) gives each document the logits it has alone; position_ids, as
    DataCollatorWithFlattening makes them, are refused in one line, naming the way that works."""
    eot = CHARS.index("\n")
    ckpt, model = checkpoint(pos_encoding="rope", packing="documents", eot_token=eot)
    out = export.export(ckpt, tmp_path / "hf")
    assert json.loads((out / "nanope.json").read_text())["architecture"] == "nanope"
    docs = [
        torch.tensor([5, 6, 7, 8, 9]),
        torch.tensor([eot, 10, 11]),
        torch.tensor([eot, 12, 13, 14]),
    ]
    row = torch.cat(docs)[None]
    got = logits_alone(out, row, tmp_path)
    t = 0
    with torch.no_grad():
        for doc in docs:
            close(got[0, t : t + len(doc)], model(doc[None])[0][0], tol=1e-5)
            t += len(doc)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    with torch.no_grad():
        # <|endoftext|> reads as the model's
        close(hf(row.masked_fill(row == eot, V)).logits, got, tol=1e-5)
    restarting = torch.cat([torch.arange(len(d)) for d in docs])[None]
    with pytest.raises(ValueError, match="join packed examples with it") as e:
        hf(row, position_ids=restarting)
    assert "\n" not in str(e.value)
    with pytest.raises(
        ValueError, match="join packed examples with it"
    ) as e:  # generate() refuses them too
        hf.generate(
            row, attention_mask=torch.ones_like(row), position_ids=restarting, max_new_tokens=3
        )
    assert "\n" not in str(e.value)
