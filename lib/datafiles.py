"""
Tokenized datasets in nanoGPT's layout: data/<name>/{train,val}.bin (uint16 token ids) and meta.json
({"vocab_size", "tokenizer", "tokens", "eot"}). JSON, not pickle: reading a dataset can never run
code. "eot" is the token that begins each document after the first (GPT-2's <|endoftext|>, a char
dataset's DOCUMENT_SEPARATOR), where the data marks its documents (train.py's packing="documents"
needs it); absent or None where it does not.
"""

import functools
import json
import os
import re
import runpy
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from lib.tokenizer import GPT2_EOT, CharTokenizer, GPT2Tokenizer, tokenizer_from_meta

DATA_DIR = Path(__file__).resolve().parents[1] / "data"
EMBEDDED_CORPUS = DATA_DIR / "shakespeare_complete_works.txt.xz"
SPLITS = ("train", "val")
# ASCII's record separator: a char dataset's end-of-text token, between its documents
DOCUMENT_SEPARATOR = "\x1e"


class DataError(Exception):
    pass


def dataset_dir(name: str | Path) -> Path:
    """A dataset's folder: a path as given (it has a slash), else data/<name>."""
    return Path(name) if "/" in str(name) or os.sep in str(name) else DATA_DIR / name


# --------------------------------------------------------------------------------------------------
# writing


def write_dataset(
    out_dir: str | Path,
    splits: dict[str, np.ndarray],
    tokenizer_meta: dict,
    vocab_size: int,
    eot: int | None = None,
) -> None:
    """Write each split's token ids as uint16 and meta.json last, so a dataset with meta.json is
    complete. eot: the token that begins each document after the first (None: the data marks no
    documents)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if vocab_size > 2**16:
        raise DataError(f"vocab_size={vocab_size} does not fit in uint16 token files")
    for split, ids in splits.items():
        tmp = out_dir / f".{split}.bin.tmp"
        np.asarray(ids, dtype=np.uint16).tofile(tmp)
        os.replace(tmp, out_dir / f"{split}.bin")
    meta = {
        "vocab_size": vocab_size,
        "tokenizer": tokenizer_meta,
        "tokens": {s: len(v) for s, v in splits.items()},
    }
    if eot is not None:
        meta["eot"] = eot
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=1))


def prepare_text(
    text: str,
    out_dir: str | Path,
    tokenizer: str = "char",
    val_fraction: float = 0.1,
    separator: str | None = None,
) -> dict:
    """Tokenize one text (char-level or GPT-2 BPE); the last val_fraction of it is the validation
    split. With a separator, the text is documents split at each occurrence of it (dropped), marked
    for packing="documents"."""
    if separator is not None:
        return prepare_documents(text.split(separator), out_dir, tokenizer, val_fraction)
    if tokenizer not in ("char", "gpt2"):
        raise DataError(f"tokenizer={tokenizer!r}: choose 'char' or 'gpt2'")
    if not text:
        raise DataError("the text is empty")
    tok = CharTokenizer.from_text(text) if tokenizer == "char" else GPT2Tokenizer()
    n = int(len(text) * (1 - val_fraction))
    splits = {"train": np.array(tok.encode(text[:n])), "val": np.array(tok.encode(text[n:]))}
    write_dataset(out_dir, splits, tok.meta, tok.vocab_size)
    report(out_dir, tok.vocab_size, splits)
    return splits


def prepare_documents(
    documents: list[str], out_dir: str | Path, tokenizer: str = "char", val_fraction: float = 0.1
):
    """Tokenize documents (char-level or GPT-2 BPE) into one stream, an end-of-text token before
    each document after the first (GPT-2's <|endoftext|>; for chars DOCUMENT_SEPARATOR, which no
    document may hold), and record that token in meta.json. The validation split is the last
    documents, about val_fraction of the text."""
    if tokenizer not in ("char", "gpt2"):
        raise DataError(f"tokenizer={tokenizer!r}: choose 'char' or 'gpt2'")
    documents = [d for d in documents if d.strip()]
    if len(documents) < 2:
        raise DataError(
            f"{len(documents)} non-empty document(s): a training and a validation "
            "split need two or more"
        )
    if tokenizer == "char":
        if any(DOCUMENT_SEPARATOR in d for d in documents):
            raise DataError(
                f"a document holds {DOCUMENT_SEPARATOR!r}, the char datasets' "
                "end-of-text token: remove it"
            )
        tok = CharTokenizer.from_text(DOCUMENT_SEPARATOR + "".join(documents))
        eot = tok.encode(DOCUMENT_SEPARATOR)[0]
    else:
        tok = GPT2Tokenizer()
        eot = GPT2_EOT
    lengths = np.cumsum([len(d) for d in documents])
    first_val = min(
        int(np.searchsorted(lengths, lengths[-1] * (1 - val_fraction))) + 1, len(documents) - 1
    )

    def encode(docs: list[str]) -> np.ndarray:
        ids = []
        for i, doc in enumerate(docs):
            ids += ([eot] if i else []) + tok.encode(doc)
        return np.array(ids)

    splits = {"train": encode(documents[:first_val]), "val": encode(documents[first_val:])}
    write_dataset(out_dir, splits, tok.meta, tok.vocab_size, eot=eot)
    report(
        out_dir,
        tok.vocab_size,
        splits,
        f", {first_val:,} + {len(documents) - first_val:,} documents",
    )
    return splits


def report(out_dir, vocab_size: int, splits: dict, extra: str = "") -> None:
    print(
        f"wrote {out_dir}: vocab {vocab_size}, train {len(splits['train']):,} tokens, "
        f"val {len(splits['val']):,} tokens{extra}"
    )


# a heading that begins a scene (or an act and the scene after it) in the embedded corpus: "ACT
# II.", "SCENE 3.", "Scene IV."; the setting lines of a play's front matter ("SCENE: Ephesus") are
# not headings
SCENE_HEADING = re.compile(r"^(ACT|SCENE|Scene)\s+([0-9]+|[IVXLC]+)\b")


def scenes(text: str) -> list[str]:
    """The embedded corpus as documents: each play's scenes (an act's heading goes with its first
    scene), each work's front matter, and each poem or sequence of sonnets whole (they have no
    scenes). Joined, they are the text."""
    lines = text.splitlines(keepends=True)
    starts = [0]
    heading_before = False
    for i, line in enumerate(lines):
        title = (
            i + 2 < len(lines) and lines[i + 2].strip() == "by William Shakespeare" and line.strip()
        )
        heading = bool(SCENE_HEADING.match(line))
        if (title or heading and not heading_before) and i > 0:
            starts.append(i)
        if line.strip():
            heading_before = heading
    return ["".join(lines[a:b]) for a, b in zip(starts, [*starts[1:], len(lines)], strict=True)]


# a speaker's line, which begins a speech after a blank line: "COUNTESS.", "FIRST LORD.", "KING
# HENRY."
SPEAKER = re.compile(r"^[A-Z][A-Z0-9 .,'&-]*\.\n?$")


def speeches(text: str) -> list[str]:
    """The embedded corpus in documents shorter than a block of training: each speech (a speaker's
    line, after a blank line, and what is said until the next speaker), within scenes() (a heading
    and its stage directions before the first speaker are a document of their own). Joined, they are
    the text."""
    out = []
    for scene in scenes(text):
        lines = scene.splitlines(keepends=True)
        starts = [0] + [
            i for i in range(1, len(lines)) if SPEAKER.match(lines[i]) and not lines[i - 1].strip()
        ]
        out += ["".join(lines[a:b]) for a, b in zip(starts, [*starts[1:], len(lines)], strict=True)]
    return out


def read_embedded_corpus() -> str:
    """The complete works of Shakespeare (5,057,321 characters), committed xz-compressed."""
    import lzma

    return lzma.decompress(EMBEDDED_CORPUS.read_bytes()).decode("utf-8")


@functools.cache
def gpt2_tokenizer() -> GPT2Tokenizer:
    """One GPT-2 tokenizer per process (each of datasets' workers builds its own on first use)."""
    return GPT2Tokenizer()


def prepare_hf(
    dataset_dict,
    out_dir: str | Path,
    text_column: str = "text",
    eot: bool | Callable[[str], bool] = True,
    num_proc: int | None = None,
) -> dict[str, int]:
    """Tokenize a Hugging Face DatasetDict (splits 'train' and 'val') with GPT-2 BPE in parallel,
    with progress bars, and write it in shards. eot True: <|endoftext|> after each row (a row is a
    document); a function of a row's text: before each row it says begins a document (a corpus split
    into lines); False: the documents are unmarked."""
    from tqdm import tqdm

    num_proc = num_proc or max(1, (os.cpu_count() or 2) // 2)
    tok = gpt2_tokenizer()

    def encode(example):
        # the tokenizer by name, not in the closure: datasets pickles the function to hash it and to
        # send it to each worker, and GPT-2's 50,257-token table took seconds every time
        text = example[text_column]
        before = [GPT2_EOT] if callable(eot) and eot(text) else []
        ids = before + gpt2_tokenizer().encode(text) + ([GPT2_EOT] if eot is True else [])
        return {"ids": ids, "len": len(ids)}

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    counts = {}
    for split in SPLITS:
        ds = dataset_dict[split]
        ds = ds.map(
            encode, remove_columns=ds.column_names, desc=f"tokenizing {split}", num_proc=num_proc
        )
        total = int(np.sum(ds["len"], dtype=np.uint64))
        tmp = out_dir / f".{split}.bin.tmp"
        arr = np.memmap(tmp, dtype=np.uint16, mode="w+", shape=(total,))
        shards = min(1024, len(ds))
        offset = 0
        for i in tqdm(range(shards), desc=f"writing {split}.bin"):
            batch = ds.shard(num_shards=shards, index=i, contiguous=True).with_format("numpy")
            ids = np.concatenate(batch["ids"]) if len(batch) else np.array([], dtype=np.uint16)
            arr[offset : offset + len(ids)] = ids
            offset += len(ids)
        arr.flush()
        del arr
        os.replace(tmp, out_dir / f"{split}.bin")
        counts[split] = total
    meta = {"vocab_size": tok.vocab_size, "tokenizer": tok.meta, "tokens": counts}
    if eot:
        meta["eot"] = GPT2_EOT
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=1))
    return counts


def hf_recipe(folder: Path, split: Callable, eot: bool | Callable[[str], bool] = True) -> Callable:
    """A Hugging Face dataset recipe's prepare(dataset, out_dir=None, num_proc=None): split(dataset)
    -> {"train", "val"}, tokenized and written to out_dir (by default the recipe's folder) by
    prepare_hf."""

    def prepare(
        dataset, out_dir: Path | None = None, num_proc: int | None = None
    ) -> dict[str, int]:
        """Tokenize a loaded DatasetDict and write train.bin, val.bin and meta.json."""
        return prepare_hf(split(dataset), out_dir or folder, eot=eot, num_proc=num_proc)

    return prepare


def run_hf_recipe(doc: str, prepare: Callable, load: Callable) -> None:
    """A recipe's command (python data/<name>/prepare.py [--num_proc 8]): load(load_dataset,
    num_proc) downloads the dataset from the Hugging Face hub, prepare writes it; without the
    datasets package, a one-line error first."""
    import argparse
    import sys

    from lib.devices import missing

    parser = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num_proc", type=int, default=None)
    args = parser.parse_args()
    if problem := missing("datasets", "this dataset (read from the Hugging Face hub)"):
        sys.exit(f"error: {problem}")
    from datasets import load_dataset

    prepare(load(load_dataset, args.num_proc), num_proc=args.num_proc)


# --------------------------------------------------------------------------------------------------
# reading


def load_meta(data_dir: str | Path, block_size: int | None = None) -> dict:
    """meta.json of a prepared dataset, checked against its token files (sizes only, so it is
    instant for any dataset): "tokens" holds each split's actual count. Raises DataError naming the
    problem and the fix."""
    data_dir = Path(data_dir)
    name = data_dir.name
    missing = [f for f in ("meta.json", "train.bin", "val.bin") if not (data_dir / f).is_file()]
    if missing and not data_dir.is_dir():
        known = sorted(p.parent.name for p in DATA_DIR.glob("*/prepare.py"))
        raise DataError(
            f"no dataset {name!r} (looked in {data_dir}); datasets here: {', '.join(known)}"
        )
    recipe = DATA_DIR / name / "prepare.py"
    fix = (
        f"python data/{name}/prepare.py"
        if recipe.is_file()
        else "the script that prepared it (e.g. data/text/prepare.py)"
    )
    if missing:
        raise DataError(
            f"dataset {name!r} is not prepared ({', '.join(missing)} missing in "
            f"{data_dir}); run: {fix}"
        )
    try:
        meta = json.loads((data_dir / "meta.json").read_text())
        meta["vocab_size"] = int(meta["vocab_size"])
    except (ValueError, KeyError, TypeError) as e:
        raise DataError(f"{data_dir / 'meta.json'} is not valid ({e}); re-run {fix}") from e
    problem = _tokenizer_problem(meta)
    # caught here, not when the first checkpoint (which stores the tokenizer) is written
    if problem:
        raise DataError(f"{data_dir / 'meta.json'}: {problem}; re-run {fix}")
    eot = meta.setdefault("eot", None)
    if eot is not None and not (
        isinstance(eot, int) and not isinstance(eot, bool) and 0 <= eot < meta["vocab_size"]
    ):
        raise DataError(
            f"{data_dir / 'meta.json'}: eot={eot!r} is not a token id of its "
            f"vocabulary; re-run {fix}"
        )
    recorded = meta.get("tokens") if isinstance(meta.get("tokens"), dict) else {}
    meta["tokens"] = {}
    for split in SPLITS:
        path = data_dir / f"{split}.bin"
        size = path.stat().st_size
        if size % 2:
            raise DataError(
                f"{path} has an odd size ({size:,} bytes) for 2-byte tokens: it is "
                f"cut short; re-run {fix}"
            )
        n = size // 2
        expected = recorded.get(split)
        if isinstance(expected, int) and expected != n:
            raise DataError(
                f"{path} holds {n:,} tokens but meta.json records {expected:,}: the file is "
                "truncated or from "
                f"another preparation; re-run {fix}"
            )
        if n == 0:
            raise DataError(f"{path} is empty; re-run {fix}")
        if n <= (block_size or 0):
            raise DataError(
                f"{path} holds {n:,} tokens, too few for block_size={block_size} (it needs more "
                "than one block); "
                "use a smaller --block_size or more text"
            )
        meta["tokens"][split] = n
    return meta


def _tokenizer_problem(meta: dict) -> str | None:
    """What is wrong with meta.json's tokenizer description, which every checkpoint stores for
    sample.py."""
    tok = meta.get("tokenizer")
    V = meta["vocab_size"]
    if tok is None:
        return (
            "it has no 'tokenizer' entry, which every checkpoint stores so that sample.py can "
            "decode"
        )
    if not isinstance(tok, dict) or tok.get("kind") not in ("char", "gpt2"):
        return (
            f'its tokenizer is {tok!r}; expected {{"kind": "char", "chars": "..."}} or {{"kind": '
            f'"gpt2"}}'
        )
    if tok["kind"] == "gpt2" and V != GPT2Tokenizer.vocab_size:
        return f"vocab_size is {V} but the gpt2 tokenizer has {GPT2Tokenizer.vocab_size} tokens"
    if tok["kind"] == "char":
        chars = tok.get("chars")
        if not isinstance(chars, str) or len(set(chars)) != len(chars):
            return "its character list (tokenizer.chars) is not a string of distinct characters"
        if len(chars) != V:
            return f"its character list has {len(chars)} characters but vocab_size is {V}"
    return None


def describe_tokenizer(tok: dict) -> str:
    """A tokenizer description (meta.json's or a checkpoint's) in words, for errors."""
    kind = tok.get("kind") if isinstance(tok, dict) else None
    if kind == "char":
        return f"a character vocabulary of {len(tok.get('chars', ''))} characters"
    if kind == "gpt2":
        return "GPT-2's BPE"
    if kind == "ids":
        return f"a synthetic task's token ids (vocabulary {tok.get('vocab_size')})"
    return repr(tok)


def tokenizer_difference(data_tok: dict, model_tok: dict) -> str | None:
    """How a dataset's tokenizer differs from the one a model reads (a checkpoint's), or None where
    they are the same: only then does each token id stand for the text the model learned it as."""
    if data_tok == model_tok:
        return None
    text = (
        f"is tokenized with {describe_tokenizer(data_tok)}, but the model reads "
        f"{describe_tokenizer(model_tok)}"
    )
    if data_tok.get("kind") == model_tok.get("kind") == "char":
        differ = sorted(set(data_tok["chars"]) ^ set(model_tok["chars"]))
        shown = ", ".join(repr(ch) for ch in differ[:10]) + (" …" if len(differ) > 10 else "")
        text += (
            f" (they differ in {shown})" if differ else " (the same characters in another order)"
        )
    return text


# --------------------------------------------------------------------------------------------------
# what a run trains on: a run goes on from a checkpoint (a resume, an extension) only on data in the
# same token ids


def task_meta(vocab_size: int) -> dict:
    """A synthetic task's meta.json, had it one: its token ids are a tokenizer of their own."""
    return {"vocab_size": vocab_size, "tokenizer": {"kind": "ids", "vocab_size": vocab_size}}


def data_name(cfg: dict) -> str:
    """What a run trains on, as its options say."""
    if cfg.get("task"):
        return f"the synthetic task {cfg['task']!r} (task_vocab={cfg.get('task_vocab')})"
    return f"the text of dataset {cfg.get('dataset')!r}"


def other_data(
    old: dict, old_tokenizer: dict | None, new: dict, tokenizer: dict | None, same_task: bool
) -> str | None:
    """Why a run trained on old's data (old, new: train.py's options) cannot go on with new's: their
    token ids mean other things (another tokenizer: a synthetic task's ids are one of their own),
    or, with same_task (a resume), it is another task, or text. None where it can: another text in
    the same tokenizer is fine-tuning. A nanoGPT checkpoint records no tokenizer: its ids count as
    the same."""
    same_ids = old_tokenizer in (None, tokenizer)
    if same_ids and (not same_task or (old.get("task") or "") == (new.get("task") or "")):
        return None
    other = "" if same_ids else ", whose token ids mean other things (another tokenizer)"
    return (
        f"was trained on {data_name(old)}, and this run would train it on {data_name(new)}{other}"
    )


def validation_tokens(
    ckpt: dict, vocab_size: int, out_dir: str | Path, data_dir: str | Path | None = None
):
    """The validation split (N,) uint16 of the dataset a checkpoint trained on (data_dir, a prepared
    folder, overrides it), and its name; the dataset must be written with the checkpoint's tokenizer
    (a nanoGPT checkpoint, which records none, with token ids the model has: below vocab_size).
    Raises DataError naming the fix."""
    trained_on = (ckpt.get("config") or {}).get("dataset") or "shakespeare_char"
    path = Path(data_dir) if data_dir else dataset_dir(trained_on)
    meta = load_meta(path)  # names a missing or unprepared dataset and how to prepare it
    tok = ckpt.get("tokenizer")
    if tok:
        problem = tokenizer_difference(meta["tokenizer"], tok)
    else:
        n = meta["vocab_size"]
        problem = (
            f"has {n} token ids, more than the model's {vocab_size}" if n > vocab_size else None
        )
    if problem:
        fix = (
            f"leave out --data_dir to use the dataset it trained on ({trained_on}), or give one "
            "prepared with the "
            "same tokenizer"
            if data_dir
            else "the dataset was prepared again since the run trained on it: prepare it as it "
            "was, or give "
            "--data_dir a dataset prepared with the run's tokenizer"
        )
        raise DataError(f"{out_dir}: {path} {problem}; {fix}")
    return np.memmap(path / "val.bin", dtype=np.uint16, mode="r"), path.name


def get_batch(
    data_dir: str | Path,
    split: str,
    batch_size: int,
    block_size: int,
    generator: torch.Generator,
    vocab_size: int,
    device: str = "cpu",
    rank: int = 0,
    world_size: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A random batch x, y (B, T) from split, y shifted by one. All ranks draw the same world_size *
    B offsets from one generator and take their own slice, so the sampler's state is one generator
    state."""
    path = Path(data_dir) / f"{split}.bin"
    # re-opened each batch to avoid a memmap memory leak
    data = np.memmap(path, dtype=np.uint16, mode="r")
    if len(data) <= block_size:
        raise DataError(f"{path} holds {len(data)} tokens, too few for block_size={block_size}")
    ix = torch.randint(len(data) - block_size, (world_size * batch_size,), generator=generator)
    ix = ix[rank * batch_size : (rank + 1) * batch_size].tolist()
    x = np.stack([data[i : i + block_size] for i in ix]).astype(np.int64)
    y = np.stack([data[i + 1 : i + 1 + block_size] for i in ix]).astype(np.int64)
    if max(x.max(), y.max()) >= vocab_size:
        raise DataError(
            f"{path} holds token id {max(x.max(), y.max())} but the vocabulary has {vocab_size} "
            "tokens: "
            "the data and meta.json disagree; re-run the dataset's prepare.py"
        )
    x = torch.from_numpy(x)
    y = torch.from_numpy(y)
    if device.startswith("cuda"):  # pinned memory lets the copy overlap with compute
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(
            device, non_blocking=True
        )
    return x.to(device), y.to(device)


def trained_distances(
    data_dir: str | Path, block_size: int, eot: int, windows: int = 64
) -> tuple[int, float]:
    """The longest and the median distance a query reaches back under packing="documents" (each
    token's position in its document, cut where its window begins), over `windows` random windows of
    train.bin (a fixed seed)."""
    data = np.memmap(Path(data_dir) / "train.bin", dtype=np.uint16, mode="r")
    offsets = np.random.default_rng(0).integers(0, len(data) - block_size, windows)
    x = np.stack([data[i : i + block_size] for i in offsets])
    t = np.arange(block_size)
    positions = t - np.maximum.accumulate(np.where(x == eot, t, 0), axis=1)  # (windows, block_size)
    return int(positions.max()), float(np.median(positions))


# --------------------------------------------------------------------------------------------------
# a training run's data

# prepared from files in the repository, offline
EMBEDDED_DATASETS = (
    "shakespeare_char",
    "shakespeare",
    "shakespeare_char_scenes",
    "shakespeare_char_speeches",
)


@dataclass
class Data:
    dir: Path | None  # None for a synthetic task, whose sequences are generated
    meta: dict  # meta.json: the dataset's vocab_size and tokenizer
    # the model's: GPT-2's 50257 tokens padded to a multiple of 64 (faster matmuls), a char one as
    # is
    vocab_size: int
    task_tok: object | None  # the tokenizer that writes the task sequences (task_fraction > 0)


def load_data(cfg: dict, procs) -> Data:
    """The dataset, prepared on first use where it is embedded and checked (meta.json, the token
    files) before any training, and the tokenizer of its retrieval tasks
    (text_tasks.check_training_tasks checks them). A synthetic task has no files."""
    if cfg["task"]:
        V = cfg["task_vocab"]
        return Data(None, task_meta(V), V, None)
    data_dir = dataset_dir(cfg["dataset"])
    if cfg["dataset"] in EMBEDDED_DATASETS and not (data_dir / "meta.json").is_file():
        if procs.master:
            procs.log(f"preparing the {cfg['dataset']} dataset (first run only)")
            runpy.run_path(str(data_dir / "prepare.py"), run_name="__main__")
        procs.barrier()
    meta = load_meta(data_dir, block_size=cfg["block_size"])
    n = meta["vocab_size"]
    # lib/text_tasks.py checks them
    task_tok = tokenizer_from_meta(meta["tokenizer"]) if cfg["task_fraction"] else None
    return Data(data_dir, meta, n if n < 1024 else -(-n // 64) * 64, task_tok)


def no_documents(cfg: dict) -> str:
    """Why packing="documents" cannot train on the options' data, which marks no documents, and the
    fix."""
    return (
        f"packing='documents' needs data that marks its documents, and {data_name(cfg)} does not "
        "(its meta.json names "
        "no end-of-text token, 'eot'): use --dataset=shakespeare_char_scenes, prepare your text "
        "with "
        "data/text/prepare.py --separator=..., re-run the dataset's prepare.py (a GPT-2 dataset an "
        "earlier version "
        'prepared with <|endoftext|> between documents needs only "eot": 50256 in its meta.json), '
        "or train with "
        "--packing=stream"
    )


def model_data_problem(config, cfg: dict, data: Data) -> str | None:
    """Why a model of this config (model.GPTConfig) cannot train on this data with these options, or
    None: more tokens than its vocabulary, a block longer than its own, documents marked otherwise
    than it packs them."""
    if data.meta["vocab_size"] > config.vocab_size:
        return (
            f"dataset {cfg['dataset']!r} has {data.meta['vocab_size']} tokens but the model only "
            f"{config.vocab_size}"
        )
    if cfg["block_size"] > config.block_size:
        fix = (  # a run resumes at its own length; a longer one is an extension, a new run from it
            f"to train it longer, extend it into a new folder: --init_from={cfg['out_dir']} "
            "--out_dir=<a new folder> "
            f"--block_size={cfg['block_size']}"
            if cfg["init_from"] == "resume"
            else f"use --block_size={config.block_size} or less"
        )
        return (
            f"block_size={cfg['block_size']} is longer than the model's {config.block_size}: {fix}"
        )
    if config.packing == "documents" and data.meta.get("eot") != config.eot_token:
        marks = (
            "marks none"
            if data.meta.get("eot") is None
            else f"begins them at token {data.meta['eot']}"
        )
        return (
            f"the model ({cfg['out_dir'] if cfg['init_from'] == 'resume' else cfg['init_from']}) "
            "packs documents, each "
            f"begun at token {config.eot_token}, and "
            f"{data_name(cfg)} {marks}: train it on data that marks its documents as the model's "
            "did (the dataset it "
            "trained on)"
        )
    return None
