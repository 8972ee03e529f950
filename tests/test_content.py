"""The encodings whose bias reads the content (CoPE, the forgetting gate): each equals its paper's
equations written out here in float64 (forward and every gradient), on a CPU's blocks of queries and
on the reference; FoX's running sum goes on through the KV cache; neither makes a (T, T) tensor on a
CPU (CoPE: a block of 64 queries over the keys)."""

import contextlib
import copy
from dataclasses import replace

import pytest
import torch
from conftest import CONTENT, tiny, tokens

import model as model_py
from generate import KVCache, generate
from model import Chunk


def cope_scores(q, k, e, p_max: int) -> torch.Tensor:
    """Golovneva et al. 2024, eqs. 3-5 as the authors' code computes them: g_ij = σ(q_i·k_j/√d),
    p_ij = Σ_{t=j..i} g_it (clamped to p_max - 1), and the score q_i·k_j/√d + z_i[p_ij], z_i[p] =
    q_i·e[p] read linearly between ⌊p⌋ and ⌈p⌉. q, k (B, nh, T, hs)."""
    T = q.size(2)
    hs = q.size(-1)
    causal = torch.ones(T, T, dtype=torch.bool).tril()  # [t <= i]
    g = torch.sigmoid(q @ k.transpose(-1, -2) / hs**0.5) * causal  # (B, nh, i, t)
    from_j = torch.ones(T, T, dtype=q.dtype).tril()  # [t >= j], (t, j)
    p = (g @ from_j).clamp(max=p_max - 1)  # Σ_t g_it [j <= t <= i]
    z = q @ e.T  # (B, nh, T, p_max)
    lo = p.floor()
    hi = p.ceil()
    z_lo = z.gather(-1, lo.long())
    z_hi = z.gather(-1, hi.long())
    interpolated = torch.where(
        hi > lo, z_lo + (p - lo) / (hi - lo).clamp(min=1) * (z_hi - z_lo), z_lo
    )
    return (q @ k.transpose(-1, -2) / hs**0.5 + interpolated).masked_fill(~causal, float("-inf"))


def fox_scores(q, k, x, w, b) -> torch.Tensor:
    """Lin et al. 2025, eq. 5-6: f_t = σ(w·x_t + b) per head, and q_i·k_j/√d + Σ_{t=j+1..i} log f_t.
    x (B, T, C)."""
    T = q.size(2)
    hs = q.size(-1)
    log_f = torch.log(torch.sigmoid(x @ w.T + b)).transpose(1, 2)  # (B, nh, T)
    i = torch.arange(T)[:, None, None]
    j = torch.arange(T)[None, :, None]
    t = torch.arange(T)[None, None, :]
    between = ((j < t) & (t <= i)).to(q.dtype)  # (i, j, t)
    decay = torch.einsum("ijt,bht->bhij", between, log_f)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    return (q @ k.transpose(-1, -2) / hs**0.5 + decay).masked_fill(~causal, float("-inf"))


def paper_attention(model, x: torch.Tensor) -> torch.Tensor:
    """Layer 0's attention output from the paper's equations, in float64 (x: the layer's input (B,
    T, C))."""
    attn = model.transformer.h[0].attn
    pe = model.encoding
    cfg = model.config
    B, T, C = x.shape
    q, k, v = (t.view(B, T, cfg.n_head, -1).transpose(1, 2) for t in attn.c_attn(x).split(C, dim=2))
    if cfg.pos_encoding == "cope":
        scores = cope_scores(q, k, pe.e[0], cfg.cope_p_max)
    else:
        scores = fox_scores(q, k, x, pe.w[0], pe.b[0])
    return attn.c_proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, C))


def ours(model, x: torch.Tensor, starts: torch.Tensor | None = None) -> torch.Tensor:
    """Layer 0's attention output as the model computes it, over the queries' own keys; starts (B,
    T): where each token's document starts (packed documents), None: one stream."""
    pos = torch.arange(x.size(1))
    chunk = Chunk(
        pos,
        key_pos=pos,
        slots=None,
        window=None,
        consecutive=True,
        starts=starts,
        key_starts=starts,
    )
    attention = model_py.attention_for(
        chunk, model.encoding, model.config, model.attention_options, 0.0
    )
    return model.transformer.h[0].attn(x, None, attention, None)


# the kernels each path takes: a CPU's (blocks of 64 queries, two here), a GPU's fused ones (its
# emulation on a CPU: the cuda fixture), the reference's one block
KERNELS_TAKEN = {
    "cpu": dict(cope="bias_blocks", fox="sum_blocks"),
    "gpu": dict(cope="bias_blocks", fox="bias_blocks"),
    "reference": dict(cope="one_block", fox="one_block"),
}


@pytest.mark.parametrize("pe", CONTENT)
@pytest.mark.parametrize("path", ["cpu", "gpu", "reference"])
def test_equals_the_papers_equations_forward_and_gradients(pe, path, monkeypatch, request):
    """In float64, the attention and the gradient of every parameter it reads (q, k, v's projection,
    the encoding's vectors or gates) and of its input equal the paper's equations to 1e-10, with
    CoPE's positions clamped (p_max 5), on a CPU's kernels, a GPU's (CoPE's counted blocks, FoX's
    rows by blocks) and the reference."""
    if path == "gpu":
        request.getfixturevalue("cuda")
    model = tiny(pe, block_size=80, n_layer=1, cope_p_max=5).double()
    fused = {"cpu": None, "gpu": True, "reference": False}[path]
    model.attention_options = replace(model.attention_options, fused=fused)
    taken = []
    kernel = model_py.fast_paths.kernel

    def spy(*a, **k):
        builder = kernel(*a, **k)
        taken.append(builder.__name__)  # a bias of the content always has a builder
        return builder

    monkeypatch.setattr(model_py.fast_paths, "kernel", spy)
    x = torch.randn(2, 80, 32, dtype=torch.float64, requires_grad=True)
    results = []
    for fn in (ours, paper_attention):
        model.zero_grad()
        x.grad = None
        y = fn(model, x)
        (y * torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y)).sum().backward()
        results.append(
            (
                y.detach(),
                x.grad.clone(),
                {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
            )
        )
    (y, gx, grads), (y_ref, gx_ref, grads_ref) = results
    assert taken == [KERNELS_TAKEN[path][pe]]
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(gx, gx_ref, rtol=1e-10, atol=1e-10)
    assert grads.keys() == grads_ref.keys() and any(
        n.startswith("transformer.encoding") for n in grads
    )
    for n in grads_ref:
        torch.testing.assert_close(grads[n], grads_ref[n], rtol=1e-9, atol=1e-10, msg=n)


def x_transformers_attention(
    model, x: torch.Tensor, starts: torch.Tensor | None = None
) -> torch.Tensor:
    """Layer 0's attention output with x-transformers' CoPE inside its Attend (causal, the logits
    scaled by 1/√d before the gates) reading the model's q, k, v and its vectors e (shared: their
    gradient is the model's); starts: packed documents as Attend's mask of each row's own."""
    from x_transformers.attend import Attend
    from x_transformers.x_transformers import CoPE as XCoPE

    attn = model.transformer.h[0].attn
    cfg = model.config
    B, T, C = x.shape
    cope = XCoPE(dim=C // cfg.n_head, heads=cfg.n_head, max_pos=cfg.cope_p_max)
    del cope.pos_emb  # the model's vectors, not a parameter of its own
    cope.pos_emb = model.encoding.e[0]  # (p_max, hs)
    q, k, v = (t.view(B, T, cfg.n_head, -1).transpose(1, 2) for t in attn.c_attn(x).split(C, dim=2))
    # (B, 1, T, T)
    mask = None if starts is None else (starts[:, :, None] == starts[:, None, :])[:, None]
    softmax = lambda scores: scores.softmax(-1)  # noqa: E731  in float64 (Attend's own softmax is float32)
    out = Attend(causal=True, cope=cope, custom_attn_fn=softmax)(q, k, v, mask=mask)
    out = out[0] if isinstance(out, tuple) else out  # (B, nh, T, hs), and its intermediates
    return attn.c_proj(out.transpose(1, 2).reshape(B, T, C))


@pytest.mark.parametrize("documents", [False, True])
def test_cope_equals_x_transformers_cope(documents):
    """CoPE's attention equals x-transformers' CoPE module inside its Attend on the same weights, in
    float64: the output and the gradient of the input and of every parameter it reads (c_attn's,
    c_proj's, CoPE's vectors), on one stream and on packed documents (each row's documents under
    Attend's mask); positions clamp at p_max 12."""
    model = tiny("cope", block_size=80, n_layer=1, cope_p_max=12).double()
    x = torch.randn(2, 80, 32, dtype=torch.float64, requires_grad=True)
    starts = torch.tensor([[0] * 30 + [30] * 50, [0] * 9 + [9] * 71]) if documents else None
    results = []
    for fn in (ours, x_transformers_attention):
        model.zero_grad()
        x.grad = None
        y = fn(model, x, starts)
        (y * torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y)).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((y.detach(), x.grad.clone(), grads))
    (y, gx, grads), (y_ref, gx_ref, grads_ref) = results
    assert grads.keys() == grads_ref.keys() and "transformer.encoding.e" in grads
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(gx, gx_ref, rtol=1e-10, atol=1e-10)
    for n in grads_ref:
        torch.testing.assert_close(grads[n], grads_ref[n], rtol=1e-9, atol=1e-10, msg=n)


def test_a_cope_checkpoint_from_before_the_scaled_gates_computes_what_it_did(tmp_path):
    """A checkpoint whose config predates cope_gates (its model gated σ(q·k)) loads with
    cope_gates='unscaled' and computes σ(q·k)'s attention; a new model gates σ(q·k/√d), as the
    authors' code."""
    from dataclasses import asdict

    from lib.checkpoint import load_checkpoint, model_from_checkpoint

    model = tiny("cope", block_size=32, n_layer=1, n_head=2)
    assert model.config.cope_gates == "scaled" and model.encoding.gate_scale == 16**-0.5
    old = {
        k: v
        for k, v in asdict(replace(model.config, cope_gates="unscaled")).items()
        if k != "cope_gates"
    }
    torch.save({"model": model.state_dict(), "model_args": old}, tmp_path / "ckpt.pt")
    loaded = model_from_checkpoint(load_checkpoint(tmp_path / "ckpt.pt")).eval()
    assert loaded.config.cope_gates == "unscaled" and loaded.encoding.gate_scale == 1.0
    unscaled = model_py.GPT(replace(model.config, cope_gates="unscaled")).eval()
    unscaled.load_state_dict(model.state_dict())
    idx = tokens(2, 32)
    with torch.no_grad():
        assert torch.equal(loaded(idx)[0], unscaled(idx)[0])
        assert not torch.allclose(loaded(idx)[0], model(idx)[0], atol=1e-3)


def test_fox_in_float32_where_it_forgets_fast_is_the_papers_attention(monkeypatch):
    """With forget rates near e^-4 the bias passes -87 (where float32's exp underflows, and the
    flash kernels count it 0) some 21 keys back: the float32 blocks, through SDPA's flash kernels
    forward and backward, still equal the paper's equations in float64, forward and gradients."""
    model = tiny("fox", block_size=160, n_layer=1)
    with torch.no_grad():
        model.encoding.b.fill_(-4.0)
    taken = []
    backward = model_py.fast_paths.FLASH_BACKWARD
    spy = lambda *a, **kw: (taken.append(a[1].dtype), backward(*a, **kw))[1]  # noqa: E731  a[1]: the queries
    monkeypatch.setattr(model_py.fast_paths, "FLASH_BACKWARD", spy)
    x = torch.randn(2, 160, 32)
    results = []
    for m, fn in ((model, ours), (copy.deepcopy(model).double(), paper_attention)):
        xi = x.to(next(m.parameters()).dtype).detach().requires_grad_()
        y = fn(m, xi)
        (y * torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y)).sum().backward()
        grads = {n: p.grad.double() for n, p in m.named_parameters() if p.grad is not None}
        results.append((y.detach().double(), xi.grad.double(), grads))
    (y, gx, grads), (y_ref, gx_ref, grads_ref) = results
    assert torch.float32 in taken, "the float32 model's backward never ran the flash kernel"
    torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(gx, gx_ref, rtol=1e-4, atol=1e-4)
    for n in grads_ref:
        torch.testing.assert_close(grads[n], grads_ref[n], rtol=1e-4, atol=1e-4, msg=n)


def test_cope_counts_the_gates_not_the_tokens():
    """CoPE's position of a key is the sum of the gates from it to the query, not its distance: with
    every gate near 1 a key's position is its distance + 1, with the gates of the keys between near
    0 it stays small."""
    pe = tiny("cope", n_layer=1, cope_p_max=64).encoding
    q = torch.zeros(1, 1, 1, 8)  # (B, nh, 1, hs): the query at i = 5
    q[..., 0] = 20.0
    k = torch.full((1, 1, 6, 8), 4.0)  # q·k/√8 = 28: σ = 1
    k[:, :, 1:5] *= -1  # the keys between: σ(-28) = 0
    pe.e.data[0] = torch.arange(64.0)[:, None] * torch.eye(8)[0] * 0.05  # z_i[p] = q_i·e[p] = p
    bias = pe.content_bias(0, q, k, torch.ones(1, 6, dtype=torch.bool), None, None)
    torch.testing.assert_close(
        bias[0, 0, 0], torch.tensor([2.0, 1.0, 1.0, 1.0, 1.0, 1.0]), atol=1e-6, rtol=0
    )


def test_fox_running_sum_goes_on_through_the_cache():
    """FoX's cache keeps each key's running sum (float64) of log forget gates: fed in pieces and a
    token at a time, the sums equal the whole sequence's, and so do the logits."""
    model = tiny("fox", block_size=32)
    idx = tokens(2, 20)
    with torch.no_grad():
        full = model(idx)[0]
        cache = KVCache(model.config.n_layer, 20)
        pieces = [model(idx[:, a:b], cache=cache)[0] for a, b in [(0, 7), (7, 8), (8, 20)]]
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=1e-5, atol=1e-5)
    x = model.transformer.h[0].ln_1(model.transformer.wte(idx))
    sums = model.encoding.forget(0, x).cumsum(-1)  # (B, nh, T)
    assert cache.running[0].dtype == torch.float64
    torch.testing.assert_close(cache.running[0], sums, rtol=1e-12, atol=1e-12)


def attention_shaped(fn) -> list[tuple[int, ...]]:
    """The shapes of every 4-D tensor (B, nh, rows, columns) the ops run by fn() create, forward and
    backward."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    shapes = []

    class Shapes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            shapes.extend(
                tuple(t.shape)
                for t in tree_flatten(out)[0]
                if isinstance(t, torch.Tensor) and t.dim() == 4
            )
            return out

    with Shapes():
        fn()
    return shapes


@pytest.mark.parametrize("pe", CONTENT)
@pytest.mark.parametrize("train", [True, False])
def test_a_block_of_64_queries_at_most_on_a_cpu(pe, train):
    """On a CPU, training and evaluation at T = 256 make no (.., T, T) tensor: every
    attention-shaped tensor has at most 64 rows (a block of queries) or at most 65 columns (a head's
    dims; CoPE's p_max of 64, and its last entry again), forward and backward."""
    model = tiny(pe, block_size=256, n_layer=1).train(train)
    idx = tokens(2, 256)

    def step():
        with contextlib.nullcontext() if train else torch.no_grad():
            loss = model(idx, targets=torch.roll(idx, -1, 1))[1]
            if train:
                loss.backward()

    shapes = attention_shaped(step)
    assert shapes and all(min(s[-2:]) <= 65 for s in shapes), max(shapes, key=lambda s: min(s[-2:]))
    # the last block's rows over every key they see
    rows = model_py.fast_paths.COUNT_BLOCK if pe == "cope" else model_py.fast_paths.TABLE_BLOCK
    assert any(s[-2:] == (rows, 256) for s in shapes)


def test_fox_gate_bias_sets_the_forget_rate():
    """fox_gate_bias is b's initial value: f = σ(b) at a zero input (0: 1/2, as the authors' code
    starts)."""
    for b in (0.0, 3.0):
        config = model_py.GPTConfig(
            n_layer=2, n_head=2, n_embd=8, block_size=8, vocab_size=16, pos_encoding="fox"
        )
        pe = model_py.GPT(replace(config, fox_gate_bias=b)).encoding
        f = pe.forget(1, torch.zeros(1, 3, 8)).exp()  # (B, nh, T)
        torch.testing.assert_close(
            f, torch.full((1, 2, 3), 1 / (1 + torch.e**-b), dtype=torch.float64)
        )


def test_fox_trains_finite_at_its_gate_bias_bound():
    """At nine tenths of the bound fox_gate_bias takes (float32's largest over the block), a
    training step's loss and gradients are finite: the running sum of log σ(b) over the block stays
    in float32's range."""
    config = model_py.GPTConfig(
        n_layer=1, n_head=2, n_embd=16, block_size=32, vocab_size=16, pos_encoding="fox"
    )
    bound = torch.finfo(torch.float32).max / 32
    model = model_py.GPT(replace(config, fox_gate_bias=-0.9 * bound))
    with pytest.raises(ValueError, match="must be at least"):
        replace(config, fox_gate_bias=-1.1 * bound)
    idx = tokens(2, 32) % 16
    loss = model(idx, targets=torch.roll(idx, -1, 1))[1]
    loss.backward()
    assert loss.isfinite() and all(
        p.grad.isfinite().all() for p in model.parameters() if p.grad is not None
    )


@pytest.mark.parametrize("pe", CONTENT)
def test_compiled_decode_equals_eager(pe):
    """The compiled decode step (one graph over the cache: FoX's sums read and written by index, no
    host value) gives the eager generation's greedy tokens, past the block (the rolling cache)."""
    model = tiny(pe, block_size=16, n_layer=1)
    idx = tokens(2, 5)
    assert torch.equal(
        generate(model, idx, 24, temperature=0, compile=True),
        generate(model, idx, 24, temperature=0),
    )
