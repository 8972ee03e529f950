"""Generation (nanochat's engine.py, gpt-fast's generate.py): the loop that feeds a model.GPT a
token at a time through its KV cache, and sampling. The model neither builds nor holds any of it:
sample.py calls `generate(model, idx, ...)`, the Hugging Face export `next_logits`."""

from __future__ import annotations

import math
import types
import weakref
from collections.abc import Callable

import torch
from torch.nn import functional as F

# in an export's folder, transformers loads this file as a module of a package, beside model.py
try:
    from .model import GPT, Chunk, PositionalEncoding, document_starts
except ImportError:
    from model import GPT, Chunk, PositionalEncoding, document_starts

# --------------------------------------------------------------------------------------------------
# The KV cache: generation's state, which it builds and holds; the model writes a chunk's keys and
# values into it


class KVCache:
    """Keys (after rotation) and values of every layer, each (B, nh, S, hs), in a ring of S slots
    (position p in slot p % S; `pos` (S,) holds each slot's, EMPTY where unused). Fixed shapes and
    in-place writes make a compiled decode step one CUDA graph; `claim` alone advances it."""

    EMPTY = 2**62

    def __init__(self, n_layer: int, size: int):
        if size < 1:
            raise ValueError(f"KVCache size={size} must be a positive number of slots")
        self.size = size
        self.k: list[torch.Tensor | None] = [None] * n_layer
        self.v: list[torch.Tensor | None] = [None] * n_layer
        self.pos: torch.Tensor | None = None  # (S,) absolute position held by each slot
        # (B, S) packing="documents": where each slot's document starts
        self.starts: torch.Tensor | None = None
        # (B, nh, S) float64: FoX's sums at each key
        self.running: list[torch.Tensor | None] = [None] * n_layer
        self.next_pos = 0  # absolute position of the next token
        self.length = 0  # tokens written so far

    def max_chunk(self, T: int, window: int | None) -> int:
        """The most tokens one forward may write without evicting a key one of its queries needs (S
        - W + 1 with a window W); a ValueError where the cache cannot serve the window, or has no
        room for T more tokens."""
        if window is not None and self.size < window:
            raise ValueError(
                f"a KV cache of {self.size} slots cannot serve a window of {window} tokens"
            )
        if window is None and self.length + T > self.size:
            raise ValueError(
                f"the KV cache holds {self.size} tokens and has {self.length}; {T} more do not fit "
                "(make a bigger cache, or pass a window to roll it)"
            )
        return self.size - self.length if window is None else self.size - window + 1

    def claim(
        self,
        idx: torch.Tensor,
        window: int | None,
        eot_token: int | None = None,
        pos=None,
        last: int | None = None,
    ) -> Chunk:
        """The Chunk of idx (B, T), its slots claimed and its keys every slot's: at the next T
        positions, or at pos (T,) whose last is `last` (a host int: no sync); eot_token: where
        documents start (packing="documents"). model.GPT.chunk checks a chunk before it claims."""
        T = idx.size(1)
        start = self.next_pos
        if pos is None:  # the cache's next T positions
            pos = torch.arange(start, start + T, device=idx.device)
            last = start + T - 1
            consecutive = True
        else:  # .diff() syncs: only for explicit positions
            consecutive = T == 1 or bool((pos.diff() == 1).all())
        starts = None if eot_token is None else document_starts(idx, pos, eot_token, self)  # (B, T)
        if self.pos is None:
            self.pos = torch.full((self.size,), self.EMPTY, dtype=torch.long, device=pos.device)
        slots = pos % self.size
        self.pos.index_copy_(0, slots, pos)
        if starts is not None:
            if self.starts is None:  # an unused slot's document starts nowhere a token's does
                self.starts = torch.full(
                    (len(starts), self.size), -1, dtype=torch.long, device=pos.device
                )
            self.starts.index_copy_(1, slots, starts)
        self.next_pos = last + 1
        self.length = self.length + len(pos)
        return Chunk(
            pos,
            self.pos,
            slots,
            window,
            consecutive,
            starts=starts,
            key_starts=self.starts,
            cached=True,
        )

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write one layer's k, v (B, nh, T, hs) into the chunk's slots and return every slot's keys
        and values."""
        if self.k[layer] is None:
            shape = (k.size(0), k.size(1), self.size, k.size(3))
            self.k[layer] = torch.zeros(shape, dtype=k.dtype, device=k.device)
            self.v[layer] = torch.zeros(shape, dtype=v.dtype, device=v.device)
        self.k[layer].index_copy_(2, slots, k)
        self.v[layer].index_copy_(2, slots, v)
        return self.k[layer], self.v[layer]

    def sums(
        self, layer: int, increments: torch.Tensor, chunk: Chunk
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A running sum over the tokens (FoX's): the chunk's (B, nh, T), continued from the token
        before it (the sum in its slot, 0 in a new cache), written to the chunk's slots; and every
        slot's (B, nh, S)."""
        if self.running[layer] is None:
            self.running[layer] = increments.new_zeros(*increments.shape[:2], self.size)
        # (B, nh, 1), before it writes
        before = self.running[layer].index_select(2, (chunk.pos[:1] - 1) % self.size)
        sums = before + increments.cumsum(-1)
        self.running[layer].index_copy_(2, chunk.slots, sums)
        return sums, self.running[layer]


# --------------------------------------------------------------------------------------------------
# The loop, and sampling


@torch.no_grad()
def generate(
    model: GPT,
    idx: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    use_cache: bool = True,
    max_context: int | None = None,
    generator: torch.Generator | None = None,
    compile: bool = False,
) -> torch.Tensor:
    """Extend idx (B, T) by max_new_tokens sampled tokens (temperature 0: greedy), attending to at
    most max_context tokens: past it the absolute encodings crop and restart at 0, the others roll
    their cache. A bad argument is a ValueError naming it, before any work."""
    # a numpy scalar's or 0-d tensor's value
    numbers = (max_new_tokens, temperature, top_k, top_p, max_context)
    max_new_tokens, temperature, top_k, top_p, max_context = (
        x.item() if getattr(x, "ndim", None) == 0 and hasattr(x, "item") else x for x in numbers
    )
    if problem := sampling_problem(temperature, top_k, top_p):
        name, rule = problem
        raise ValueError(
            f"{name}={dict(temperature=temperature, top_k=top_k, top_p=top_p)[name]!r} {rule}"
        )
    if not (type(max_new_tokens) is int and max_new_tokens >= 0):
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an integer >= 0")
    integers = isinstance(idx, torch.Tensor) and not (
        idx.dtype.is_floating_point or idx.dtype.is_complex
    )
    if not (integers and idx.dtype != torch.bool and idx.dim() == 2 and idx.numel()):
        got = (
            f"a {tuple(idx.shape)} {idx.dtype} tensor"
            if isinstance(idx, torch.Tensor)
            else type(idx).__name__
        )
        raise ValueError(
            "idx must be a (B, T) tensor of integer token ids, B and T >= 1 (e.g. "
            f"torch.tensor([[1, 2]])); got {got}"
        )
    idx = idx.long()  # ids of any integer width
    V = model.config.vocab_size
    if (low := int(idx.min())) < 0 or (high := int(idx.max())) >= V:
        raise ValueError(
            f"idx holds token id {low if low < 0 else high}: the model's vocabulary is 0 … {V - 1}"
        )
    # a longer one is never reached
    W = min(context_window(model, max_context), idx.size(1) + max_new_tokens)
    decode = compiled(model, idx.device.type) if compile and use_cache else decode_step
    cache, new = None, idx  # new: the tokens the model has not seen yet
    for _ in range(max_new_tokens):
        # the cache (None without one)
        logits, after = next_logits(model, idx, new, cache, W, use_cache, decode)
        # a new cache: its tensors keep their addresses, CUDA graphs need no copy
        if compile and after is not cache:
            for t in [
                after.pos,
                *after.k,
                *after.v,
                *(t for t in [after.starts, *after.running] if t is not None),
            ]:
                torch._dynamo.mark_static_address(t)
        cache = after  # new: (B, 1)
        new = sample_next(logits, temperature, top_k, top_p, generator)
        idx = torch.cat([idx, new], dim=1)
    return idx


def next_logits(
    model: GPT,
    idx: torch.Tensor,
    new: torch.Tensor,
    cache: KVCache | None,
    W: int,
    use_cache: bool = True,
    decode: Callable | None = None,
) -> tuple[torch.Tensor, KVCache | None]:
    """Logits (B, vocab_size) of the token after idx (B, T), whose last tokens `new` the cache has
    not read, attending to at most W tokens; and the cache to pass next time. decode: the decode
    step (compiled or not)."""
    pe = model.transformer.encoding
    T = idx.size(1)
    if not use_cache or min(T, W) > pe.cache_span:  # the whole window again
        # FIRE reads the window at its own positions
        absolute = pe.rolling and not pe.relative and T > W
        pos, doc_start = None, None
        # and in documents, from where the window's first document began, as the rolling cache
        # counts
        if absolute:
            pos = torch.arange(T - W, T, device=idx.device)
            if model.config.packing == "documents":
                # (B, T)
                everyone = document_starts(
                    idx, torch.arange(T, device=idx.device), model.config.eot_token
                )
                doc_start = everyone[:, T - W]  # (B,)
        return model.lm_head(
            model.features(idx[:, -W:], pos=pos, doc_start=doc_start)[:, -1]
        ), cache
    # rolling: keys keep their positions; else crop to W, positions from 0
    window = W if pe.rolling else None
    eot = model.config.eot_token if model.config.packing == "documents" else None
    # (re)start: a prefill, eagerly
    if cache is None or (not pe.rolling and cache.next_pos + 1 > W):
        cache = KVCache(model.config.n_layer, cache_size(pe, W, new.size(1)))
        tokens = new if pe.rolling else idx[:, -W:]
        # the decode step over the prompt, W tokens at most at once (cache_size)
        for piece in tokens.split(W, dim=1):
            logits = decode_step(model, piece, cache.claim(piece, window, eot), cache)
        return logits, cache
    # one token: its slot claimed (host-side), then the step, compiled or not, on tensors
    return (decode or decode_step)(model, new, cache.claim(new, window, eot), cache), cache


def decode_step(model: GPT, idx: torch.Tensor, chunk: Chunk, cache: KVCache) -> torch.Tensor:
    """Logits (B, vocab_size) of one new token idx (B, 1) at chunk.pos, its slot claimed: the unit
    compiled."""
    return model.lm_head(model.chunk_features(idx, chunk, cache)[:, -1])


# a model's compiled decode step, and the encoding it was compiled for (set_rope_scaling replaces
# the encoding); held here, not by the model, and dropped with the model
COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def compiled(model: GPT, device_type: str) -> Callable:
    """decode_step compiled for this model once, then reused by every generate() call (on CUDA one
    graph over the static cache). Each model compiles a copy of decode_step's code, so that dynamo's
    limit of recompiles per code object is never reached."""
    encoding, decode = COMPILED.get(model, (None, None))
    if encoding is not model.transformer.encoding:
        if device_type == "cuda":
            kw = dict(mode="reduce-overhead")
        else:
            kw = dict(options={"post_grad_fusion_options": {"decompose_mm_pass": {}}})
        step = types.FunctionType(decode_step.__code__.replace(), decode_step.__globals__)
        decode = torch.compile(types.MethodType(step, model), fullgraph=True, **kw)
        COMPILED[model] = (model.transformer.encoding, decode)
    return lambda model, idx, chunk, cache: decode(idx, chunk, cache)


def cache_size(encoding: PositionalEncoding, window: int, prompt: int) -> int:
    """The slots a generation's cache takes: a rolling one the window and the longest chunk written
    at once (the prompt, in pieces of at most the window), a cropping one the window."""
    return window - 1 + min(prompt, window) if encoding.rolling else window


def context_window(model: GPT, max_context: int | None = None) -> int:
    """The longest context generation attends to: max_context, by default block_size."""
    config = model.config
    W = config.block_size if max_context is None else max_context
    if type(W) is not int or W < 1:  # True is an int to Python, and no context
        raise ValueError(f"max_context={max_context!r} must be a positive integer")
    if W > model.transformer.encoding.max_length:
        raise ValueError(
            f"max_context={W} is longer than pos_encoding={config.pos_encoding!r} can take "
            f"(block_size={config.block_size}); use max_context <= {config.block_size}"
        )
    return W


def sampling_problem(
    temperature: float, top_k: int | None, top_p: float | None
) -> tuple[str, str] | None:
    """The first sampling argument out of its range, as (name, what is allowed), or None: the one
    rule that generate() and sample.py check."""
    real = lambda x: isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)  # noqa: E731
    if not (real(temperature) and temperature >= 0):
        return "temperature", "must be a finite number >= 0 (0: greedy)"
    # logits / temperature overflow float32 near 1e-36; long before, it is greedy anyway
    if 0 < temperature < 1e-6:
        return "temperature", "below 1e-6 it is greedy: use 0"
    if not (top_k is None or (type(top_k) is int and top_k >= 1)):
        return "top_k", "must be an integer >= 1, or None (all)"
    if not (top_p is None or (real(top_p) and 0 < top_p <= 1)):
        return "top_p", "must be in (0, 1], or None (all)"
    return None


def sample_next(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """One token per row of logits (B, V) -> (B, 1). temperature 0 is greedy; top_k keeps the k
    likeliest tokens, top_p the smallest set whose probability reaches p (Holtzman et al. 2019)."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits.float() / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = F.softmax(sorted_logits, dim=-1)
        # mass before this token already reaches p (keeps the first)
        drop = probs.cumsum(dim=-1) - probs >= top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return torch.multinomial(F.softmax(logits, dim=-1), num_samples=1, generator=generator)
