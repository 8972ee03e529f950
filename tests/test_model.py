"""Tests for model.py: every positional encoding, the exact KV cache, and GPT-2 parity."""

import contextlib
import copy
import inspect
import itertools
import math
from dataclasses import fields, replace
from pathlib import Path

import pytest
import torch
from conftest import (
    BIASED,
    CROPPING,
    ENCODINGS,
    EXTRAPOLATING,
    POSITION_BIASED,
    RELATIVE,
    ROLLING,
    VOCAB,
    cached_logits,
    close,
    greedy_reference,
    tiny,
    tokens,
)
from torch._dynamo.testing import CompileCounterWithBackend
from torch.nn import functional as F
from torch.nn.attention.flex_attention import flex_attention

import fast_paths
import model as model_py
from fast_paths import AttentionOptions, kernel
from generate import KVCache, generate, sample_next
from lib import kernel_fallbacks
from lib.kernel_fallbacks import with_kernel_fallbacks
from model import (
    ENCODING_OPTIONS,
    GPT,
    POS_ENCODINGS,
    Chunk,
    GPTConfig,
    ModelShape,
    alibi_slopes,
    apply_rotary,
)

# --------------------------------------------------------------------------------------------------
# KV cache, case 1: inside the context window


@pytest.mark.parametrize("pe", ENCODINGS)
@pytest.mark.parametrize("B", [1, 3])
@pytest.mark.parametrize("chunks", [[16], [1] * 16, [5, 1, 7, 3], [2, 9, 1, 1, 3]])
def test_cache_inside_block_equals_full_forward(pe, B, chunks):
    """Feeding tokens through the cache in any chunking gives the full forward's logits."""
    model = tiny(pe)
    idx = tokens(B, sum(chunks))
    close(cached_logits(model, idx, chunks), model(idx)[0])


@pytest.mark.parametrize("pe", ENCODINGS)
@pytest.mark.parametrize("B,T", [(1, 1), (2, 5), (3, 9)])
def test_cached_greedy_generation_equals_uncached(pe, B, T):
    """Greedy tokens with the cache equal those of full forwards (inside block_size)."""
    model = tiny(pe)
    idx = tokens(B, T)
    steps = model.config.block_size - T
    expected = greedy_reference(model, idx, steps, lambda m, x: m(x)[0][:, -1])
    assert torch.equal(model.generate(idx, steps, temperature=0), expected)
    assert torch.equal(model.generate(idx, steps, temperature=0, use_cache=False), expected)


# --------------------------------------------------------------------------------------------------
# KV cache, case 2: max_context > block_size, positions keep counting


@pytest.mark.parametrize("pe", EXTRAPOLATING)
@pytest.mark.parametrize("chunks", [[30], [5] + [1] * 25, [3, 11, 1, 15]])
@pytest.mark.parametrize("extra", [0, 7])
def test_cache_past_block_size_equals_full_forward(pe, chunks, extra):
    """Past block_size (no window reached), cached logits equal the full forward over the whole
    sequence."""
    model = tiny(pe, block_size=8)
    idx = tokens(2, sum(chunks))
    close(cached_logits(model, idx, chunks, window=40, extra=extra), model(idx)[0])


@pytest.mark.parametrize("pe", EXTRAPOLATING)
def test_generation_past_block_size_uses_true_positions(pe):
    """generate(max_context > block_size) equals greedy full forwards over the whole, uncropped
    sequence."""
    model = tiny(pe, block_size=8)
    idx = tokens(2, 3)
    expected = greedy_reference(model, idx, 25, lambda m, x: m(x)[0][:, -1])
    assert torch.equal(model.generate(idx, 25, temperature=0, max_context=28), expected)


def test_learned_positions_refuse_to_extrapolate():
    """A learned-position model raises a clear error past block_size instead of indexing out of
    range."""
    model = tiny("learned", block_size=8)
    with pytest.raises(ValueError, match="block_size=8"):
        model(tokens(1, 9))
    with pytest.raises(ValueError, match="max_context"):
        model.generate(tokens(1, 2), 3, max_context=9)
    cache = KVCache(model.config.n_layer, 16)
    model(tokens(1, 8), cache=cache)
    with pytest.raises(ValueError, match="block_size"):
        model(tokens(1, 1), cache=cache)


# --------------------------------------------------------------------------------------------------
# KV cache, case 3: past max_context


@pytest.mark.parametrize("pe", RELATIVE)
def test_sliding_window_forward_equals_cropped_forward_one_layer(pe):
    """With one layer, a relative encoding's sliding-window forward at position t equals a plain
    forward over the last W tokens (an independent check of the window mask)."""
    model = tiny(pe, n_layer=1)
    W = 6
    idx = tokens(2, 20)
    windowed = model(idx, window=W)[0]
    for t in range(idx.size(1)):
        close(windowed[:, t], model(idx[:, max(0, t - W + 1) : t + 1])[0][:, -1], tol=1e-4)


@pytest.mark.parametrize("pe", ROLLING)
@pytest.mark.parametrize("chunks", [[30], [1] * 30, [4, 1, 1, 9, 1, 14], [12, 18]])
@pytest.mark.parametrize("extra", [0, 3, 40])
def test_rolling_cache_equals_sliding_window_forward(pe, chunks, extra):
    """A rolling cache of width W gives the logits of a full forward with a sliding-window causal
    mask of W, whether its ring wraps every token (extra=0), every few tokens, or never
    (extra=40)."""
    model = tiny(pe)
    W = 6
    idx = tokens(2, sum(chunks))
    close(cached_logits(model, idx, chunks, window=W, extra=extra), model(idx, window=W)[0])


@pytest.mark.parametrize("pe", RELATIVE)
@pytest.mark.parametrize("T", [2, 10])
def test_generation_past_max_context_relative(pe, T):
    """Relative encodings: cached generation past max_context equals greedy sliding-window full
    forwards; uncached generation equals nanoGPT's crop-and-recompute."""
    model = tiny(pe)
    W = 6
    steps = 20
    idx = tokens(2, T)
    windowed = greedy_reference(model, idx, steps, lambda m, x: m(x, window=W)[0][:, -1])
    assert torch.equal(model.generate(idx, steps, temperature=0, max_context=W), windowed)
    cropped = greedy_reference(model, idx, steps, lambda m, x: m(x[:, -W:])[0][:, -1])
    assert torch.equal(
        model.generate(idx, steps, temperature=0, max_context=W, use_cache=False), cropped
    )


@pytest.mark.parametrize("pe", [e for e in ROLLING if e not in RELATIVE])
@pytest.mark.parametrize("T", [2, 10])
def test_generation_past_max_context_keeps_absolute_positions(pe, T):
    """FIRE reads absolute positions past its training length: cached generation past max_context
    equals greedy sliding-window full forwards at the tokens' own positions, and uncached generation
    re-runs the window at its positions (not from 0)."""
    model = tiny(pe)
    W = 6
    steps = 20
    idx = tokens(2, T)
    windowed = greedy_reference(model, idx, steps, lambda m, x: m(x, window=W)[0][:, -1])
    assert torch.equal(model.generate(idx, steps, temperature=0, max_context=W), windowed)

    def at_document_positions(m, x):
        return m(x[:, -W:], pos=torch.arange(max(0, x.size(1) - W), x.size(1)))[0][:, -1]

    cropped = greedy_reference(model, idx, steps, at_document_positions)
    assert torch.equal(
        model.generate(idx, steps, temperature=0, max_context=W, use_cache=False), cropped
    )


@pytest.mark.parametrize("pe", CROPPING)
@pytest.mark.parametrize("T", [2, 10])
@pytest.mark.parametrize("use_cache", [True, False])
def test_generation_past_max_context_absolute(pe, T, use_cache):
    """Absolute encodings past max_context crop to the last W tokens and restart positions at 0, as
    nanoGPT."""
    model = tiny(pe)
    W = 6
    steps = 20
    idx = tokens(2, T)
    expected = greedy_reference(model, idx, steps, lambda m, x: m(x[:, -W:])[0][:, -1])
    assert torch.equal(
        model.generate(idx, steps, temperature=0, max_context=W, use_cache=use_cache), expected
    )


def test_rolling_cache_keeps_only_the_window():
    """The rolling cache is preallocated: S slots, position p in slot p % S, holding the last S
    positions."""
    model = tiny("rope")
    W = 6
    S = 8
    cache = KVCache(model.config.n_layer, S)
    model(tokens(1, 20), cache=cache, window=W)
    assert (
        cache.pos.tolist() == [16, 17, 18, 19, 12, 13, 14, 15]
        and cache.next_pos == 20
        and cache.length == 20
    )
    assert all(k.size(2) == S for k in cache.k)
    k_before = cache.k[0].clone()
    model(tokens(1, 1), cache=cache, window=W)
    assert torch.equal(cache.k[0][:, :, 5:], k_before[:, :, 5:]) and torch.equal(
        cache.k[0][:, :, :4], k_before[:, :, :4]
    )
    assert not torch.equal(cache.k[0][:, :, 4], k_before[:, :, 4]) and cache.pos[4] == 20


def test_cache_errors_name_the_problem():
    """A cache too small for its window, or full without one, raises a clear error instead of
    dropping keys."""
    model = tiny("alibi")
    with pytest.raises(ValueError, match="window of 6"):
        model(tokens(1, 3), cache=KVCache(model.config.n_layer, 4), window=6)
    cache = KVCache(model.config.n_layer, 5)
    model(tokens(1, 4), cache=cache)
    with pytest.raises(ValueError, match="holds 5 tokens"):
        model(tokens(1, 2), cache=cache)


def test_the_cache_advances_only_in_claim(monkeypatch):
    """A KV cache's bookkeeping (next_pos, length, the slots' positions) changes in KVCache.claim
    alone, once per chunk the model writes (a chunk split to fit the window is several) and once per
    decoded token, and greedy generation through it still equals full forwards."""
    claims = []
    inside = [False]
    version = [None]
    claim = KVCache.claim
    set_attr = KVCache.__setattr__

    def claiming(self, idx, *args):
        assert self.pos is None or self.pos._version == version[0], (
            "the slots' positions changed outside claim"
        )
        inside[0] = True
        try:
            return claim(self, idx, *args)
        finally:
            inside[0] = False
            version[0] = self.pos._version
            claims.append(idx.size(1))

    def watched(self, name, value):
        # after __init__
        if name in ("next_pos", "length", "pos", "starts") and hasattr(self, name):
            assert inside[0], f"KVCache.{name} set outside claim"
        set_attr(self, name, value)

    monkeypatch.setattr(KVCache, "claim", claiming)
    monkeypatch.setattr(KVCache, "__setattr__", watched)
    model = tiny("alibi")
    idx = tokens(2, 16)
    close(cached_logits(model, idx, [5, 1, 7, 3]), model(idx)[0])
    assert claims == [5, 1, 7, 3]
    claims.clear()
    # 6 slots: chunks of one
    close(cached_logits(model, idx, [16], window=6), model(idx, window=6)[0])
    assert claims == [1] * 16
    claims.clear()
    prompt = tokens(2, 5)
    expected = greedy_reference(model, prompt, 8, lambda m, x: m(x)[0][:, -1])
    assert torch.equal(model.generate(prompt, 8, temperature=0), expected)
    assert claims == [5] + [1] * 7  # the prompt, then each token fed back (the last one is not)


# --------------------------------------------------------------------------------------------------
# Attention paths and the encodings against their formulas

# the facts of a bias of i - j alone (bias-RPE) training on a CPU, eagerly, handed as its table:
# each row of the table below changes what it needs
FACTS = dict(
    bias=True,
    has_table=True,
    trainable=True,
    window=False,
    cached=False,
    consecutive=True,
    device="cpu",
    compiling=False,
    dropout=False,
    fits=True,
    queries=100,  # more than one block of queries (a decode step has 1)
)
CUDA_COMPILED = dict(device="cuda", compiling=True)
# the CUDA tests' head sizes: below FlexAttention's floor (the materialized bias) and above it; a
# GPU adds the sizes whose Triton kernels differ, which its emulation on a CPU (the `cuda` fixture)
# runs alike
CUDA_HEAD_DIMS = [8, 16, 64, 128] if torch.cuda.is_available() else [8, 16]


def attention_path(options: AttentionOptions, bias, window, cached, consecutive, **facts) -> str:
    """The path a forward takes: model.py's reference (SDPA, causal where it can) where the encoding
    has no score bias or fast_paths.kernel has no row for it, else that kernel."""
    if not bias:
        return "sdpa_causal" if not window and not cached else "sdpa_mask"
    return (
        name_of(kernel(options, own_keys=consecutive and not cached, cached=cached, **facts))
        or "sdpa_mask"
    )


@pytest.mark.parametrize(
    "fused, facts, path",
    [
        # sdpa_causal: no bias, no window, no cache, whatever else holds
        (None, dict(bias=False, has_table=False), "sdpa_causal"),
        (True, dict(bias=False, has_table=False, **CUDA_COMPILED, dropout=True), "sdpa_causal"),
        (None, dict(bias=False, has_table=False, window=True), "sdpa_mask"),
        (None, dict(bias=False, has_table=False, cached=True, trainable=False), "sdpa_mask"),
        # flex_table: a trainable bias handed as its table, fused (by default: compiled on CUDA),
        # consecutive, no cache
        (None, CUDA_COMPILED, "flex_table"),
        (True, dict(), "flex_table"),
        (None, dict(**CUDA_COMPILED, window=True), "flex_table"),
        (None, dict(**CUDA_COMPILED, cached=True), "sdpa_mask"),
        (None, dict(**CUDA_COMPILED, consecutive=False), "sdpa_mask"),
        # FIRE compiled: no table, its rows by blocks
        (None, dict(**CUDA_COMPILED, has_table=False), "bias_blocks"),
        (None, dict(**CUDA_COMPILED, has_table=False, dropout=True), "sdpa_mask"),
        (None, dict(**CUDA_COMPILED, has_table=False, cached=True), "sdpa_mask"),
        (None, dict(device="cuda", has_table=False), "sdpa_mask"),  # uncompiled on CUDA: not fused
        (None, dict(**CUDA_COMPILED, dropout=True), "sdpa_mask"),
        (None, dict(**CUDA_COMPILED, fits=False), "sdpa_mask"),
        (False, CUDA_COMPILED, "sdpa_mask"),
        # uncompiled on CUDA: FlexAttention would not be fused
        (None, dict(device="cuda"), "sdpa_mask"),
        # flex: a bias without a gradient (ALiBi, or evaluation), fused, any cache or window
        (None, dict(**CUDA_COMPILED, trainable=False, has_table=False), "flex"),
        (True, dict(trainable=False, cached=True, window=True, consecutive=False), "flex"),
        # eager on a CPU: not fused by default
        (None, dict(trainable=False, has_table=False), "bias_blocks"),
        (True, dict(trainable=False, dropout=True), "sdpa_mask"),
        (True, dict(trainable=False, fits=False), "bias_table"),
        (True, dict(trainable=False, fits=False, has_table=False), "bias_blocks"),
        # uncompiled on CUDA: not fused, the reference
        (None, dict(trainable=False, device="cuda"), "sdpa_mask"),
        # compiled, keys from a cache
        (None, dict(trainable=False, compiling=True, cached=True), "sdpa_mask"),
        # bias_blocks: any other bias on a CPU (FIRE past its threshold), trained or not, eager, or
        # compiled with the keys the queries' own; no dropout, unless fused is False
        (None, dict(has_table=False), "bias_blocks"),
        (True, dict(has_table=False), "bias_blocks"),
        (None, dict(has_table=False, cached=True, window=True, consecutive=False), "bias_blocks"),
        # the reference: a cached chunk of one block of queries at most on a CPU (a decode step),
        # whose one block would be the reference's matrix
        (None, dict(has_table=False, trainable=False, cached=True, queries=1), "sdpa_mask"),
        (None, dict(has_table=False, trainable=False, cached=True, queries=64), "sdpa_mask"),
        (None, dict(has_table=False, trainable=False, cached=True, queries=65), "bias_blocks"),
        (True, dict(trainable=False, cached=True, queries=1), "flex"),  # fused: FlexAttention first
        (None, dict(has_table=False, compiling=True), "bias_blocks"),
        (None, dict(has_table=False, compiling=True, window=True), "bias_blocks"),
        (False, dict(has_table=False), "sdpa_mask"),
        (None, dict(has_table=False, compiling=True, cached=True), "sdpa_mask"),
        (None, dict(has_table=False, compiling=True, consecutive=False), "sdpa_mask"),
        (None, dict(has_table=False, dropout=True), "sdpa_mask"),
        # learned positions' table trains: no bias
        (None, dict(bias=False, has_table=False, window=True), "sdpa_mask"),
        # bias_table: a bias of i - j alone handed as its table (on a CPU), trained or not, eager or
        # with own keys
        (None, dict(), "bias_table"),
        (None, dict(trainable=False, cached=True, window=True), "bias_table"),
        (None, dict(compiling=True), "bias_table"),
        # fused, but its keys from a cache: no band of distances
        (True, dict(cached=True), "bias_table"),
        (True, dict(trainable=False), "flex"),
        (False, dict(), "sdpa_mask"),
        (None, dict(dropout=True), "sdpa_mask"),
        (None, dict(compiling=True, cached=True), "sdpa_mask"),
        (None, dict(trainable=False, device="cuda"), "sdpa_mask"),
    ],
)
def test_attention_path_follows_its_table(fused, facts, path):
    """fast_paths.kernel gives the builder docs/development.md's table names for each row, and the
    next row down (at last model.py's reference) where a row's condition fails."""
    table = (Path(__file__).parents[1] / "docs" / "development.md").read_text()
    table = table.split("### The kernel table, row by row")[1].split("###")[0]
    assert path in ("sdpa_causal", "sdpa_mask") or f"`{path}`" in table
    # kernel options pick no path
    options = AttentionOptions(fused=fused, flex_kernel_options={"num_stages": 1})
    assert attention_path(options, **{**FACTS, **facts}) == path


def name_of(builder) -> str | None:
    """A builder kernel() answers, by name (None: model.py's reference)."""
    return None if builder is None else builder.__name__


@pytest.mark.parametrize("pe", BIASED)
@pytest.mark.parametrize("grad", [True, False])
def test_attention_is_built_in_one_call_per_forward(pe, grad, monkeypatch):
    """model.py calls into the kernels at one site, the builder fast_paths.kernel returns, once per
    forward (once per layer for a bias of each layer's own), training and evaluating on a CPU."""
    source = inspect.getsource(model_py)
    assert source.count("fast_paths.kernel(") == 1 and source.count("build(") == 1
    built = []
    kernel = fast_paths.kernel

    def spy(*a, **k):
        builder = kernel(*a, **k)

        def counted(layer: fast_paths.LayerBias):
            built.append(builder.__name__)
            return builder(layer)

        return counted

    monkeypatch.setattr(fast_paths, "kernel", spy)
    model = tiny(pe, block_size=130, n_layer=3)
    with torch.set_grad_enabled(grad):
        model(torch.randint(0, VOCAB, (2, 130)))
    assert len(built) == (3 if model.encoding.per_layer else 1), built


def test_every_kernel_of_the_table_has_its_builder():
    """Over every combination of facts, fast_paths.kernel answers only builders of fast_paths (each
    from a LayerBias to the attention), or None for the reference; each is the answer for some
    facts: none is unreachable, and no answer is a name."""
    names = [
        "trainable",
        "own_keys",
        "compiling",
        "dropout",
        "fits",
        "has_table",
        "sums",
        "content",
    ]
    answers = {
        kernel(AttentionOptions(fused=fused), device=device, **dict(zip(names, bits, strict=True)))
        for fused in (None, True, False)
        for device in ("cpu", "cuda")
        for bits in itertools.product((False, True), repeat=len(names))
    }
    builders = {"flex_table", "flex", "bias_table", "sum_blocks", "bias_blocks", "one_block"}
    assert {name_of(a) for a in answers} == builders | {None}
    for builder in answers - {None}:
        assert getattr(fast_paths, builder.__name__) is builder
        assert list(inspect.signature(builder).parameters) == ["layer"]


def taken_paths(monkeypatch) -> list[str]:
    """The paths each forward builds from now on: a kernel's name, or sdpa_causal / sdpa_mask for
    the reference."""
    got = []
    answers = []
    table = fast_paths.kernel
    attention = model_py.attention_for
    monkeypatch.setattr(
        fast_paths, "kernel", lambda *a, **k: answers.append(table(*a, **k)) or answers[-1]
    )

    def recording(chunk, pe, *args):
        answers.clear()
        built = attention(chunk, pe, *args)
        if pe.has_score_bias:
            got.append(name_of(answers[-1]) or "sdpa_mask")
        else:
            got.append("sdpa_causal" if chunk.window is None and not chunk.cached else "sdpa_mask")
        return built

    monkeypatch.setattr(model_py, "attention_for", recording)
    return got


@pytest.mark.parametrize(
    "pe, fused, train, kw, paths",
    [
        ("rope", None, True, dict(), {"sdpa_causal"}),
        ("rope", None, False, dict(window=5), {"sdpa_mask"}),
        ("alibi", True, False, dict(window=5), {"flex"}),
        ("bias_rpe", None, True, dict(), {"bias_table"}),
        ("alibi", None, False, dict(), {"bias_table"}),
        # no table: distances unknown
        ("kerple", None, True, dict(pos=2 * torch.arange(16)), {"bias_blocks"}),
        ("bias_rpe", False, True, dict(), {"sdpa_mask"}),
        ("bias_rpe", True, True, dict(), {"flex_table"}),
        ("bias_rpe", True, True, dict(pos=2 * torch.arange(16)), {"bias_table"}),
        ("kerple", True, True, dict(), {"flex_table"}),  # its table over the distances 0 … T - 1
        # every query within its threshold: x of i - j alone
        ("fire", True, True, dict(), {"flex_table"}),
        ("fire", True, True, dict(pos=torch.arange(16) + 64), {"bias_blocks"}),  # past it
        ("fire", None, False, dict(), {"bias_table"}),
        ("fire", None, False, dict(pos=torch.arange(16) + 64), {"bias_blocks"}),
        ("fire", False, False, dict(), {"sdpa_mask"}),
    ],
)
def test_model_asks_the_table_with_its_own_facts(
    pe, fused, train, kw, paths, monkeypatch, flex_backward
):
    """A forward builds its attention once per layer (once in all for a bias shared by the layers),
    from the table's answer for the encoding's score bias, its gradient, the cache, the device and
    the positions as they are."""
    got = taken_paths(monkeypatch)
    model = tiny(pe, block_size=64).train(train)
    model.attention_options = replace(model.attention_options, fused=fused)
    idx = tokens(2, 16)
    with contextlib.nullcontext() if train else torch.no_grad():
        model(idx, **kw)
    assert set(got) == paths and len(got) == (
        model.config.n_layer if model.encoding.per_layer else 1
    )


@pytest.mark.parametrize("pe", ENCODINGS)
def test_causal_fast_path_equals_materialized_mask(pe):
    """SDPA's is_causal path and the materialized mask path give the same outputs."""
    model = tiny(pe)
    idx = tokens(2, 16)
    close(model(idx)[0], model(idx, window=16)[0])


# the encodings reference_attention writes out (sinusoidal, learned and none add nothing to
# attention itself)
HANDWRITTEN = (
    "sinusoidal",
    "learned",
    "none",
    "rope",
    "alibi",
    "bias_rpe",
    "t5",
    "kerple",
    "fire",
    "cope",
    "fox",
)


def reference_attention(model: GPT, x: torch.Tensor) -> torch.Tensor:
    """Layer 0's attention written out by hand: softmax(q·k/√d + bias + causal mask)·v, RoPE as
    complex numbers."""
    attn = model.transformer.h[0].attn
    pe = model.encoding
    cfg = model.config
    if cfg.pos_encoding not in HANDWRITTEN:
        pytest.fail(
            f"reference_attention has no formula for pos_encoding={cfg.pos_encoding!r}: write its "
            "term of the scores "
            "(or its rotation) here from its paper, and add it to HANDWRITTEN"
        )
    B, T, C = x.shape
    hs = C // cfg.n_head
    q, k, v = (
        t.view(B, T, cfg.n_head, hs).transpose(1, 2).double()
        for t in attn.c_attn(x).split(C, dim=2)
    )
    i = torch.arange(T)
    if cfg.pos_encoding == "rope":
        theta = cfg.rope_base ** (-torch.arange(0, hs, 2, dtype=torch.float64) / hs)
        rot = torch.polar(torch.ones(T, hs // 2, dtype=torch.float64), i[:, None] * theta)
        q, k = (
            torch.view_as_real(
                torch.view_as_complex(t.reshape(B, cfg.n_head, T, hs // 2, 2)) * rot
            ).flatten(-2)
            for t in (q, k)
        )
    scores = q @ k.transpose(-1, -2) / math.sqrt(hs)
    rel = i[:, None] - i[None, :]
    if cfg.pos_encoding == "alibi":
        scores = scores - alibi_slopes(cfg.n_head).double()[:, None, None] * rel
    if cfg.pos_encoding == "bias_rpe":
        r = cfg.rpe_max_distance
        scores = scores + pe.weight.double()[:, rel.clamp(-(r - 1), r - 1) + r - 1]
    # Raffel et al.: n < B/2 exact, then log-spaced up to max_distance, then the last
    if cfg.pos_encoding == "t5":
        nb = cfg.t5_num_buckets
        md = cfg.t5_max_distance
        exact = cfg.t5_num_buckets // 2
        bucket = lambda n: (
            n
            if n < exact
            else min(nb - 1, exact + int(math.log(n / exact) / math.log(md / exact) * (nb - exact)))
        )  # noqa: E731,E501
        scores = (
            scores + pe.weight.double()[:, [[bucket(max(int(n), 0)) for n in row] for row in rel]]
        )
    if cfg.pos_encoding == "kerple":  # Chi et al.: -r1·log(1 + r2·(i - j))
        r1, r2 = (p.exp().double()[:, None, None] for p in (pe.log_r1, pe.log_r2))
        scores = scores - r1 * torch.log(1 + r2 * rel.clamp(min=0))
    # Li et al.: f(ψ(i - j) / (ψ(max(L, i)) + 1e-6)), ψ(x) = log(|c|·x + 1), layer 0
    if cfg.pos_encoding == "fire":
        c = pe.c[0].abs().double()
        L = (pe.L_multiplier[0] * cfg.block_size).abs().double()
        psi = lambda x: torch.log(c * x + 1)  # noqa: E731
        x = psi(rel.clamp(min=0).double()) / (psi(torch.maximum(L, i[:, None].double())) + 1e-6)
        hidden = torch.relu(x[..., None] * pe.w1[0].double() + pe.b1[0].double())  # (T, T, 32)
        scores = scores + (hidden @ pe.w2[0].double().T).permute(2, 0, 1)
    # Golovneva et al.: p_ij = Σ_{t=j..i} σ(q_i·k_t/√d), z_i[p] = q_i·e[p], ⌊p⌋ to ⌈p⌉
    if cfg.pos_encoding == "cope":
        # g_it, t <= i
        g = torch.sigmoid(q @ k.transpose(-1, -2) / math.sqrt(hs)).masked_fill(rel < 0, 0.0)
        # (B, nh, T, T)
        p = torch.stack([g[..., j:].sum(-1) for j in range(T)], -1).clamp(max=cfg.cope_p_max - 1)
        z = q @ pe.e[0].double().T
        lo = p.floor()
        scores = (
            scores
            + z.gather(-1, p.ceil().long()) * (p - lo)
            + z.gather(-1, lo.long()) * (1 - p + lo)
        )
    # Lin et al.: Σ_{t=j+1..i} log f_t, f_t = σ(w·x_t + b) of each head
    if cfg.pos_encoding == "fox":
        # (B, nh, T)
        log_f = F.logsigmoid(x.double() @ pe.w[0].double().T + pe.b[0].double()).transpose(1, 2)
        scores = scores + torch.stack(
            [log_f[..., j + 1 : i + 1].sum(-1) for i in range(T) for j in range(T)], -1
        ).view(B, cfg.n_head, T, T)
    scores = scores.masked_fill(rel < 0, float("-inf"))
    y = (scores.softmax(-1) @ v.double()).transpose(1, 2).reshape(B, T, C)
    return attn.c_proj(y.float())


@pytest.mark.parametrize("pe", ENCODINGS)
def test_a_bf16_model_keeps_its_positions_exact_at_16x_the_block(pe):
    """A model cast to bf16 computes its positions as the float32 model with the same (rounded)
    parameters, at 16 times its block (or its longest): the embedding, the rotation, and the score
    bias of the last query over every key. A constant of the formula rounded to bf16 (ALiBi's slope
    2^-0.5) or a bias in bf16 arithmetic (KERPLE's log) is off by 0.01 or more there."""
    m32 = tiny(pe, block_size=16, n_head=12, n_embd=48)
    mb = copy.deepcopy(m32).to(torch.bfloat16)
    with torch.no_grad():
        for p in m32.parameters():
            p.copy_(p.bfloat16().float())
    pos = torch.arange(min(16 * 16, m32.encoding.max_length))
    pairs = [(m32.encoding.embed(pos), mb.encoding.embed(pos))]
    pairs += list(zip(m32.encoding.rotary(pos) or (), mb.encoding.rotary(pos) or (), strict=True))
    if m32.encoding.has_score_bias:
        last = Chunk(pos[-1:], key_pos=pos, slots=None, window=None, consecutive=False)
        # (nh, 1, T)
        pairs.append(
            tuple(model_py.pair_bias(m.encoding, 0, torch.arange(12), last) for m in (m32, mb))
        )
    for exact, cast in pairs:
        if exact is not None:
            torch.testing.assert_close(cast.float(), exact, rtol=1e-6, atol=0.0)


@pytest.mark.parametrize("pe", POSITION_BIASED)
def test_a_decode_step_computes_a_shared_bias_once(pe, monkeypatch):
    """Generating through the cache, each forward (the prefill, then a token) computes its score
    bias once when the layers share it, and once per layer for a bias of each layer's own: never
    once per layer for a shared one."""
    model = tiny(pe, n_layer=3)
    calls = []
    pair_bias = model_py.pair_bias
    monkeypatch.setattr(
        model_py, "pair_bias", lambda *a, **k: calls.append(1) or pair_bias(*a, **k)
    )
    generate(model, tokens(1, 5), 4, temperature=0)  # a prefill and 3 decode steps
    assert len(calls) == 4 * (3 if model.encoding.per_layer else 1)


def test_the_handwritten_reference_names_its_encodings():
    """The hand-written reference's list is the registry's: a new encoding meets a line naming what
    to add, not a mismatch of numbers; and an encoding it does not know fails with that line."""
    assert set(HANDWRITTEN) == set(ENCODINGS), (
        f"reference_attention lacks {sorted(set(ENCODINGS) - set(HANDWRITTEN))}"
    )
    model = tiny("alibi")
    model.config.pos_encoding = "sandwich"  # as a new encoding would meet it
    with pytest.raises(pytest.fail.Exception, match="no formula for pos_encoding='sandwich'"):
        reference_attention(model, torch.randn(1, 4, 32))


@pytest.mark.parametrize("pe", ENCODINGS)
def test_attention_matches_handwritten_reference(pe):
    """Each encoding's attention equals a float64 softmax written out from the papers' formulas."""
    model = tiny(pe)
    x = torch.randn(2, 12, 32)
    pos = torch.arange(12)
    cfg_attn = model.transformer.h[0].attn
    chunk = Chunk(pos, key_pos=pos, slots=None, window=None, consecutive=True)
    attention = model_py.attention_for(
        chunk, model.encoding, model.config, model.attention_options, 0.0
    )
    got = cfg_attn(x, model.encoding.rotary(pos), attention, None)
    close(got, reference_attention(model, x), tol=1e-4)


def test_fire_follows_the_papers_parameterisation():
    """FIRE as the paper's reference code: c starts at 0.1, the threshold is a multiplier from 1 of
    a fixed L0 = block_size, and a threshold of 0 keeps position 0 finite (ε in the normaliser); no
    output bias."""
    model = tiny("fire", block_size=16)
    pe = GPT(
        GPTConfig(
            block_size=16, vocab_size=VOCAB, n_layer=2, n_head=4, n_embd=32, pos_encoding="fire"
        )
    ).encoding
    assert torch.equal(pe.c, torch.full((2,), 0.1)) and torch.equal(pe.L_multiplier, torch.ones(2))
    assert float(pe.init_L) == 16.0 and "init_L" in dict(pe.named_buffers())
    assert not [n for n, _ in pe.named_parameters() if n.startswith("b2")]
    with torch.no_grad():
        model.encoding.L_multiplier.zero_()
    logits = model(tokens(2, 16))[0]
    assert torch.isfinite(logits).all()


PUBLISHED_SLOPES = {  # Press et al. 2021, the values of the paper's reference code
    8: [1 / 2, 1 / 4, 1 / 8, 1 / 16, 1 / 32, 1 / 64, 1 / 128, 1 / 256],
    12: [
        0.5,
        0.25,
        0.125,
        0.0625,
        0.03125,
        0.015625,
        0.0078125,
        0.00390625,
        0.70711,
        0.35355,
        0.17678,
        0.08839,
    ],
    6: [0.25, 0.0625, 0.015625, 0.00390625, 0.5, 0.125],
}


def fairseq_slopes(n: int) -> list[float]:
    """The recursive form of the ALiBi reference code's get_slopes."""

    def power_of_2(n):
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if math.log2(n).is_integer():
        return power_of_2(n)
    closest = 2 ** math.floor(math.log2(n))
    return power_of_2(closest) + fairseq_slopes(2 * closest)[0::2][: n - closest]


@pytest.mark.parametrize("n_head", range(1, 33))
def test_alibi_slopes_match_the_paper(n_head):
    """alibi_slopes equals the paper's reference code for 1–32 heads and its published values."""
    got = alibi_slopes(n_head)
    close(got, torch.tensor(fairseq_slopes(n_head)), tol=1e-7)
    if n_head in PUBLISHED_SLOPES:
        close(got, torch.tensor(PUBLISHED_SLOPES[n_head]), tol=1e-5)


def test_alibi_naive_formula_differs_for_non_power_of_two():
    """The naive 2^(-8h/n) is not what the paper uses for 12 heads (guards against that
    shortcut)."""
    naive = torch.tensor([2 ** (-8 * (h + 1) / 12) for h in range(12)])
    assert not torch.allclose(alibi_slopes(12), naive, atol=1e-3)


def test_bias_rpe_clamps_relative_distance():
    """bias_rpe gathers table[clamp(i - j, ±(r_max - 1)) + r_max - 1]: distances beyond r_max - 1
    share a bias."""
    model = tiny("bias_rpe")  # rpe_max_distance=5: 9 biases per head
    pe = model.encoding
    assert pe.weight.shape == (4, 9)
    with torch.no_grad():
        pe.weight.copy_(torch.arange(36.0).view(4, 9))
    rel = torch.arange(-8, 9)[None, :]
    expected = (rel.clamp(-4, 4) + 4).float() + 9 * torch.arange(4.0)[:, None, None]
    heads = torch.arange(4)[:, None, None]
    close(pe.score_bias(heads, rel, 0), expected)
    assert pe.score_bias(torch.tensor(0), torch.tensor([4, 5, 100]), 0).tolist() == [8.0, 8.0, 8.0]


def test_bias_rpe_starts_at_zero():
    """The relative-bias table is initialised to zero (T5's start)."""
    assert (
        torch.count_nonzero(
            GPT(
                GPTConfig(
                    n_layer=1,
                    n_head=2,
                    n_embd=8,
                    pos_encoding="bias_rpe",
                    vocab_size=10,
                    block_size=8,
                )
            ).encoding.weight
        )
        == 0
    )


def test_sinusoidal_matches_formula():
    """PE[p, 2i] = sin(p/10000^(2i/C))/√C, PE[p, 2i+1] = cos(p/10000^(2i/C))/√C, past block_size
    too."""
    model = tiny("sinusoidal", block_size=8)
    pos = torch.tensor([0, 1, 7, 100, 1000])
    got = model.encoding.embed(pos)
    C = model.config.n_embd
    for r, p in enumerate(pos.tolist()):
        for i in range(C // 2):
            angle = p / 10000 ** (2 * i / C)
            assert abs(got[r, 2 * i].item() * math.sqrt(C) - math.sin(angle)) < 1e-4
            assert abs(got[r, 2 * i + 1].item() * math.sqrt(C) - math.cos(angle)) < 1e-4


@pytest.mark.parametrize("compiled", [False, True])
def test_apply_rotary_rotates_each_pair_by_its_angle(compiled):
    """Each pair (2k, 2k+1) of q or k turns by the angle p·θ_k: [x'_2k, x'_2k+1] = R(p·θ_k) [x_2k,
    x_2k+1], with R(a) = [[cos a, -sin a], [sin a, cos a]], on eager's complex path and on the real
    arithmetic that compiled code takes, for an input laid out as attention's q (a strided view)."""
    model = tiny("rope")
    # (B, nh, T, hs), like q in attention
    x = torch.randn(2, 10, 3 * 16)[..., :16].view(2, 10, 2, 8).transpose(1, 2)
    pos = torch.arange(50, 60)
    rotate = (
        torch.compile(apply_rotary, backend="aot_eager", fullgraph=True)
        if compiled
        else apply_rotary
    )
    got = rotate(x, *model.encoding.rotary(pos))
    theta = 10000.0 ** (-torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    a = pos[:, None].double() * theta  # (T, hs/2)
    # (T, hs/2, 2, 2)
    R = torch.stack([torch.stack([a.cos(), -a.sin()], -1), torch.stack([a.sin(), a.cos()], -1)], -2)
    expected = (R @ x.double().unflatten(-1, (-1, 2))[..., None]).squeeze(-1).flatten(-2)
    close(got, expected.float())


@pytest.mark.parametrize("pe", ENCODINGS)
def test_shifting_positions(pe):
    """Shifting every position by a constant leaves relative encodings' outputs unchanged and
    changes absolute ones' (RoPE's relative property, and its absence for sinusoidal and
    learned)."""
    model = tiny(pe, block_size=64)
    idx = tokens(2, 16)
    # past block_size where it can: FIRE is relative below it
    shift = 237 if POS_ENCODINGS[pe].extrapolates else 37
    base = model(idx)[0]
    shifted = model(idx, pos=torch.arange(16) + shift)[0]
    if POS_ENCODINGS[pe].relative:
        close(shifted, base, tol=1e-4)
    else:
        assert (shifted - base).abs().max() > 1e-2


# --------------------------------------------------------------------------------------------------
# Config, sampling, training, compile


def test_config_errors_name_the_field():
    """Invalid configs raise ValueError naming the field and the valid choices."""
    with pytest.raises(ValueError, match="pos_encoding='xpos'.*" + ", ".join(POS_ENCODINGS)):
        GPTConfig(pos_encoding="xpos")
    with pytest.raises(ValueError, match="head dim"):
        GPTConfig(n_embd=36, n_head=4, pos_encoding="rope")  # head dim 9
    with pytest.raises(ValueError, match="divisible"):
        GPTConfig(n_embd=30, n_head=4)
    with pytest.raises(ValueError, match="dropout"):
        GPTConfig(dropout=1.5)
    with pytest.raises(ValueError, match="gelu='relu'.*exact, tanh"):
        GPTConfig(gelu="relu")
    with pytest.raises(ValueError, match="max_context"):
        tiny("rope").generate(tokens(1, 2), 1, max_context=0)


def test_gpt_config_fields_are_the_shape_and_every_encoding_option():
    """GPTConfig's fields, in order, are ModelShape's then every ENCODING_OPTIONS entry (each
    option's default is its field's): an option an encoding declares without its GPTConfig field
    fails here, with the line to add."""
    got = [f.name for f in fields(GPTConfig)]
    missing = [
        f"    {name}: <type> = <default>  # {enc}"
        for name, (enc, _) in ENCODING_OPTIONS.items()
        if name not in got
    ]
    assert not missing, "add to GPTConfig in model.py:\n" + "\n".join(missing)
    expected = [f.name for f in fields(ModelShape)] + list(ENCODING_OPTIONS)
    extra = [name for name in got if name not in expected]
    assert not extra, (
        f"GPTConfig's {extra} are neither ModelShape's nor an encoding's option: remove them"
    )
    assert got == expected, (
        "GPTConfig lists ModelShape's fields, then the options in ENCODING_OPTIONS' order"
    )


def test_sample_next_filters():
    """temperature 0 is argmax; top_k=1 and a tiny top_p are argmax too; top_p keeps the smallest
    set reaching p."""
    logits = torch.log(torch.tensor([[0.1, 0.5, 0.15, 0.25]]))
    assert sample_next(logits, temperature=0).item() == 1
    g = torch.Generator().manual_seed(0)
    assert {sample_next(logits, top_k=1, generator=g).item() for _ in range(50)} == {1}
    assert {sample_next(logits, top_p=0.01, generator=g).item() for _ in range(50)} == {1}
    # 0.5 + 0.25
    assert {sample_next(logits, top_p=0.7, generator=g).item() for _ in range(300)} == {1, 3}
    assert {sample_next(logits, top_k=3, generator=g).item() for _ in range(300)} == {1, 2, 3}


@pytest.mark.parametrize("pe", ENCODINGS)
def test_overfits_one_batch(pe):
    """Every encoding can memorise one small batch (the loss falls from ~ln V to near zero)."""
    torch.manual_seed(0)
    model = GPT(
        GPTConfig(block_size=16, vocab_size=VOCAB, n_layer=2, n_head=4, n_embd=32, pos_encoding=pe)
    )
    idx = tokens(4, 17)
    opt = torch.optim.AdamW(model.parameters(), lr=1.5e-2)
    for _ in range(80):  # every encoding ends below 0.004 (measured)
        _, loss = model(idx[:, :-1], idx[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.1, loss.item()


def test_gpt2_parity_with_transformers(tmp_path):
    """A random transformers GPT2LMHeadModel converted with model.from_hf (and saved/loaded through
    from_pretrained) gives the same logits."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_positions=32, vocab_size=VOCAB, n_layer=2, n_head=4, n_embd=32)
    ).eval()
    idx = tokens(2, 32)
    with torch.no_grad():
        expected = hf(idx).logits
    for ours in (
        model_py.from_hf(hf),
        GPT.from_pretrained(str(hf.save_pretrained(tmp_path) or tmp_path)),
    ):
        ours.eval()
        got = ours(idx)[0]
        assert ((got - expected).norm() / expected.norm()).item() < 1e-5
    assert ours.config.pos_encoding == "learned" and ours.config.block_size == 32


def test_checkpoint_model_args_rebuild_the_model(tmp_path):
    """A checkpoint with nanoGPT's keys rebuilds the same model with
    GPTConfig(**ckpt['model_args'])."""
    from dataclasses import asdict

    model = tiny("alibi")
    torch.save(
        {"model": model.state_dict(), "model_args": asdict(model.config)}, tmp_path / "ckpt.pt"
    )
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    rebuilt = GPT(GPTConfig(**ckpt["model_args"]))
    rebuilt.load_state_dict(ckpt["model"])
    idx = tokens(1, 10)
    assert torch.equal(rebuilt.eval()(idx)[0], model(idx)[0])


# Compiled through inductor itself: RoPE, the default (and compiled generation below, through
# inductor for three encodings). On a CPU inductor writes C++, not the Triton a GPU runs, and its
# 10-25 s per model buy little more for the other encodings than aot_eager's check (Dynamo's one
# graph, AOTAutograd's forward and backward, the branches the model takes when compiled) at a tenth
# the time.
INDUCTOR_CHECKED = ("rope",)


@pytest.mark.slow
@pytest.mark.parametrize("pe", ENCODINGS)
def test_torch_compile_forward_backward(pe):
    """torch.compile(model) (one graph; inductor for INDUCTOR_CHECKED, else aot_eager) runs forward
    and backward for every encoding from its own initialisation, matches eager, and gives every
    parameter of the encoding a non-zero gradient (a table, MLP or slope it never trains is a bug).
    One layer: a second would compile the same fast_paths."""
    torch.manual_seed(0)
    model = GPT(
        GPTConfig(block_size=16, vocab_size=VOCAB, n_layer=1, n_head=2, n_embd=16, pos_encoding=pe)
    )
    idx = tokens(2, 17)
    # the counter proves it compiled: past dynamo's recompile limit, eager runs
    counter = CompileCounterWithBackend("inductor" if pe in INDUCTOR_CHECKED else "aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    logits, loss = compiled(idx[:, :-1], idx[:, 1:])
    loss.backward()
    assert counter.frame_count == 1
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    for name, p in model.encoding.named_parameters():
        assert p.grad.abs().sum() > 0, f"{pe}'s {name} gets no gradient, compiled"
    close(logits, model(idx[:, :-1])[0], tol=1e-4)


@pytest.mark.slow
def test_compiled_fire_equals_eager_wherever_L_is():
    """Compiled, FIRE's bias takes its branch at run time (no size from the data in one graph): a
    gather where no query is past L, the last T / 8 rows pair by pair where a few are, every pair
    where more are. One compiled model takes all three without compiling again, and each gives
    eager's logits and gradients (eager is checked against the paper's formula above), float64 to
    1e-10."""
    torch.manual_seed(0)
    model = tiny("fire", block_size=16, n_layer=1).double()
    with torch.no_grad():
        model.encoding.w2.mul_(50)  # a bias that matters
    # eager's attention as compiled's (SDPA over the materialized bias)
    model.attention_options = replace(model.attention_options, fused=False)
    idx = tokens(2, 16)

    def run(m):
        m.zero_grad()
        logits = m(idx)[0]
        (logits**2).mean().backward()
        return logits, [p.grad.clone() for p in model.parameters()]

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    graphs = None
    for multiplier in (1.0, 0.9, 0.47):  # L = 16, 14.4, 7.52: no query past it, one (<= T / 8), 8
        with torch.no_grad():
            model.encoding.L_multiplier.fill_(multiplier)
        a, grads_a = run(compiled)
        b, grads_b = run(model)
        # compiled once
        assert counter.frame_count >= 1 and graphs in (None, counter.frame_count), multiplier
        graphs = counter.frame_count  # (float64 makes Dynamo trace it twice)
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
        for ga, gb in zip(grads_a, grads_b, strict=True):
            torch.testing.assert_close(ga, gb, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("pe", ENCODINGS)
def test_every_encoding_parameter_gets_a_gradient(pe):
    """From its own initialisation, one training step (eager, the default attention path: the CPU's
    kernels for trainable biases) gives every parameter of the encoding a non-zero gradient, and
    changes it."""
    torch.manual_seed(0)
    model = GPT(
        GPTConfig(block_size=16, vocab_size=VOCAB, n_layer=2, n_head=2, n_embd=16, pos_encoding=pe)
    ).train()
    before = {n: p.detach().clone() for n, p in model.encoding.named_parameters()}
    optimizer = model.configure_optimizers(0.1, 1e-2, (0.9, 0.99), "cpu")
    idx = tokens(4, 17)
    model(idx[:, :-1], idx[:, 1:])[1].backward()
    for name, p in model.encoding.named_parameters():
        assert p.grad.abs().sum() > 0, f"{pe}'s {name} gets no gradient"
    optimizer.step()
    for name, p in model.encoding.named_parameters():
        assert not torch.equal(p, before[name]), f"{pe}'s {name} did not change"


def test_pe_lr_scale_moves_the_encoding_faster():
    """pe_lr_scale puts the encoding's parameters in groups whose lr_scale multiplies the rate:
    Adam's first step moves each table entry with a gradient by lr·scale, and every other parameter
    by at most lr. At 1 the groups are the two of before (decay or not), so older checkpoints'
    optimizer states still load."""
    model = tiny("bias_rpe").train()
    assert len(model.configure_optimizers(0.1, 1e-3, (0.9, 0.99), "cpu").param_groups) == 2
    opt = model.configure_optimizers(0.0, 1e-3, (0.9, 0.99), "cpu", pe_lr_scale=10.0)
    for group in opt.param_groups:
        group["lr"] = 1e-3 * group["lr_scale"]  # as train.py does
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    idx = tokens(2, 16)
    model(idx, targets=torch.roll(idx, -1, 1))[1].backward()
    table_grad = model.encoding.weight.grad.clone()
    opt.step()
    for name, p in model.named_parameters():
        step = (p.detach() - before[name]).abs()
        if name == "transformer.encoding.weight":
            moved = table_grad.abs() > 1e-5
            assert moved.sum() > 0
            close(step[moved], torch.full_like(step[moved], 1e-2), tol=1e-4)
        else:
            assert step.max() <= 1e-3 * (1 + 1e-4), name


@pytest.mark.parametrize("pe", ENCODINGS)
def test_checkpoint_round_trip(pe, tmp_path):
    """save_checkpoint then load_checkpoint and model_from_checkpoint rebuild every encoding with
    the same logits, its trained parameters included."""
    from dataclasses import asdict

    from lib.checkpoint import load_checkpoint, model_from_checkpoint, save_checkpoint

    model = tiny(pe)
    save_checkpoint(
        {"model": model.state_dict(), "model_args": asdict(model.config)}, tmp_path / "ckpt.pt"
    )
    rebuilt = model_from_checkpoint(load_checkpoint(tmp_path / "ckpt.pt")).eval()
    idx = tokens(2, 12)
    assert torch.equal(rebuilt(idx)[0], model(idx)[0])


# --------------------------------------------------------------------------------------------------
# Fused attention (FlexAttention score_mod) against the materialized reference


# and next to the compile test above: one worker pays inductor's start-up once for both
@pytest.mark.slow
def test_compiled_generation_equals_eager():
    """generate(compile=True) (the compiled one-token step; on CPU with batch-1 matmuls decomposed
    into reductions) gives the eager tokens, rolling past max_context (relative) or re-prefilling
    past it (absolute). Two layers (each its own cache) for RoPE; one for the others, which inductor
    compiles in half the time. Each model compiles its own step: with dynamo's recompile limit at 1,
    three models in one process still compile (one shared step would hit the limit at the second
    model, an error under fullgraph)."""
    for pe, B, n_layer in [("rope", 1, 2), ("alibi", 1, 1), ("learned", 2, 1)]:
        model = tiny(pe, block_size=16, n_layer=n_layer)
        idx = tokens(B, 5)
        eager = model.generate(idx, 30, temperature=0, max_context=12)
        # dynamo's own patch: it restores the option itself
        with torch._dynamo.config.patch(recompile_limit=1):
            compiled = model.generate(idx, 30, temperature=0, max_context=12, compile=True)
        assert torch.equal(compiled, eager), pe


def grads(model: GPT, idx: torch.Tensor, **kw) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    logits, loss = model(idx, targets=torch.roll(idx, -1, 1), **kw)
    loss.backward()
    named = model.named_parameters()  # a compiled model's names start with _orig_mod.
    return logits.detach(), {
        n.removeprefix("_orig_mod."): p.grad.clone() for n, p in named if p.grad is not None
    }


@pytest.mark.parametrize("pe", POSITION_BIASED)
@pytest.mark.parametrize("window", [None, 5])
def test_fused_attention_equals_reference(pe, window):
    """FlexAttention with the encoding's score_mod gives the materialized path's logits (its
    backward needs CUDA: see the next test)."""
    model = tiny(pe)
    idx = tokens(2, 16)
    expected = model(idx, window=window)[0]
    model.attention_options = replace(model.attention_options, fused=True)
    with torch.no_grad():
        close(model(idx, window=window)[0], expected)


@pytest.mark.parametrize(
    "pe, T, window, block, dtype, step, path",
    [
        ("bias_rpe", 150, None, 64, torch.float32, 1, "bias_table"),
        ("bias_rpe", 40, None, 16, torch.float32, 1, "bias_table"),
        ("bias_rpe", 40, 9, 16, torch.float32, 1, "bias_table"),
        # positions 0, 2, 4, …: every key read
        ("bias_rpe", 40, 9, 16, torch.float32, 2, "bias_table"),
        ("bias_rpe", 150, None, 64, torch.bfloat16, 1, "bias_table"),
        ("kerple", 40, 9, 16, torch.float32, 1, "bias_table"),
        # no table: its distances are not known
        ("kerple", 40, 9, 16, torch.float32, 2, "bias_blocks"),
        # within its threshold: x of i - j alone
        ("fire", 40, None, 16, torch.float32, 1, "bias_table"),
        ("fire", 40, None, 16, torch.float32, -1, "bias_blocks"),  # positions 40 … 79, past it
        ("fire", 150, None, 64, torch.float32, -1, "bias_blocks"),
        ("fire", 150, 9, 64, torch.bfloat16, -1, "bias_blocks"),
    ],
)
def test_cpu_bias_kernels_gradients_equal_reference(
    pe, T, window, block, dtype, step, path, monkeypatch
):
    """On a CPU, a trainable bias trains through a kernel of its own: TableBiasAttention for a bias
    of i - j alone (its table read a block of queries at a time, no (nh, T, T) tensor), else
    bias_blocks (its bias computed a block of queries at a time, each block recomputed in the
    backward, the keys past the last query skipped where they are the queries' own). Logits and
    every gradient equal the reference path's (SDPA's math path on the materialized bias), with
    ragged last blocks, a sliding window, positions that skip, and bf16 autocast."""

    paths = taken_paths(monkeypatch)
    monkeypatch.setattr(fast_paths, "TABLE_BLOCK", block)
    model = tiny(pe, block_size=T).train()
    # every layer's threshold L at 1.5 T: positions 0 … T - 1 within it, T … 2T - 1 past it
    if pe == "fire":
        model.encoding.L_multiplier.data.fill_(1.5 if step == 1 else 0.9)
    pos = {1: None, 2: 2 * torch.arange(T), -1: T + torch.arange(T)}[step]
    idx = tokens(3, T)
    kw = dict(window=window, pos=pos)
    autocast = torch.autocast("cpu", dtype) if dtype != torch.float32 else contextlib.nullcontext()
    with autocast:
        model.attention_options = replace(model.attention_options, fused=False)
        ref_logits, ref_grads = grads(model, idx, **kw)
        assert set(paths) == {"sdpa_mask"}
        paths.clear()
        model.attention_options = replace(model.attention_options, fused=None)  # the default
        logits, fused_grads = grads(model, idx, **kw)
    assert set(paths) == {path}, paths
    assert ref_grads.keys() == fused_grads.keys()
    if dtype == torch.float32:
        for got, want in [(logits, ref_logits)] + [
            (fused_grads[n], ref_grads[n]) for n in ref_grads
        ]:
            close(got, want, tol=1e-5)
    # the two kernels round differently in bf16: each must be as close to float32 as the reference
    else:
        exact_logits, exact = grads(model, idx, **kw)
        error = lambda a, b: float((a.float() - b).norm() / b.norm().clamp(min=1e-30))  # noqa: E731  (L's is 0 past L)
        assert error(logits, exact_logits) <= 2 * error(ref_logits, exact_logits) + 1e-3
        for n in exact:
            assert error(fused_grads[n], exact[n]) <= 2 * error(ref_grads[n], exact[n]) + 1e-3, n
    # every query past L: x does not read L
    zero = {"transformer.encoding.L_multiplier"} if step == -1 else set()
    assert all(
        ref_grads[n].abs().sum() > 0
        for n, _ in model.encoding.named_parameters("transformer.encoding")
        if n not in zero
    )


@pytest.mark.parametrize("pe", BIASED)
def test_a_float64_model_attends_in_float64(pe):
    """A float64 model's reference attention adds its float32 score bias as float64: without a
    gradient (SDPA's CPU flash kernel, which reads a mask as q's dtype) its logits equal those with
    one (the math kernel)."""
    model = tiny(pe).double()
    model.attention_options = replace(model.attention_options, fused=False)
    idx = tokens(2, 16)
    with torch.no_grad():
        flash = model(idx)[0]
    close(flash, model(idx)[0].detach(), tol=1e-10)


@pytest.mark.parametrize("pe", BIASED)
@pytest.mark.parametrize("kw", [{}, dict(window=5), dict(pos=torch.arange(7, 31))])
def test_cpu_bias_kernels_equal_the_reference_in_float64(pe, kw):
    """In float64 the CPU kernels of a score bias (its table a block of queries at a time, FIRE's
    within its threshold too; bias_blocks) give the materialized reference's logits and every
    gradient to 1e-10 relative: the same sums in another order, so float64 leaves only rounding;
    with a window and explicit positions. bias-RPE's and T5's tables stay float32 in a float64 model
    (their bias is a float32 gather), so their gradient is summed in float32 on both paths: 1e-6
    there. (In float32 the tests above hold them to 1e-5, in bf16 to the reference's own error.)"""
    model = tiny(pe, block_size=32).double().train()
    if pe == "fire":
        # every position within its threshold: its table
        model.encoding.L_multiplier.data.fill_(1.5)
    idx = tokens(2, 24)
    logits, got = grads(model, idx, **kw)
    model.attention_options = replace(model.attention_options, fused=False)
    ref_logits, ref = grads(model, idx, **kw)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-10, atol=1e-12)
    float32_table = pe in ("bias_rpe", "t5")
    for n in ref:
        tol = 1e-6 if float32_table and n.startswith("transformer.encoding") else 1e-10
        torch.testing.assert_close(
            got[n], ref[n], rtol=tol, atol=tol * ref[n].abs().max().item(), msg=n
        )


def largest_square(fn) -> tuple[int, int]:
    """The largest trailing (rows, columns) of any tensor the ops run by fn() create, forward and
    backward, with rows == columns: a (.., T, T) tensor shows as (T, T)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    largest = [(0, 0)]

    class Shapes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if (
                    isinstance(t, torch.Tensor)
                    and t.dim() >= 2
                    and t.size(-1) == t.size(-2) > largest[0][0]
                ):
                    largest[0] = (t.size(-2), t.size(-1))
            return out

    with Shapes():
        fn()
    return largest[0]


@pytest.mark.parametrize(
    "pe, train",
    [(pe, train) for pe in [*BIASED, "fire_past"] for train in (True, False)],
)
def test_a_bias_makes_no_square_tensor_on_a_cpu(pe, train):
    """On a CPU, an encoding whose bias is a function of i - j alone trains and evaluates with no
    (.., T, T) tensor, forward or backward: its table over distances, read a block of queries at a
    time (the reference path, by contrast, makes one); and the bias's gradient is the same in two
    runs, bit for bit. FIRE trains so while its queries are within its threshold; past it
    (fire_past: L at half the block), and any bias without a table, a block of queries at a time,
    each block computed again in the backward."""
    model = tiny(pe.removesuffix("_past"), block_size=256, n_layer=1).train(train)
    # its threshold L at 1.5 times the block (every query within it), or at half of it
    if pe.startswith("fire"):
        model.encoding.L_multiplier.data.fill_(0.5 if pe == "fire_past" else 1.5)
    idx = tokens(2, 256)

    def step():
        with contextlib.nullcontext() if train else torch.no_grad():
            logits, loss = model(idx, targets=torch.roll(idx, -1, 1))
            if train:
                loss.backward()

    assert largest_square(step)[0] < 256
    if train and pe != "alibi":  # ALiBi's slopes are fixed: nothing to train
        first = [p.grad.clone() for p in model.encoding.parameters() if p.grad is not None]
        model.zero_grad()
        step()
        again = [p.grad for p in model.encoding.parameters() if p.grad is not None]
        assert first and all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    # the reference materializes it
    model.attention_options = replace(model.attention_options, fused=False)
    assert largest_square(step) == (256, 256)


@pytest.mark.parametrize(
    "pe, window, path",
    [("bias_rpe", None, "bias_table"), ("fire", None, "bias_blocks"), ("kerple", 9, "bias_table")],
)
def test_compiled_cpu_bias_kernels_are_one_graph_and_equal_reference(pe, window, path, monkeypatch):
    """Compiled on a CPU, a trainable bias whose keys are the queries' own (training) trains through
    the kernel eager takes (TableBiasAttention for a bias of i - j alone, else bias_blocks): its
    blocks have sizes known before the data, so the whole forward and backward is one graph
    (fullgraph), and its logits and gradients equal SDPA's math path (the reference) to 1e-5 in
    float32."""
    paths = taken_paths(monkeypatch)
    monkeypatch.setattr(fast_paths, "TABLE_BLOCK", 16)  # ragged: 40 queries in blocks of 16
    torch.manual_seed(0)
    # a second layer would compile the same code again
    model = tiny(pe, block_size=40, n_layer=1).train()
    idx = tokens(3, 40)
    counter = CompileCounterWithBackend("aot_eager")
    logits, got = grads(torch.compile(model, backend=counter, fullgraph=True), idx, window=window)
    assert counter.frame_count >= 1 and set(paths) == {path}, paths
    model.attention_options = replace(model.attention_options, fused=False)
    ref_logits, ref = grads(model, idx, window=window)
    close(logits, ref_logits, tol=1e-5)
    assert got.keys() == ref.keys()
    for n in ref:
        close(got[n], ref[n], tol=1e-5)


@pytest.mark.parametrize(
    "pe, kw, T, window, compiled, tile",
    [
        ("bias_rpe", dict(rpe_max_distance=5), 16, None, False, 128),
        ("bias_rpe", dict(rpe_max_distance=5), 23, None, False, 128),
        ("bias_rpe", dict(rpe_max_distance=5), 23, 6, False, 128),
        ("bias_rpe", dict(rpe_max_distance=5), 23, 3, False, 128),
        ("bias_rpe", dict(rpe_max_distance=64), 40, None, False, 128),
        # 7 block diagonals, a ragged last tile
        ("bias_rpe", dict(rpe_max_distance=64), 40, None, False, 6),
        # compiled (slow: they start with the compile tests, on a worker whose dynamo has started):
        # one layer
        pytest.param(
            "bias_rpe",
            dict(rpe_max_distance=8, n_layer=1),
            33,
            None,
            True,
            128,
            marks=pytest.mark.slow,
        ),
        ("bias_rpe", dict(rpe_max_distance=1), 12, None, False, 128),
        ("t5", dict(t5_num_buckets=8, t5_max_distance=20), 40, None, False, 128),
        pytest.param(
            "t5",
            dict(t5_num_buckets=8, t5_max_distance=12, n_layer=1),
            30,
            9,
            True,
            128,
            marks=pytest.mark.slow,
        ),
        # a table over every distance 0 … T - 1: KERPLE, and FIRE while every query is within its
        # threshold
        ("kerple", dict(), 23, None, False, 128),
        ("kerple", dict(), 23, None, False, 4),
        ("kerple", dict(), 23, 6, False, 4),
        ("fire", dict(), 23, None, False, 5),
    ],
)
def test_table_gradient_equals_reference(
    pe, kw, T, window, compiled, tile, monkeypatch, flex_backward
):
    """The fused path's table gradient (the kernel reads the bias as a constant; TableGrad computes
    the gradient from the block diagonals of tiles holding a distance below the far one, and the
    rows' zero sum) equals the materialized path's, the shared far entry included, for bias-RPE and
    T5 (a clamped table), KERPLE and FIRE (a table over every distance), with ragged tiles, T <
    span, windows shorter than it, one shared bias, compiled."""

    monkeypatch.setattr(fast_paths, "DIAGONAL_TILE", tile)
    calls = []
    # FlexAttention itself: its dense math on a CPU (flex_backward)
    real = fast_paths.flex_attention_lse
    monkeypatch.setattr(fast_paths, "flex_attention_lse", lambda *a: calls.append(1) or real(*a))
    model = tiny(pe, block_size=T, **kw).train()
    idx = tokens(3, T)
    model.attention_options = replace(model.attention_options, fused=False)
    ref_logits, ref_grads = grads(model, idx, window=window)
    model.attention_options = replace(model.attention_options, fused=True)
    # compiled: dynamo and AOTAutograd trace TableGrad's forward and backward, and FlexAttention's;
    # inductor would lower FlexAttention's CPU kernel (40 s per case on a CPU for code no GPU runs)
    counter = CompileCounterWithBackend("aot_eager")
    logits, fused_grads = grads(
        torch.compile(model, backend=counter) if compiled else model, idx, window=window
    )
    assert calls, "the fused path did not run"
    # compiled, not run eagerly past dynamo's recompile limit
    assert counter.frame_count == compiled
    close(logits, ref_logits)
    assert ref_grads.keys() == fused_grads.keys()
    for name in ref_grads:
        close(fused_grads[name], ref_grads[name], tol=1e-5)
    span = model.encoding.far_distance
    # a key past the span: the shared far entry has a gradient
    if span is not None and 0 < span < (window or T):
        assert ref_grads["transformer.encoding.weight"][:, -1].abs().sum() > 0


@pytest.mark.parametrize(
    "pe, kw",
    [("bias_rpe", dict(rpe_max_distance=5)), ("t5", dict(t5_num_buckets=8, t5_max_distance=12))],
)
@pytest.mark.parametrize("stride, offset", [(2, 0), (3, 0), (1, 7)])
def test_fused_table_gradient_with_explicit_positions(
    pe, kw, stride, offset, monkeypatch, flex_backward
):
    """With explicit positions the fused path's table gradient equals the materialized path's:
    positions that skip (2·arange, 3·arange: distances are not index differences) leave the band
    gradient for the materialized bias, and a shifted range (7 + arange: the same distances) keeps
    it."""

    calls = []
    # FlexAttention itself: its dense math on a CPU (flex_backward)
    real = fast_paths.flex_attention_lse
    monkeypatch.setattr(fast_paths, "flex_attention_lse", lambda *a: calls.append(1) or real(*a))
    T = 20
    model = tiny(pe, block_size=3 * T, **kw).train()
    idx = tokens(2, T)
    pos = offset + stride * torch.arange(T)
    model.attention_options = replace(model.attention_options, fused=False)
    ref_logits, ref_grads = grads(model, idx, pos=pos)
    model.attention_options = replace(model.attention_options, fused=True)
    logits, fused_grads = grads(model, idx, pos=pos)
    assert bool(calls) == (stride == 1)
    close(logits, ref_logits)
    for name in ref_grads:
        close(fused_grads[name], ref_grads[name], tol=1e-5)


@pytest.mark.parametrize("pe, multiplier", [("kerple", None), ("fire", 1.5), ("fire", 0.5)])
def test_a_trainable_bias_never_takes_flex_attentions_own_gradient(
    pe, multiplier, monkeypatch, flex_backward
):
    """A trainable bias never takes FlexAttention's captured-parameter gradient (atomics on the
    table's few entries: slow, not deterministic, or out of a GPU's shared memory). With fused=True
    a bias of i - j alone trains through its table over every distance (KERPLE, FIRE within its
    threshold: FlexAttention reads it as a constant, TableGrad gives its gradient); FIRE past its
    threshold, with no table, never through FlexAttention in training (its rows a block of queries
    at a time, on any device); each with the reference's logits and gradients, and each still
    evaluates through FlexAttention."""
    calls = []
    paths = taken_paths(monkeypatch)
    monkeypatch.setattr(
        fast_paths, "flex_attention", lambda *a, **k: calls.append(1) or flex_attention(*a, **k)
    )
    # FlexAttention itself: its dense math on a CPU (flex_backward)
    real = fast_paths.flex_attention_lse
    monkeypatch.setattr(fast_paths, "flex_attention_lse", lambda *a: calls.append(1) or real(*a))
    model = tiny(pe).train()
    if multiplier is not None:
        model.encoding.L_multiplier.data.fill_(multiplier)
    idx = tokens(2, 16)
    model.attention_options = replace(model.attention_options, fused=False)
    ref_logits, ref_grads = grads(model, idx)
    model.attention_options = replace(model.attention_options, fused=True)
    paths.clear()
    logits, fused_grads = grads(model, idx)
    table = multiplier != 0.5
    assert set(paths) == ({"flex_table"} if table else {"bias_blocks"}) and bool(calls) == table, (
        paths
    )
    close(logits, ref_logits)
    for name in ref_grads:
        close(fused_grads[name], ref_grads[name], tol=1e-5)
    calls.clear()
    with torch.no_grad():
        model(idx)
    assert calls


@pytest.mark.parametrize(
    "R, tile, window", [(4, 128, None), (4, 3, 6), (18, 128, None), (18, 4, None), (18, 5, 7)]
)
def test_table_gradient_of_each_entry(R, tile, window, monkeypatch):
    """table_grad on raw tensors equals autograd through softmax(q·kᵀ/√hs + table[min(i - j, R)])·v,
    causal (and inside a window), in float64: a clamped table (R = 4) and one over every distance (R
    = T - 1 = 18), in tiles of the default size and of a few queries (several block diagonals, a
    ragged last tile); two runs equal bit for bit."""
    monkeypatch.setattr(fast_paths, "DIAGONAL_TILE", tile)
    torch.manual_seed(0)
    B, nh, T, hs = 2, 3, 19, 8
    q, k, v, dy = (torch.randn(B, nh, T, hs, dtype=torch.float64) for _ in range(4))
    table = torch.randn(nh, R + 1, dtype=torch.float64, requires_grad=True)
    rel = torch.arange(T)[:, None] - torch.arange(T)[None, :]
    s = (q @ k.transpose(-2, -1)) / hs**0.5 + table[:, rel.clamp(0, R)]
    s = s.masked_fill(~fast_paths.sees(rel, window), float("-inf"))
    y = torch.softmax(s, -1) @ v
    (expected,) = torch.autograd.grad((y * dy).sum(), table)
    got = fast_paths.table_grad(q, k, v, y.detach(), s.logsumexp(-1).detach(), dy, table, window)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
    again = fast_paths.table_grad(q, k, v, y.detach(), s.logsumexp(-1).detach(), dy, table, window)
    assert torch.equal(got, again)


@pytest.mark.parametrize("R", [64, 1023])
def test_table_gradient_on_cuda_is_deterministic_and_exact(R, cuda):
    """On CUDA, table_grad (bias-RPE's clamped table, KERPLE's over every distance, at GPT-2's
    block) gives the same gradient bit for bit in two runs (no atomics), within float32's error of
    the float64 gradient on the CPU. Runs on the GPU machine."""
    torch.manual_seed(0)
    B, nh, T, hs = 2, 4, 1024, 64
    q, k, v, dy = (torch.randn(B, nh, T, hs, dtype=torch.float64) for _ in range(4))
    table = torch.randn(nh, R + 1, dtype=torch.float64) * 0.5
    rel = torch.arange(T)[:, None] - torch.arange(T)[None, :]
    s = ((q @ k.transpose(-2, -1)) / hs**0.5 + table[:, rel.clamp(0, R)]).masked_fill(
        rel < 0, float("-inf")
    )
    y = torch.softmax(s, -1) @ v
    lse = s.logsumexp(-1)
    exact = fast_paths.table_grad(q, k, v, y, lse, dy, table)
    on_cuda = [t.cuda().float() for t in (q, k, v, y, lse, dy, table)]
    got = fast_paths.table_grad(*on_cuda)
    again = fast_paths.table_grad(*on_cuda)
    assert torch.equal(got, again)
    torch.testing.assert_close(
        got.double().cpu(), exact, rtol=1e-4, atol=1e-4 * exact.abs().max().item()
    )


@pytest.mark.parametrize("window", [None, 40])
def test_table_gradient_of_a_table_over_every_distance_sums_each_entry(window):
    """Where no distance a query sees is past the table's last entry (KERPLE's table over every
    distance, or a window no longer than the table), table_grad sums that entry from its own pairs:
    inferred from the rows' zero sum, as a clamped table's far entry is, it would gather every row's
    rounding (FlexAttention's y in bf16), and be off by more than any other entry."""
    torch.manual_seed(0)
    B, nh, T, hs = 4, 2, 384, 16
    q, k, v, dy = (torch.randn(B, nh, T, hs, dtype=torch.float64) for _ in range(4))
    table = torch.randn(nh, T, dtype=torch.float64)  # R = T - 1: every distance its own entry
    rel = torch.arange(T)[:, None] - torch.arange(T)[None, :]
    s = (q @ k.transpose(-2, -1)) / hs**0.5 + table[:, rel.clamp(min=0)]
    s = s.masked_fill(~fast_paths.sees(rel, window), float("-inf"))
    y = torch.softmax(s, -1) @ v
    lse = s.logsumexp(-1)
    exact = fast_paths.table_grad(q, k, v, y, lse, dy, table, window)
    # y as a bf16 kernel's
    rounded = fast_paths.table_grad(q, k, v, y.bfloat16().double(), lse, dy, table, window)
    error = (rounded - exact).abs()
    assert error[:, -1].max() <= error[:, :-1].max()
    if window is not None:  # the distances past the window: no gradient at all
        assert torch.equal(exact[:, window:], torch.zeros_like(exact[:, window:]))


def test_key_span_reads_only_the_keys_a_block_of_queries_may_see():
    """The keys j0 … j1 - 1 of queries i0 … i1 - 1 (own keys at consecutive positions): none in
    their future, none window or more before the first, none before the earliest start of their
    documents; every key from a cache."""
    pos = torch.arange(100, 228)  # 128 consecutive positions from 100
    assert fast_paths.key_span(64, 128, 128, True, pos, None) == (0, 128)
    assert fast_paths.key_span(64, 128, 128, True, pos, None, window=9) == (56, 128)
    assert fast_paths.key_span(0, 64, 128, True, pos, None, window=9) == (0, 64)
    starts = torch.full((2, 128), 100)
    starts[0, 60:] = 100 + 70  # row 0's second document begins at index 70; row 1 is one document
    # row 1 reads from its start
    assert fast_paths.key_span(64, 128, 128, True, pos, starts) == (0, 128)
    starts[1, 30:] = 100 + 80
    assert fast_paths.key_span(64, 128, 128, True, pos, starts) == (70, 128)
    assert fast_paths.key_span(64, 128, 128, True, pos, starts, window=9) == (70, 128)
    assert fast_paths.key_span(64, 128, 300, False, pos, starts, window=9) == (0, 300)


def test_diagonal_sums():
    """diagonal_sums(m)[o + n - 1] is the sum of m[r, c] over r - c = o, for every diagonal of a
    square."""
    m = torch.randn(2, 5, 5, dtype=torch.float64)
    expected = torch.stack(
        [torch.diagonal(m, offset=-o, dim1=-2, dim2=-1).sum(-1) for o in range(-4, 5)], dim=-1
    )
    torch.testing.assert_close(fast_paths.diagonal_sums(m), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("pe", POSITION_BIASED)
@pytest.mark.parametrize("head_dim", CUDA_HEAD_DIMS)
def test_compiled_fused_attention_gradients_on_cuda(pe, head_dim, cuda, monkeypatch):
    """Compiled on CUDA, the bias encodings train through FlexAttention (the default there) at head
    dims from 16, and through the materialized bias below (Triton's minimum); FIRE (no table:
    whether its queries are within its threshold is data) through its rows a block of queries at a
    time, at every head dim; logits and gradients, the bias-RPE table's included, are as close to a
    float64 forward as the eager float32 path is (within 3x its error, or 1e-4): at head dim 128
    float32 itself is off by up to 1e-3 on these logits, so a fixed 1e-4 between the two float32
    paths would fail both. Where the fused kernel does not compile, the model's kernel fallbacks
    take over, as in train.py, and the path they end on must agree too; up to head dim 64 the
    default options compile. Runs on the GPU machine."""
    import copy

    calls = []

    def counting_flex(*args, **kw):
        calls.append(1)
        return flex_attention(*args, **kw)

    monkeypatch.setattr(fast_paths, "flex_attention", counting_flex)
    model = (
        tiny(pe, block_size=256, n_layer=1, n_head=2, n_embd=2 * head_dim, rpe_max_distance=64)
        .cuda()
        .train()
    )
    idx = tokens(2, 256).cuda()
    exact_logits, exact_grads = grads(copy.deepcopy(model).double(), idx)
    ref_logits, ref_grads = grads(model, idx)
    assert not calls
    paths = taken_paths(monkeypatch)
    compiled = [torch.compile(model)]
    notes = []

    def recompile(options):
        model.attention_options = options
        calls.clear()
        compiled[0] = torch.compile(model)

    step = lambda: grads(compiled[0], idx)  # noqa: E731
    logits, fused_grads = with_kernel_fallbacks(
        step, model.attention_options, recompile, notes.append
    )
    print(pe, head_dim, notes or "no fallback")
    assert head_dim > 64 or not notes, notes
    wpe = model.encoding
    # a table of i - j (trained through TableGrad) or no parameters; FIRE compiled has no table
    # (FlexAttention's own gradient, atomics, is never taken): its rows a block of queries at a
    # time, through SDPA
    fused = head_dim >= 16 and wpe.relative and model.attention_options.fused is not False
    assert bool(calls) == fused, "FlexAttention where it fits, the materialized elsewhere"
    assert pe != "fire" or notes or set(paths) == {"bias_blocks"}, paths
    assert (kernel_fallbacks.fused_attention_note(head_dim, "cuda") is None) == (head_dim >= 16)

    def as_exact_as_eager(got, ref, exact):
        eager_error = (ref.double() - exact).abs().max().item()
        close(got.double(), exact, tol=max(1e-4, 3 * eager_error))

    as_exact_as_eager(logits, ref_logits, exact_logits)
    assert ref_grads.keys() == fused_grads.keys() == exact_grads.keys()
    for name in ref_grads:
        as_exact_as_eager(fused_grads[name], ref_grads[name], exact_grads[name])
    assert ref_grads["transformer.h.0.attn.c_attn.weight"].abs().sum() > 0
    if pe == "bias_rpe":
        assert (
            ref_grads["transformer.encoding.weight"][:, -1].abs().sum() > 0
        )  # the clamped entry too


@pytest.mark.parametrize("pe", ENCODINGS)
def test_compiled_bf16_training_step_on_cuda(pe, cuda, monkeypatch):
    """A GPU trains compiled under bf16 autocast, through the kernels the table picks there
    (FlexAttention for a bias of positions, CoPE's counted blocks, the rows of FoX's and FIRE's bias
    by blocks, SDPA): its logits and gradients are as close to eager float32's as eager bf16's are
    (within twice, or bf16's 2%). Runs on the GPU machine; elsewhere on its emulation (the cuda
    fixture)."""
    from test_precision import ROUNDING, gradient_error, logit_error, model_for, step

    # one layer: each layer compiles the same kernels
    model = model_for(pe, seed=0, n_layer=1).to(cuda)
    idx = tokens(2, 128).to(cuda)
    exact_logits, exact = step(model, idx, autocast=False, device=cuda)
    eager_logits, eager = step(model, idx, autocast=True, device=cuda)
    paths = taken_paths(monkeypatch)
    logits, compiled = step(torch.compile(model), idx, autocast=True, device=cuda)
    assert not model.encoding.has_score_bias or set(paths) <= {
        "flex_table",
        "flex",
        "bias_blocks",
    }, paths
    errors = [(logit_error(logits, exact_logits), logit_error(eager_logits, exact_logits))]
    errors.append((gradient_error(compiled, exact), gradient_error(eager, exact)))
    for got, eager_error in errors:
        assert got <= max(2 * eager_error, ROUNDING), (got, eager_error)


@pytest.mark.parametrize("pe", EXTRAPOLATING)
def test_cache_equals_full_forward_on_cuda(pe, cuda):
    """On a GPU the KV cache (a prompt, then a token at a time past the block) gives the full
    forward's logits, and generation's compiled decode step the eager one's tokens, rolling past the
    context. Runs on the GPU machine; elsewhere on its emulation (the cuda fixture)."""
    model = tiny(pe, block_size=16, n_layer=1).to(cuda)
    idx = tokens(2, 30).to(cuda)
    close(cached_logits(model, idx, [5] + [1] * 25, window=40), model(idx)[0], tol=1e-4)
    eager = model.generate(idx[:, :5], 20, temperature=0, max_context=12)
    assert torch.equal(
        model.generate(idx[:, :5], 20, temperature=0, max_context=12, compile=True), eager
    )


def test_kernel_fallbacks_in_order_and_only_for_the_compilers_failures():
    """fall_back: a compiler failure (Triton's, under the error torch raises) moves a bias model's
    options to one pipeline stage, then to the materialized bias, then has nothing left; a model's
    own error, or a model without a bias (no options), has nothing to fall back from.
    with_kernel_fallbacks retries the step after each, logging one line, with the fallback's
    options."""
    from torch._inductor.runtime.triton_heuristics import NoTritonConfigsError

    from lib.kernel_fallbacks import fall_back

    failure = RuntimeError("the compiled step failed")
    failure.__cause__ = NoTritonConfigsError(
        "out of resource: Required: 245760 Hardware limit: 232448"
    )
    options = tiny("alibi").attention_options
    assert options == AttentionOptions() and fall_back(options, ValueError("a bug")) is None
    options, note = fall_back(options, failure)
    assert "num_stages=1" in note and options == AttentionOptions(
        flex_kernel_options={"num_stages": 1}
    )
    options, note = fall_back(options, failure)
    assert "materialized bias" in note and options.fused is False
    assert fall_back(options, failure) is None
    tries = []
    notes = []
    retried = []

    def step():
        tries.append(1)
        if len(tries) < 3:
            raise failure
        return "done"

    assert (
        with_kernel_fallbacks(step, AttentionOptions(), retried.append, log=notes.append) == "done"
    )
    assert (
        len(tries) == 3
        and len(notes) == 2
        and all("(the compiled step failed)" in n for n in notes)
    )
    stage = {"num_stages": 1}
    assert retried == [
        AttentionOptions(flex_kernel_options=stage),
        AttentionOptions(False, flex_kernel_options=stage),
    ]
    tries.clear()
    with pytest.raises(
        RuntimeError, match="the compiled step failed"
    ):  # no score bias: nothing to fall back from
        with_kernel_fallbacks(step, None, retried.append, log=notes.append)
    assert len(tries) == 1


@pytest.mark.parametrize("pe", ["alibi", "bias_rpe"])
def test_fused_attention_with_smaller_kernel_options_on_cuda(pe, cuda):
    """train.py's first fallback when Triton runs out of shared memory, FlexAttention with
    num_stages=1, compiles and gives the eager materialized path's logits and gradients. Runs on the
    GPU machine."""
    model = (
        tiny(pe, block_size=256, n_layer=1, n_head=2, n_embd=128, rpe_max_distance=64)
        .cuda()
        .train()
    )
    idx = tokens(2, 256).cuda()
    ref_logits, ref_grads = grads(model, idx)
    model.attention_options = replace(
        model.attention_options, flex_kernel_options={"num_stages": 1}
    )
    logits, fused_grads = grads(torch.compile(model), idx)
    close(logits, ref_logits, tol=1e-4)
    for name in ref_grads:
        close(fused_grads[name], ref_grads[name], tol=1e-4)


@pytest.mark.parametrize("pe", BIASED)
def test_training_keeps_about_one_bias_per_layer(pe):
    """A training forward on the materialized path keeps few (Tq, Tk)-sized tensors for the
    backward, at most two biases' worth per layer: the bias's formula is recomputed in the backward,
    not stored (FIRE's MLP once stored about 100 biases' worth per layer, which would be 60 GB at
    GPT-2 124M and block 1024)."""
    T, n_layer = 64, 3
    model = tiny(pe, block_size=T, n_layer=n_layer).train()
    saved = []

    def pack(t):
        if t.dim() >= 2 and t.shape[-2:] == (T, T):
            saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(tokens(2, T), tokens(2, T))[1]
    loss.backward()
    one_bias = model.config.n_head * T * T * 4  # (nh, T, T) float32
    assert sum(saved) <= 2 * n_layer * one_bias, sum(saved) / one_bias
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.encoding.parameters())


def test_scalar_mlp_gradients_equal_autograd():
    """FIRE's MLP with its hand-written backward (one hidden unit at a time) has autograd's
    gradients for x and every weight, with the weights broadcast per head against x (heads, queries,
    keys), in float64."""
    from fast_paths import UnitByUnit

    g = torch.Generator().manual_seed(0)
    x = torch.rand(3, 5, 7, dtype=torch.float64, generator=g, requires_grad=True)
    w1, b1, w2 = (
        torch.randn(3, 1, 1, 4, dtype=torch.float64, generator=g, requires_grad=True)
        for _ in range(3)
    )
    mlp = POS_ENCODINGS["fire"].mlp
    torch.autograd.gradcheck(lambda *t: UnitByUnit.apply(mlp, *t), (x, w1, b1, w2))
    plain = sum(torch.relu(x * w1[..., u] + b1[..., u]) * w2[..., u] for u in range(4))
    torch.testing.assert_close(UnitByUnit.apply(mlp, x, w1, b1, w2), plain)


def test_fire_bias_keeps_few_tensors_for_its_gradient():
    """FIRE's bias at every pair with a gradient (positions that skip, too many pairs to keep the
    hidden units) keeps a few bias-sized tensors for the backward, not one per hidden unit (32):
    what a checkpointed bias's recomputation in the backward holds."""
    T = 160  # 25,600 pairs: past fast_paths.MLP_FEW
    pe = tiny("fire", block_size=2 * T, n_layer=2).train().encoding
    saved = []

    def pack(t):
        saved.append(t.numel() if t.shape[-2:] == (T, T) else 0)
        return t

    pos = 2 * torch.arange(T)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        chunk = Chunk(pos, key_pos=pos, slots=None, window=None, consecutive=False)
        bias = model_py.pair_bias(pe, 1, torch.arange(4, 8), chunk)
    bias.sum().backward()
    assert sum(saved) <= 6 * 4 * T * T, sum(saved) / (4 * T * T)
    assert all(p.grad is not None for p in pe.parameters())


@pytest.mark.parametrize("multiplier", [1.0, 0.5])  # every query within L, half of them past it
def test_fire_layer_bias_keeps_less_than_one_bias_for_its_gradient(multiplier):
    """A layer's whole bias, as training computes it (the rows within L a gather from the distances,
    the rest per pair and recomputed in the backward): what autograd keeps for the backward adds up
    to less than half an (nh, T, T) bias (today: a third with every query within L, the gather's
    index; a fifth with half of them past it)."""
    from model import Chunk

    T = 256
    pe = tiny("fire", block_size=T, n_layer=2).train().encoding
    with torch.no_grad():
        pe.L_multiplier.fill_(multiplier)
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    pos = torch.arange(T)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        bias = model_py.pair_bias(
            pe,
            1,
            torch.arange(4, 8),
            Chunk(pos, key_pos=pos, slots=None, window=None, consecutive=True),
            recompute=True,
        )
    bias.sum().backward()
    assert bias.shape == (4, T, T)
    assert sum(saved) < 4 * T * T / 2, sum(saved) / (4 * T * T)
    # layer 1's parameters (heads 4 … 7)
    assert all(p.grad[1].abs().sum() > 0 for p in pe.parameters())


def test_reference_attention_adds_a_float32_bias_to_half_precision():
    """With bf16 q, k, v the materialized path adds the bias in float32, as FlexAttention does:
    ALiBi's bias at distances 3000-3100 of a 1/256-slope head (7 distinct values once rounded to
    bf16) weighs the keys exactly, so the output is the exact one rounded once to bf16."""
    from model import attend

    T = 4096
    q = torch.zeros(2, 1, 1, 16, dtype=torch.bfloat16)
    k = torch.zeros(2, 1, T, 16, dtype=torch.bfloat16)
    rel = (T - 1) - torch.arange(T)  # the last query against every key
    # exact in bf16, mean near 0
    v = ((rel - 3050).float() / 8)[None, None, :, None].expand(2, 1, T, 16).bfloat16()
    seen = (rel >= 3000) & (rel <= 3100)
    bias = (-rel.float() / 256).masked_fill(~seen, float("-inf"))[None, None]  # (nh=1, Tq=1, Tk)
    exact = torch.softmax(bias.double(), -1) @ v.double()
    got = attend(q, k, v, score_bias=bias)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), exact.bfloat16().double(), rtol=2**-8, atol=0)


@pytest.mark.parametrize("pe", ENCODINGS)
def test_bf16_model_generates(pe):
    """A model cast to bf16 (weights and activations) keeps bf16 activations and generates, with and
    without the cache (a float32 sinusoidal table once turned x to float32 and crashed the next bf16
    Linear)."""
    reference = tiny(pe)
    model = tiny(pe).to(torch.bfloat16)
    idx = tokens(2, 5)
    logits = model(idx)[0]
    assert logits.dtype == torch.bfloat16
    # the same weights in bf16 give the float32 model's logits to bf16's precision (8 bits of
    # mantissa)
    expected = reference(idx)[0]
    assert (logits.float() - expected).abs().max() <= 0.05 * expected.abs().max()
    for use_cache in (True, False):
        assert model.generate(idx, 6, temperature=0, use_cache=use_cache).shape == (2, 11)


def test_fused_attention_note_names_the_head_dim_limit_and_dropout():
    """A head dim under 16 cannot take FlexAttention on CUDA (Triton's minimum): flex_fits says no,
    and the model's note says why and what attention does instead; on CPUs, and from 16 on, it fits
    and there is no note. Attention dropout (FlexAttention has none) sends a score bias to the
    materialized bias in training: the note says so and names the fix; a CPU's paths take dropout
    the same way for every encoding (no note)."""
    from fast_paths import flex_fits
    from lib.kernel_fallbacks import fused_attention_note

    assert not flex_fits(8, "cuda") and flex_fits(8, "cpu") and flex_fits(16, "cuda")
    note = fused_attention_note(8, "cuda")
    assert "at least 16" in note and "(this model has 8)" in note and "materialized bias" in note
    assert fused_attention_note(8, "cpu") is None and fused_attention_note(16, "cuda") is None
    note = fused_attention_note(64, "cuda", dropout=0.2)
    assert "dropout=0.2" in note and "materialized bias" in note and "--dropout=0" in note
    assert (
        fused_attention_note(64, "cpu", dropout=0.2) is None
        and fused_attention_note(64, "cuda", 0.0) is None
    )


@pytest.mark.parametrize("pe", POSITION_BIASED)
@pytest.mark.parametrize(
    "chunks,window,extra", [([7, 1, 1, 5], None, 0), ([4, 1, 9, 1, 1, 14], 6, 0), ([3, 27], 6, 5)]
)
def test_fused_attention_with_cache_applies_the_query_offset(pe, chunks, window, extra):
    """Fused attention over a KV cache (queries at an offset, keys in a wrapped ring) equals the
    full forward. One layer: FlexAttention runs unfused (and slowly) on a CPU, and a layer's heads
    are tested in the test above."""
    model = tiny(pe, n_layer=1)
    idx = tokens(2, sum(chunks))
    expected = model(idx, window=window)[0]
    model.attention_options = replace(model.attention_options, fused=True)
    with torch.no_grad():
        close(cached_logits(model, idx, chunks, window=window, extra=extra), expected)


# --------------------------------------------------------------------------------------------------
# The encodings after ALiBi: T5 buckets, KERPLE


def test_t5_buckets_equal_the_reference_implementation():
    """T5's causal buckets equal Hugging Face's port of Mesh TensorFlow's
    `_relative_position_bucket` (bidirectional=False) for distances 0 … 2000, at the default 32
    buckets / 128 and a smaller 8 / 20; far_distance is the first distance of the last bucket."""
    pytest.importorskip("transformers")  # CI has it; a bare GPU machine may not
    from transformers.models.t5.modeling_t5 import T5Attention

    n = torch.arange(2001)
    for buckets, max_distance in [(32, 128), (8, 20)]:
        pe = tiny("t5", t5_num_buckets=buckets, t5_max_distance=max_distance).encoding
        expected = T5Attention._relative_position_bucket(
            -n, bidirectional=False, num_buckets=buckets, max_distance=max_distance
        )
        assert torch.equal(pe.bucket(n), expected)
        assert pe.far_distance == int((expected < buckets - 1).sum())
        with torch.no_grad():
            pe.weight.copy_(torch.randn_like(pe.weight))
        close(pe.score_bias(torch.arange(4)[:, None], n + 7, 7), pe.weight[:, expected])
    with pytest.raises(ValueError, match="t5_max_distance"):
        GPTConfig(pos_encoding="t5", t5_num_buckets=32, t5_max_distance=16)


def test_kerple_log_bias_matches_the_formula():
    """KERPLE (log): bias = -r1·log(1 + r2·(i - j)) per head, r1, r2 > 0, a function of i - j
    alone."""
    pe = tiny("kerple").encoding
    r1 = pe.log_r1.exp().detach()
    r2 = pe.log_r2.exp().detach()
    assert (r1 > 0).all() and (r2 > 0).all()
    n = torch.arange(0, 3000, 7).float()
    expected = -r1[:, None] * torch.log(1 + r2[:, None] * n)
    close(pe.score_bias(torch.arange(4)[:, None], n.long() + 100, 100), expected)
    close(
        pe.score_bias(torch.arange(4)[:, None], n.long() + 5, 5),
        pe.score_bias(torch.arange(4)[:, None], n.long(), 0),
    )


def test_kerple_per_layer_gives_each_layer_its_own_pair():
    """kerple_per_layer=True (the paper's model): a (r1, r2) pair per head in every layer, so layers
    attend with different biases, and the cache still equals the full forward; the default shares
    one pair per head."""
    shared = tiny("kerple", n_layer=3)
    per_layer = tiny("kerple", n_layer=3, kerple_per_layer=True)
    assert shared.encoding.log_r1.shape == (4,) and not shared.encoding.per_layer
    assert per_layer.encoding.log_r1.shape == (12,) and per_layer.encoding.per_layer
    pe = per_layer.encoding
    n = torch.arange(50)
    layer_bias = [
        pe.score_bias(torch.arange(4)[:, None] + 4 * layer, n + 50, 50) for layer in range(3)
    ]
    # the layers' own pairs, read at h = layer·n_head + head
    assert not torch.allclose(layer_bias[0], layer_bias[1])
    idx = tokens(2, 16)
    cache = KVCache(per_layer.config.n_layer, 16)  # fed a token at a time, against the full forward
    close(
        torch.cat([per_layer(idx[:, t : t + 1], cache=cache)[0] for t in range(16)], 1),
        per_layer(idx)[0],
    )
    with pytest.raises(ValueError, match="kerple_per_layer='yes' must be True or False"):
        tiny("kerple", kerple_per_layer="yes")


def fire_reference(pe, layer: int, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
    """FIRE's bias from the paper's formula (Li et al. 2023, eq. 3 and their code), written here
    apart from model.py, in the parameters' dtype: f(ψ(i - j) / (ψ(max(L, i)) + 1e-6)), ψ(x) =
    log(|c|·x + 1), L = |m|·L0, f = w2·relu(w1·x + b1) per head. i (Tq, 1) and j (Tk,) positions ->
    (nh, Tq, Tk)."""
    dt = pe.c.dtype
    c = pe.c[layer].abs()
    L = (pe.L_multiplier[layer] * pe.init_L).abs()
    d = (i - j).clamp(min=0).to(dt)
    x = torch.log(c * d + 1) / (torch.log(c * torch.maximum(L, i.to(dt)) + 1) + 1e-6)  # (Tq, Tk)
    hidden = torch.relu(x[..., None] * pe.w1[layer] + pe.b1[layer])  # (Tq, Tk, 32)
    return torch.einsum("qkn,hn->hqk", hidden, pe.w2[layer])


# L = block_size (every query within it), below most, below all
@pytest.mark.parametrize("multiplier", [1.0, 0.3, 0.1])
@pytest.mark.parametrize("regime", ["default", "explicit", "cached"])
@pytest.mark.parametrize("path", ["cpu", "matrix"])
def test_fire_equals_the_papers_formula(multiplier, regime, path, monkeypatch):
    """FIRE's fast bias gives the logits and every parameter's gradient of a model whose bias is the
    paper's formula at every pair, in float64 to 1e-10 relative: with L above every query's
    position, below most, below all, at default, explicit (offset) positions, and through a KV cache
    in chunks. On the CPU's path, its table of distances while every query is within L, else a block
    of queries at a time, pair by pair (the hidden units once per layer); its matrix (the
    reference's, and a GPU's), one MLP per distance for the queries within L and pair by pair past
    it."""
    torch.manual_seed(0)
    # L0 = 32: positions 5 … 28 are within it
    model = tiny("fire", block_size=32, n_layer=2).double().train()
    with torch.no_grad():
        model.encoding.L_multiplier.fill_(multiplier)
        model.encoding.w2.mul_(50)  # a bias that matters: the logits depend on it
    if path == "matrix":
        model.attention_options = replace(model.attention_options, fused=False)
    ref = copy.deepcopy(model)
    ref.attention_options = replace(ref.attention_options, fused=False)
    nh = ref.config.n_head
    ref.encoding.layer_bias = None  # every pair, by the paper's formula
    ref.encoding.score_bias = lambda h, i, j: fire_reference(
        ref.encoding, int(h.flatten()[0]) // nh, i, j
    )
    idx = tokens(2, 24)

    def run(m):
        m.zero_grad()
        # inference: the cache is written in place, no gradient goes through it
        if regime == "cached":
            cache = KVCache(m.config.n_layer, 32)
            with torch.no_grad():
                chunks = [m(idx[:, a:b], cache=cache)[0] for a, b in ((0, 10), (10, 11), (11, 24))]
            return torch.cat(chunks, 1), {}
        pos = torch.arange(5, 29) if regime == "explicit" else None
        logits = m(idx, pos=pos)[0]
        (logits**2).mean().backward()
        return logits, {n: p.grad for n, p in m.named_parameters()}

    shapes = []
    run_mlp = fast_paths.run_mlp
    monkeypatch.setattr(
        fast_paths,
        "run_mlp",
        lambda f, x, *w, **few: shapes.append(tuple(x.shape)) or run_mlp(f, x, *w, **few),
    )
    a, grads_a = run(model)
    b, grads_b = run(ref)
    # the matrix: the MLP ran on the 24 distances, and pair by pair only on the queries past L (all
    # 24 only when all are). The CPU's path: on the 24 distances where no query is past L, else pair
    # by pair (one block of 24 queries). In a cache, every chunk's queries over the cache's 32 slots
    # (inference: no gradient)
    past = int(
        (
            (torch.arange(5, 29) if regime == "explicit" else torch.arange(24)) > multiplier * 32
        ).sum()
    )
    if regime == "cached":
        expected = {(10, 32), (1, 32), (13, 32)}
    elif path == "cpu":
        expected = {(24, 24)} if past else {(24,)}
    else:
        expected = ({(24,)} if past < 24 else set()) | ({(past, 24)} if past else set())
    assert set(shapes) == expected, shapes
    assert (
        past
        == {1.0: 0, 0.3: {"explicit": 19}.get(regime, 14), 0.1: {"explicit": 24}.get(regime, 20)}[
            multiplier
        ]
    )
    # logits of about 1: a near-zero one differs at 1e-15
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    for name in grads_b:
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=1e-10, atol=1e-14, msg=name)


@pytest.mark.parametrize("pe", ENCODINGS)
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_gives_the_same_step(pe, mode):
    """With activation checkpointing (every block's sublayers, or its attention alone, computed
    again in the backward), a training step's logits, loss and every gradient equal the step without
    it, bit for bit, dropout's draws included (the recompute replays the RNG); and the backward
    recomputes: fewer tensors are kept."""
    from shape import set_activation_checkpointing

    def step(model):
        torch.manual_seed(3)
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(
            lambda t: saved.append(t.numel()) or t, lambda t: t
        ):
            logits, loss = model(tokens(2, 16), targets=torch.roll(tokens(2, 16), -1, 1))
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return logits.detach(), loss.detach(), grads, sum(saved)

    model = tiny(pe, dropout=0.1).train()
    logits, loss, grads, kept = step(model)
    model.zero_grad()
    set_activation_checkpointing(model, mode)
    logits2, loss2, grads2, kept2 = step(model)
    assert torch.equal(logits, logits2) and torch.equal(loss, loss2)
    assert grads.keys() == grads2.keys() and all(torch.equal(grads[n], grads2[n]) for n in grads)
    assert kept2 < kept
    with pytest.raises(
        ValueError, match="activation_checkpointing='some': choose none, full, selective"
    ):
        set_activation_checkpointing(model, "some")


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_around_the_cpus_blocks_gives_the_same_step(mode, monkeypatch):
    """FIRE past its threshold (no dropout: its bias a block of queries at a time, each block under
    activation checkpointing of its own) under the model's activation checkpointing, one nested in
    the other: the same logits and gradients bit for bit, and fewer tensors kept."""
    from shape import set_activation_checkpointing

    def step(model):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(
            lambda t: saved.append(t.numel()) or t, lambda t: t
        ):
            logits, loss = model(tokens(2, 16), targets=torch.roll(tokens(2, 16), -1, 1))
        loss.backward()
        return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, sum(saved)

    monkeypatch.setattr(fast_paths, "TABLE_BLOCK", 5)  # 16 queries: four blocks, the last ragged
    model = tiny("fire").train()
    model.encoding.L_multiplier.data.fill_(0.3)  # L = 4.8 of 16 positions
    logits, grads_, kept = step(model)
    model.zero_grad()
    set_activation_checkpointing(model, mode)
    logits2, grads2, kept2 = step(model)
    assert torch.equal(logits, logits2) and all(torch.equal(grads_[n], grads2[n]) for n in grads_)
    assert kept2 < kept


@pytest.mark.parametrize(
    "pe, mode", [("rope", "full"), ("bias_rpe", "selective"), ("fire", "full")]
)
def test_activation_checkpointing_compiles_to_one_graph(pe, mode):
    """Compiled (dynamo and AOTAutograd, one graph), a training step with activation checkpointing
    gives the eager step's logits and gradients without it."""
    from shape import set_activation_checkpointing

    # a second layer would compile the same code again
    model = tiny(pe, block_size=32, n_layer=1).train()
    idx = tokens(2, 32)
    ref_logits, ref = grads(model, idx)
    set_activation_checkpointing(model, mode)
    counter = CompileCounterWithBackend("aot_eager")
    logits, got = grads(torch.compile(model, backend=counter, fullgraph=True), idx)
    assert counter.frame_count == 1
    close(logits, ref_logits)
    assert got.keys() == ref.keys()
    for n in ref:
        close(got[n], ref[n])
