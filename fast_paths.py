"""The fast paths: faster ways to the attention model.py computes, each tested equal to it. Nothing
here imports the project's code or reads a model object; docs/development.md ("How attention is
computed") gives each path, its contract and why."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from torch.nn import functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from torch.utils.checkpoint import checkpoint

try:  # torch >= 2.9 (return_lse is deprecated there)
    from torch.nn.attention.flex_attention import AuxRequest
except ImportError:  # pragma: no cover
    AuxRequest = None

# --------------------------------------------------------------------------------------------------
# Which kernel: the user's options, and the table


@dataclass(frozen=True)
class AttentionOptions:
    """The user's say in the kernel table (model.attention_options; replaced, never edited): `fused`
    (FlexAttention: None where it is fused, compiled on CUDA; False: never, nor the CPU's kernels)
    and FlexAttention's Triton options."""

    fused: bool | None = None
    flex_kernel_options: dict | None = None


FLEX_MIN_HEAD_DIM = 16  # on CUDA: Triton's tl.dot needs at least 16


def flex_fits(head_dim: int, device_type: str) -> bool:
    """Whether FlexAttention takes this head dim on this device."""
    return device_type != "cuda" or head_dim >= FLEX_MIN_HEAD_DIM


def kernel(
    attention_options: AttentionOptions,
    *,
    trainable: bool,
    own_keys: bool,
    device: str,
    dropout: bool,
    has_table: bool = False,
    cached: bool = False,
    queries: int = 0,
    head_dim: int | None = None,
    fits: bool | None = None,
    compiling: bool | None = None,
    sums: bool = False,
    content: bool = False,
) -> Callable[[LayerBias], Callable] | None:
    """The builder of the kernel for a forward with a score bias: the first row of the table in
    docs/development.md that matches, or None for model.py's reference (a bias of the content: its
    own, one_block)."""
    compiling = torch.compiler.is_compiling() if compiling is None else compiling
    fused = (
        (compiling and device == "cuda")
        if attention_options.fused is None
        else attention_options.fused
    )
    fusable = fused and not dropout and (flex_fits(head_dim, device) if fits is None else fits)
    reference = one_block if content else None
    if fusable and trainable and has_table and own_keys:
        return flex_table
    if fusable and not trainable:
        return reference if content else flex
    # FIRE on a GPU: never FlexAttention's atomics
    if fused and not dropout and trainable and own_keys and not has_table:
        return bias_blocks
    cpu = (
        device == "cpu"
        and (own_keys or not compiling)
        and not dropout
        and attention_options.fused is not False
    )
    if not cpu or (cached and queries <= TABLE_BLOCK):
        return reference
    return bias_table if has_table else sum_blocks if sums else bias_blocks


@dataclass(frozen=True)
class LayerBias:
    """One layer's score bias over a forward's chunk, as model.attention_for hands it to the
    builder kernel() chose: the positions, and the bias by formula, table, rows or content."""

    pos: torch.Tensor  # (Tq,) the queries' positions
    key_pos: torch.Tensor  # (Tk,) the keys'
    window: int | None
    own_keys: bool  # the keys are the queries' own, in order (no cache)
    starts: tuple | None  # where each query's and key's document starts, (B, Tq) and (B, Tk)
    attention_options: AttentionOptions
    attend: Callable  # model.attend with the run's dropout: SDPA under a score bias
    block: Callable  # block(i0, i1, j0, j1): the chunk of queries i0 … i1 - 1 over keys j0 … j1 - 1
    seen: Callable  # seen(chunk): what its queries see, (1 or B, 1, Tq, Tk)
    score: Callable | None = None  # score(h + first_head, i, j): the bias at a pair
    first_head: int = 0
    table: torch.Tensor | None = None  # (nh, D): a bias of i - j alone at distances 0 … D - 1
    matrix: Callable | None = None  # matrix(chunk): its bias (nh or B, nh, Tq, Tk), -inf unseen
    content_bias: Callable | None = None  # (q, k, seen, order, sums) of a block: CoPE's, FoX's
    forget: Callable | None = None  # x -> what each token adds to FoX's running sums (B, nh, T)
    sums: Callable | None = None  # a cache's: increments -> the queries' and every key's sums
    counts: Callable | None = None  # () -> GateCounts: CoPE's counted positions


def flex_mask(layer: LayerBias):
    """FlexAttention's block mask of what each query sees (causal, the window, its document)."""

    def visible(b, h, i, j):  # query and key indices -> bool
        seen = sees(layer.pos[i] - layer.key_pos[j], layer.window)
        return (
            seen
            if layer.starts is None
            else seen & (layer.starts[0][b, i] == layer.starts[1][b, j])
        )

    batch = None if layer.starts is None else layer.starts[0].size(0)
    shape = (len(layer.pos), len(layer.key_pos))  # Tq, Tk
    return create_block_mask(visible, batch, None, *shape, device=layer.pos.device)


def flex(layer: LayerBias) -> Callable:
    """FlexAttention with the bias as its score_mod, read at positions in each document where there
    are documents (a bias that reads the query's own position, FIRE's, reads its document's)."""
    block_mask = flex_mask(layer)

    def score_mod(s, b, h, i, j):
        i_pos = layer.pos[i]
        j_pos = layer.key_pos[j]
        if layer.starts is not None:  # positions in each document
            i_pos = i_pos - layer.starts[0][b, i]
            j_pos = j_pos - layer.starts[1][b, j]
        return s + layer.score(h + layer.first_head, i_pos, j_pos).to(s.dtype)

    options = layer.attention_options.flex_kernel_options
    return lambda q, k, v, x: flex_attention(
        q, k, v, score_mod=score_mod, block_mask=block_mask, kernel_options=options
    )


def flex_table(layer: LayerBias) -> Callable:
    """FlexAttention reading a bias of i - j alone as a constant, its table (nh, R + 1) over the
    distances 0 … R (the last for every longer one), which TableGrad gives its gradient."""
    frozen = layer.table.detach()
    R = layer.table.size(1) - 1
    rel = lambda i, j: (layer.pos[i] - layer.key_pos[j]).clamp(0, R)  # noqa: E731
    score_mod = lambda s, b, h, i, j: s + frozen[h, rel(i, j)].to(s.dtype)  # noqa: E731
    block_mask = flex_mask(layer)

    def attention(q, k, v, x):
        y, lse = flex_attention_lse(
            q, k, v, score_mod, block_mask, layer.attention_options.flex_kernel_options
        )
        # own keys: the keys' starts are the queries'
        starts = layer.starts and layer.starts[0]
        return TableGrad.apply(y, lse, q, k, v, layer.table, layer.window, starts)

    return attention


def bias_table(layer: LayerBias) -> Callable:
    """TableBiasAttention: a bias of i - j alone read from its table, a block of queries at a time
    (on a CPU)."""
    query_starts, key_starts = layer.starts or (None, None)
    # Dynamo traces no Function given one tensor twice: None where the keys are the queries' own
    key_pos = None if layer.own_keys else layer.key_pos
    key_starts = None if layer.own_keys else key_starts
    return lambda q, k, v, x: TableBiasAttention.apply(
        q, k, v, layer.table, layer.pos, key_pos, layer.window, query_starts, key_starts
    )


def sees(rel: torch.Tensor, window: int | None) -> torch.Tensor:
    """Whether a query sees a key at i - j = rel: causal, and inside the window if there is one
    (model.py's rule)."""
    return rel >= 0 if window is None else (rel >= 0) & (rel < window)


# --------------------------------------------------------------------------------------------------
# FlexAttention: the score bias as its score_mod, under a block mask of what each query sees


def flex_attention_lse(q, k, v, score_mod, block_mask, kernel_options=None):
    """FlexAttention's output (B, nh, T, hs) and its natural-log log-sum-exp (B, nh, T), float32."""
    kw = dict(score_mod=score_mod, block_mask=block_mask, kernel_options=kernel_options)
    if AuxRequest is None:  # pragma: no cover (torch < 2.9)
        return flex_attention(q, k, v, return_lse=True, **kw)
    y, aux = flex_attention(q, k, v, return_aux=AuxRequest(lse=True), **kw)
    return y, aux.lse


class TableGrad(torch.autograd.Function):
    """The identity on attention's output y, whose backward gives table (nh, R + 1) its gradient
    (table_grad) without FlexAttention's atomics, which serialise and are not deterministic.
    Positions must be consecutive, as in training."""

    @staticmethod
    def forward(ctx, y, lse, q, k, v, table, window, starts):
        ctx.save_for_backward(y, lse, q, k, v, table, starts)
        ctx.window = window
        return y.view_as(y)

    @staticmethod
    def backward(ctx, dy):
        y, lse, q, k, v, table, starts = ctx.saved_tensors
        grad = table_grad(q, k, v, y, lse, dy, table, ctx.window, starts)
        return dy, None, None, None, None, grad, None, None


DIAGONAL_TILE = 128  # queries (and keys) per tile of table_grad


def table_grad(q, k, v, y, lse, dy, table, window: int | None = None, starts=None) -> torch.Tensor:
    """d loss / d table (nh, R + 1) from dS = P ⊙ (dO·Vᵀ - rowsum(dO ⊙ O)), in tiles of n queries
    and keys, each block diagonal's tiles summed first, then along their diagonals: no (T, T)
    tensor, no atomics. q, k, v, y, dy (B, nh, T, hs); lse (B, nh, T); starts (B, T) or None."""
    B, nh, T, hs = q.shape
    R = table.size(1) - 1
    if R == 0:  # one bias for every distance: softmax ignores it
        return torch.zeros_like(table)
    n = min(R, DIAGONAL_TILE)
    nb = -(-T // n)
    seen = min(T, window or T)  # the distances 0 … seen - 1 a query sees
    # where none is past R (a table over every distance: KERPLE's) every entry is summed from its
    # own pairs; else the far one is inferred (its pairs are most of them), from the rows' zero sum
    direct = seen <= R + 1
    band = seen if direct else R  # the distances read from the tiles
    last = min(nb - 1, (band + n - 2) // n)  # the last block diagonal holding a distance below band
    dtype = torch.promote_types(q.dtype, torch.float32)  # bf16 inputs, float32 arithmetic
    pad = lambda t: F.pad(t.to(dtype).contiguous(), (0, 0, 0, nb * n - T)).view(B, nh, nb, n, hs)  # noqa: E731
    qb, kb, vb, yb, dyb = (pad(t) for t in (q, k, v, y, dy))  # (B, nh, nb, n, hs)
    lse_b = F.pad(lse.to(dtype), (0, nb * n - T)).view(B, nh, nb, n, 1)
    D = (dyb * yb).sum(-1, keepdim=True)  # (B, nh, nb, n, 1): rowsum(dP ⊙ P)
    # documents' starts
    sb = None if starts is None else F.pad(starts, (0, nb * n - T), value=-1).view(B, nb, n)
    r = torch.arange(n, device=q.device)[:, None]
    c = torch.arange(n, device=q.device)[None, :]
    frozen = table.detach().to(dtype)
    near_grad = torch.zeros(nh, band, device=q.device, dtype=dtype)
    for kd in range(last + 1):  # query tiles kd … nb - 1 against key tiles 0 … nb - 1 - kd
        rel = kd * n + r - c  # (n, n): i - j
        query = torch.arange(kd, nb, device=q.device)[:, None, None] * n + r  # (nb - kd, n, 1)
        near = (rel >= 0) & (rel < band) & (query < T)  # (nb - kd, n, n)
        if sb is not None:  # and in the query's document: (B, 1, nb - kd, n, n)
            near = near & (sb[:, kd:, :, None] == sb[:, : nb - kd, None, :])[:, None]
        # query tiles kd … against key tiles … nb - 1 - kd: (B, nh, nb - kd, n, n)
        s = qb[:, :, kd:] @ kb[:, :, : nb - kd].transpose(-2, -1) * hs**-0.5
        s = s + frozen[:, rel.clamp(0, R)][None, :, None]
        p = torch.where(near, (s - lse_b[:, :, kd:]).exp(), 0.0)
        # dS = P ⊙ (dP - D), summed over the batch and the tiles: (nh, n, n)
        dp = dyb[:, :, kd:] @ vb[:, :, : nb - kd].transpose(-2, -1)
        ds = (p * (dp - D[:, :, kd:])).sum((0, 2))
        sums = diagonal_sums(ds)  # (nh, 2n - 1): distances kd·n - (n - 1) … kd·n + n - 1
        lo = kd * n - (n - 1)
        d1 = min(band, kd * n + n)
        near_grad[:, max(0, lo) : d1] += sums[:, max(0, lo) - lo : d1 - lo]
    if direct:  # entries past the last seen distance (a window shorter than the table) have none
        return F.pad(near_grad, (0, R + 1 - band)).to(table.dtype)
    return torch.cat([near_grad, -near_grad.sum(1, keepdim=True)], dim=1).to(table.dtype)


def diagonal_sums(m: torch.Tensor) -> torch.Tensor:
    """The sums of the diagonals of m (..., n, n): out[..., o + n - 1] sums m[..., r, c] over r - c
    = o. Each row shifted by its index (a pad and a reshape) puts a diagonal in one column: a plain
    sum, no scatter."""
    n = m.size(-1)
    # row r, column c' = n - 1 - c at r + c'
    shifted = F.pad(m.flip(-1), (0, n)).flatten(-2)[..., : n * (2 * n - 1)]
    return shifted.unflatten(-1, (n, 2 * n - 1)).sum(-2)


# --------------------------------------------------------------------------------------------------
# A score bias a block of queries at a time through SDPA: TableBiasAttention (on a CPU, a bias of i
# - j alone from its table: the flash kernel, which gives a bias no gradient, and a backward of its
# own), SumBiasAttention (c_i - c'_j as two more dimensions of q and k: the flash kernels forward
# and backward), bias_blocks (any bias, by rows)


def flash(q, k, v, bias, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q·kᵀ·scale + bias)·v (scale None: 1/√hs) and its log-sum-exp (B, nh, Tq), for a float
    bias (nh or B, nh, Tq, Tk): SDPA's flash kernel on a CPU, else its math, in float32 at least (so
    that ALiBi's -m·3000 is not rounded to steps of 1/16)."""
    work = torch.promote_types(q.dtype, torch.float32)
    q = q.to(work)
    k = k.to(work)
    v = v.to(work)
    bias = (bias if bias.dim() == 4 else bias[None]).to(work)
    # compare/probe.py reads with V the identity
    if v.size(-1) != q.size(-1) or q.device.type != "cpu":
        s = (q @ k.transpose(-2, -1)) * (q.size(-1) ** -0.5 if scale is None else scale) + bias
        lse = s.logsumexp(-1)
        return (s - lse[..., None]).exp() @ v, lse
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, attn_mask=bias, scale=scale
    )


class TableBiasAttention(torch.autograd.Function):
    """softmax(q·kᵀ/√hs + bias)·v for a bias of i - j alone, read from its table (nh, D) a block of
    queries at a time on a CPU: no (nh, Tq, Tk) tensor, and a backward that adds the bias's gradient
    into the table in order (deterministic)."""

    @staticmethod
    def forward(ctx, q, k, v, table, pos, key_pos, window, starts=None, key_starts=None):
        # None: the queries' own
        own_keys = key_pos is None
        key_pos = pos if key_pos is None else key_pos
        key_starts = starts if key_starts is None else key_starts

        # (nh, bq, nk), or (B, nh, bq, nk) by documents
        def bias(rows: slice, cols: slice, dtype) -> torch.Tensor:
            block, _ = table_block(table, pos[rows], key_pos[cols], window)
            return in_documents(block, starts, key_starts, rows, cols)

        y, lse = flash_blocks(
            q, k, v, query_blocks(q.size(2), k.size(2), own_keys, pos, starts, window), bias
        )
        ctx.save_for_backward(q, k, v, table, pos, key_pos, y, lse, starts, key_starts)
        ctx.window, ctx.own_keys = window, own_keys
        return y.to(q.dtype)

    @staticmethod
    def backward(ctx, dy):
        q, k, v, table, pos, key_pos, y, lse, starts, key_starts = ctx.saved_tensors
        # bf16 in, float32 arithmetic
        dtype = q.dtype
        work = torch.promote_types(q.dtype, torch.float32)
        q, k, v, dy, y = (t.to(work) for t in (q, k, v, dy, y))
        # D: rowsum(dP ⊙ P), (B, nh, Tq, 1)
        scale = q.size(-1) ** -0.5
        D = (dy * y).sum(-1, keepdim=True)
        dq = torch.empty_like(q)
        dk = torch.zeros_like(k)
        dv = torch.zeros_like(v)
        dtable = torch.zeros_like(table)
        for rows, cols in query_blocks(q.size(2), k.size(2), ctx.own_keys, pos, starts, ctx.window):
            # (nh, bq, nk), (bq, nk)
            bias, index = table_block(table, pos[rows], key_pos[cols], ctx.window)
            qb = q[:, :, rows]
            dyb = dy[:, :, rows]
            kb = k[:, :, cols]
            vb = v[:, :, cols]
            p = (
                (qb @ kb.transpose(-2, -1))
                .mul_(scale)
                .add_(bias.to(work))
                .sub_(lse[:, :, rows, None])
                .exp_()
            )
            # another document's keys: probability 0 (in place, no bias of each row's own)
            if starts is not None:
                p.masked_fill_(~same_document(starts, key_starts, rows, cols)[:, None], 0.0)
            dv[:, :, cols] += p.transpose(-2, -1) @ dyb
            # dS = P ⊙ (dP - D), (B, nh, bq, nk)
            ds = p.mul_((dyb @ vb.transpose(-2, -1)).sub_(D[:, :, rows]))
            # unseen pairs add 0
            dtable.index_add_(1, index.flatten(), ds.sum(0).flatten(1).to(dtable.dtype))
            ds.mul_(scale)
            dq[:, :, rows] = ds @ kb
            dk[:, :, cols] += ds.transpose(-2, -1) @ qb
        return dq.to(dtype), dk.to(dtype), dv.to(dtype), dtable, None, None, None, None, None


TABLE_BLOCK = 64  # queries per block of TableBiasAttention and bias_blocks
COUNT_BLOCK = 32  # of CountAttention (less causal waste; BENCHMARKS.md)


def query_blocks(
    Tq: int, Tk: int, own_keys: bool, pos: torch.Tensor, starts, window: int | None, n=TABLE_BLOCK
):
    """The blocks of n queries, each as (its queries, the keys they may see: key_span), two
    slices."""
    for i0 in range(0, Tq, n):
        i1 = min(i0 + n, Tq)
        yield slice(i0, i1), slice(*key_span(i0, i1, Tk, own_keys, pos, starts, window))


def flash_blocks(q, k, v, blocks, bias: Callable) -> tuple[torch.Tensor, torch.Tensor]:
    """SDPA's CPU flash kernel a block of queries at a time: y (B, nh, Tq, hs) and the log-sum-exp
    (B, nh, Tq), each block of (rows, cols) of `blocks` under bias(rows, cols, dtype), -inf where a
    query does not see a key."""
    B, nh, Tq, _ = q.shape
    work = torch.promote_types(q.dtype, torch.float32)
    y = q.new_empty(B, nh, Tq, v.size(-1), dtype=work)
    lse = q.new_empty(B, nh, Tq, dtype=work)
    for rows, cols in blocks:
        y[:, :, rows], lse[:, :, rows] = flash(
            q[:, :, rows], k[:, :, cols], v[:, :, cols], bias(rows, cols, lse.dtype)
        )
    return y, lse


class SumBiasAttention(torch.autograd.Function):
    """softmax(q·kᵀ/√hs + c_i - c'_j)·v for FoX's two per-token sums (c (B, nh, Tq), c' (B, nh, Tk)
    or None: the queries' own), a block of queries at a time on a CPU: the bias is two more
    dimensions of q and k, so SDPA's flash kernels take it, forward and backward."""

    @staticmethod
    def forward(ctx, q, k, v, c, key_c, pos, key_pos, window, starts=None, key_starts=None):
        own_keys = key_pos is None
        key_pos, key_c = (pos, c) if own_keys else (key_pos, key_c)
        key_starts = starts if key_starts is None else key_starts
        blocks = list(query_blocks(q.size(2), k.size(2), own_keys, pos, starts, window))
        qs, ks, vs = summed(q, k, v)
        ys = qs.new_empty(*q.shape[:3], vs.size(-1))
        lse = qs.new_empty(q.shape[:3])
        for rows, cols in blocks:
            qb, kb = with_sums(qs, ks, c, key_c, rows, cols)
            mask = unseen(pos, key_pos, window, starts, key_starts, rows, cols, qs.dtype)
            ys[:, :, rows], lse[:, :, rows] = flash(qb, kb, vs[:, :, cols], mask, scale=1.0)
        ctx.save_for_backward(qs, ks, vs, c, key_c, pos, key_pos, ys, lse, starts, key_starts)
        ctx.window = window
        ctx.own_keys = own_keys
        ctx.blocks = blocks
        ctx.dtype = q.dtype
        return ys[..., : v.size(-1)].to(q.dtype)

    @staticmethod
    def backward(ctx, dy):
        qs, ks, vs, c, key_c, pos, key_pos, ys, lse, starts, key_starts = ctx.saved_tensors
        hs = qs.size(-1) - 2  # with a gradient v is q's size too (summed padded it)
        dys = F.pad(dy.to(qs.dtype), (0, 2))
        dq = qs.new_empty(*qs.shape[:3], hs)
        dk = torch.zeros_like(ks[..., :hs])
        dv = torch.zeros_like(vs[..., :hs])
        dc = torch.zeros_like(c)
        dkey_c = torch.zeros_like(key_c)
        for rows, cols in ctx.blocks:
            qb, kb = with_sums(qs, ks, c, key_c, rows, cols)
            mask = unseen(pos, key_pos, ctx.window, starts, key_starts, rows, cols, qs.dtype)
            dqb, dkb, dvb = FLASH_BACKWARD(
                dys[:, :, rows],
                qb,
                kb,
                vs[:, :, cols],
                ys[:, :, rows],
                lse[:, :, rows],
                0.0,
                False,
                attn_mask=mask,
                scale=1.0,
            )  # (B, nh, bq, hs + 2), (B, nh, nk, hs + 2), (B, nh, nk, hs + 2)
            dq[:, :, rows] = dqb[..., :hs]
            # Σ_j dS_ij: the query's c against the keys' 1
            dc[:, :, rows] += dqb[..., hs].to(dc.dtype)
            dk[:, :, cols] += dkb[..., :hs]
            # Σ_i dS_ij: the key's -c' against the queries' 1
            dkey_c[:, :, cols] -= dkb[..., hs + 1].to(dc.dtype)
            dv[:, :, cols] += dvb[..., :hs]
        if ctx.own_keys:  # c is the keys' too: one gradient
            dc = dc + dkey_c
            dkey_c = None
        dq = dq.mul_(hs**-0.5)  # the queries went in as q/√hs
        return (
            dq.to(ctx.dtype),
            dk.to(ctx.dtype),
            dv.to(ctx.dtype),
            dc,
            dkey_c,
            None,
            None,
            None,
            None,
            None,
        )


FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def summed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple:
    """q, k and v (B, nh, T, hs) with two dimensions more, in float32 at least (bf16 would round the
    bias): q as q/√hs, the keys' 1 in the first new one and the queries' 1 in the second (with_sums
    writes the sums beside them), v with zeros (the flash kernel takes one head size)."""
    work = torch.promote_types(q.dtype, torch.float32)
    qs = F.pad(q.to(work) * q.size(-1) ** -0.5, (0, 2), value=1.0)
    ks = F.pad(k.to(work), (0, 2), value=1.0)
    return (
        qs,
        ks,
        F.pad(v.to(work), (0, qs.size(-1) - v.size(-1)))
        if v.size(-1) == q.size(-1)
        else v.to(work),
    )


def with_sums(qs, ks, c, key_c, rows: slice, cols: slice) -> tuple[torch.Tensor, torch.Tensor]:
    """The queries in rows and the keys in cols (views of summed's) with c_i - r and -(c'_j - r) in
    their new dimensions: q·k/√hs + c_i - c'_j, each sum taken from r, the block's last query's c,
    in float64 and then in float32 (what rounds is far from it, where exp(bias) is 0)."""
    ref = c[:, :, rows.stop - 1, None]  # (B, nh, 1)
    qs[:, :, rows, -2] = c[:, :, rows] - ref
    ks[:, :, cols, -1] = ref - key_c[:, :, cols]
    return qs[:, :, rows], ks[:, :, cols]


def unseen(
    pos, key_pos, window, starts, key_starts, rows: slice, cols: slice, dtype
) -> torch.Tensor:
    """The mask (1, 1, bq, nk), or (B, 1, bq, nk) by documents, of the queries in rows over the keys
    in cols: -inf where a query does not see a key (the window, the future, another document), else
    0."""
    mask = torch.zeros(
        rows.stop - rows.start, cols.stop - cols.start, dtype=dtype, device=pos.device
    )
    mask.masked_fill_(~sees(pos[rows, None] - key_pos[cols], window), float("-inf"))
    return in_documents(mask[None, None], starts, key_starts, rows, cols)


@dataclass(frozen=True)
class GateCounts:
    """One layer's bias of positions counted by gates (model.CoPE.counts): the gate of a key is
    σ(q·k·gate_scale), a key's position p the sum of the gates from it to the query (at most p_max -
    1), its bias q·e[p] read between ⌊p⌋ and ⌈p⌉; e (p_max, hs)."""

    e: torch.Tensor
    gate_scale: float


class CountAttention(torch.autograd.Function):
    """softmax(q·kᵀ/√hs + q·e[p])·v for CoPE's counted positions p over the queries' own keys, a
    block of queries at a time, the keys nearest first (so p is a prefix sum), with a backward of
    its own that recomputes each block: no (Tq, Tk) tensor kept."""

    @staticmethod
    def forward(ctx, q, k, v, e, counts: GateCounts, pos, window, starts, blocks):
        work = torch.promote_types(q.dtype, torch.float32)
        with torch.autocast(q.device.type, enabled=False):
            qs = q.to(work).contiguous()
            kf = k.to(work).flip(-2)
            vf = v.to(work).flip(-2)
            es = e.to(work)
            y = qs.new_empty(*q.shape[:3], v.size(-1))
            lse = qs.new_empty(*q.shape[:3], 1)
            keys = Keys(qs, kf, es, counts, pos, window, starts)
            nears = []
            # the bias alone: the kernel adds it to the scores it computes
            for rows, cols in blocks:
                them = reversed_keys(cols, kf.size(2))
                bias, *_, near = counted_scores(keys, rows, cols, scores=False)
                y[:, :, rows], lse[:, :, rows, 0] = flash(
                    qs[:, :, rows], kf[:, :, them], vf[:, :, them], bias
                )
                nears.append(near)
        ctx.save_for_backward(qs, kf, vf, es, y, lse, pos, starts)
        ctx.counts, ctx.window, ctx.blocks, ctx.nears = counts, window, blocks, nears
        ctx.dtypes = q.dtype, e.dtype
        return y.to(q.dtype, copy=True)  # not y itself, which the backward keeps

    @staticmethod
    def backward(ctx, dy):
        qs, kf, vf, es, y, lse, pos, starts = ctx.saved_tensors
        # gate logit = score·ratio
        c = qs.size(-1) ** -0.5
        ratio = ctx.counts.gate_scale * qs.size(-1) ** 0.5
        with torch.autocast(qs.device.type, enabled=False):
            dy = dy.to(qs.dtype)
            D = (dy * y).sum(-1, keepdim=True)  # (B, nh, Tq, 1): rowsum(dP ⊙ P)
            keys = Keys(qs, kf, es, ctx.counts, pos, ctx.window, starts)
            dq = torch.empty_like(qs)
            dkf = torch.zeros_like(kf)
            dvf = torch.zeros_like(vf)
            dz = torch.empty_like(keys.z)
            for (rows, cols), near in zip(ctx.blocks, ctx.nears, strict=True):
                p, g, lo, w, step, _ = counted_scores(keys, rows, cols, near=near)
                them = reversed_keys(cols, kf.size(2))
                qb = qs[:, :, rows]
                dyb = dy[:, :, rows]
                p = p.sub_(lse[:, :, rows]).exp_()  # the probabilities (B, nh, bq, nk)
                dvf[:, :, them] += p.transpose(-2, -1) @ dyb
                dP = torch.matmul(
                    dyb, vf[:, :, them].transpose(-2, -1), out=keys.take("dp", p.shape)
                )
                ds = p.mul_(dP.sub_(D[:, :, rows]))  # dS = P ⊙ (dP - D)
                # the bias z[lo] + w·(z[lo + 1] - z[lo]): z[lo] takes dS·(1 - w), z[lo + 1] dS·w;
                # past `near` every count has stopped at p_max - 1, each key's bias z[p_max - 1],
                # its gate moving no count
                counted = ds[..., :near]
                dsw = torch.mul(counted, w, out=w)
                at_lo = dz[:, :, rows].zero_().scatter_add_(-1, lo, counted)
                at_lo[..., -1] += ds[..., near:].sum(-1)
                w_at_lo = keys.take("w_at_lo", at_lo.shape).zero_().scatter_add_(-1, lo, dsw)
                at_lo.sub_(w_at_lo)[..., 1:] += w_at_lo[..., :-1]  # dz (B, nh, bq, p_max)
                dp = step.mul_(counted)  # d/dw; 0 where p is clamped (its z step is 0)
                dg = torch.cumsum(dp, -1, out=keys.take("dg", dp.shape))
                # each gate: the counts of the farther keys
                dg = dg.neg_().add_(dp).add_(dp.sum(-1, keepdim=True))
                # dg·g·(1 - g)
                dgate = torch.ops.aten.sigmoid_backward.grad_input(dg, g[..., :near], grad_input=dg)
                counted += dgate if ratio == 1 else dgate.mul_(ratio)
                dscore = ds  # (B, nh, bq, nk)
                dq[:, :, rows] = (dscore @ kf[:, :, them]).mul_(c)
                dkf[:, :, them] += (dscore.transpose(-2, -1) @ qb).mul_(c)
            dq += dz @ es
            de = dz.flatten(0, 2).T @ qs.flatten(0, 2)  # (p_max, hs)
        dtype, e_dtype = ctx.dtypes
        grads = dq.to(dtype), dkf.flip(-2).to(dtype), dvf.flip(-2).to(dtype), de.to(e_dtype)
        return *grads, None, None, None, None, None


class Keys:
    """What CountAttention's blocks read: queries, keys reversed (B, nh, T, hs), z = q·e and its
    steps, positions, and buffers of the largest block's size kept between calls (a fresh one costs
    a CPU as much as the pass that fills it)."""

    kept: dict = {}  # (name, dtype, device) -> a flat buffer, grown as needed

    def __init__(self, qs, kf, es, counts: GateCounts, pos, window, starts):
        self.qs, self.kf, self.counts, self.window = qs, kf, counts, window
        # (B, nh, Tq, p_max + 1): z[n] = q·e[n], and z[p_max - 1] again
        zz = qs @ torch.cat([es, es[-1:]]).T
        self.z = zz[..., :-1]  # z[n], z[n + 1]
        self.z_next = zz[..., 1:]
        self.pos = pos
        self.key_pos = pos.flip(0)
        self.starts = starts
        self.key_starts = None if starts is None else starts.flip(-1)
        self.size = qs.size(0) * qs.size(1) * TABLE_BLOCK * kf.size(2)

    def take(self, name: str, shape, dtype=None) -> torch.Tensor:
        key = (name, dtype or self.qs.dtype, self.qs.device)
        if torch.compiler.is_compiling():  # the compiler plans its own buffers
            return self.qs.new_empty(shape, dtype=key[1])
        if key not in self.kept or self.kept[key].numel() < self.size:
            self.kept[key] = self.qs.new_empty(self.size, dtype=key[1])
        return self.kept[key][: math.prod(shape)].view(shape)


def reversed_keys(cols: slice, Tk: int) -> slice:
    """The keys in cols among Tk keys reversed (the last first)."""
    return slice(Tk - cols.stop, Tk - cols.start)


def counted_scores(
    keys: Keys, rows: slice, cols: slice, scores: bool = True, near: int | None = None
) -> tuple:
    """A block's scores q·kᵀ/√hs + z[p] (B, nh, bq, nk) (scores False: z[p] alone) over keys `cols`,
    nearest first, -inf where unseen; in keys' buffers what the backward reads: the gates, and over
    the `near` nearest keys ⌊p⌋, p - ⌊p⌋ and z's step."""
    them = reversed_keys(cols, keys.kf.size(2))
    qb = keys.qs[:, :, rows]
    kb = keys.kf[:, :, them]
    c = keys.qs.size(-1) ** -0.5
    shape = (*qb.shape[:3], kb.size(2))
    mask = unseen(
        keys.pos, keys.key_pos, keys.window, keys.starts, keys.key_starts, rows, them, qb.dtype
    )
    qk = keys.take("s", shape)
    g = keys.take("g", shape)
    torch.bmm(qb.flatten(0, 1), kb.flatten(0, 1).transpose(1, 2), out=qk.flatten(0, 1))
    if keys.counts.gate_scale != c:  # σ(q·k·gate_scale), 0 where unseen
        torch.mul(qk, keys.counts.gate_scale, out=g).sigmoid_().mul_(mask.isfinite())
    s = qk.mul_(c).add_(mask)  # -inf where unseen
    if keys.counts.gate_scale == c:
        torch.sigmoid(s, out=g)  # σ(-inf) = 0
    last = keys.z.size(-1) - 1
    p = torch.cumsum(g, -1, out=keys.take("w", shape)).clamp_(max=last)  # the gates from the key on
    # eager: p grows along the keys, so the stopped ones end each row; compiled: every key
    if near is None:
        near = (
            shape[-1]
            if torch.compiler.is_compiling()
            else int((p.amin(dim=(0, 1, 2)) < last).sum())
        )
    p = p[..., :near]
    z = keys.z[:, :, rows]
    lo = keys.take("lo", p.shape, torch.long).copy_(p)  # ⌊p⌋ (p >= 0)
    w = p.frac_()
    # z[⌊p⌋ + 1]
    step = torch.gather(keys.z_next[:, :, rows], -1, lo, out=keys.take("step", p.shape))
    bias = keys.take("z", shape)
    counted = torch.gather(z, -1, lo, out=bias[..., :near])  # z[⌊p⌋]
    counted.addcmul_(w, step.sub_(counted))  # z[⌊p⌋] + w·(z[⌊p⌋ + 1] - z[⌊p⌋])
    bias[..., near:] = z[..., last:]  # z[p_max - 1]
    return bias.add_(s if scores else mask), g, lo, w, step, near


def key_span(
    i0: int, i1: int, Tk: int, own_keys: bool, pos: torch.Tensor, starts, window: int | None = None
) -> tuple[int, int]:
    """The keys j0 … j1 - 1 that queries i0 … i1 - 1 may see: none in their future, none a window or
    more back, and under packing="documents" none before their documents' earliest start (eager:
    read on the host; compiled: from the first key)."""
    if not own_keys:
        return 0, Tk
    # own keys: consecutive, key j at position pos[0] + j
    j0 = 0 if window is None else max(0, i0 - window + 1)
    if starts is not None and not torch.compiler.is_compiling():
        j0 = max(j0, int(starts[:, i0:i1].min() - pos[0]))
    return j0, i1


def table_block(
    table: torch.Tensor, pos: torch.Tensor, key_pos: torch.Tensor, window: int | None
) -> tuple:
    """The bias (nh, bq, Tk) float32 of queries at pos (bq,) over keys at key_pos (Tk,), -inf where
    a query does not see a key, and the table entry each pair reads (bq, Tk): i - j, from 0 (the
    future, masked) to D - 1."""
    rel = pos[:, None] - key_pos[None, :]
    index = rel.clamp(0, table.size(1) - 1)
    bias = table[:, index].to(torch.promote_types(table.dtype, torch.float32))
    return bias.masked_fill(~sees(rel, window), float("-inf")), index


def in_documents(
    bias: torch.Tensor, starts, key_starts, query_slice: slice, key_slice: slice
) -> torch.Tensor:
    """A block's bias (nh, bq, nk) of the queries in query_slice over the keys in key_slice, -inf
    where in different documents ((B, nh, bq, nk); starts (B, Tq) and key_starts (B, Tk): where each
    one's document starts), or as it is without documents (starts None)."""
    if starts is None:
        return bias
    same = same_document(starts, key_starts, query_slice, key_slice)
    # one pass (masked_fill would copy, then fill)
    return torch.where(same[:, None], bias, float("-inf"))


def same_document(
    starts: torch.Tensor, key_starts: torch.Tensor, query_slice: slice, key_slice: slice
) -> torch.Tensor:
    """Whether the queries in query_slice and the keys in key_slice are in one document (B, bq,
    nk)."""
    return starts[:, query_slice, None] == key_starts[:, None, key_slice]


def in_blocks(
    block_bias: Callable[[int, int, int, int], torch.Tensor],
    span: Callable[[int, int], tuple],
    attend,
) -> Callable:
    """Attention with a score bias a block of queries at a time: each block's keys (span), its bias
    block_bias(i0, i1, j0, j1), then attend(q, k, v, score_bias); with a gradient each block is
    checkpointed, so autograd takes the bias's gradient into its formula. No (nh, Tq, Tk) tensor."""

    def block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, i0: int, i1: int) -> torch.Tensor:
        j0, j1 = span(i0, i1)
        return attend(
            q[:, :, i0:i1], k[:, :, j0:j1], v[:, :, j0:j1], score_bias=block_bias(i0, i1, j0, j1)
        )

    def attention(q, k, v):
        grad = torch.is_grad_enabled()
        run = (lambda *a: checkpoint(block, *a, use_reentrant=False)) if grad else block
        Tq = q.size(2)
        return torch.cat(
            [run(q, k, v, i0, min(i0 + TABLE_BLOCK, Tq)) for i0 in range(0, Tq, TABLE_BLOCK)], dim=2
        )

    return attention


def span_of(layer: LayerBias) -> Callable[[int, int], tuple[int, int]]:
    """(i0, i1) -> the keys j0, j1 that queries i0 … i1 - 1 may see (key_span)."""
    starts = None if layer.starts is None else layer.starts[0]
    return partial(
        key_span, Tk=len(layer.key_pos), own_keys=layer.own_keys, pos=layer.pos, starts=starts,
        window=layer.window,
    )  # fmt: skip


def content_rows(layer: LayerBias, q, k, x, order) -> tuple:
    """A bias of the content over this layer's q and k: FoX's running sums (the queries', every
    key's; None) and block_bias(i0, i1, j0, j1), -inf where a query does not see a key."""
    running = None if layer.forget is None else layer.forget(x)  # (B, nh, T)
    if running is not None:
        running = (c := running.cumsum(-1), c) if layer.sums is None else layer.sums(running)

    def block_bias(i0, i1, j0, j1):
        seen = layer.seen(layer.block(i0, i1, j0, j1))
        part = None if running is None else (running[0][..., i0:i1], running[1][..., j0:j1])
        bias = layer.content_bias(q[:, :, i0:i1], k[:, :, j0:j1], seen, order, part)
        return bias.masked_fill(~seen, float("-inf"))

    return running, block_bias


def one_block(layer: LayerBias) -> Callable:
    """A bias of the content as one block of every query over every key (its reference); a cache's
    keys are counted in position order."""
    order = None if layer.own_keys else layer.key_pos.argsort()  # (Tk,)

    def attention(q, k, v, x):
        _, block_bias = content_rows(layer, q, k, x, order)
        return layer.attend(q, k, v, score_bias=block_bias(0, q.size(2), 0, k.size(2)))

    return attention


def sum_blocks(layer: LayerBias) -> Callable:
    """FoX's c_i - c'_j by SumBiasAttention (on a CPU), from the running sums of forget(x)."""
    query_starts, key_starts = layer.starts or (None, None)
    # own keys: the keys' are the queries' own, given once (as to TableBiasAttention)
    key_pos = None if layer.own_keys else layer.key_pos
    key_starts = None if layer.own_keys else key_starts

    def attention(q, k, v, x):
        (c, key_c), _ = content_rows(layer, q, k, x, None)
        key_c = None if layer.own_keys else key_c
        return SumBiasAttention.apply(
            q, k, v, c, key_c, layer.pos, key_pos, layer.window, query_starts, key_starts
        )

    return attention


def bias_blocks(layer: LayerBias) -> Callable:
    """Any bias a block of queries at a time (in_blocks): its rows, or a bias of the content's
    blocks; CoPE's counted positions over the queries' own keys by CountAttention."""
    span = span_of(layer)
    if layer.content_bias is None:
        rows = in_blocks(lambda *block: layer.matrix(layer.block(*block)), span, layer.attend)
        return lambda q, k, v, x: rows(q, k, v)
    order = None if layer.own_keys else layer.key_pos.argsort()  # (Tk,)
    starts = None if layer.starts is None else layer.starts[0]

    def attention(q, k, v, x):
        if layer.counts is not None and layer.own_keys:  # CoPE's positions, counted in order
            counts = layer.counts()
            blocks = list(
                query_blocks(
                    q.size(2), k.size(2), True, layer.pos, starts, layer.window, COUNT_BLOCK
                )
            )
            return CountAttention.apply(
                q, k, v, counts.e, counts, layer.pos, layer.window, starts, blocks
            )
        _, block_bias = content_rows(layer, q, k, x, order)
        return in_blocks(block_bias, span, layer.attend)(q, k, v)

    return attention


# --------------------------------------------------------------------------------------------------
# A bias that is a small MLP of each pair's input (FIRE's), computed fast: the MLP once per distance
# where its input is a function of i - j alone, its units at once for few inputs or one at a time
# for many, a gradient that keeps the input alone


@dataclass(frozen=True)
class MLPBias:
    """One layer's bias f(x) as FIRE declares it (model.FIRE.layer_bias): x = input(c, threshold, i,
    j), f(x) = mlp(x, w1, b1, w2, together) summed over its units; below the threshold (i <
    threshold) x is a function of i - j alone."""

    input: Callable
    mlp: Callable
    c: torch.Tensor  # () the input's scale
    threshold: torch.Tensor  # ()
    w1: torch.Tensor  # (units,)
    b1: torch.Tensor  # (units,)
    w2: torch.Tensor  # (nh, units)


MLP_FEW = 1 << 14  # MLP inputs up to which its units are kept at once (16,384 x 32 floats: 2 MiB)


def recomputed(fn: Callable) -> Callable:
    """fn under activation checkpointing: its intermediates are computed again in the backward
    instead of kept."""
    return lambda *args: checkpoint(fn, *args, use_reentrant=False)


class UnitByUnit(torch.autograd.Function):
    """mlp(x, w1, b1, w2) with a gradient that keeps x alone and recomputes its units one at a time
    in the backward (autograd would keep one bias-sized pre-activation per unit)."""

    @staticmethod
    def forward(ctx, mlp, x, w1, b1, w2):
        ctx.save_for_backward(x, w1, b1, w2)
        return mlp(x, w1, b1, w2)

    @staticmethod
    def backward(ctx, g):
        x, w1, b1, w2 = ctx.saved_tensors
        gx = torch.zeros_like(g)
        gw1 = torch.zeros_like(w1)
        gb1 = torch.zeros_like(b1)
        gw2 = torch.zeros_like(w2)
        for u in range(w1.size(-1)):
            a = x * w1[..., u] + b1[..., u]
            ga = torch.where(a > 0, g * w2[..., u], 0.0)  # d out / d a_u
            gw2[..., u] = (g * a.clamp(min=0)).sum_to_size(w2[..., u].shape)
            gb1[..., u] = ga.sum_to_size(b1[..., u].shape)
            gw1[..., u] = (ga * x).sum_to_size(w1[..., u].shape)
            gx = gx + ga * w1[..., u]
        return None, gx.sum_to_size(x.shape), gw1, gb1, gw2


def run_mlp(mlp: Callable, x: torch.Tensor, w1, b1, w2, few: bool = False) -> torch.Tensor:
    """mlp(x, w1, b1, w2) the fastest exact way: its units together for few inputs (a block's
    distances, a decode step's row) or compiled with a gradient; eager with a gradient, UnitByUnit,
    which keeps x alone."""
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (x, w1, b1, w2))
    if few or (grad and torch.compiler.is_compiling()):
        return mlp(x, w1, b1, w2, together=True)
    return UnitByUnit.apply(mlp, x, w1, b1, w2) if grad else mlp(x, w1, b1, w2)


def mlp_distances(f: MLPBias, T: int, c, threshold, w1, b1, w2) -> torch.Tensor:
    """The bias (nh, T) of the distances 0 … T - 1 for queries below the threshold (x of i - j
    alone), the MLP run once per distance; w2 (nh, 1, units)."""
    x = f.input(c, threshold, torch.arange(T, device=c.device), 0)
    return run_mlp(f.mlp, x, w1, b1, w2, few=T <= MLP_FEW)


def mlp_table(f: MLPBias, pos: torch.Tensor, queries: torch.Tensor) -> torch.Tensor | None:
    """The bias as a table over distances 0 … T - 1 (nh, T) where every query at `queries` ((T,) or
    (B, T)) is below the threshold and the keys are its own at consecutive positions, else None.
    Eager on a CPU only: the test reads the data."""
    if torch.compiler.is_compiling() or pos.device.type != "cpu":
        return None
    if bool(queries.max() >= f.threshold):  # at i = L max(L, i) splits its gradient: by pairs
        return None
    return mlp_distances(f, len(pos), f.c, f.threshold, f.w1, f.b1, f.w2[:, None])


def mlp_by_document_position(f: MLPBias, pos, doc_pos, c, threshold, w1, b1, w2) -> torch.Tensor:
    """The bias (B, nh, T, T) of packed documents begun in the chunk: a function of a query's
    position in its document and the distance alone, so the MLP runs once per (position, distance)
    past the threshold and once per distance below it; each row gathers its own."""
    T = len(pos)
    device = pos.device
    # p < L
    within = 0 if torch.compiler.is_compiling() else min(T, max(0, math.ceil(threshold.item())))
    table = mlp_distances(f, T, c, threshold, w1, b1, w2[:, 0])  # (nh, T): p < L reads d alone
    p = torch.arange(within, T, device=device)[:, None]
    d = torch.arange(T, device=device)
    past = run_mlp(f.mlp, f.input(c, threshold, p, p - d), w1, b1, w2)  # (nh, T - within, T)
    by_position = torch.cat([table[:, None].expand(-1, within, -1), past], dim=1)  # (nh, p, d)
    rel = (pos[:, None] - pos).clamp(min=0)  # (T, T): i - j, the same in a document
    return by_position[:, doc_pos[:, :, None], rel].transpose(0, 1)  # (B, nh, T, T)


def mlp_matrix(
    f: MLPBias, pos, key_pos, own_keys: bool, doc_pos=None, recompute: bool = False
) -> torch.Tensor:
    """The bias at every pair of queries at pos (Tq,) and keys at key_pos (Tk,), (nh, Tq, Tk), or
    (B, nh, Tq, Tk) with doc_pos: a gather from the MLP on the distances below the threshold, the
    MLP per pair past it. recompute: in the backward (autograd keeps the bias alone)."""
    # the tensors the MLP's evaluations take (so that checkpointing and torch.cond see them); w2
    # (nh, 1, 1, units)
    operands = f.c, f.threshold, f.w1, f.b1, f.w2[:, None, None]
    if doc_pos is not None:  # positions restart per document: each row's own bias (B, nh, T, Tk)
        # pair by pair at each row's positions where the keys are not the queries' own, or a
        # document began before the chunk (read on the host, eager, only then)
        if not own_keys or (not torch.compiler.is_compiling() and bool(doc_pos[0][:, 0].max() > 0)):
            i, j = doc_pos  # (B, Tq), (B, Tk)
            few = i.numel() * j.size(1) <= MLP_FEW

            # x (B, 1, Tq, Tk), the heads' in w2: (B, nh, Tq, Tk)
            def by_rows(c, threshold, w1, b1, w2):
                return run_mlp(
                    f.mlp,
                    f.input(c, threshold, i[:, None, :, None], j[:, None, None, :]),
                    w1,
                    b1,
                    w2,
                    few=few,
                )

            return (recomputed(by_rows) if recompute and not few else by_rows)(*operands)
        return mlp_by_document_position(f, pos, doc_pos[0], *operands)

    # the bias of these queries over every key: (nh, Tq, Tk)
    def pairs(queries: torch.Tensor) -> Callable:
        # little to keep for the backward: nothing to recompute
        few = len(queries) * len(key_pos) <= MLP_FEW

        def at(c, threshold, w1, b1, w2):
            return run_mlp(
                f.mlp, f.input(c, threshold, queries[:, None], key_pos), w1, b1, w2, few=few
            )

        return recomputed(at) if recompute and not few else at

    if not own_keys or len(pos) < 2:
        return pairs(pos)(*operands)
    return mlp_suffix(f, pos, pairs, operands)


def mlp_suffix(f: MLPBias, pos: torch.Tensor, pairs: Callable, operands: tuple) -> torch.Tensor:
    """mlp_matrix where the keys are the queries' own at consecutive positions pos (T,): the queries
    below the threshold (a prefix) gather from the distances, those past it take pairs(queries) (the
    MLP per pair)."""
    T = len(pos)
    rel = (pos[:, None] - pos[None, :]).clamp(min=0)  # (T, T): 0 … T - 1

    # the first `prefix` queries, within L
    def by_distance(c, threshold, w1, b1, w2, prefix: int = T):
        table = mlp_distances(f, T, c, threshold, w1, b1, w2[:, 0])  # (nh, T)
        # (nh, prefix, T); keeps little for the backward: nothing to recompute
        return table[:, rel[:prefix]]

    # (T,): True on a suffix (at i = L too: max(L, i) splits its gradient there)
    past = pos >= operands[1]
    # one graph, so no size from the data: branches taken at run time
    if torch.compiler.is_compiling():
        # up to R queries past L: the last R rows pair by pair where past, a gather elsewhere
        R = max(1, T // 8)

        def few_past(*operands):
            table = by_distance(*operands)  # (nh, T, T)
            tail = torch.where(
                past[T - R :, None], pairs(pos[T - R :])(*operands), table[:, T - R :]
            )
            return torch.cat([table[:, : T - R], tail], dim=1)

        def some_past(*operands):
            return torch.cond(past.sum() <= R, few_past, pairs(pos), operands)

        return torch.cond(past.any(), some_past, by_distance, operands)
    n = int(past.sum())
    if n == 0 or n == T:
        return (by_distance if n == 0 else pairs(pos))(*operands)
    return torch.cat([by_distance(*operands, prefix=T - n), pairs(pos[T - n :])(*operands)], dim=1)
