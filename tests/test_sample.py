"""Tests for sample.py, lib/tokenizer.py, lib/configurator.py and lib/checkpoint.py."""

import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import run_cli, tiny

import sample
from generate import generate
from lib.checkpoint import (
    Checkpointer,
    CheckpointError,
    load_checkpoint,
    model_from_checkpoint,
    save_checkpoint,
)
from lib.configurator import ConfigError, configure
from lib.tokenizer import CharTokenizer, GPT2Tokenizer, tokenizer_from_meta
from model import GPT, GPTConfig

ROOT = Path(__file__).resolve().parents[1]
TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\n"


def make_checkpoint(
    out_dir: Path, pos_encoding: str = "rope", block_size: int = 32, noise: float = 0.0
) -> CharTokenizer:
    tok = CharTokenizer.from_text(TEXT)
    torch.manual_seed(0)
    config = GPTConfig(
        block_size=block_size,
        vocab_size=tok.vocab_size,
        n_layer=2,
        n_head=2,
        n_embd=16,
        pos_encoding=pos_encoding,
    )
    model = GPT(config)
    with torch.no_grad():  # noise: weights far from init, so that positions shape the output
        for p in model.parameters():
            p.add_(torch.randn_like(p) * noise)
    save_checkpoint(
        {
            "model": model.state_dict(),
            "model_args": asdict(config),
            "tokenizer": tok.meta,
            "iter_num": 0,
            "best_val_loss": 9.9,
            "config": {},
        },
        out_dir / "ckpt.pt",
    )
    return tok


def run_sample(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "sample.py"), "--device=cpu", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )


def sample_here(*args: str) -> subprocess.CompletedProcess:
    """sample.py's command in this process (see run_cli); run_sample starts the real one."""
    return run_cli(sample.cli, ["--device=cpu", *args])


def test_sample_generates_with_and_without_cache(tmp_path):
    """sample.py rebuilds model and char tokenizer from the checkpoint; greedy text is the same with
    and without the cache, and it reports tokens/s."""
    make_checkpoint(tmp_path)
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("Before we")
    common = (
        f"--out_dir={tmp_path}",
        f"--start=FILE:{prompt}",
        "--num_samples=1",
        "--max_new_tokens=40",
        "--temperature=0",
        "--max_context=48",
    )
    cached = run_sample(*common)
    uncached = sample_here(*common, "--no_cache")
    assert cached.returncode == 0, cached.stderr
    assert uncached.returncode == 0, uncached.stderr
    assert (
        cached.stdout.startswith("Before we")
        and len(cached.stdout.rstrip("\n")) == len("Before we") + 40
    )
    assert cached.stdout == uncached.stdout
    assert "tokens/s" in cached.stderr


def test_sample_with_rope_scaling(tmp_path):
    """--rope_scaling=yarn with max_context 3x the block: the same text as the model scaled by
    set_rope_scaling (factor 3 by default), cached or not; scaling a non-RoPE model is a clear
    error."""
    tok = make_checkpoint(tmp_path, noise=0.5)
    common = (
        f"--out_dir={tmp_path}",
        "--start=Before",
        "--num_samples=1",
        "--max_new_tokens=60",
        "--temperature=0",
    )
    cached = run_sample(*common, "--max_context=96", "--rope_scaling=yarn")
    uncached = sample_here(*common, "--max_context=96", "--rope_scaling=yarn", "--no_cache")
    assert cached.returncode == 0, cached.stderr
    assert cached.stdout == uncached.stdout
    model = model_from_checkpoint(load_checkpoint(tmp_path / "ckpt.pt")).eval()
    model.set_rope_scaling("yarn", 3.0)
    y = model.generate(torch.tensor([tok.encode("Before")]), 60, temperature=0, max_context=96)
    assert cached.stdout.rstrip("\n") == tok.decode(y[0].tolist())
    plain = sample_here(*common, "--max_context=96")
    assert plain.stdout != cached.stdout  # the scaling changes what the model says past its block
    make_checkpoint(tmp_path / "alibi", pos_encoding="alibi")
    r = sample_here(f"--out_dir={tmp_path / 'alibi'}", "--rope_scaling=yarn", "--max_new_tokens=2")
    assert r.returncode != 0 and "not of 'alibi'" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize(
    "pe, args, message",
    [
        (
            "cope",
            ["--rope_factor=2"],
            "rope_factor=2.0 is an option of pos_encoding='rope', not of 'cope': drop it",
        ),
        (
            "fox",
            ["--rope_scaling=yarn"],
            "rope_scaling='yarn' is an option of pos_encoding='rope', not of 'fox'",
        ),
        ("rope", ["--rope_factor=2"], "rope_factor=2.0 does nothing without a RoPE scaling"),
    ],
)
def test_an_option_that_does_nothing_is_refused_as_train_py_refuses_it(pe, args, message, tmp_path):
    """sample.py refuses an option the run's model does not read (RoPE's on a CoPE or FoX run, a
    factor without a scaling) in one line, in train.py's words, before sampling anything."""
    make_checkpoint(tmp_path, pos_encoding=pe)
    r = sample_here(f"--out_dir={tmp_path}", "--max_new_tokens=2", *args)
    assert r.returncode == 1 and message in r.stderr and not r.stdout, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_sample_errors_are_clear(tmp_path):
    """Missing or corrupt checkpoints, unknown characters, over-long prompts and misspelled keys
    give a message (the first as the command; the rest in this process, where any exception but the
    one-line exit fails the test)."""
    r = run_sample(f"--out_dir={tmp_path}")
    assert r.returncode != 0 and "no checkpoint at" in r.stderr and "train.py" in r.stderr

    make_checkpoint(tmp_path)
    r = sample_here(
        f"--out_dir={tmp_path}", "--start=Zebra €", "--num_samples=1", "--max_new_tokens=2"
    )
    assert (
        r.returncode != 0
        and "'Z'" in r.stderr
        and "'€'" in r.stderr
        and "Traceback" not in r.stderr
    )

    r = sample_here(f"--out_dir={tmp_path}", "--max_new_token=2")
    assert r.returncode != 0 and "did you mean 'max_new_tokens'" in r.stderr

    learned = tmp_path / "learned"
    make_checkpoint(learned, pos_encoding="learned", block_size=8)
    r = sample_here(
        f"--out_dir={learned}", "--start=Before we proceed", "--num_samples=1", "--max_new_tokens=2"
    )
    assert r.returncode != 0 and "at most 8" in r.stderr and "Traceback" not in r.stderr

    ckpt = tmp_path / "ckpt.pt"
    ckpt.write_bytes(ckpt.read_bytes()[:1000])
    r = sample_here(f"--out_dir={tmp_path}")
    assert (
        r.returncode != 0
        and "not a readable checkpoint" in r.stderr
        and "Traceback" not in r.stderr
    )


def test_char_tokenizer_round_trip_and_unknown_characters():
    """Char tokenizer ids follow sorted characters, round-trip, and unknown characters are named."""
    tok = CharTokenizer.from_text("hello")
    assert (
        tok.chars == "ehlo"
        and tok.encode("hell") == [1, 0, 2, 2]
        and tok.decode(tok.encode("hole")) == "hole"
    )
    with pytest.raises(ValueError, match="'x', 'z'"):
        tok.encode("xhz")
    assert tokenizer_from_meta(tok.meta).encode("ole") == tok.encode("ole")


def test_gpt2_tokenizer_matches_published_ids():
    """The vendored GPT-2 BPE gives GPT-2's ids ("Hello world" -> 15496, 995) and <|endoftext|> =
    50256."""
    tok = GPT2Tokenizer()
    assert tok.encode("Hello world") == [15496, 995]
    assert tok.enc.encode("<|endoftext|>", allowed_special="all") == [50256]
    text = "It's a test: ünïcödé, numbers 12345 and    spaces\n"
    assert tok.decode(tok.encode(text)) == text
    try:  # when tiktoken's own gpt2 encoding is reachable (cached or online), compare with it
        import tiktoken

        ref = tiktoken.get_encoding("gpt2")
    except Exception:
        return
    assert tok.encode(text) == ref.encode_ordinary(text)


def test_configure_files_overrides_and_errors(tmp_path):
    """Config files then --key=value apply in order; unknown keys name the closest; types are
    checked."""
    defaults = {"batch_size": 12, "dropout": 0.1, "compile": True, "device": "cpu", "top_k": None}
    cfg_file = tmp_path / "c.py"
    cfg_file.write_text("import math\nbatch_size = 4\ndropout = 0.2\n")
    cfg = configure(
        defaults, [str(cfg_file), "--dropout=0", "--compile=False", "--device=cuda:1", "--top_k=5"]
    )
    assert cfg == {
        "batch_size": 4,
        "dropout": 0.0,
        "compile": False,
        "device": "cuda:1",
        "top_k": 5,
    }
    assert isinstance(cfg["dropout"], float)
    assert configure(defaults, ["--compile"])["compile"] is True
    with pytest.raises(ConfigError, match="did you mean 'batch_size'"):
        configure(defaults, ["--batchsize=3"])
    bad = tmp_path / "bad.py"
    bad.write_text("drop_out = 0.0\n")
    with pytest.raises(ConfigError, match=r"drop_out.*bad\.py.*did you mean 'dropout'"):
        configure(defaults, [str(bad)])
    with pytest.raises(ConfigError, match="expected an integer"):
        configure(defaults, ["--batch_size=1.5"])
    with pytest.raises(ConfigError, match="True or False"):
        configure(defaults, ["--compile=1"])
    with pytest.raises(ConfigError, match="not found"):
        configure(defaults, ["missing.py"])


def test_checkpoint_save_is_atomic(tmp_path, monkeypatch):
    """A crash while writing leaves the previous checkpoint intact and no temporary file behind."""
    path = tmp_path / "ckpt.pt"
    save_checkpoint({"model": {"w": torch.ones(2)}, "model_args": {}}, path)

    def crash(obj, f):
        f.write(b"half a checkpoint")
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint({"model": {"w": torch.zeros(2)}, "model_args": {}}, path)
    assert torch.equal(load_checkpoint(path)["model"]["w"], torch.ones(2))
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]


def test_load_checkpoint_rejects_what_is_not_a_checkpoint(tmp_path):
    """load_checkpoint names missing, corrupt and foreign files, and strips nanoGPT's _orig_mod.
    prefix."""
    with pytest.raises(CheckpointError, match="no checkpoint"):
        load_checkpoint(tmp_path / "nope.pt")
    torch.save({"weights": 1}, tmp_path / "other.pt")
    with pytest.raises(CheckpointError, match="lacks model, model_args"):
        load_checkpoint(tmp_path / "other.pt")
    config = GPTConfig(block_size=8, vocab_size=16, n_layer=1, n_head=2, n_embd=8)
    model = GPT(config)
    state = {"_orig_mod." + k: v for k, v in model.state_dict().items()}
    torch.save({"model": state, "model_args": asdict(config)}, tmp_path / "nanogpt.pt")
    rebuilt = model_from_checkpoint(load_checkpoint(tmp_path / "nanogpt.pt"))
    assert all(
        torch.equal(a, b)
        for a, b in zip(rebuilt.state_dict().values(), model.state_dict().values(), strict=True)
    )


@pytest.mark.parametrize(
    "option, message",
    [
        ("--temperature=-1", "temperature=-1.0: must be a finite number >= 0"),
        ("--top_k=0", "top_k=0: must be an integer >= 1"),
        ("--top_k=2.5", "top_k=2.5 in the command line: expected an integer"),
        ("--top_p=0", r"top_p=0: must be in \(0, 1\]"),
        ("--top_p=1.5", r"top_p=1.5: must be in \(0, 1\]"),
        ("--num_samples=0", "num_samples=0: must be >= 1"),
        ("--max_new_tokens=-5", "max_new_tokens=-5: must be >= 1"),
        ("--max_context=0", "max_context=0: must be an integer >= 1"),
        ("--rope_factor=0.5", "rope_factor=0.5: must be a number >= 1"),
        ("--rope_factor=1e400", "rope_factor=inf: must be a number >= 1"),
        ("--temperature=1e-300", "temperature=1e-300: below 1e-6 it is greedy: use 0"),
        ("--rope_scaling=yarm", "rope_scaling='yarm': choose one of"),
        ("--dtype=float64", "dtype='float64': choose float32"),
        ("--device=foo", "device='foo' is not a device"),
        ("--seed=-1", "seed=-1: must be an integer from 0 to 2"),
        (
            "--seed=99999999999999999999",
            "seed=99999999999999999999: must be an integer from 0 to 2",
        ),
    ],
)
def test_sample_options_out_of_range_are_errors(option, message):
    """Sampling options out of range are errors naming the value and the rule, raised before any
    checkpoint is read (a negative temperature used to sample the least likely tokens, top_p=1.5 was
    ignored, top_k=0 crashed)."""
    with pytest.raises(ConfigError, match=message):
        sample.main(["--out_dir=/nonexistent", option])


def test_sample_bad_value_gives_one_line_error(tmp_path):
    """From the command line (cli, as the script runs it), a bad value is one 'error:' line and exit
    status 1, not a traceback."""
    make_checkpoint(tmp_path)
    r = sample_here(f"--out_dir={tmp_path}", "--top_p=0")
    assert (
        r.returncode == 1 and r.stderr.startswith("error: top_p=0") and "Traceback" not in r.stderr
    )


def test_sample_dynamic_ntk_factor_is_one(tmp_path, capsys):
    """--rope_scaling=dynamic_ntk at max_context 4x the block samples as the model with factor 1
    (whose NTK ratio grows as L / block_size by itself), not factor 4 (ratio 4·L/L0 - 3: scaled
    twice)."""
    tok = make_checkpoint(tmp_path, noise=0.5)
    args = [
        "--start=Before",
        "--num_samples=1",
        "--max_new_tokens=60",
        "--temperature=0",
        "--max_context=128",
    ]
    sample.main([f"--out_dir={tmp_path}", "--device=cpu", "--rope_scaling=dynamic_ntk", *args])
    out = capsys.readouterr().out.rstrip("\n")
    texts = {}
    for factor in (1.0, 4.0):
        model = model_from_checkpoint(load_checkpoint(tmp_path / "ckpt.pt")).eval()
        model.set_rope_scaling("dynamic_ntk", factor)
        y = model.generate(torch.tensor([tok.encode("Before")]), 60, temperature=0, max_context=128)
        texts[factor] = tok.decode(y[0].tolist())
    assert texts[1.0] != texts[4.0]  # the factor matters past the block of 32
    assert out == texts[1.0]


def test_corrupt_checkpoint_advice_keeps_the_run(tmp_path, capsys):
    """An unreadable ckpt.pt points to a readable ckpt_best.pt (and --ckpt=ckpt_best.pt samples it),
    else to a new out_dir; it never suggests training into the same out_dir, which would replace the
    run."""
    make_checkpoint(tmp_path)
    ckpt = tmp_path / "ckpt.pt"
    best = tmp_path / "ckpt_best.pt"
    best.write_bytes(ckpt.read_bytes())
    ckpt.write_bytes(ckpt.read_bytes()[:1000])
    with pytest.raises(SystemExit, match="(?s)not a readable checkpoint.*--ckpt=ckpt_best.pt") as e:
        sample.main([f"--out_dir={tmp_path}", "--device=cpu"])
    assert f"--out_dir={tmp_path} " not in str(e.value) + " "
    sample.main(
        [
            f"--out_dir={tmp_path}",
            "--device=cpu",
            "--ckpt=ckpt_best.pt",
            "--num_samples=1",
            "--max_new_tokens=3",
        ]
    )
    assert "tokens/s" in capsys.readouterr().err
    best.unlink()
    with pytest.raises(
        SystemExit, match=f"(?s)not a readable checkpoint.*new folder, e.g. --out_dir={tmp_path}-2"
    ) as e:
        sample.main([f"--out_dir={tmp_path}", "--device=cpu"])


def test_tokenizer_that_disagrees_with_the_vocab_is_an_error(tmp_path):
    """A checkpoint whose character list is shorter than its model's vocabulary (a meta.json at odds
    with itself) is a clear error, not a crash when the model samples an id the tokenizer lacks."""
    make_checkpoint(tmp_path)
    ckpt = load_checkpoint(tmp_path / "ckpt.pt")
    ckpt["tokenizer"] = {"kind": "char", "chars": ckpt["tokenizer"]["chars"][:-3]}
    save_checkpoint(ckpt, tmp_path / "ckpt.pt")
    with pytest.raises(
        SystemExit, match="tokenizer has 24 tokens but its model's vocabulary is 27"
    ):
        sample.main([f"--out_dir={tmp_path}", "--device=cpu", "--start=Be", "--max_new_tokens=50"])


def test_sample_help_and_unloadable_gpt2_name(capsys):
    """--help lists every option with its comment (it used to be 'unknown config key'); GPT-2
    weights that cannot be loaded (a misspelled name, offline) are one error line, not a
    traceback."""
    sample.main(["--help"])
    out = capsys.readouterr().out
    assert (
        all(f"{key}=" in out for key in sample.defaults)
        and "top_p=None,  # nucleus sampling" in out
    )
    with pytest.raises(
        SystemExit, match="cannot load GPT-2 weights from init_from='/nonexistent/gpt2'"
    ):
        sample.main(["--init_from=/nonexistent/gpt2", "--device=cpu"])


def test_binary_prompt_file_is_a_one_line_error(tmp_path):
    """A prompt file that is not UTF-8 text is one line naming it (it used to be a
    UnicodeDecodeError)."""
    make_checkpoint(tmp_path)
    binary = tmp_path / "binary.bin"
    binary.write_bytes(bytes(range(128, 256)))
    r = sample_here(f"--out_dir={tmp_path}", f"--start=FILE:{binary}", "--max_new_tokens=2")
    assert r.returncode == 1 and f"the prompt file {binary} is not UTF-8 text" in r.stderr
    assert "give a text file" in r.stderr and "Traceback" not in r.stderr and r.stdout == ""


def test_huge_context_is_what_the_tokens_need(tmp_path, monkeypatch):
    """A max_context far past the prompt and the new tokens samples what the whole sequence as
    context does (it used to allocate a cache of that many slots and fail); more tokens than the
    device's memory holds is one line, checked before any is generated."""
    make_checkpoint(tmp_path, noise=0.5)
    common = (
        f"--out_dir={tmp_path}",
        "--start=Before",
        "--num_samples=1",
        "--max_new_tokens=40",
        "--temperature=0",
    )
    huge = sample_here(*common, "--max_context=1000000000000")
    exact = sample_here(*common, "--max_context=46")
    assert (
        huge.returncode == 0
        and huge.stdout == exact.stdout
        and len(huge.stdout) == len("Before") + 41
    )
    monkeypatch.setattr(
        GPT, "generate", lambda *a, **k: pytest.fail("generated before the memory was checked")
    )
    r = sample_here(*common[:-2], "--max_new_tokens=1000000000000", "--max_context=1000000000000")
    assert (
        r.returncode == 1
        and "needs at least" in r.stderr
        and "use a smaller --max_context or --max_new_tokens" in r.stderr
    )
    assert "Traceback" not in r.stderr


def test_checkpoint_advice_is_what_train_py_accepts(tmp_path):
    """A ckpt.dcp whose folder of shards is gone is advised a restore or --overwrite=True, which
    train.py accepts for that folder (it refuses a plain fresh start there, which sample.py used to
    suggest); a misspelled --ckpt names the checkpoints the folder holds; a checkpoint file given as
    out_dir names its folder."""

    dangling = tmp_path / "dangling"
    dangling.mkdir()
    (dangling / "ckpt.dcp").symlink_to("shards/00000010-gone")
    r = sample_here(f"--out_dir={dangling}")
    assert (
        r.returncode == 1 and "Train a model first" not in r.stderr and "Traceback" not in r.stderr
    )
    assert f"python train.py config/rope.py --out_dir={dangling} --overwrite=True" in r.stderr
    checkpointer = Checkpointer(dangling, sharded=False)
    with pytest.raises(CheckpointError, match="already holds a run"):
        checkpointer.prepare("scratch", overwrite=False)
    checkpointer.prepare("scratch", overwrite=True)
    checkpointer.release()

    run = tmp_path / "run"
    make_checkpoint(run)
    r = sample_here(f"--out_dir={run}", "--ckpt=ckpt_bst.pt")
    assert (
        r.returncode == 1
        and f"{run} holds ckpt.pt: sample from one with --ckpt=ckpt.pt" in r.stderr
    )
    r = sample_here(f"--out_dir={run / 'ckpt.pt'}")
    assert (
        r.returncode == 1
        and f"is a file; give the folder that holds the checkpoint, e.g. --out_dir={run}"
        in r.stderr
    )


def test_synthetic_model_prompt_example_is_token_ids(tmp_path):
    """A model of a synthetic task reads token ids: the default prompt (a newline) is empty to it,
    and the error's example is ids, which then sample."""
    save_checkpoint(
        {
            "model": GPT(
                GPTConfig(block_size=16, vocab_size=128, n_layer=1, n_head=2, n_embd=16)
            ).state_dict(),
            "model_args": asdict(
                GPTConfig(block_size=16, vocab_size=128, n_layer=1, n_head=2, n_embd=16)
            ),
            "tokenizer": {"kind": "ids", "vocab_size": 128},
            "config": {"task": "passkey"},
        },
        tmp_path / "ckpt.pt",
    )
    r = sample_here(f"--out_dir={tmp_path}", "--max_new_tokens=3")
    assert r.returncode == 1 and "--start='0 17 5'" in r.stderr
    r = sample_here(
        f"--out_dir={tmp_path}", "--start=0 17 5", "--max_new_tokens=3", "--num_samples=1"
    )
    assert r.returncode == 0 and len(r.stdout.split()) == 6 and r.stdout.startswith("0 17 5 ")


@pytest.mark.parametrize(
    "args, words",
    [
        (dict(max_new_tokens=-3), "max_new_tokens=-3"),
        (dict(max_new_tokens=2.0), "max_new_tokens=2.0"),
        (dict(idx=torch.zeros(1, 0, dtype=torch.long)), "got a (1, 0)"),
        (dict(idx=torch.tensor([1, 2])), "got a (2,)"),
        (dict(idx=torch.zeros(1, 2, 2, dtype=torch.long)), "got a (1, 2, 2)"),
        (dict(idx=torch.tensor([[1.0, 2.0]])), "torch.float32"),
        (dict(idx=torch.tensor([[3, 64]])), "token id 64: the model's vocabulary is 0 … 63"),
        (dict(idx=torch.tensor([[-1, 3]])), "token id -1"),
        (dict(temperature=-1), "temperature=-1 must be a finite number >= 0"),
        (dict(temperature=float("nan")), "temperature=nan"),
        (dict(temperature=float("inf")), "temperature=inf must be a finite number"),
        (dict(temperature="0.8"), "temperature='0.8' must be a finite number"),
        (dict(idx=torch.tensor([[True, False]])), "integer token ids"),
        (dict(max_context=True), "max_context=True must be a positive integer"),
        (dict(max_context=np.int64(0)), "max_context=0 must be a positive integer"),
        (dict(top_k=0), "top_k=0 must be an integer >= 1"),
        (dict(top_p=0), "top_p=0 must be in (0, 1]"),
        (dict(top_p=1.5), "top_p=1.5 must be in (0, 1]"),
    ],
)
def test_generate_refuses_bad_arguments_by_name(args, words):
    """generate() from Python checks what sample.py checks (one rule for the sampling arguments) and
    its prompt: a bad value is one ValueError naming the argument, its value and what is allowed,
    never an IndexError or a silently wrong sample."""
    model = tiny("rope")
    kw = dict(idx=torch.tensor([[1, 2, 3]]), max_new_tokens=3) | args
    with pytest.raises(ValueError) as e:
        generate(model, kw.pop("idx"), kw.pop("max_new_tokens"), **kw)
    assert words in str(e.value), str(e.value)
    # 0: the prompt
    assert torch.equal(generate(model, torch.tensor([[1, 2, 3]]), 0), torch.tensor([[1, 2, 3]]))


def test_generate_takes_every_kind_of_number_and_integer_ids():
    """Numbers as users pass them (numpy integers, 0-d tensors) are taken at their value, ids of any
    integer width are ids, and a max_context longer than the prompt and the new tokens is capped
    there (as sample.py caps it: the same tokens, no cache of 10**10 slots)."""
    model = tiny("rope")
    idx = torch.tensor([[1, 2, 3, 4, 5, 6]])
    seeded = lambda: torch.Generator().manual_seed(0)  # noqa: E731
    expected = generate(model, idx, 4, temperature=0.8, top_k=5, max_context=16, generator=seeded())
    kinds = dict(
        temperature=torch.tensor(0.8),
        top_k=np.int64(5),
        max_context=np.int64(16),
        generator=seeded(),
    )
    assert torch.equal(generate(model, idx.to(torch.uint8), np.int64(4), **kinds), expected)
    greedy = generate(model, idx, 4, temperature=0)
    for ids in (idx.to(torch.int16), idx.to(torch.int32)):
        assert torch.equal(generate(model, ids, 4, temperature=0), greedy)
    assert torch.equal(generate(model, idx, 4, temperature=0, max_context=10**10), greedy)
