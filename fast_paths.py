"""
The fast paths: faster ways to compute the numbers model.py computes, tested equal to them. model.py asks
`fast_attention()` once per forward for a kernel, and takes its reference attention where the answer is None; FIRE's
bias matrix, RoPE's eager rotation and the compiled decode step come from here too. Nothing here imports the
project's code: the chunk (model.Chunk) and the score bias (model.ScoreBias) are read through their attributes.

Sections: the options and the table that picks a kernel, FlexAttention's paths, BiasAttention (a CPU bias with a
gradient), FIRE's bias, the fallbacks when the compiler cannot build a kernel, RoPE's rotation and the decode step.
docs/development.md ("How attention is computed") explains each path and why it is there.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch.nn import functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from torch.utils.checkpoint import checkpoint

try:  # torch >= 2.9 (return_lse is deprecated there)
    from torch.nn.attention.flex_attention import AuxRequest
except ImportError:  # pragma: no cover
    AuxRequest = None

# ----------------------------------------------------------------------------------------------------------------
# Which kernel: the user's options, and the table


@dataclass(frozen=True)
class AttentionOptions:
    """The user's say in the table (model.attention_options; replaced, never edited). fused: a score bias through
    FlexAttention; None: where it has a backward and is fused (compiled on CUDA); False: never, nor BiasAttention.
    flex_kernel_options: FlexAttention's Triton options, e.g. {"num_stages": 1}."""

    fused: bool | None = None
    flex_kernel_options: dict | None = None


FLEX_MIN_HEAD_DIM = 16  # on CUDA: Triton's tl.dot needs at least 16
MATERIALIZED = "attention adds a materialized bias instead (slower, memory quadratic in the context)"


def flex_fits(head_dim: int, device_type: str) -> bool:
    """Whether FlexAttention takes this head dim on this device."""
    return device_type != "cuda" or head_dim >= FLEX_MIN_HEAD_DIM


def fused_attention_note(head_dim: int, device_type: str) -> str | None:
    """Why a score bias cannot be fused at this head dim on this device, for the user; None where it can."""
    if flex_fits(head_dim, device_type):
        return None
    return f"FlexAttention needs a head dim of at least {FLEX_MIN_HEAD_DIM} on CUDA (this model has {head_dim}): " + (
        MATERIALIZED
    )


def kernel(
    options: AttentionOptions,
    *,
    trainable: bool,
    band: bool,
    own_keys: bool,
    device: str,
    compiling: bool,
    dropout: bool,
    fits: bool,
) -> str | None:
    """The fast kernel for a forward with a score bias, or None for model.py's reference: the first row that matches.

    | fused     | the bias's gradient                   | device, compile      | dropout | kernel         |
    |-----------|---------------------------------------|----------------------|---------|----------------|
    | yes, fits | yes: a band bias, own keys            | ·                    | no      | flex_band      |
    | yes, fits | none                                  | ·                    | no      | flex           |
    | not False | yes                                   | CPU: eager, or own keys | no   | bias_attention |

    fused is options.fused, where None: compiling on CUDA. own_keys: the keys are the queries' own, in order (no
    cache). band: the bias depends on i - j alone, one constant from some distance on (far_distance)."""
    fused = (compiling and device == "cuda") if options.fused is None else options.fused
    flex = fused and not dropout and fits
    if flex and trainable and band and own_keys:
        return "flex_band"
    if flex and not trainable:
        return "flex"
    if trainable and device == "cpu" and (own_keys or not compiling) and not dropout and options.fused is not False:
        return "bias_attention"
    return None


def fast_attention(
    options: AttentionOptions, chunk, score_bias, head_dim: int, dropout_p: float
) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """A fast attention (q, k, v) -> y for this forward's chunk and score bias (model.ScoreBias), or None where
    model.py's reference path is the one to take (no score bias, or no row of `kernel` matches)."""
    if score_bias is None:
        return None
    device = chunk.pos.device.type
    name = kernel(
        options,
        trainable=score_bias.trainable,
        band=score_bias.encoding.far_distance is not None,
        own_keys=chunk.consecutive and not chunk.cached,
        device=device,
        compiling=torch.compiler.is_compiling(),
        dropout=dropout_p > 0,
        fits=flex_fits(head_dim, device),
    )
    return None if name is None else KERNELS[name](chunk, score_bias, options.flex_kernel_options)


# ----------------------------------------------------------------------------------------------------------------
# FlexAttention: the score bias as its score_mod, under a block mask of what each query sees


def flex_band(chunk, score_bias, kernel_options: dict | None) -> Callable:
    # the kernel reads the bias as a constant table of distances 0 … R, BandBiasGrad gives the table its gradient
    R, device, pos, keys = score_bias.encoding.far_distance, chunk.pos.device, chunk.pos, chunk.keys
    heads, distances = torch.arange(score_bias.n_head, device=device)[:, None], torch.arange(R + 1, device=device)
    table = score_bias(heads, distances[None], 0)
    frozen = table.detach()  # (nh, R + 1)
    score_mod = lambda s, b, h, i, j: s + frozen[h, (pos[i] - keys[j]).clamp(0, R)].to(s.dtype)  # noqa: E731
    block_mask = flex_block_mask(chunk)

    def attend(q, k, v):
        y, lse = flex_attention_lse(q, k, v, score_mod, block_mask, kernel_options)
        return BandBiasGrad.apply(y, lse, q, k, v, table, chunk.window)

    return attend


def flex(chunk, score_bias, kernel_options: dict | None) -> Callable:
    pos, keys = chunk.pos, chunk.keys
    score_mod = lambda s, b, h, i, j: s + score_bias(h, pos[i], keys[j]).to(s.dtype)  # noqa: E731
    block_mask = flex_block_mask(chunk)
    return lambda q, k, v: flex_attention(
        q, k, v, score_mod=score_mod, block_mask=block_mask, kernel_options=kernel_options
    )


def flex_block_mask(chunk):
    """Which (query, key) blocks hold any pair a query sees."""
    pos, keys = chunk.pos, chunk.keys
    return create_block_mask(
        lambda b, h, i, j: chunk.sees(pos[i] - keys[j]), None, None, len(pos), len(keys), device=pos.device
    )


def flex_attention_lse(q, k, v, score_mod, block_mask, kernel_options=None):
    """FlexAttention's output (B, nh, T, hs) and its natural-log log-sum-exp (B, nh, T), float32."""
    kw = dict(score_mod=score_mod, block_mask=block_mask, kernel_options=kernel_options)
    if AuxRequest is None:  # pragma: no cover (torch < 2.9)
        return flex_attention(q, k, v, return_lse=True, **kw)
    y, aux = flex_attention(q, k, v, return_aux=AuxRequest(lse=True), **kw)
    return y, aux.lse


class BandBiasGrad(torch.autograd.Function):
    """The identity on attention's output y, whose backward gives the gradient of table (nh, R + 1), a bias of the
    distance i - j alone, constant from distance R on. FlexAttention's own gradient would add every pair's share into
    the table's few entries with atomics, which serialise; this one reads only the band 0 <= i - j < R (linear in T).
    Positions must be consecutive, as in training."""

    @staticmethod
    def forward(ctx, y, lse, q, k, v, table, window):
        ctx.save_for_backward(y, lse, q, k, v, table)
        ctx.window = window
        return y.view_as(y)

    @staticmethod
    def backward(ctx, dy):
        y, lse, q, k, v, table = ctx.saved_tensors
        return dy, None, None, None, None, band_bias_grad(q, k, v, y, lse, dy, table, ctx.window), None


def band_bias_grad(q, k, v, y, lse, dy, table, window: int | None = None) -> torch.Tensor:
    """d loss / d table (nh, R + 1). q, k, v, y, dy (B, nh, T, hs); lse (B, nh, T); window as Chunk's."""
    B, nh, T, hs = q.shape
    R = table.size(1) - 1
    if R == 0:  # one bias for every distance: softmax ignores it
        return torch.zeros_like(table)
    n, nb = R, -(-T // R)  # blocks of n queries, each against the n keys before it and its own n
    dtype = torch.promote_types(q.dtype, torch.float32)  # bf16 inputs, float32 arithmetic
    pad = lambda t: F.pad(t.to(dtype), (0, 0, 0, nb * n - T)).view(B, nh, nb, n, hs)  # noqa: E731
    qb, kb, vb, yb, dyb = (pad(t) for t in (q, k, v, y, dy))  # (B, nh, nb, n, hs)
    window2 = lambda t: torch.cat([F.pad(t, (0, 0, 0, 0, 1, -1)), t], dim=3)  # noqa: E731  (B, nh, nb, 2n, hs)
    kw, vw = window2(kb), window2(vb)
    r, c = torch.arange(n, device=q.device)[:, None], torch.arange(2 * n, device=q.device)[None, :]
    rel = n + r - c  # (n, 2n): i - j for query r of a block and key c of its window
    i = torch.arange(nb, device=q.device)[:, None, None] * n + r  # (nb, n, 1) absolute query index
    band = R if window is None else min(R, window)  # the distances with a bias of their own that a query sees
    near = (rel >= 0) & (rel < band) & (i - rel >= 0) & (i < T)  # (nb, n, 2n)
    lse_b = F.pad(lse.to(dtype), (0, nb * n - T)).view(B, nh, nb, n, 1)
    s = (qb @ kw.transpose(-2, -1)) * hs**-0.5 + table.detach()[:, rel.clamp(0, R)][None, :, None]  # (B,nh,nb,n,2n)
    p = torch.where(near, (s - lse_b).exp(), 0.0)
    D = (dyb * yb).sum(-1, keepdim=True)  # (B, nh, nb, n, 1): rowsum(dP ⊙ P)
    ds = (p * (dyb @ vw.transpose(-2, -1) - D)).sum((0, 2))  # (nh, n, 2n), summed over the batch and the blocks
    near_grad = torch.zeros(nh, R, device=q.device, dtype=dtype).index_add_(
        1, rel.clamp(0, R - 1).flatten(), ds.flatten(1)
    )
    # dS sums to zero over each row: the shared far entry's gradient is minus the near ones' sum
    return torch.cat([near_grad, -near_grad.sum(1, keepdim=True)], dim=1).to(table.dtype)


# ----------------------------------------------------------------------------------------------------------------
# BiasAttention: a trainable score bias on a CPU, through SDPA's flash kernel (which gives a bias no gradient)


def bias_attention(chunk, score_bias, kernel_options: dict | None) -> Callable:
    scores = score_bias.matrix(chunk)  # (nh, Tq, Tk), -inf where a query does not see a key
    own_keys = chunk.consecutive and not chunk.cached  # key j is query j: query i sees keys 0 … i at most
    function = OwnKeysBiasAttention if own_keys else BiasAttention
    return lambda q, k, v: function.apply(q, k, v, scores.to(q.dtype))


BIAS_ATTENTION_BLOCK = 64  # queries per block of BiasAttention's backward


class BiasAttention(torch.autograd.Function):
    """softmax(q·kᵀ/√hs + bias)·v with a gradient for the bias (nh, Tq, Tk; -inf where masked): the flash kernel
    forward, and a backward that recomputes the probabilities from its log-sum-exp a block of queries at a time,
    skipping the keys no query of the block sees (which, it reads from the mask)."""

    @staticmethod
    def forward(ctx, q, k, v, bias):
        y, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=bias[None])
        ctx.save_for_backward(q, k, v, bias, y, lse)
        return y

    @staticmethod
    def backward(ctx, dy):
        return bias_attention_backward(ctx, dy, own_keys=False)


class OwnKeysBiasAttention(BiasAttention):
    """BiasAttention where the keys are the queries' own: the blocks' sizes are known without reading the mask, so
    Dynamo can trace the backward."""

    @staticmethod
    def backward(ctx, dy):
        return bias_attention_backward(ctx, dy, own_keys=True)


def bias_attention_backward(ctx, dy: torch.Tensor, own_keys: bool) -> tuple:
    q, k, v, bias, y, lse = ctx.saved_tensors  # lse (B, nh, Tq), float32
    dtype, (q, k, v, dy, y) = q.dtype, (t.float() for t in (q, k, v, dy, y))
    scale, Tq, Tk, block = q.size(-1) ** -0.5, q.size(2), k.size(2), BIAS_ATTENTION_BLOCK
    # query i sees keys up to last[i] (exclusive); -inf bias past it gives probability 0, so skip those keys. Every
    # head has the same mask: read it from head 0, or where the keys are the queries' own, last[i] <= i + 1.
    if own_keys:
        last = range(1, Tq + 1)
    else:
        last = (bias[0].isfinite() * torch.arange(1, Tk + 1, device=q.device)).amax(-1).tolist()
    D = (dy * y).sum(-1, keepdim=True)  # (B, nh, Tq, 1): rowsum(dP ⊙ P), the softmax backward's correction
    dq, dk, dv, dbias = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v), torch.zeros_like(bias)
    for i0 in range(0, Tq, block):
        i1 = min(i0 + block, Tq)
        j1 = max(last[i0:i1])
        qb, dyb, kb, vb = q[:, :, i0:i1], dy[:, :, i0:i1], k[:, :, :j1], v[:, :, :j1]
        p = (qb @ kb.transpose(-2, -1)).mul_(scale).add_(bias[:, i0:i1, :j1]).sub_(lse[:, :, i0:i1, None]).exp_()
        dv[:, :, :j1] += p.transpose(-2, -1) @ dyb
        ds = p.mul_((dyb @ vb.transpose(-2, -1)).sub_(D[:, :, i0:i1]))  # dS = P ⊙ (dP - D), (B, nh, bq, j1)
        dbias[:, i0:i1, :j1] = ds.sum(0)  # the bias is shared by the batch
        ds.mul_(scale)
        dq[:, :, i0:i1] = ds @ kb
        dk[:, :, :j1] += ds.transpose(-2, -1) @ qb
    return dq.to(dtype), dk.to(dtype), dv.to(dtype), dbias


KERNELS = {build.__name__: build for build in (flex_band, flex, bias_attention)}  # kernel()'s answers


# ----------------------------------------------------------------------------------------------------------------
# FIRE's bias: the same values as model.FIRE.score_bias at every pair, with less memory and time


def recomputed(fn: Callable, recompute: bool) -> Callable:
    """fn, or with recompute fn under activation checkpointing: its intermediates are computed again in the
    backward instead of kept."""
    if not recompute:
        return fn
    return lambda *args: checkpoint(fn, *args, use_reentrant=False)


FIRE_FEW = 1 << 14  # MLP inputs up to which its hidden units are kept (16,384 x 32 floats: 2 MiB)


def fire_mlp(mlp: Callable, x, w1, b1, w2, few: bool = False):
    """FIRE's f(x) (model.FIRE.mlp, one hidden unit at a time), computed the fastest exact way. Few inputs (a block's
    distances, a decode step's row), or compiled with a gradient: one broadcast expression, whose hidden units are
    few, or which inductor fuses without storing them. Eager with a gradient: ScalarMLP, which keeps x alone."""
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (x, w1, b1, w2))
    if few or (grad and torch.compiler.is_compiling()):
        return (torch.relu(x[..., None] * w1 + b1) * w2).sum(-1)
    return ScalarMLP.apply(mlp, x, w1, b1, w2) if grad else mlp(x, w1, b1, w2)


class ScalarMLP(torch.autograd.Function):
    """mlp(x, w1, b1, w2) with a gradient that keeps x alone and recomputes the 32 hidden units one at a time in the
    backward (autograd would keep 32 bias-sized pre-activations)."""

    @staticmethod
    def forward(ctx, mlp, x, w1, b1, w2):
        ctx.save_for_backward(x, w1, b1, w2)
        return mlp(x, w1, b1, w2)

    @staticmethod
    def backward(ctx, g):
        x, w1, b1, w2 = ctx.saved_tensors
        gx, gw1, gb1, gw2 = torch.zeros_like(g), torch.zeros_like(w1), torch.zeros_like(b1), torch.zeros_like(w2)
        for u in range(w1.size(-1)):
            a = x * w1[..., u] + b1[..., u]
            ga = torch.where(a > 0, g * w2[..., u], 0.0)  # d out / d a_u
            gw2[..., u] = (g * a.clamp(min=0)).sum_to_size(w2[..., u].shape)
            gb1[..., u] = ga.sum_to_size(b1[..., u].shape)
            gw1[..., u] = (ga * x).sum_to_size(w1[..., u].shape)
            gx = gx + ga * w1[..., u]
        return None, gx.sum_to_size(x.shape), gw1, gb1, gw2


def fire_matrix(fire, first: int, n_head: int, chunk, recompute: bool = False) -> torch.Tensor:
    """One layer's (nh, Tq, Tk) FIRE bias (fire: model.FIRE), its x and hidden units computed once for the layer's
    heads. Where the queries are their own keys at consecutive positions, a query within the threshold L has x of
    i - j alone: its row is a gather from the MLP run on the T distances. Only queries past L (a suffix) take the MLP
    per pair."""
    layer, pos = first // n_head, chunk.pos
    c, threshold = fire.c[layer].abs(), (fire.L_multiplier[layer] * fire.init_L).abs()
    w1, b1, w2 = fire.w1[layer], fire.b1[layer], fire.w2[layer][:, None, None]  # (32,), (32,), (nh, 1, 1, 32)
    operands = (c, threshold, w1, b1, w2)

    def pairs(queries: torch.Tensor) -> Callable:  # the bias of these queries over every key: (nh, Tq, Tk)
        few = len(queries) * len(chunk.keys) <= FIRE_FEW  # little to keep for the backward: nothing to recompute

        def f(c, threshold, w1, b1, w2):
            return fire_mlp(fire.mlp, fire.input(c, threshold, queries[:, None], chunk.keys), w1, b1, w2, few=few)

        return recomputed(f, recompute and not few)

    if chunk.cached or not chunk.consecutive or len(pos) < 2:
        return pairs(pos)(*operands)
    T = len(pos)
    rel = (pos[:, None] - pos[None, :]).clamp(min=0)  # (T, T): 0 … T - 1

    def by_distance(c, threshold, w1, b1, w2, rows: int = T):  # the first `rows` queries, within L
        d = torch.arange(T, device=pos.device)
        x = fire.input(c, threshold, d, 0)
        table = fire_mlp(fire.mlp, x, w1, b1, w2[:, 0], few=T <= FIRE_FEW)  # (nh, T): L >= d
        return table[:, rel[:rows]]  # (nh, rows, T); keeps little for the backward: nothing to recompute

    past = pos > threshold  # (T,): True on a suffix
    if torch.compiler.is_compiling():  # one graph, so no size from the data: branches taken at run time
        R = max(1, T // 8)  # up to R queries past L: the last R rows pair by pair where past, a gather elsewhere

        def few_past(*operands):
            table = by_distance(*operands)  # (nh, T, T)
            tail = torch.where(past[T - R :, None], pairs(pos[T - R :])(*operands), table[:, T - R :])
            return torch.cat([table[:, : T - R], tail], dim=1)

        def some_past(*operands):
            return torch.cond(past.sum() <= R, few_past, pairs(pos), operands)

        return torch.cond(past.any(), some_past, by_distance, operands)
    n = int(past.sum())
    if n == 0 or n == T:
        return (by_distance if n == 0 else pairs(pos))(*operands)
    return torch.cat([by_distance(*operands, rows=T - n), pairs(pos[T - n :])(*operands)], dim=1)


# ----------------------------------------------------------------------------------------------------------------
# Kernel fallbacks: a fused kernel that the compiler cannot build for this model on this GPU (Triton's shared memory,
# an unsupported shape) is replaced, never a crash: first the same kernel with one pipeline stage (less shared memory
# per block), then a materialized bias (always compiles). Each replaces fields of the model's AttentionOptions.
KERNEL_FALLBACKS = [
    (
        "FlexAttention retries with kernel_options num_stages=1 (less shared memory)",
        {"flex_kernel_options": {"num_stages": 1}},
    ),
    (MATERIALIZED, {"fused": False}),
]


def compiler_failure(e: BaseException | None) -> bool:
    """Whether e, or an exception it came from, is the compiler's (Dynamo's backend, Inductor, Triton)."""
    from torch._dynamo.exc import BackendCompilerFailed
    from torch._inductor import exc as inductor_exc  # imported here: torch does not load inductor until it compiles

    kinds = (BackendCompilerFailed, getattr(inductor_exc, "InductorError", BackendCompilerFailed))
    while e is not None:
        name = f"{type(e).__module__}.{type(e).__name__}"
        if isinstance(e, kinds) or name.startswith("triton.") or name.endswith("NoTritonConfigsError"):
            return True
        e = e.__cause__ or e.__context__
    return False


def fall_back(model, error: BaseException) -> str | None:
    """Where error is the compiler failing on the fused kernel the default options chose, move model.attention_options
    to the next fallback and say what changed (one line); None where there is nothing to fall back from or to."""
    options = model.attention_options
    if not (model.encoding.has_score_bias and options.fused is None and compiler_failure(error)):
        return None
    for what, settings in KERNEL_FALLBACKS:
        if any(getattr(options, k) != v for k, v in settings.items()):
            model.attention_options = replace(options, **settings)
            first_line = next((ln for ln in str(error).splitlines() if ln.strip()), type(error).__name__)[:200]
            return f"the fused attention kernel (FlexAttention) failed to compile ({first_line}); {what}"
    return None


def with_kernel_fallbacks(model, step: Callable, before_retry: Callable | None = None, log=print):
    """step(), and where the fused kernel cannot be compiled, step() again after each fallback in turn (one log line
    each). before_retry() puts back what the failed step changed and re-wraps the model. A fallback stays."""
    while True:
        try:
            return step()
        except Exception as e:
            note = fall_back(model, e)
            if note is None:
                raise
            log(f"note: {note}")
            if before_retry is not None:
                before_retry()


# ----------------------------------------------------------------------------------------------------------------
# RoPE's rotation, and the compiled decode step


def fast_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """model.apply_rotary eagerly as one complex multiply, (x1 + i·x2)(cos + i·sin): one kernel where the real
    arithmetic takes six. None when compiling: inductor has no complex codegen, and fuses the real arithmetic."""
    if torch.compiler.is_compiling():
        return None
    pairs = x.float().unflatten(-1, (-1, 2))  # (B, nh, T, hs/2, 2)
    return torch.view_as_real(torch.view_as_complex(pairs) * torch.complex(cos, sin)).flatten(-2).type_as(x)


def compiled_step(step: Callable, owner, device_type: str) -> Callable:
    """step (a function of owner and tensors, e.g. model.Engine.step) compiled for owner: on CUDA one graph replayed
    over the static cache; on a CPU, batch-1 matmuls as fused multiply-reductions (faster than MKL's GEMV). Dynamo
    keeps its graphs, and its limit of 8 recompiles, per code object: each owner compiles a copy of step's code, so a
    process that compiles many models never reaches the limit, which fullgraph=True makes an error."""
    if device_type == "cuda":
        kw = dict(mode="reduce-overhead")
    else:
        kw = dict(options={"post_grad_fusion_options": {"decompose_mm_pass": {}}})
    code = step.__code__.replace()
    return torch.compile(types.MethodType(types.FunctionType(code, step.__globals__), owner), fullgraph=True, **kw)
