"""The synthetic token-level tasks: each generator's layout, reproducibility and errors; an oracle
that reads the answer from the sequence scores 100% and a context-blind predictor scores chance; the
answer-only loss; a tiny run learns the one-step task; train.py's and compare/sweep.py's synthetic
track end to end."""

import json
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import run_cli, train_in_process
from test_train import ENV, ROOT

import train
from compare import sweep
from compare import synthetic as S
from compare.sweep_report import Cell
from lib import options, synthetic_tasks
from lib.batches import Batches
from lib.checkpoint import load_checkpoint
from lib.configurator import ConfigError, configure
from lib.datafiles import load_data
from lib.parallel import Processes
from lib.synthetic_tasks import MARK, QUERY, SEP
from lib.tokenizer import IdsTokenizer, tokenizer_from_meta
from model import GPT, GPTConfig

V = 128
VOCAB = synthetic_tasks.Vocab(V)
TASKS = list(synthetic_tasks.SYNTHETIC_TASKS)


def in_range(x: np.ndarray, span: tuple[int, int]) -> bool:
    return bool(((x >= span[0]) & (x < span[1])).all())


# --------------------------------------------------------------------------------------------------
# generators


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("train_rows", [False, True])
def test_generator_lengths_and_reproducibility(task, train_rows):
    """Every sequence is L inputs and L targets with at least one answer, inside the vocabulary,
    from the shortest length the task allows up; the same seed gives the same sequences and another
    seed others."""
    shortest = synthetic_tasks.fixed_tokens(task) - 1
    for L in (shortest, shortest + 1, 64, 200):
        a = [
            synthetic_tasks.sequence(task, V, L, np.random.default_rng(7), train_rows)
            for _ in range(2)
        ]
        b = synthetic_tasks.sequence(task, V, L, np.random.default_rng(8), train_rows)
        x, y = a[0]
        assert x.shape == y.shape == (L,) and x.dtype == y.dtype == np.int64
        assert (
            (y >= 0).any()
            and in_range(x, (0, V))
            and in_range(y[y >= 0], (0, V))
            and (y[y < 0] == -1).all()
        )
        assert np.array_equal(a[0][0], a[1][0]) and np.array_equal(a[0][1], a[1][1])
        if L >= 64:
            assert not np.array_equal(x, b[0])


@pytest.mark.parametrize("task", ["needle", "passkey"])
def test_lookup_layout(task):
    """needle and passkey: one MARK, the key after it, QUERY last, and the one answer after it is
    the key; needle's filler is the filler range (the key is the only key token), passkey's the key
    range."""
    rng = np.random.default_rng(0)
    depths = []
    for _ in range(300):
        x, y = synthetic_tasks.sequence(task, V, 64, rng)
        (at,) = np.flatnonzero(x == MARK)
        assert x[-1] == QUERY and y[-1] == x[at + 1] and np.flatnonzero(y >= 0).tolist() == [63]
        assert in_range(x[at + 1 : at + 2], VOCAB.keys)
        rest = np.delete(x[:-1], [at, at + 1])
        assert in_range(rest, VOCAB.filler if task == "needle" else VOCAB.keys)
        depths.append(at)
    assert min(depths) <= 3 and max(depths) >= 58  # the key is hidden at every depth


@pytest.mark.parametrize("layout", synthetic_tasks.MQAR_LAYOUTS)
def test_mqar_layout(layout):
    """mqar: task_pairs pairs, keys distinct and values distinct, each key and value once before the
    queries; each query is a key of them, whose target is its value; scattered puts the queries
    together at the end, zoology the pairs together at the start; the filler is from the filler
    range."""
    rng = np.random.default_rng(0)
    for L, pairs, queries in ((64, 8, 4), (20, 8, 4), (300, 6, 6), (40, 3, 1)):
        x, y = synthetic_tasks.sequence(
            "mqar", V, L, rng, pairs=pairs, queries=queries, layout=layout
        )
        at = np.flatnonzero(y >= 0)
        assert len(at) == queries and len(set(x[at].tolist())) == queries
        if layout == "scattered":
            assert at.tolist() == list(range(L - queries, L))
        else:
            assert in_range(x[0 : 2 * pairs : 2], VOCAB.keys) and in_range(
                x[1 : 2 * pairs : 2], VOCAB.values
            )
            assert at.min() >= 2 * pairs
        context = x[: at.min()]
        keys = context[(context >= VOCAB.keys[0]) & (context < VOCAB.keys[1])]
        values = context[(context >= VOCAB.values[0]) & (context < VOCAB.values[1])]
        assert (
            len(keys) == len(set(keys.tolist())) == pairs
            and len(values) == len(set(values.tolist())) == pairs
        )
        for t in at:
            (where,) = np.flatnonzero(context == x[t])
            assert context[where + 1] == y[t]
        others = np.ones(L, dtype=bool)
        others[at] = False
        others[: at.min()] &= ~(np.isin(context, keys) | np.isin(context, values))
        assert in_range(x[others], VOCAB.filler)


@pytest.mark.parametrize("layout", synthetic_tasks.MQAR_LAYOUTS)
def test_mqar_answers_never_enter_the_input(layout):
    """No mqar answer is in the input after its pair: a value occurs once, right after its key, so a
    model cannot rule out values already answered (before, a query's value followed it, and the last
    query was 100% by exclusion); training rows too."""
    rng = np.random.default_rng(1)
    for train_rows in (False, True):
        for _ in range(300):
            x, y = synthetic_tasks.sequence(
                "mqar", V, 64, rng, train_rows, pairs=8, queries=8, layout=layout
            )
            for t in np.flatnonzero(y >= 0):
                (where,) = np.flatnonzero(x == y[t])
                assert where < t and x[where - 1] == x[t]


def test_copy_layout():
    """copy: the answers are the string again after SEP; evaluation strings fill half the sequence,
    training strings take every length from 1 up."""
    rng = np.random.default_rng(0)
    for L in (2, 3, 64, 65):
        x, y = synthetic_tasks.sequence("copy", V, L, rng)
        tokens = np.append(x, y[-1])
        n = L // 2
        assert (y >= 0).sum() == n and tokens[L - n] == SEP
        assert np.array_equal(tokens[L + 1 - n :], tokens[L - 2 * n : L - n])
        assert np.array_equal(y[y >= 0], tokens[L + 1 - n :])
    lengths = {
        int((synthetic_tasks.sequence("copy", V, 64, rng, train=True)[1] >= 0).sum())
        for _ in range(500)
    }
    assert lengths == set(range(1, 33))


def test_offset_layout():
    """offset: QUERY and a number k in 1..4 last, and the answer is the token k places after the one
    MARK; the filler is from the key range, so only the position tells it."""
    rng = np.random.default_rng(0)
    ks = set()
    for _ in range(300):
        x, y = synthetic_tasks.sequence("offset", V, 64, rng)
        (at,) = np.flatnonzero(x == MARK)
        k = x[-1] - VOCAB.values[0] + 1
        ks.add(int(k))
        assert (
            x[-2] == QUERY
            and y[-1] == x[at + k]
            and at + k < 62
            and np.flatnonzero(y >= 0).tolist() == [63]
        )
        assert in_range(np.delete(x[:-2], at), VOCAB.keys)
    assert ks == set(range(1, synthetic_tasks.OFFSETS + 1))


@pytest.mark.parametrize("task", TASKS)
def test_too_short_and_too_small_vocabulary_are_errors(task):
    """A length below the task's fixed parts, and a vocabulary whose ranges are too small, are
    one-line errors that name the fix."""
    shortest = synthetic_tasks.fixed_tokens(task) - 1
    synthetic_tasks.check(task, shortest, V)
    with pytest.raises(
        synthetic_tasks.SyntheticError, match=f"at least {shortest} tokens.*raise block_size"
    ):
        synthetic_tasks.check(task, shortest - 1, V)
    least = 8 if task == "mqar" else 2
    synthetic_tasks.check(task, 64, synthetic_tasks.N_SPECIAL + 3 * least)
    with pytest.raises(
        synthetic_tasks.SyntheticError,
        match=rf"task_vocab={synthetic_tasks.N_SPECIAL + 3 * least - 1} is too small.*>= ",
    ):
        synthetic_tasks.check(task, 64, synthetic_tasks.N_SPECIAL + 3 * least - 1)
    # fewer tokens than the special ones: ranges of none, not of a negative count
    with pytest.raises(synthetic_tasks.SyntheticError, match=r"filler\) of 0 tokens each"):
        synthetic_tasks.check(task, 64, 2)


def test_unknown_task_and_bad_queries_are_errors():
    with pytest.raises(
        synthetic_tasks.SyntheticError,
        match="'neddle' is not a synthetic task; choose one of needle, passkey",
    ):
        synthetic_tasks.check("neddle", 64, V)
    with pytest.raises(
        synthetic_tasks.SyntheticError, match="task_queries=9 must be between 1 and task_pairs=8"
    ):
        synthetic_tasks.check("mqar", 64, V, pairs=8, queries=9)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--task=neddle"], "not a synthetic task"),
        (["--task=mqar", "--block_size=16"], "at least 20 tokens"),
        (["--task=needle", "--task_vocab=8"], "task_vocab=8 is too small"),
        (["--task=needle", "--dataset=shakespeare_char"], "dataset='shakespeare_char' is for text"),
        (["--task=needle", "--task_fraction=0.1"], "task_fraction=0.1 is for text"),
        (["--task=needle", "--task_mix=1.0"], "task_mix=1.0 must be in"),
        (
            ["--task=needle", "--task_pairs=-3"],
            "task_pairs=-3 is read by task=mqar and this is task='needle'",
        ),
        (["--task=mqar", "--task_pairs=0", "--task_queries=0"], "task_pairs=0 must be at least 1"),
        (["--task_mix=0.5"], "task_mix=0.5 is read by a synthetic task .* and this is a text run"),
        (["--task_vocab=7"], "task_vocab=7 is read by a synthetic task"),
    ],
)
def test_train_rejects_bad_synthetic_options(args, message):
    """train.py checks the synthetic options before any work: one ConfigError naming the problem."""
    with pytest.raises(ConfigError, match=message):
        options.resolve(configure(train.defaults, ["--device=cpu", *args]), train.defaults)


def test_train_cli_error_is_one_line(tmp_path):
    """From the command line: 'error: …' on one line and exit 1, before any training output."""
    cmd = [
        sys.executable,
        "train.py",
        "config/rope.py",
        "config/passkey.py",
        "--dataset=openwebtext",
    ]
    r = subprocess.run(
        cmd + [f"--out_dir={tmp_path}"], cwd=ROOT, capture_output=True, text=True, env=ENV
    )
    assert r.returncode == 1 and r.stdout == ""
    assert (
        r.stderr.startswith("error: task='passkey' trains on synthetic sequences alone")
        and r.stderr.count("\n") == 1
    )


# --------------------------------------------------------------------------------------------------
# scoring: an oracle, a context-blind predictor, the loss


def oracle_answers(x: np.ndarray) -> np.ndarray:
    """The next token after every input position of x (T,), read from the inputs by each task's
    rule, independently of the generators: the token after MARK (needle, passkey), k after it
    (offset), after the earlier copy of the current key (mqar), n + 1 back after SEP (copy)."""
    T = len(x)
    marks = np.flatnonzero(x == MARK)
    seps = np.flatnonzero(x == SEP)
    if len(seps):  # copy: the string is x[s - n : s] and its copy ends at the last target
        return x[np.arange(T) - (T - seps[-1])]
    out = np.zeros(T, dtype=np.int64)  # first: where each token first appears
    first = {}
    for t in range(T):
        if x[t] == QUERY:
            out[t] = x[marks[0] + 1]
        elif T >= 2 and x[T - 2] == QUERY and t == T - 1:  # offset: QUERY, k
            out[t] = x[marks[0] + x[t] - VOCAB.values[0] + 1]
        elif x[t] in first:  # mqar: the pair of the queried key
            out[t] = x[first[x[t]] + 1]
        first.setdefault(x[t], t)
    return out


def oracle(x: torch.Tensor) -> torch.Tensor:
    """Logits (B, T, V), one-hot at each position's answer by oracle_answers."""
    answers = torch.from_numpy(np.stack([oracle_answers(row) for row in x.numpy()]))
    return torch.nn.functional.one_hot(answers, V).float()


@pytest.mark.parametrize("task", TASKS)
def test_oracle_scores_100_percent(task):
    """A reader that follows each task's rule scores 100% at the training length and 8x it: every
    answer is in the sequence, where the task says it is."""
    for L in (64, 512):
        assert S.accuracy(oracle, task, V, L, 60) == 1.0


@pytest.mark.parametrize("task", TASKS)
def test_context_blind_predictor_scores_chance(task):
    """A bigram predictor fit on 3000 training sequences (the likeliest next token given the current
    one) cannot see the context: it scores chance, one over the answer range's size (binomial
    bounds, 5 sigma)."""
    rng = np.random.default_rng(0)
    counts = torch.zeros(V, V)
    x, y = synthetic_tasks.batch(task, V, 3000, 64, rng)
    mask = y >= 0
    counts.index_put_((x[mask], y[mask]), torch.ones(int(mask.sum())), accumulate=True)
    bigram = lambda x: counts[x]  # noqa: E731
    n = 800
    trials = n * {"mqar": 4, "copy": 32}.get(task, 1)
    acc = S.accuracy(bigram, task, V, 64, n)
    p = 1 / VOCAB.n
    assert abs(acc - p) < 5 * (p * (1 - p) / trials) ** 0.5 + 1e-9, acc


def reference_floor(task: str, L: int, n: int, **kw) -> float:
    """Each task's no-retrieval baseline, written here from the task's description (not
    synthetic.shortcut), on the evaluation's sequences: the expected accuracy of guessing uniformly
    among the baseline's candidates."""
    rng = S.eval_rng(0, task, L)
    hits = []
    for _ in range(n):
        # batch() draws whether each row is a curriculum row, also at evaluation (mix 0)
        rng.uniform()
        x, y = synthetic_tasks.sequence(task, V, L, rng, **kw)
        for t in np.flatnonzero(y >= 0):
            before = x[: t + 1].tolist()
            if task == "passkey":  # the most frequent key so far
                keys = [tok for tok in before if VOCAB.keys[0] <= tok < VOCAB.keys[1]]
                top = max(keys.count(k) for k in set(keys))
                guesses = {k for k in set(keys) if keys.count(k) == top}
            elif task == "mqar":  # a value present in the context
                guesses = {tok for tok in before if VOCAB.values[0] <= tok < VOCAB.values[1]}
            elif task == "offset":  # the token right after the marker
                guesses = {before[before.index(MARK) + 1]}
            elif task == "copy":  # a token that followed the current one earlier
                guesses = {before[i + 1] for i in range(t) if before[i] == before[t]} or set(
                    range(*VOCAB.keys)
                )
            else:  # needle: chance among the keys
                guesses = set(range(*VOCAB.keys))
            hits.append((y[t] in guesses) / len(guesses))
    return float(np.mean(hits))


@pytest.mark.parametrize("task", TASKS)
def test_floor_is_the_no_retrieval_baseline(task):
    """synthetic.floor equals a baseline written independently on the same sequences; mqar's is one
    over the pairs (every value stays a candidate: none is ruled out by an answer in the input),
    needle's chance among the keys, offset's about the k = 1 share (a quarter), and each is far
    below what retrieval scores (100%)."""
    kw = {"pairs": 4, "queries": 4, "layout": "zoology"} if task == "mqar" else {}
    n = 300
    got = S.floor(task, V, 64, n, **kw)["token"]
    # the reference reads n sequences: the floor too
    saved = S.FLOOR_SEQUENCES
    S.FLOOR_SEQUENCES = n
    try:
        first = S.floor(task, V, 64, n, **kw)["strategies"][next(iter(S.SHORTCUTS[task]))]
        assert first == pytest.approx(reference_floor(task, 64, n, **kw), abs=1e-12)
    finally:
        S.FLOOR_SEQUENCES = saved
    expected = {"mqar": 1 / 4, "needle": 1 / VOCAB.n}
    if task in expected:
        assert got == pytest.approx(expected[task])
    if task == "offset":
        assert 0.24 < got < 0.33
    assert got < 0.75


def test_floor_reads_the_scored_sequences_and_takes_the_best_shortcut():
    """The floor's first n sequences are the ones scores() reads (a model that records its inputs
    sees them), and it takes the best shortcut; the steadier estimate over more sequences is close
    to the scored one; a model playing a one-candidate shortcut (the token after the marker) scores
    exactly its floor on the scored sequences."""
    n, L = 300, 128
    seen = []

    def recorder(x: torch.Tensor) -> torch.Tensor:
        seen.append(x.clone())
        return torch.zeros(*x.shape, V)

    S.scores(recorder, "offset", V, L, n)
    scored = torch.cat(seen)
    rng = S.eval_rng(0, "offset", L)
    mine = torch.cat(
        [synthetic_tasks.batch("offset", V, 1, L, rng, train=False)[0] for _ in range(n)]
    )
    assert torch.equal(scored, mine)
    f = S.floor("offset", V, L, n)
    assert f["token"] == max(f["strategies"].values()) == f["strategies"][f["strategy"]]
    # one answer a sequence
    assert abs(f["steady"] - f["token"]) < 2 * f["band"] and 0.02 < f["band"] < 0.06

    def player(x: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(*x.shape, V)
        for b in range(len(x)):
            t = x.shape[1] - 1
            logits[
                b, t, S.SHORTCUTS["offset"]["the token after the marker"](x[b].numpy(), t, VOCAB)
            ] = 1
        return logits

    assert S.scores(player, "offset", V, L, n)["token"] == pytest.approx(
        f["strategies"]["the token after the marker"]
    )


def test_offsets_commonest_token_counts_every_tie():
    """Offset's shortcut that ignores k guesses among every token tied for the commonest of the four
    after the marker (scored as the expectation of a uniform pick), not the first of them."""
    v, mark = VOCAB, MARK
    k = list(range(*v.keys))
    distinct = np.array([k[0], mark, k[1], k[2], k[3], k[4], k[5]])
    assert (
        sorted(S.SHORTCUTS["offset"]["the commonest of the 4 after the marker"](distinct, 6, v))
        == k[1:5]
    )
    repeated = np.array([k[0], mark, k[1], k[2], k[2], k[3], k[5]])
    assert list(
        S.SHORTCUTS["offset"]["the commonest of the 4 after the marker"](repeated, 6, v)
    ) == [k[2]]
    pairs = np.array([k[0], mark, k[3], k[2], k[2], k[3], k[5]])
    assert sorted(
        S.SHORTCUTS["offset"]["the commonest of the 4 after the marker"](pairs, 6, v)
    ) == [k[2], k[3]]


def test_whole_sequence_score_needs_every_answer():
    """scores(): "sequence" counts a copy right only when every copied token is; a reader wrong at
    one token of each string keeps nearly all its token accuracy and none of its whole strings."""

    def wrong_last(x: torch.Tensor) -> torch.Tensor:
        logits = oracle(x)
        logits[:, -1] = logits[:, -1].roll(1, -1)  # the last copied token: another token
        return logits

    assert S.scores(oracle, "copy", V, 64, 20) == {"token": 1.0, "sequence": 1.0}
    wrong = S.scores(wrong_last, "copy", V, 64, 20)
    assert wrong["sequence"] == 0.0 and wrong["token"] == pytest.approx(31 / 32)


def test_validation_reads_the_evaluation_distribution():
    """train.py's validation rows are the evaluation's (every mqar row has task_pairs pairs and
    task_queries queries, no needle rows), its training rows the curriculum's (1 to task_pairs
    pairs, needle rows)."""
    cfg = options.resolve(
        configure(train.defaults, ["config/rope.py", "config/mqar.py"]), train.defaults
    )
    procs = Processes(False, 0, 0, 1, "cpu")
    batches = Batches(cfg, load_data(cfg, procs), procs)
    g = torch.Generator().manual_seed(0)
    pairs = {}
    for split in ("train", "val"):
        x, y = batches.batch(split, g)
        is_value = (x >= VOCAB.values[0]) & (x < VOCAB.values[1])
        pairs[split] = set(is_value.sum(1).tolist())
        assert split == "train" or set((y >= 0).sum(1).tolist()) == {cfg["task_queries"]}
    assert pairs["val"] == {cfg["task_pairs"]} and len(pairs["train"]) > 1


def test_answer_only_loss_is_masked_cross_entropy():
    """The model's loss on a synthetic batch equals the cross-entropy computed by hand over the
    answer tokens alone."""
    torch.manual_seed(0)
    model = GPT(
        GPTConfig(block_size=64, vocab_size=V, n_layer=2, n_head=2, n_embd=32, pos_encoding="rope")
    )
    x, y = synthetic_tasks.batch("mqar", V, 6, 64, np.random.default_rng(1), train=False)
    logits, loss = model(x, y)
    lp = F.log_softmax(logits.double(), -1)
    terms = [-lp[b, t, y[b, t]] for b in range(6) for t in range(64) if y[b, t] >= 0]
    assert len(terms) == 6 * 4
    torch.testing.assert_close(loss.double(), torch.stack(terms).mean(), atol=1e-6, rtol=1e-6)


def test_previous_token_curriculum_asks_for_the_token_before():
    """task_prev_tokens: every position that is not an answer asks for the token before it, the
    answers stay, the first position asks for nothing; without it the rows are the task's alone."""
    plain = synthetic_tasks.batch(
        "mqar", V, 8, 64, np.random.default_rng(3), pairs=4, queries=4, layout="zoology"
    )
    x, y = synthetic_tasks.batch(
        "mqar",
        V,
        8,
        64,
        np.random.default_rng(3),
        previous=True,
        pairs=4,
        queries=4,
        layout="zoology",
    )
    assert torch.equal(x, plain[0])
    answers = plain[1] >= 0
    assert torch.equal(y[answers], plain[1][answers]) and (y[:, 0] == -1).all()
    assert torch.equal(y[:, 1:][~answers[:, 1:]], x[:, :-1][~answers[:, 1:]])


def test_mix_puts_needle_rows_in_training_batches():
    """task_mix: about that share of the rows are needle rows (filler from the filler range), the
    rest the task's."""
    x, _ = synthetic_tasks.batch("passkey", V, 2000, 64, np.random.default_rng(0), mix=0.25)
    needle_rows = ((x >= VOCAB.filler[0]).sum(1) > 30).float().mean().item()
    assert 0.22 < needle_rows < 0.28


def test_ids_tokenizer_round_trip():
    """The synthetic checkpoints' tokenizer writes ids as numbers and reads them back; a bad id is
    an error."""
    tok = tokenizer_from_meta(IdsTokenizer(V).meta)
    assert tok.encode(" 0 17\n5 ") == [0, 17, 5] and tok.decode([0, 17, 5]) == "0 17 5"
    with pytest.raises(ValueError, match="token id 128 is outside"):
        tok.encode("1 128")
    with pytest.raises(ValueError, match="numbers separated by spaces"):
        tok.encode("a b")


# --------------------------------------------------------------------------------------------------
# training and the suite


@pytest.mark.slow
def test_tiny_run_learns_the_needle(tmp_path):
    """train.py on the one-step task, 200 iterations of a 30k-parameter model at batch 32:
    validation accuracy at the training length far above chance (1/41), and the checkpoint's history
    and eval at 2x agree with it."""
    out = tmp_path / "needle"
    fast = ["--batch_size=32", "--learning_rate=3e-3", "--warmup_iters=20", "--eval_interval=50"]
    train_in_process(
        [
            "config/rope.py",
            "config/needle.py",
            f"--out_dir={out}",
            "--max_iters=200",
            "--lr_decay_iters=200",
            *fast,
        ]
    )
    ckpt = load_checkpoint(out / "ckpt.pt")
    history = ckpt["history"]
    assert [h["iter"] for h in history] == list(range(0, 201, 50))
    assert history[0]["acc"] < 0.1 and history[-1]["acc"] > 0.8
    assert ckpt["tokenizer"] == {"kind": "ids", "vocab_size": V}
    report = S.main([str(out), "--lengths", "64", "128", "--n", "200"])
    assert report[str(out)]["accuracy"][64] > 0.8 and report[str(out)]["learned_at"] is not None


@pytest.mark.slow
def test_synthetic_resume_is_exact(tmp_path):
    """A synthetic run stopped and resumed gives the same weights and history as one that never
    stopped."""
    common = [
        "config/alibi.py",
        "config/passkey.py",
        "--eval_interval=5",
        "--lr_decay_iters=20",
        "--batch_size=8",
    ]
    common += ["--eval_iters=2"]
    train_in_process([*common, "--max_iters=20", f"--out_dir={tmp_path / 'straight'}"])
    train_in_process([*common, "--max_iters=10", f"--out_dir={tmp_path / 'split'}"])
    train_in_process(
        [*common, "--max_iters=20", f"--out_dir={tmp_path / 'split'}", "--init_from=resume"]
    )
    a, b = (load_checkpoint(tmp_path / d / "ckpt.pt") for d in ("straight", "split"))
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    assert a["history"] == b["history"] and len(a["history"]) == 5


@pytest.mark.slow
@pytest.mark.usefixtures("forked_train_py")
def test_synthetic_suite_end_to_end(tmp_path):
    """compare/sweep.py --synthetic: trains each encoding on the task, two at a time; the report has
    a table per task with the learned counts, the plot, and a second run reuses everything."""
    out = tmp_path / "suite"
    cmd = ["--synthetic", "needle", "--encodings", "alibi", "learned", "--seeds", "1"]
    cmd += [
        "--jobs",
        "2",
        "--task_trials",
        "20",
        f"--out_dir={out}",
        "--train",
        "--max_iters=30",
        "--eval_interval=10",
    ]
    # in this process; its runs forked from a server that imported train.py
    r = run_cli(sweep.main, cmd)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = (out / "report.md").read_text()
    assert "## needle" in report and "| 64 (1×) | 128 (2×) |" in report and "Every seed:" in report
    # needle: chance, 1 in 41 keys
    assert "| *floor (no retrieval)* | | | *2%* | *2%* | *2%* | *2%* |" in report
    learned_row = next(line for line in report.splitlines() if line.startswith("| learned | "))
    # 2x, 4x, 8x: no positions past its block
    assert " of 1 |" in learned_row and learned_row.count("n/a") == 3
    assert (out / "synthetic.png").stat().st_size > 10_000
    results = json.loads((out / "results.json").read_text())["results"]["needle"]
    assert set(results) == {"alibi", "learned"} and results["alibi"][0]["iters"] == 30
    again = run_cli(sweep.main, cmd)
    assert again.returncode == 0 and again.stdout.count("finished earlier, not trained again") == 2


def synthetic_checkpoint(out_dir, task: str = "needle", n_embd: int = 16) -> None:
    """A random model's checkpoint as train.py writes one for a synthetic task (block 64, vocabulary
    128)."""
    from dataclasses import asdict

    from lib.checkpoint import save_checkpoint

    config = GPTConfig(
        block_size=64, vocab_size=V, n_layer=1, n_head=2, n_embd=n_embd, pos_encoding="alibi"
    )
    cfg = {
        "task": task,
        "task_vocab": V,
        "task_pairs": 8,
        "task_queries": 4,
        "block_size": 64,
        "max_iters": 1,
    }
    ckpt = {
        "model": GPT(config).state_dict(),
        "model_args": asdict(config),
        "config": cfg,
        "iter_num": 1,
    }
    save_checkpoint(
        ckpt | {"tokenizer": {"kind": "ids", "vocab_size": V}, "best_val_loss": 1.0},
        out_dir / "ckpt.pt",
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["--seed", "-1"], "--seed=-1: must be in [0, 2**63)"),
        (["--device=foo"], "device='foo' is not a device"),
        (["--device=cuda:7"], "device='cuda:7' but"),
        (["--out_json", "DIR"], "is a folder; give a file name"),
        (["--out_json", "DIR/missing/x.json"], "does not exist; create it"),
        (
            ["--lengths", "2"],
            "needs a length of at least 3 tokens (its fixed parts alone), got "
            "2; evaluate at longer",
        ),
        (["--lengths", "10000000"], "length 10,000,000 needs at least"),
        (["--lengths", "64", "64", "100"], "--lengths 64 64 100: each length may appear once"),
    ],
)
def test_synthetic_cli_bad_values_are_one_line_errors_before_work(
    tmp_path, args, message, monkeypatch
):
    """compare/synthetic.py's options are checked before any evaluation: one line naming the value
    and the fix, no traceback, nothing written."""
    synthetic_checkpoint(tmp_path / "run")
    monkeypatch.setattr(S, "accuracy", lambda *a, **k: pytest.fail("evaluated before the checks"))
    args = [a.replace("DIR", str(tmp_path)) for a in args]
    r = run_cli(S.main, [str(tmp_path / "run"), *args])
    assert r.returncode in (1, 2) and message in r.stderr and "Traceback" not in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_unreadable_synthetic_cache_is_evaluated_again(tmp_path):
    """A truncated synthetic.json (a kill mid-write in an older version) is read as missing: the run
    is evaluated again and the cache written whole."""
    d = tmp_path / "needle" / "alibi-seed1"
    synthetic_checkpoint(d)
    (d / "synthetic.json").write_text('{"key": {"lengths": [64')
    out = sweep.evaluate_synthetic(d, [64], 5)
    assert 0 <= out.accuracy[64] <= 1 and json.loads((d / "synthetic.json").read_text())[
        "accuracy"
    ] == {"64": out.accuracy[64]}


def test_sweep_lengths_apply_to_the_synthetic_suite(tmp_path):
    """--lengths with --synthetic are the lengths the suite scores at (not silently the default 1x
    to 8x)."""
    d = tmp_path / "needle" / "alibi-seed1"
    synthetic_checkpoint(d)
    out = sweep.evaluate_synthetic(d, [64, 96], 5)
    assert list(out.accuracy) == [64, 96]


def test_synthetic_cache_is_for_its_checkpoint(tmp_path):
    """A run trained again with other options (its checkpoints deleted, the same number of
    iterations) is evaluated again, not given the deleted model's cached synthetic.json."""
    d = tmp_path / "needle" / "alibi-seed1"
    synthetic_checkpoint(d)
    before = sweep.evaluate_synthetic(d, [64], 5)
    (d / "ckpt.pt").unlink()
    synthetic_checkpoint(d, n_embd=32)  # --train --n_embd=32
    after = sweep.evaluate_synthetic(d, [64], 5)
    assert after.params > before.params and after.key != before.key
    assert sweep.evaluate_synthetic(d, [64], 5) == after  # the same checkpoint: read from the cache


def test_synthetic_report_takes_the_training_length_from_the_checkpoints(tmp_path):
    """--lengths that start past the training length: the report says the checkpoints' block size
    (64), not the first length, and labels each length with its multiple of it; runs trained at
    different lengths are refused."""
    d = tmp_path / "needle" / "alibi-seed1"
    synthetic_checkpoint(d)
    score = sweep.evaluate_synthetic(d, [100, 200], 5)
    results = {"needle": [Cell("alibi", [score])]}
    report = sweep.synthetic_report(tmp_path, results, [], 0.0, 5).read_text()
    assert "trained at 64 tokens" in report and "| 100 (1.56×) | 200 (3.12×) |" in report
    results["needle"].append(Cell("rope", [replace(score, block_size=128)]))
    with pytest.raises(SystemExit, match="trained at different lengths .block_size 64, 128."):
        sweep.synthetic_report(tmp_path, results, [], 0.0, 5)


@pytest.mark.slow
def test_synthetic_suite_from_a_process_that_ran_torch_threads(tmp_path):
    """The suite's evaluation workers come from a fork server: forked from a process whose torch
    thread pool has run (a caller that computed something first), a worker with more than one thread
    (here --jobs 1 on 2 cores) deadlocked in OpenMP and the sweep never ended."""
    for enc in ("alibi", "rope"):
        synthetic_checkpoint(tmp_path / "needle" / f"{enc}-seed1")
    script = (
        "import sys, torch; sys.path.insert(0, sys.argv[1]); torch.set_num_threads(2); "
        "torch.randn(512, 512) @ "
        "torch.randn(512, 512); from compare import sweep; sweep.main(['--synthetic', 'needle', "
        "'--encodings', "
        "'alibi', 'rope', '--seeds', '1', '--jobs', '1', '--task_trials', '10', '--out_dir', "
        "sys.argv[2], '--train', "
        "'--max_iters=1'])"
    )
    env = dict(ENV, OMP_NUM_THREADS="2")
    r = subprocess.run(
        [sys.executable, "-c", script, str(ROOT), str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert (tmp_path / "report.md").exists()
