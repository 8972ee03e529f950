"""Tests for compare/tasks.py: the retrieval task generators, their evaluation (an oracle scores
100%, a model blind to the context scores chance), task rows in training batches, and the CLI."""

import json
import re

import numpy as np
import pytest
import torch
import torch.nn as nn
from conftest import run_cli, train_in_process
from test_eval_length import save_run, save_synthetic_run

import train as train_py
from compare import tasks
from lib import options, text_tasks
from lib.checkpoint import load_checkpoint
from lib.configurator import ConfigError, configure
from lib.datafiles import prepare_text, read_embedded_corpus
from lib.tokenizer import CharTokenizer, GPT2Tokenizer
from model import GPT, GPTConfig

SHAKESPEARE_CHARS = (
    "\n !\"&'()*,-./0123456789:;?@ABCDEFGHIJKLMNOPQRSTUVWXYZ[]_abcdefghijklmnopqrstuvwxyz{}"
)
CHAR = CharTokenizer(SHAKESPEARE_CHARS)
TOKENIZERS = {"char": lambda: CHAR, "gpt2": GPT2Tokenizer}


def make(
    task: str, tok=CHAR, length: int = 200, seed: int = 0, **kw
) -> tuple[np.ndarray, np.ndarray]:
    return text_tasks.TEXT_TASKS[task](tok, length, np.random.default_rng(seed), **kw)


def spans(answer: np.ndarray) -> list[tuple[int, int]]:
    edges = np.flatnonzero(np.diff(np.concatenate([[0], answer.astype(int), [0]])))
    return list(zip(edges[::2], edges[1::2], strict=True))


# --------------------------------------------------------------------------------------------------
# generators


@pytest.mark.parametrize("kind", TOKENIZERS)
@pytest.mark.parametrize("length", [100, 257])
def test_passkey_length_and_answer(kind, length):
    """A passkey sequence has length + 1 tokens and its answer is the key hidden in the filler."""
    tok = TOKENIZERS[kind]()
    x, a = make("passkey", tok, length)
    assert x.dtype == np.int64 and len(x) == len(a) == length + 1
    assert len(spans(a)) == 1 and a[-1]  # one span, at the end
    key = tok.decode(x[a].tolist())
    text = tok.decode(x.tolist())
    assert re.fullmatch(r"\d{5}", key)
    assert f"The pass key is {key}. Remember it." in text and text.endswith(
        f"The pass key is {key}"
    )


@pytest.mark.parametrize("kind", TOKENIZERS)
def test_recall_answers_are_the_values_of_the_queried_keys(kind):
    """Each recall answer span is the value its key was paired with at the start."""
    tok = TOKENIZERS[kind]()
    x, a = make("recall", tok, 150)
    assert len(x) == 151
    text = tok.decode(x.tolist())
    pairs = dict(re.findall(r"([a-z]{2}):(\d{2}) ", text[: text.index(". ")]))
    assert len(pairs) == 8
    found = spans(a)
    assert len(found) == 4
    for s, e in found:
        key = tok.decode(x[s - 3 : s - 1].tolist())  # "ab:" before the value
        assert pairs[key] == tok.decode(x[s:e].tolist())


@pytest.mark.parametrize("kind", TOKENIZERS)
@pytest.mark.parametrize("n_chars", [None, 10])
def test_copy_answer_repeats_the_string(kind, n_chars):
    """The copy task's answer is the string before the separator, and by default it fills the
    length."""
    tok = TOKENIZERS[kind]()
    x, a = make("copy", tok, 101, n_chars=n_chars)
    assert len(x) == 102
    copy = tok.decode(x[a].tolist())
    assert len(copy) == (n_chars or (102 - len(tok.encode(text_tasks.COPY_SEPARATOR))) // 2)
    assert tok.decode(x.tolist()).endswith(copy + text_tasks.COPY_SEPARATOR + copy)


def test_training_copies_vary_in_length():
    """Training's copies (vary=True) take many lengths up to the longest that fits, so the copy sits
    at many distances back and cannot be learned by position alone; each is still the string before
    the separator."""
    lengths = set()
    for seed in range(40):
        x, a = make("copy", CHAR, 101, seed=seed, vary=True)
        copy = CHAR.decode(x[a].tolist())
        assert len(x) == 102 and CHAR.decode(x.tolist()).endswith(
            copy + text_tasks.COPY_SEPARATOR + copy
        )
        lengths.add(len(copy))
    longest = (102 - len(text_tasks.COPY_SEPARATOR)) // 2
    assert len(lengths) >= 20 and max(lengths) <= longest and min(lengths) >= 1


@pytest.mark.parametrize("task", text_tasks.TEXT_TASKS)
def test_generators_are_reproducible_and_seeds_differ(task):
    """The same seed gives the same sequence; another seed another one."""
    x1, a1 = make(task, seed=3)
    x2, a2 = make(task, seed=3)
    x3, _ = make(task, seed=4)
    assert np.array_equal(x1, x2) and np.array_equal(a1, a2)
    assert not np.array_equal(x1, x3)


@pytest.mark.parametrize("depth", [0.0, 0.3, 0.5, 1.0])
def test_passkey_depth_places_the_key(depth):
    """The needle starts after depth × (filler tokens): 0 at the start, 1 right before the
    question."""
    x, a = make("passkey", CHAR, 300, depth=depth)
    text = CHAR.decode(x.tolist())
    start = text.index("The pass key is")
    n_fill = (
        len(text) - len("The pass key is 12345. Remember it. ") - len(text_tasks.PASS_QUESTION) - 5
    )
    assert start == round(depth * n_fill)


def test_tasks_explain_what_they_cannot_do():
    """A vocabulary without digits, or a length shorter than the phrases, is a TaskError that says
    so."""
    no_digits = CharTokenizer("".join(c for c in SHAKESPEARE_CHARS if not c.isdigit()))
    with pytest.raises(
        text_tasks.TaskError,
        match=r"passkey task writes characters .* lacks "
        r"\('0', '1', .*'9'\)",
    ):
        make("passkey", no_digits)
    for task in text_tasks.TEXT_TASKS:
        with pytest.raises(
            text_tasks.TaskError, match=f"the {task} task needs a length of at least"
        ):
            make(task, CHAR, 5)
    with pytest.raises(text_tasks.TaskError, match="depth"):
        make("passkey", depth=1.5)


# --------------------------------------------------------------------------------------------------
# evaluation


class Oracle(nn.Module):
    """Knows the sequences: puts all its mass on the true next token of whichever stored sequence
    the input begins."""

    def __init__(self, seqs: list[np.ndarray], vocab: int):
        super().__init__()
        self.seqs = torch.from_numpy(np.stack(seqs))
        self.vocab = vocab

    def forward(self, idx):
        B, T = idx.shape
        match = (idx[:, None, :] == self.seqs[None, :, :T]).all(-1).float().argmax(1)  # (B,)
        return nn.functional.one_hot(self.seqs[match, 1 : T + 1], self.vocab).float(), None


class Blind(nn.Module):
    """Ignores the context: a random digit at every position (it knows the answer is digits, not
    which)."""

    def __init__(self, vocab: int, digits: list[int], seed: int = 0):
        super().__init__()
        self.vocab = vocab
        self.digits = torch.tensor(digits)
        self.g = torch.Generator().manual_seed(seed)

    def forward(self, idx):
        pick = self.digits[torch.randint(len(self.digits), idx.shape, generator=self.g)]
        return nn.functional.one_hot(pick, self.vocab).float(), None


@pytest.mark.parametrize("task", text_tasks.TEXT_TASKS)
def test_oracle_scores_100_percent(task):
    """A model that always predicts the true next token answers every trial."""
    seqs = [x for x, _ in tasks.trials(CHAR, task, 120, 6, seed=5)]
    r = tasks.evaluate_task(
        Oracle(seqs, len(SHAKESPEARE_CHARS)), CHAR, task, 120, 6, seed=5, batch_size=4
    )
    assert r == {"accuracy": 1.0, "token_accuracy": 1.0}


def test_context_blind_model_scores_chance():
    """A model guessing digits without reading the context gets ~10% of the digits and almost no
    5-digit key."""
    blind = Blind(len(SHAKESPEARE_CHARS), CHAR.encode(text_tasks.DIGITS))
    r = tasks.evaluate_task(blind, CHAR, "passkey", 100, 200, batch_size=50)
    assert 0.06 < r["token_accuracy"] < 0.14  # 1000 digits: 10% ± 3 standard deviations
    assert r["accuracy"] <= 0.01
    # 400 two-digit values: 1% ± 0.5%
    r = tasks.evaluate_task(blind, CHAR, "recall", 100, 100, batch_size=50)
    assert r["accuracy"] < 0.04


def test_random_gpt_retrieves_nothing_and_learned_positions_stop_at_block_size():
    """An untrained GPT scores (near) zero; past a learned table's block size the grid says n/a."""
    torch.manual_seed(0)
    cfg = dict(vocab_size=len(SHAKESPEARE_CHARS), n_layer=1, n_head=2, n_embd=16, block_size=96)
    rope = GPT(GPTConfig(**cfg, pos_encoding="rope")).eval()
    learned = GPT(GPTConfig(**cfg, pos_encoding="learned"))
    assert tasks.evaluate_task(rope, CHAR, "passkey", 192, 20)["accuracy"] <= 0.05
    r = tasks.evaluate_checkpoint(
        learned.eval(), CHAR, [96, 192], [0.0, 1.0], 2, 0, list(text_tasks.TEXT_TASKS), 8, "cpu"
    )
    assert r["passkey_grid"][192] is None and r["recall"][192] is None and r["copy"][192] is None
    assert len(r["passkey_grid"][96]) == 2 and r["copy"][96] is not None


def test_answer_logits_equal_the_full_forward():
    """A GPT's logits at the answer positions alone equal the full forward's there."""
    torch.manual_seed(0)
    model = GPT(
        GPTConfig(vocab_size=len(SHAKESPEARE_CHARS), n_layer=1, n_head=2, n_embd=16, block_size=96)
    ).eval()
    x, a = make("recall", CHAR, 96)
    idx = torch.from_numpy(x[None, :-1])
    mask = torch.from_numpy(a[None, 1:])
    torch.testing.assert_close(tasks.answer_logits(model, idx, mask), model(idx)[0][mask])


def test_k_max_is_the_longest_length_at_20_percent():
    """k_max skips lengths below 20% and n/a cells, and is None when no length reaches it."""
    assert tasks.k_max({64: 1.0, 128: 0.2, 256: 0.1, 512: 0.25, 1024: None}) == 512
    assert tasks.k_max({64: 0.1, 128: None}) is None


# --------------------------------------------------------------------------------------------------
# training


def batch(B: int = 8, T: int = 100) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randint(
        0, len(SHAKESPEARE_CHARS), (B, T + 1), generator=torch.Generator().manual_seed(0)
    )
    return x[:, :-1], x[:, 1:]


def test_mix_tasks_replaces_the_fraction_reproducibly():
    """task_fraction 0.25 of 8 rows makes 2 task rows, targets only at answers; the same seed the
    same batch; fraction 0 leaves the batch as it was."""
    x, y = batch()
    mx, my = text_tasks.mix_tasks(x, y, 0.25, CHAR, (1, 7, 0, 0))
    rows = (my == -1).any(1)
    assert rows.sum() == 2 and torch.equal(mx[~rows], x[~rows]) and torch.equal(my[~rows], y[~rows])
    for r in rows.nonzero().flatten():
        m = my[r] != -1
        # y is x shifted, at the answers
        assert m[-1] and torch.equal(my[r, :-1][m[:-1]], mx[r, 1:][m[:-1]])
        # digits (passkey, recall) or a copy
        assert re.fullmatch(r"\d+|[a-z]+", CHAR.decode(my[r][m].tolist()))
    mx2, my2 = text_tasks.mix_tasks(x, y, 0.25, CHAR, (1, 7, 0, 0))
    assert torch.equal(mx, mx2) and torch.equal(my, my2)
    assert not torch.equal(text_tasks.mix_tasks(x, y, 0.25, CHAR, (1, 8, 0, 0))[0], mx)
    x0, y0 = text_tasks.mix_tasks(x, y, 0.0, CHAR, (1, 7, 0, 0))
    assert x0 is x and y0 is y


def test_mix_tasks_fraction_is_right_on_average():
    """A fraction that is not a multiple of 1/B is met in expectation (stochastic rounding)."""
    x, y = batch(B=4, T=100)
    n = [
        (text_tasks.mix_tasks(x, y, 0.1, CHAR, (0, i))[1] == -1).any(1).sum().item()
        for i in range(200)
    ]
    assert 0.25 < np.mean(n) < 0.55  # 0.4 rows per batch; std of the mean ~0.035


TINY = [
    "--device=cpu",
    "--compile=False",
    "--dtype=float32",
    "--n_layer=1",
    "--n_head=2",
    "--n_embd=16",
    "--block_size=96",
    "--batch_size=4",
    "--eval_iters=1",
    "--eval_interval=2",
    "--log_interval=1",
    "--warmup_iters=1",
    "--lr_decay_iters=6",
]


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    """A character-level dataset from the first 50k characters of the embedded corpus, and the
    digits (which that part lacks)."""
    d = tmp_path_factory.mktemp("data") / "tiny"
    prepare_text(read_embedded_corpus()[:50_000] + text_tasks.DIGITS, d, "char")
    return d


def train_here(*args: str) -> None:
    train_in_process([*TINY, *args])


def test_training_with_tasks_resumes_exactly(tiny_data, tmp_path):
    """With task_fraction=0.25, 4 iterations in one go equal 2 then 2 resumed (task rows are seeded
    by iteration), and differ from text-only training."""
    args = [f"--dataset={tiny_data}", "--task_fraction=0.25", "--task_seed=3"]
    train_here(*args, f"--out_dir={tmp_path / 'a'}", "--max_iters=4")
    train_here(*args, f"--out_dir={tmp_path / 'b'}", "--max_iters=2")
    train_here(*args, f"--out_dir={tmp_path / 'b'}", "--max_iters=4", "--init_from=resume")
    train_here(f"--dataset={tiny_data}", f"--out_dir={tmp_path / 'c'}", "--max_iters=4")
    a, b, c = (load_checkpoint(tmp_path / run / "ckpt.pt") for run in "abc")
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    assert not torch.equal(a["model"]["lm_head.weight"], c["model"]["lm_head.weight"])
    assert a["config"]["task_fraction"] == 0.25 and a["config"]["task_seed"] == 3


def test_task_options_are_checked(tiny_data, tmp_path):
    """task_fraction outside [0, 1) and a block too short for the tasks are one-line errors before
    training."""
    for bad in ("1.0", "-0.1"):
        with pytest.raises(ConfigError, match=r"task_fraction=.* must be in \[0, 1\)"):
            cfg = configure(train_py.defaults, ["--device=cpu", f"--task_fraction={bad}"])
            options.resolve(cfg, train_py.defaults)
    with pytest.raises(
        ConfigError, match="task_fraction=0.1: the passkey task needs a length of at least"
    ):
        train_here(
            f"--dataset={tiny_data}",
            f"--out_dir={tmp_path}",
            "--task_fraction=0.1",
            "--block_size=32",
        )


def test_cli_writes_table_json_and_heatmap(tiny_data, tmp_path, capsys):
    """compare/tasks.py reads checkpoints and writes a markdown table, the JSON and the heatmap;
    learned is n/a past its block size."""
    for pe in ("rope", "learned"):
        train_here(
            f"--dataset={tiny_data}",
            f"--out_dir={tmp_path / pe}",
            "--max_iters=1",
            f"--pos_encoding={pe}",
        )
    capsys.readouterr()
    out = tmp_path / "tasks.json"
    argv = [
        "--out_dir",
        str(tmp_path / "rope"),
        str(tmp_path / "learned"),
        "--lengths",
        "96",
        "192",
    ]
    tasks.main(
        [
            *argv,
            "--trials=2",
            "--depths=3",
            f"--out_json={out}",
            f"--plot={tmp_path / 'passkey.png'}",
        ]
    )
    table = capsys.readouterr().out
    assert "| checkpoint | passkey 96 | passkey 192 |" in table and "k_max" in table
    assert re.search(r"\| learned \| \d+% \| n/a \|", table)
    report = json.loads(out.read_text())
    assert (
        report["depths"] == [0.0, 0.5, 1.0]
        and len(report["checkpoints"]["rope"]["passkey_grid"]["192"]) == 3
    )
    assert (tmp_path / "passkey.png").stat().st_size > 1000


@pytest.fixture(scope="module")
def task_runs(tiny_data, tmp_path_factory) -> dict:
    """Random checkpoints (block 16) that read tiny_data's characters, two of them in folders of one
    name; one whose vocabulary lacks digits; a synthetic-task run."""
    root = tmp_path_factory.mktemp("runs")
    meta = json.loads((tiny_data / "meta.json").read_text())
    for d in ("a/out", "b/out"):
        save_run(root / d, meta["tokenizer"], meta["vocab_size"], {"dataset": str(tiny_data)})
    no_digits = CharTokenizer("".join(c for c in SHAKESPEARE_CHARS if not c.isdigit()))
    save_run(root / "no_digits", no_digits.meta, no_digits.vocab_size, {"dataset": "elsewhere"})
    save_synthetic_run(root / "passkey")
    return {name: root / name for name in ("a/out", "b/out", "no_digits", "passkey")}


def tasks_here(*args: str):
    return run_cli(
        tasks.main, ["--device=cpu", "--lengths", "96", "--trials=1", "--depths=2", *args]
    )


@pytest.mark.parametrize(
    "args, code, message",
    [
        (["--seed=-1"], 2, "--seed=-1: must be >= 0"),
        (["--device=foo"], 2, "device='foo' is not a device"),
        (["--device=cuda:7"], 2, "device='cuda:7' but"),
        (["--depths=200"], 2, "--depths=200: more depths than the shortest length has tokens (96)"),
        (["--plot=OUT"], 2, "--plot='OUT' is a folder"),
        (["--plot=p.xyz"], 2, "--plot='p.xyz': the file name must end in .png"),
        (["--out_json=OUT"], 2, "--out_json='OUT' is a folder"),
        (["--out_json=OUT/missing/t.json"], 2, "does not exist; create it, or write elsewhere"),
        (
            ["--out_dir", "passkey"],
            1,
            "synthetic task 'passkey', not on text; score it with python -m compare.synthetic",
        ),
        (
            ["--out_dir", "a/out", "no_digits"],
            1,
            "no_digits: the passkey task writes characters that this",
        ),
        (["--out_dir", "a/out", "a/out"], 2, "--out_dir: a folder is given twice"),
        (["--lengths", "8"], 1, "the passkey task needs a length of at least"),
        (["--lengths", "96", "10000000000"], 1, "evaluating 10000000000 tokens needs at least"),
    ],
)
def test_mistakes_stop_before_any_evaluation(task_runs, tmp_path, monkeypatch, args, code, message):
    """Each mistake is one line (status 2 for an option, 1 for a checkpoint) naming it and the fix,
    before any checkpoint is evaluated and with nothing written: bad seeds, devices and output paths
    used to be tracebacks, a bad --out_json failed after the whole evaluation, and a synthetic-task
    run was sent to another dataset."""
    monkeypatch.setattr(
        tasks, "evaluate_checkpoint", lambda *a: pytest.fail("evaluated before every check")
    )
    monkeypatch.chdir(tmp_path)  # the default outputs would land here
    (tmp_path / "OUT").mkdir()
    args = [
        str(task_runs[a]) if a in task_runs else a.replace("OUT", str(tmp_path / "OUT"))
        for a in args
    ]
    args = args if "--out_dir" in args else ["--out_dir", str(task_runs["a/out"]), *args]
    r = tasks_here(*args)
    # argparse's usage, then its error line; else the error line alone
    lines = r.stderr.strip().splitlines()
    assert r.returncode == code and message.replace("OUT", str(tmp_path / "OUT")) in lines[-1], (
        r.stderr
    )
    assert "Traceback" not in r.stderr and (code == 2 or len(lines) == 1)
    assert [p.name for p in tmp_path.iterdir()] == ["OUT"] and not any((tmp_path / "OUT").iterdir())


def test_folders_of_one_name_keep_their_rows(task_runs, tmp_path):
    """Two runs in folders of one name (a/out, b/out) keep a row each, labelled by their paths (the
    second used to replace the first); a task or a length given twice is one column; the JSON and
    the heatmap are written whole, with no temporary files."""
    out = tmp_path / "t.json"
    plot = tmp_path / "t.svg"
    runs = ["--out_dir", str(task_runs["a/out"]), str(task_runs["b/out"])]
    r = tasks_here(
        *runs,
        "--tasks",
        "passkey",
        "copy",
        "copy",
        "--lengths",
        "96",
        "96",
        f"--out_json={out}",
        f"--plot={plot}",
    )
    assert r.returncode == 0, r.stderr
    # a task or length given twice: one column
    assert "| checkpoint | passkey 96 | copy 96 | k_max |" in r.stdout
    assert list(json.loads(out.read_text())["checkpoints"]) == [
        str(task_runs["a/out"]),
        str(task_runs["b/out"]),
    ]
    assert plot.read_text().startswith("<?xml") and sorted(p.name for p in tmp_path.iterdir()) == [
        "t.json",
        "t.svg",
    ]
