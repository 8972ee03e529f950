"""
Retrieval tasks in text (TEXT_TASKS): the sequences train.py's task_fraction mixes into a text run's
training rows, written in the dataset's own tokens, and that compare/tasks.py scores at longer
lengths.

- **passkey** (Mohtashami & Jaggi 2023, the protocol of position interpolation, Chen et al. 2023): a
  random key of digits hidden at a depth (0: start, 1: end) in repeated filler sentences, then "What
  is the pass key? The pass key is " and the key. Scored over a grid of lengths × depths; k_max is
  the longest length whose accuracy (over depths) is at least 20%.
- **recall** (multi-query associative recall, Arora et al. 2023, Zoology): key:value pairs ("ab:12
  cd:34 ..."), filler, then some of the keys again as queries, each followed by its value. Each
  query is one trial.
- **copy**: a random string of letters, a separator, the same string again (by default the string
  fills the length, so the copy is half the sequence).

A task sequence of length L is L + 1 tokens, as training reads T + 1 tokens for x and y: the model
reads L tokens. Every piece is encoded with the dataset's tokenizer on its own (filler and phrases
as text, each digit and letter of a key or string alone), so lengths are exact in tokens and the
answer span is known for char-level and BPE data.
"""

import numpy as np
import torch

from lib.configurator import ConfigError

FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
)
DIGITS = "0123456789"
LETTERS = "abcdefghijklmnopqrstuvwxyz"
PASS_NEEDLE = "The pass key is {}. Remember it. "
PASS_QUESTION = "What is the pass key? The pass key is "
COPY_SEPARATOR = ". Again: "


class TaskError(ValueError):
    pass


# --------------------------------------------------------------------------------------------------
# generators: each returns tokens (length + 1,) int64 and answer (length + 1,) bool, the answer
# tokens' positions


def encode(tok, text: str, task: str) -> list[int]:
    try:
        return tok.encode(text)
    except ValueError as e:  # a character vocabulary without a character the task writes
        needed = {
            "passkey": PASS_NEEDLE.format("") + PASS_QUESTION + DIGITS,
            "recall": ": " + DIGITS + LETTERS,
        }
        text = FILLER + needed.get(task, COPY_SEPARATOR + LETTERS)
        missing = ", ".join(repr(c) for c in sorted(set(text) - set(getattr(tok, "stoi", text))))
        raise TaskError(
            f"the {task} task writes characters that this dataset's vocabulary lacks "
            f"({missing or e}); "
            f"leave it out, or use a dataset with them"
        ) from e


def symbols(tok, chars: str, task: str) -> list[int]:
    """One token per character (digits and letters are single tokens in both the char and GPT-2
    vocabularies)."""
    ids = [encode(tok, ch, task) for ch in chars]
    if any(len(i) != 1 for i in ids):
        raise TaskError(f"the {task} task needs one token per character of {chars!r}")
    return [i[0] for i in ids]


def filler(tok, n: int, task: str, start: int = 0) -> list[int]:
    """n tokens of the repeated filler sentences, from token `start` of the repetition."""
    unit = encode(tok, FILLER, task)
    reps = (start + n) // len(unit) + 1
    return (unit * reps)[start : start + n]


def assemble(
    pieces: list[tuple[list[int], bool]], length: int, task: str
) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate (tokens, is_answer) pieces, checking the total is length + 1 tokens."""
    tokens = np.array([t for p, _ in pieces for t in p], dtype=np.int64)
    answer = np.array([a for p, a in pieces for _ in p], dtype=bool)
    assert len(tokens) == length + 1, (task, len(tokens), length)
    return tokens, answer


def too_short(task: str, length: int, fixed: int) -> TaskError:
    return TaskError(
        f"the {task} task needs a length of at least {fixed} tokens (its phrases "
        f"alone), got {length}"
    )


def text_passkey(
    tok, length: int, rng: np.random.Generator, depth: float | None = None, n_digits: int = 5
) -> tuple[np.ndarray, np.ndarray]:
    """Filler with "The pass key is <key>. Remember it. " at depth (the fraction of the filler
    before it; default uniform), then the question and the key. The filler is cut at a token,
    mid-word, as in Mohtashami & Jaggi's code (landmark-attention), so that every depth is exact."""
    depth = rng.uniform() if depth is None else depth
    if not 0 <= depth <= 1:
        raise TaskError(f"depth={depth} must be in [0, 1]")
    key = "".join(rng.choice(list(DIGITS), n_digits))
    head, tail = PASS_NEEDLE.split("{}")
    key_ids = symbols(tok, key, "passkey")
    needle = encode(tok, head, "passkey") + key_ids + encode(tok, tail, "passkey")
    question = encode(tok, PASS_QUESTION, "passkey")
    n_fill = length + 1 - len(needle) - len(question) - len(key_ids)
    if n_fill < 0:
        raise too_short("passkey", length, length - n_fill)
    before = round(depth * n_fill)
    pieces = [
        (filler(tok, before, "passkey"), False),
        (needle, False),
        (filler(tok, n_fill - before, "passkey", start=before), False),
        (question, False),
        (key_ids, True),
    ]
    return assemble(pieces, length, "passkey")


def text_recall(
    tok,
    length: int,
    rng: np.random.Generator,
    n_pairs: int = 8,
    n_queries: int = 4,
    n_digits: int = 2,
) -> tuple[np.ndarray, np.ndarray]:
    """n_pairs "ab:12 " pairs (distinct two-letter keys), filler, then n_queries of the keys in
    random order, each followed by its value (the answer)."""
    keys = [LETTERS[i // 26] + LETTERS[i % 26] for i in rng.choice(26 * 26, n_pairs, replace=False)]
    values = ["".join(rng.choice(list(DIGITS), n_digits)) for _ in keys]
    colon = encode(tok, ":", "recall")
    space = encode(tok, " ", "recall")
    pairs = []
    for k, v in zip(keys, values, strict=True):
        pairs += symbols(tok, k, "recall") + colon + symbols(tok, v, "recall") + space
    queries = []
    for i in rng.choice(n_pairs, n_queries, replace=False):
        queries += [
            (space + symbols(tok, keys[i], "recall") + colon, False),
            (symbols(tok, values[i], "recall"), True),
        ]
    n_fill = length + 1 - len(pairs) - sum(len(q) for q, _ in queries)
    if n_fill < 0:
        raise too_short("recall", length, length - n_fill)
    return assemble(
        [(pairs, False), (filler(tok, n_fill, "recall"), False), *queries], length, "recall"
    )


def text_copy(
    tok, length: int, rng: np.random.Generator, n_chars: int | None = None, vary: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """A random string of n_chars letters (default: as long as fits twice; vary: a uniform draw from
    1 to that), the separator, the string again; filler pads the start."""
    sep = encode(tok, COPY_SEPARATOR, "copy")
    if n_chars is None:
        longest = (length + 1 - len(sep)) // 2
        n_chars = int(rng.integers(1, longest + 1)) if vary and longest >= 1 else longest
    if n_chars < 1 or 2 * n_chars + len(sep) > length + 1:
        raise too_short("copy", length, 2 * max(n_chars, 1) + len(sep) - 1)
    s = symbols(tok, "".join(rng.choice(list(LETTERS), n_chars)), "copy")
    pad = filler(tok, length + 1 - 2 * n_chars - len(sep), "copy")
    return assemble([(pad, False), (s, False), (sep, False), (s, True)], length, "copy")


TEXT_TASKS = {"passkey": text_passkey, "recall": text_recall, "copy": text_copy}
# in training, copies of every length: at one length the copy is always the same distance back,
# which a head can learn by position alone (at 128 tokens: 99% of characters right, and 4% at 256);
# at many it must match content
TRAINING_KW = {"copy": {"vary": True}}


def check_tasks(tok, length: int, names=tuple(TEXT_TASKS)) -> None:
    """Raise TaskError if a task cannot be made at this length with this tokenizer (before any
    training)."""
    for name in names:
        TEXT_TASKS[name](tok, length, np.random.default_rng(0))


def check_training_tasks(cfg: dict, tok) -> None:
    """A training run's tasks (task_fraction > 0, written by tok, the data's tokenizer; None without
    tasks) fit its block_size: a ConfigError before any training where one does not."""
    if tok is not None:
        try:
            check_tasks(tok, cfg["block_size"])
        except TaskError as e:
            raise ConfigError(f"task_fraction={cfg['task_fraction']}: {e}") from e


# --------------------------------------------------------------------------------------------------
# training: a fraction of a batch's rows become task sequences


def mix_tasks(
    x: torch.Tensor,
    y: torch.Tensor,
    fraction: float,
    tok,
    seed: tuple[int, ...],
    names=tuple(TEXT_TASKS),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Replace fraction of the rows of a training batch x, y (B, T) by task sequences (in
    expectation: floor(f·B) rows, one more with probability frac(f·B)), each task equally likely.
    Targets are -1 (ignored) except at the answer tokens: the filler teaches nothing and a random
    key's first sight is unpredictable, so only the retrieval is learned, and the text loss stays
    about text. seed (task_seed, iteration, micro-step, rank) makes every batch reproducible without
    state, so a resumed run draws what it would have drawn."""
    if fraction <= 0:
        return x, y
    rng = np.random.default_rng(seed)
    B, T = x.shape
    n = int(fraction * B) + int(rng.uniform() < fraction * B % 1)
    x = x.clone()
    y = y.clone()
    for row in rng.choice(B, n, replace=False):
        name = names[rng.integers(len(names))]
        tokens, answer = TEXT_TASKS[name](tok, T, rng, **TRAINING_KW.get(name, {}))
        targets = np.where(answer[1:], tokens[1:], -1)
        x[row] = torch.from_numpy(tokens[:-1]).to(x.device)
        y[row] = torch.from_numpy(targets).to(y.device)
    return x, y
