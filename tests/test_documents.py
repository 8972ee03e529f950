"""Document packing (packing="documents"): each end-of-text token begins a document, positions count
from a document's first token, and attention never crosses into another document. The reference for
every test is the document alone: a packed row must give each of its documents the logits and
gradients it gets by itself, on every attention path, through the KV cache and in generation."""

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import VOCAB, cached_logits, close, tiny
from torch.nn import functional as F

import fast_paths
from generate import KVCache, generate
from model import GPT, POS_ENCODINGS, Chunk, GPTConfig

EOT = 0  # the end-of-text token of these tests' vocabulary
ENCODINGS = list(POS_ENCODINGS)
# two rows of documents (lengths), 33 tokens each: one batch
LAYOUTS = [(7, 12, 5, 9), (20, 1, 3, 9)]


def documents(lengths: tuple[int, ...], seed: int) -> list[torch.Tensor]:
    """Random documents of these lengths, each after the first beginning with the end-of-text
    token."""
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(1, VOCAB, (n,), generator=g) for n in lengths]
    for d in docs[1:]:
        d[0] = EOT
    return docs


def packed_model(pe: str, **kw) -> GPT:
    """A tiny float64 model packing documents, in training mode (dropout 0), every parameter shaping
    the output."""
    kw = {"block_size": 40, **kw}
    return tiny(pe, packing="documents", eot_token=EOT, **kw).double().train()


def logits_and_grads(model, rows: torch.Tensor, targets: torch.Tensor, **kw):
    """Logits of rows (B, T) and every parameter's gradient of the summed cross-entropy against
    targets."""
    model.zero_grad()
    logits, _ = model(rows, **kw)
    F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum").backward()
    named = model.named_parameters()  # a compiled model's names start with _orig_mod.
    return logits.detach(), {
        n.removeprefix("_orig_mod."): p.grad.clone() for n, p in named if p.grad is not None
    }


def assert_documents_alone(
    model, rows_of_docs: list[list[torch.Tensor]], tol: float = 1e-10, alone=None, **kw
) -> None:
    """The batch of packed rows gives each document the logits it gets alone (from alone: by default
    the same model), and the gradient of the rows' loss is the sum of the documents' (each
    document's targets as in its row: its next token, the last one the next document's end-of-text
    token)."""
    rows = torch.stack([torch.cat(docs) for docs in rows_of_docs])
    targets = torch.roll(rows, -1, dims=1)
    logits, grads = logits_and_grads(model, rows, targets, **kw)
    expected_grads = {name: torch.zeros_like(g) for name, g in grads.items()}
    for b, docs in enumerate(rows_of_docs):
        t = 0
        for doc in docs:
            alone_logits, doc_grads = logits_and_grads(
                alone or model, doc[None], targets[b, t : t + len(doc)][None], **kw
            )
            close(logits[b, t : t + len(doc)], alone_logits[0], tol=tol)
            for name, g in doc_grads.items():
                expected_grads[name] += g
            t += len(doc)
    assert grads.keys() == expected_grads.keys()
    # a table of biases is float32 in a float64 model: its gradient sums in float32
    for name, g in grads.items():
        close(g, expected_grads[name], tol=1e-5 if name == "transformer.encoding.weight" else tol)


def assert_logits_alone(model, rows_of_docs: list[list[torch.Tensor]], **kw) -> None:
    """Without a gradient: the batch of packed rows gives each document the logits it gets alone
    (float64, to 1e-10)."""
    with torch.no_grad():
        packed, _ = model(torch.stack([torch.cat(docs) for docs in rows_of_docs]), **kw)
        for b, docs in enumerate(rows_of_docs):
            t = 0
            for doc in docs:
                close(packed[b, t : t + len(doc)], model(doc[None], **kw)[0][0], tol=1e-10)
                t += len(doc)


def kernels_taken(monkeypatch) -> list[str]:
    """The builder each forward's attention takes, by name (None: model.py's reference), as a list
    that fills."""
    taken = []
    kernel = fast_paths.kernel

    def spy(*a, **kw):
        builder = kernel(*a, **kw)
        taken.append(None if builder is None else builder.__name__)
        return builder

    monkeypatch.setattr(fast_paths, "kernel", spy)
    return taken


@pytest.mark.parametrize("pe", ENCODINGS)
@pytest.mark.parametrize("path", ["fast", "reference"])
def test_each_document_in_a_packed_row_is_the_document_alone(pe, path, monkeypatch):
    """Logits and gradients, for every encoding, two rows of other layouts in one batch, on the
    CPU's fast path (the table of distances for a bias of i - j alone, FIRE's within its threshold)
    and on the reference (a materialized mask or bias, each row's own)."""
    model = packed_model(pe)
    model.attention_options = replace(
        model.attention_options, fused=None if path == "fast" else False
    )
    taken = kernels_taken(monkeypatch)
    assert_documents_alone(
        model, [documents(lengths, seed) for seed, lengths in enumerate(LAYOUTS)]
    )
    # a bias of the content has no table: its rows a block of queries at a time
    if model.encoding.has_score_bias:
        fast = (
            ("sum_blocks" if model.encoding.forgets else "bias_blocks")
            if model.encoding.reads_content
            else "bias_table"
        )
        reference = "one_block" if model.encoding.reads_content else None
        assert set(taken) == {fast if path == "fast" else reference}


@pytest.mark.parametrize("pe", ["bias_rpe", "t5", "kerple", "alibi", "fire", "cope", "fox"])
def test_blocks_of_queries_skip_the_keys_before_their_documents(pe, monkeypatch):
    """Rows longer than a block of queries (TABLE_BLOCK): a block reads the keys from its documents'
    earliest start on (none before it can be seen), and each document still gets its logits and
    gradients alone."""
    spans = []
    key_span = fast_paths.key_span
    monkeypatch.setattr(fast_paths, "key_span", lambda *a: spans.append(key_span(*a)) or spans[-1])
    monkeypatch.setattr(fast_paths, "COUNT_BLOCK", fast_paths.TABLE_BLOCK)  # CoPE's, as the others'
    model = packed_model(pe, block_size=160)
    assert_documents_alone(model, [documents((60, 50, 40), 0), documents((30, 40, 80), 1)])
    # the second and third block of the packed rows
    assert (30, 128) in spans and (70, 150) in spans


@pytest.mark.parametrize("pe", ENCODINGS)
def test_documents_alone_in_evaluation_and_with_a_window(pe, monkeypatch):
    """Without a gradient (evaluation: a score bias a block of queries at a time on the CPU) and
    under a sliding window, each document still gets what it gets alone."""
    model = packed_model(pe).eval()
    rows = [documents(lengths, seed) for seed, lengths in enumerate(LAYOUTS)]
    taken = kernels_taken(monkeypatch)
    for window in (None, 6):
        assert_logits_alone(model, rows, window=window)
    if model.encoding.has_score_bias:
        assert None not in taken


def test_fire_past_its_threshold_reads_each_document_at_its_document_positions(monkeypatch):
    """FIRE's bias reads the query's position, not only i - j: past its threshold L a packed row's
    bias is each row's own, on a CPU a block of 16 queries at a time (no table: bias_blocks, its
    keys from the block's earliest document on), and each document still gets what it gets alone,
    logits and gradients."""
    monkeypatch.setattr(fast_paths, "TABLE_BLOCK", 16)  # 40 queries: three blocks, the last ragged
    model = packed_model("fire")
    with torch.no_grad():
        model.encoding.L_multiplier.fill_(0.2)  # L = 8 of 40: most queries past it
    rows = [documents(lengths, seed) for seed, lengths in enumerate(LAYOUTS)]
    assert_documents_alone(model, rows)
    taken = kernels_taken(monkeypatch)
    model(torch.stack([torch.cat(docs) for docs in rows]))
    assert set(taken) == {"bias_blocks"}, "past its threshold FIRE's packed rows: no table"


@pytest.mark.parametrize(
    "pe, tile", [("bias_rpe", 128), ("t5", 128), ("kerple", 128), ("kerple", 5)]
)
def test_fused_table_gradient_stays_inside_documents(pe, tile, monkeypatch, flex_backward):
    """The fused path (FlexAttention under a block mask of each row's documents; its table gradient
    from the tiles holding a distance below the far one, inside a document): logits and gradients
    equal each document alone."""
    monkeypatch.setattr(fast_paths, "DIAGONAL_TILE", tile)
    model = packed_model(pe, t5_num_buckets=8, t5_max_distance=12)
    model.attention_options = replace(model.attention_options, fused=True)
    taken = kernels_taken(monkeypatch)
    assert_documents_alone(
        model, [documents(lengths, seed) for seed, lengths in enumerate(LAYOUTS)]
    )
    assert set(taken) == {"flex_table"}


@pytest.mark.parametrize("pe", ["alibi", "kerple", "fire"])
def test_fused_attention_stays_inside_documents(pe, monkeypatch):
    """FlexAttention (no gradient into the bias) under the block mask of each row's documents,
    eagerly on the CPU; at block 20 FIRE's threshold L is passed by the rows' stream positions and
    not by any document's own: its bias must be read at the documents' positions."""
    model = packed_model(pe, block_size=20).eval()
    model.attention_options = replace(model.attention_options, fused=True)
    rows = [documents(lengths, seed) for seed, lengths in enumerate(LAYOUTS)]
    taken = kernels_taken(monkeypatch)
    assert_logits_alone(model, rows)
    assert set(taken) == {"flex"}


@pytest.mark.parametrize("pe", ENCODINGS)
@pytest.mark.parametrize("window", [None, 7])
def test_kv_cache_equals_the_full_forward_across_documents(pe, window):
    """A prompt holding end-of-text tokens, fed through the KV cache in chunks (a prefill, a chunk
    that ends on an end-of-text token, then one token at a time), gives the logits of the full
    forward under the same rule: a document begun in one chunk goes on in the next; a rolling window
    of keys keeps their documents."""
    model = packed_model(pe).eval()
    row = torch.cat(documents((7, 12, 5, 9), seed=3))[None].repeat(2, 1)
    row[1, 3] = EOT  # the rows' documents differ
    with torch.no_grad():
        full, _ = model(row, window=window)
        cached = cached_logits(model, row, [5, 2, 6, *[1] * 20], window=window, extra=2)
    close(cached, full, tol=1e-10)


@pytest.mark.parametrize("pe", ENCODINGS)
def test_generation_after_an_end_of_text_token(pe):
    """Greedy generation from a prompt that ends a document and begins another: the KV cache, the
    compiled-free decode step and the window re-run every token agree, and the new document's first
    token is what the document's end-of-text token predicts alone."""
    model = packed_model(pe).eval()
    prompt = torch.cat(documents((6, 4), seed=5))[None]
    with_cache = generate(model, prompt, 8, temperature=0)
    without = generate(model, prompt, 8, temperature=0, use_cache=False)
    assert torch.equal(with_cache, without)
    start = prompt[:, 6:]  # the second document, alone
    assert torch.equal(
        generate(model, start, 8, temperature=0)[0, len(start[0]) :],
        with_cache[0, prompt.size(1) :],
    )


@pytest.mark.slow
@pytest.mark.parametrize("pe", ["rope", "bias_rpe"])
def test_compiled_documents_equal_eager(pe):
    """torch.compile'd: a training step's logits and gradients over packed rows equal the eager
    model's (float32, to its rounding), and the compiled decode step generates the eager tokens
    across an end-of-text token (one layer: a second adds only compile time)."""
    model = packed_model(pe, n_layer=1).float()
    rows = torch.stack(
        [torch.cat(documents(lengths, seed)) for seed, lengths in enumerate(LAYOUTS)]
    )
    targets = torch.roll(rows, -1, 1)
    eager_logits, eager_grads = logits_and_grads(model, rows, targets)
    logits, grads = logits_and_grads(torch.compile(model), rows, targets)
    close(logits, eager_logits, tol=1e-4)
    for name, g in eager_grads.items():
        close(grads[name], g, tol=1e-4)
    model.eval()
    prompt = torch.cat(documents((6, 4), seed=5))[None]
    assert torch.equal(
        generate(model, prompt, 6, temperature=0, compile=True),
        generate(model, prompt, 6, temperature=0),
    )


@pytest.mark.parametrize("pe", ["fire", "rope", "alibi"])
def test_generation_past_the_window_across_documents(pe):
    """Past max_context the rolling cache keeps each document's start; re-running the window without
    a cache (FIRE reads it at its own positions, past its threshold here) counts from the same start
    where the window cut a document: each step's logits agree (one layer, where a window of keys is
    all a query's output depends on, with or without a cache)."""
    from generate import next_logits

    model = packed_model(pe, block_size=8, n_layer=1).eval()
    # 22 tokens: the window of 12 cuts the second document
    prompt = torch.cat(documents((9, 13), seed=7))[None]
    tokens = generate(model, prompt, 10, temperature=0, max_context=12)
    cache, new = None, prompt
    with torch.no_grad():
        for T in range(prompt.size(1), tokens.size(1)):
            cached, cache = next_logits(model, tokens[:, :T], new, cache, 12)
            again, _ = next_logits(model, tokens[:, :T], tokens[:, :T], None, 12, use_cache=False)
            # RoPE's float32 angles at other positions
            close(cached, again, tol=1e-5 if pe == "rope" else 1e-10)
            new = tokens[:, T : T + 1]


def test_dynamic_ntk_reads_each_documents_length():
    """RoPE's dynamic NTK scales by the span the queries see: in a packed row, each document's own
    length, so each document gets the logits it gets alone (the longest document of the batch scales
    no other)."""
    model = packed_model("rope", rope_scaling="dynamic_ntk", rope_original_max_len=6).eval()
    assert_logits_alone(model, [documents(lengths, seed) for seed, lengths in enumerate(LAYOUTS)])


# FIRE: within its threshold
RELATIVE = [pe for pe, cls in POS_ENCODINGS.items() if cls.relative] + ["fire"]


@pytest.mark.parametrize("pe", ENCODINGS)
def test_the_restart_changes_nothing_for_the_relative_encodings(pe, monkeypatch):
    """Positions counted from each document's start, or from the row's: once attention stays inside
    a document the encodings whose scores read i - j alone (FIRE within its threshold too) give the
    same logits; the absolute ones (sinusoidal, learned) do not: for them the restart is the
    point."""
    model = packed_model(pe).eval()
    rows = torch.stack(
        [torch.cat(documents(lengths, seed)) for seed, lengths in enumerate(LAYOUTS)]
    )
    with torch.no_grad():
        restarted, _ = model(rows)
        stream = lambda chunk: (
            chunk.pos.expand(len(rows), -1),
            chunk.key_pos.expand(len(rows), -1),
        )  # noqa: E731
        monkeypatch.setattr(Chunk, "document_positions", stream)
        counted_on, _ = model(rows)
    if pe in RELATIVE:  # RoPE's angles p·θ are float32: other positions, other roundings
        close(counted_on, restarted, tol=1e-5 if pe == "rope" else 1e-10)
    else:
        assert (counted_on - restarted).abs().max() > 1e-3


def test_a_stream_model_lets_documents_see_each_other():
    """The default packing (nanoGPT's stream) is today's model: a document after the first sees the
    ones before it."""
    model = tiny("rope", block_size=40).double()
    assert model.config.packing == "stream"
    docs = documents((7, 12), seed=0)
    with torch.no_grad():
        packed, _ = model(torch.cat(docs)[None])
        alone, _ = model(docs[1][None])
    assert (packed[0, 7:] - alone[0]).abs().max() > 1e-3


@pytest.mark.parametrize(
    "kw, fragment",
    [
        (
            dict(packing="document"),
            "packing='document' is not a packing; valid choices: stream, documents",
        ),
        (dict(packing="documents"), "packing='documents' needs eot_token"),
        (dict(packing="documents", eot_token=VOCAB), "below vocab_size"),
        (dict(packing="documents", eot_token=True), "needs eot_token"),
    ],
)
def test_bad_packing_is_one_clear_error(kw, fragment):
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(")):
        GPTConfig(vocab_size=VOCAB, **kw)


def test_an_old_config_loads_as_a_stream():
    """A checkpoint's model_args from before packing existed build today's default: a stream."""
    old = {
        k: v
        for k, v in vars(GPTConfig(vocab_size=VOCAB)).items()
        if k not in ("packing", "eot_token")
    }
    assert GPTConfig(**old).packing == "stream" and GPT(GPTConfig(**old)).config.eot_token is None


def test_a_kv_cache_without_documents_stays_as_it_was():
    """A stream model's cache keeps no document starts (the decode step's tensors are as before)."""
    model = tiny("alibi")
    cache = KVCache(model.config.n_layer, 16)
    with torch.no_grad():
        model(torch.ones(1, 4, dtype=torch.long), cache=cache)
    assert cache.starts is None


# --------------------------------------------------------------------------------------------------
# The data and the training run


def test_prepared_documents_decode_to_the_documents(tmp_path):
    """prepare_documents writes the documents in order, an end-of-text token before each after the
    first (the char datasets' record separator, GPT-2's <|endoftext|>), the validation split the
    last whole documents, and meta.json names the token."""
    import json

    import numpy as np

    from lib.datafiles import DOCUMENT_SEPARATOR, load_meta, prepare_documents
    from lib.tokenizer import GPT2_EOT, tokenizer_from_meta

    docs = [f"document {i}: " + "words " * (i % 7) for i in range(40)]
    for kind in ("char", "gpt2"):
        out = tmp_path / kind
        prepare_documents(docs, out, kind)
        meta = json.loads((out / "meta.json").read_text())
        tok = tokenizer_from_meta(meta["tokenizer"])
        eot = meta["eot"]
        assert eot == (tok.encode(DOCUMENT_SEPARATOR)[0] if kind == "char" else GPT2_EOT)
        splits = [np.fromfile(out / f"{s}.bin", dtype=np.uint16).tolist() for s in ("train", "val")]
        texts = []
        for ids in splits:
            starts = [0] + [i for i, t in enumerate(ids) if t == eot]
            ends = [*starts[1:], len(ids)]
            texts += [
                tok.decode([t for t in ids[a:b] if t != eot])
                for a, b in zip(starts, ends, strict=True)
            ]
        assert texts == docs and 0 < len(splits[1]) < len(splits[0])
        assert load_meta(out)["eot"] == eot


@pytest.mark.parametrize(
    "docs, fragment",
    [
        (["only one"], "two or more"),
        (["a", "b\x1ec"], "holds '\\x1e'"),
    ],
)
def test_bad_documents_are_one_clear_error(docs, fragment, tmp_path):
    from lib.datafiles import DataError, prepare_documents

    with pytest.raises(DataError, match=fragment.replace("\\", "\\\\")):
        prepare_documents(docs, tmp_path, "char")


def test_the_embedded_corpus_in_scenes():
    """The scenes are the corpus cut before its headings: joined they are the text; each after the
    first begins with a work's title or an act's or a scene's heading; an act's heading and its
    first scene are one document."""
    from lib.datafiles import SCENE_HEADING, read_embedded_corpus, scenes

    text = read_embedded_corpus()
    docs = scenes(text)
    assert "".join(docs) == text and 700 < len(docs) < 900
    for doc in docs[1:]:
        first = doc.splitlines()
        assert SCENE_HEADING.match(first[0]) or first[2].strip() == "by William Shakespeare", first[
            :3
        ]
    assert sum(d.startswith("ACT I.\n\nSCENE 1.") for d in docs) >= 1  # an act with its first scene


@pytest.fixture(scope="module")
def scenes_data(tmp_path_factory):
    """The first 40 documents of the embedded corpus's scenes, character level."""
    from lib.datafiles import prepare_documents, read_embedded_corpus, scenes

    d = tmp_path_factory.mktemp("data") / "scenes"
    prepare_documents(scenes(read_embedded_corpus())[:40], d, "char")
    return d


TRAIN = [
    "--device=cpu",
    "--compile=False",
    "--dtype=float32",
    "--n_layer=1",
    "--n_head=2",
    "--n_embd=16",
]
TRAIN += [
    "--block_size=32",
    "--batch_size=4",
    "--eval_iters=2",
    "--eval_interval=4",
    "--warmup_iters=1",
]
TRAIN += ["--lr_decay_iters=8", "--dropout=0.0", "--pos_encoding=sinusoidal"]


def train_cli(*args: str):
    from conftest import run_cli

    import train

    return run_cli(train.cli, [*TRAIN, *args])


def test_a_documents_run_trains_records_its_packing_and_resumes_with_it(scenes_data, tmp_path):
    """--packing=documents trains on data that marks its documents, logs the distances it trains at,
    records the packing and the end-of-text token in the checkpoint; a resume that does not name the
    packing keeps it, and the checkpoint's model evaluates its documents alone."""
    from lib.checkpoint import load_checkpoint, model_from_checkpoint

    out = tmp_path / "run"
    r = train_cli(
        f"--dataset={scenes_data}", "--packing=documents", "--max_iters=4", f"--out_dir={out}"
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert (
        "documents: positions restart at each end-of-text token" in r.stdout
        and "trained distances up to" in r.stdout
    )
    ckpt = load_checkpoint(out / "ckpt.pt")
    assert ckpt["model_args"]["packing"] == "documents" and ckpt["config"]["packing"] == "documents"
    eot = ckpt["model_args"]["eot_token"]
    r = train_cli(
        f"--dataset={scenes_data}", "--max_iters=8", "--init_from=resume", f"--out_dir={out}"
    )
    assert r.returncode == 0, r.stderr[-2000:]
    ckpt = load_checkpoint(out / "ckpt.pt")
    assert ckpt["iter_num"] == 8 and ckpt["model_args"]["packing"] == "documents"
    model = model_from_checkpoint(ckpt).eval()
    docs = [torch.tensor([5, 6, 7, 8]), torch.tensor([eot, 9, 10])]
    with torch.no_grad():
        close(model(torch.cat(docs)[None])[0][0, 4:], model(docs[1][None])[0][0])


def test_packing_documents_needs_documents(tiny_stream_data, scenes_data, tmp_path):
    """Data that marks no documents, a task, and a model whose end-of-text token the data does not
    share: one line each, naming the fix."""
    r = train_cli(
        f"--dataset={tiny_stream_data}",
        "--packing=documents",
        "--max_iters=2",
        f"--out_dir={tmp_path}/a",
    )
    assert (
        r.returncode == 1
        and "needs data that marks its documents" in r.stderr
        and "Traceback" not in r.stderr
    )
    assert "--dataset=shakespeare_char_scenes" in r.stderr
    r = train_cli("--task=copy", "--packing=documents", "--max_iters=2", f"--out_dir={tmp_path}/b")
    assert r.returncode == 1 and "packing='documents' with task='copy'" in r.stderr
    out = tmp_path / "c"
    assert (
        train_cli(
            f"--dataset={scenes_data}", "--packing=documents", "--max_iters=2", f"--out_dir={out}"
        ).returncode
        == 0
    )
    unmarked = tmp_path / "unmarked"  # the same tokens, its documents not marked
    shutil.copytree(scenes_data, unmarked)
    meta = json.loads((unmarked / "meta.json").read_text())
    (unmarked / "meta.json").write_text(json.dumps({k: v for k, v in meta.items() if k != "eot"}))
    for how in (
        ["--init_from=resume", f"--out_dir={out}"],
        [f"--init_from={out}", f"--out_dir={tmp_path}/d"],
    ):
        r = train_cli(f"--dataset={unmarked}", "--max_iters=4", *how)
        assert (
            r.returncode == 1
            and "packs documents, each begun at token" in r.stderr
            and "marks none" in r.stderr
        )
        assert "Traceback" not in r.stderr and "--packing=stream" not in r.stderr


@pytest.fixture(scope="module")
def tiny_stream_data(tmp_path_factory):
    from lib.datafiles import prepare_text, read_embedded_corpus

    d = tmp_path_factory.mktemp("data") / "stream"
    prepare_text(read_embedded_corpus()[:100_000], d, "char")
    return d


def test_an_extension_keeps_the_packing(scenes_data, tmp_path):
    """A run extended to a longer block keeps its source's packing; naming another is an error."""
    from lib.checkpoint import load_checkpoint

    src = tmp_path / "src"
    assert (
        train_cli(
            f"--dataset={scenes_data}", "--packing=documents", "--max_iters=2", f"--out_dir={src}"
        ).returncode
        == 0
    )
    longer = ["--block_size=64", "--max_iters=2", f"--init_from={src}", f"--dataset={scenes_data}"]
    r = train_cli(*longer, f"--out_dir={tmp_path}/ext")
    assert r.returncode == 0, r.stderr[-2000:]
    assert load_checkpoint(tmp_path / "ext" / "ckpt.pt")["model_args"]["packing"] == "documents"
    r = train_cli(*longer, "--packing=stream", f"--out_dir={tmp_path}/ext2")
    assert r.returncode == 1 and "packing='stream' contradicts" in r.stderr, r.stderr


@pytest.mark.slow
def test_fsdp_and_activation_checkpointing_train_documents_as_one_process(scenes_data, tmp_path):
    """Two FSDP processes with full activation checkpointing, packing documents, reach the weights
    of one process without either (the same global batch): the documents are each row's, whichever
    process holds the row."""
    from test_train import torchrun

    from lib.checkpoint import load_checkpoint

    common = [
        f"--dataset={scenes_data}",
        "--packing=documents",
        "--dropout=0.0",
        "--max_iters=3",
        "--eval_interval=3",
    ]
    one = tmp_path / "one"
    assert train_cli(*common, "--batch_size=8", f"--out_dir={one}").returncode == 0
    two = tmp_path / "two"
    args = [
        "--parallel=fsdp",
        "--batch_size=2",
        "--gradient_accumulation_steps=4",
        "--activation_checkpointing=full",
    ]
    r = torchrun(2, "train.py", *TRAIN, *common, *args, f"--out_dir={two}")
    assert r.returncode == 0, r.stderr[-3000:]
    a = load_checkpoint(one / "ckpt.pt")["model"]
    b = load_checkpoint(two / "ckpt.pt")["model"]
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-5, rtol=1e-4, msg=k)


@pytest.mark.parametrize("pe", ["bias_rpe", "alibi", "rope", "fire", "cope", "fox"])
def test_documents_alone_on_cuda_compiled(pe, cuda):
    """On a GPU, compiled (FlexAttention under the block mask of each row's documents; the band
    gradient inside a document; SDPA under the mask for RoPE; CoPE's counted blocks and FoX's rows,
    each row's own documents): each document of a packed row gets its logits and gradients alone, in
    float32 to the kernels' tolerance."""
    # FlexAttention needs a head dim of 16 or more
    model = packed_model(pe, n_head=2, n_embd=64).float().cuda()
    rows = [[d.cuda() for d in documents(lengths, seed)] for seed, lengths in enumerate(LAYOUTS)]
    # the rows compiled; each document alone eager (a compile per length would test the compiler,
    # not the rule)
    assert_documents_alone(torch.compile(model), rows, tol=2e-4, alone=model)


@pytest.mark.parametrize(
    "separator, sep",
    [
        ("§", "§"),
        ("═══", "═══"),
        ("\n—\n", "\n—\n"),
        ("\\u00a7", "§"),
        ("\\N{SECTION SIGN}", "§"),
        ("##\\", "##\\"),  # a backslash that ends it: itself
        # one that starts no escape (\\s): itself, and no warning
        ("\\section{A}\\n", "\\section{A}\n"),
        ("\\r\\n\\r\\n", "\r\n\r\n"),  # a CRLF file's blank line: read with its own line ends
    ],
)
def test_a_separator_is_the_characters_typed(separator, sep, tmp_path, capsys, monkeypatch):
    """data/text/prepare.py --separator splits at the characters typed, non-ASCII ones too ('§',
    '═══', a dash between newlines), and reads Python's escapes (\\u00a7, \\N{SECTION SIGN}); a
    backslash that starts none, or ends it, is itself, with no warning; a CRLF file keeps its line
    ends: four documents joined by three separators."""
    import runpy
    import warnings

    newline = "\r\n" if "\r" in sep else "\n"
    text = sep.join(f"document {i} says hello there.{newline}" * 20 for i in range(4))
    (tmp_path / "in.txt").write_bytes(text.encode("utf-8"))
    prepare = Path(__file__).resolve().parents[1] / "data" / "text" / "prepare.py"
    argv = ["prepare.py", "--input", str(tmp_path / "in.txt"), "--out_dir", str(tmp_path / "out")]
    # as the command line gives it
    monkeypatch.setattr("sys.argv", [*argv, f"--separator={separator}"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        runpy.run_path(str(prepare), run_name="__main__")
    assert "3 + 1 documents" in capsys.readouterr().out


def test_a_separator_naming_no_character_is_one_line(tmp_path, monkeypatch):
    """--separator='\\N{SECTON SIGN}' (a misspelled name) is one line naming --separator, not a
    codec's error."""
    import runpy

    (tmp_path / "in.txt").write_text("a§b\n" * 50, encoding="utf-8")
    prepare = Path(__file__).resolve().parents[1] / "data" / "text" / "prepare.py"
    argv = ["prepare.py", "--input", str(tmp_path / "in.txt"), "--out_dir", str(tmp_path / "out")]
    monkeypatch.setattr("sys.argv", [*argv, "--separator=\\N{SECTON SIGN}"])
    with pytest.raises(SystemExit) as e:
        runpy.run_path(str(prepare), run_name="__main__")
    assert (
        str(e.value.code)
        == "error: --separator='\\\\N{SECTON SIGN}': \\N{SECTON SIGN} names no character"
    )
    assert not (tmp_path / "out").exists()


def test_the_table_gradient_compiles_for_lengths_its_tiles_divide(cuda):
    """Compiled with dynamic shapes (a training run's documents of many lengths make them so),
    bias-RPE's table gradient runs for a length its tiles divide exactly, where padding adds
    nothing: the pad of a transposed q then kept its strides, which the traced graph's views did not
    expect (a GPU's check, emulated on a CPU)."""
    model = (
        packed_model("bias_rpe", n_layer=1, n_head=2, n_embd=64, rpe_max_distance=8).float().cuda()
    )
    compiled = torch.compile(model, dynamic=True)
    idx = documents((14,), seed=0)[0][None].cuda()  # tiles of R = 7 queries: 14 pads nothing
    logits, grads = logits_and_grads(compiled, idx, torch.roll(idx, -1, 1))
    ref_logits, ref_grads = logits_and_grads(model, idx, torch.roll(idx, -1, 1))
    close(logits, ref_logits, tol=2e-4)
    close(grads["transformer.encoding.weight"], ref_grads["transformer.encoding.weight"], tol=2e-4)
