"""bf16 autocast, as a GPU trains (train.py's --dtype=bfloat16; a CPU's autocast follows nearly the
same rule): every encoding's training step and its evaluation at 16x the block against float32, as
close as RoPE's; and what each encoding computes of its own under autocast (gates, running sums,
biases, rotations) is its float32 computation."""

import copy

import pytest
import torch
from conftest import ENCODINGS, VOCAB, tokens
from torch.utils._pytree import tree_map

from model import GPT, POS_ENCODINGS, GPTConfig

SCALE = (
    # trained-like weights: each parameter moved by SCALE·N(0, 1) (a model trained 400 steps on text
    # errs alike)
    0.1
)
SEEDS = (0, 1)
BLOCK = 128
LONG = 16 * BLOCK
# at c1bb279 RoPE's errors were (logits, gradients, evaluation at 16x) 2.7%, 3.8%, 2.5% on weights
# moved by 0.3
ROPE_BEFORE = {"logits": 0.027, "gradients": 0.038, "long": 0.025}
ROUNDING = 0.02  # bf16's own rounding, at the least


def model_for(pe: str, seed: int, n_layer: int = 2) -> GPT:
    """n_layer layers, 2 heads of 16 dims, block 128, no dropout, in training mode; weights moved
    off their init."""
    torch.manual_seed(seed)
    shape = dict(
        block_size=BLOCK, vocab_size=VOCAB, n_layer=n_layer, n_head=2, n_embd=32, dropout=0.0
    )
    model = GPT(GPTConfig(**shape, pos_encoding=pe))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * SCALE)
    return model.train()


def step(
    model: GPT, idx: torch.Tensor, autocast: bool, device: str = "cpu"
) -> tuple[torch.Tensor, dict]:
    """A training step's logits (B, T, V) and every parameter's gradient, in float32; autocast:
    under bf16 autocast (the backward outside it, as train.py runs it)."""
    model.zero_grad()
    with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
        logits, loss = model(idx, targets=torch.roll(idx, -1, 1))
    loss.backward()
    named = model.named_parameters()  # a compiled model's names start with _orig_mod.
    grads = {
        n.removeprefix("_orig_mod."): p.grad.float().clone() for n, p in named if p.grad is not None
    }
    return logits.detach().float(), grads


def long_logits(model: GPT, idx: torch.Tensor, autocast: bool) -> torch.Tensor:
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        return model.eval()(idx)[0].float()


def rounded(model: GPT) -> GPT:
    """The model with every parameter rounded to bf16, computing in float32: what bf16's rounding
    alone does to it."""
    out = copy.deepcopy(model)
    with torch.no_grad():
        for p in out.parameters():
            p.copy_(p.bfloat16().float())
    return out


def logit_error(got: torch.Tensor, exact: torch.Tensor) -> float:
    return ((got - exact).abs().max() / exact.abs().max()).item()


def gradient_error(got: dict, exact: dict) -> float:
    """The worst ‖Δg‖ / ‖g‖ over the parameter tensors (those with a gradient)."""
    return max(((got[n] - g).norm() / g.norm()).item() for n, g in exact.items() if g.norm() > 0)


def errors(pe: str) -> dict:
    """Each measure's error under autocast, and the same measure on the model with its parameters
    rounded to bf16 (in float32: bf16's own rounding), the worst over SEEDS: logits and gradients of
    a training step at the block, and logits at 16x it where the encoding runs there."""
    out = {}
    for seed in SEEDS:
        model = model_for(pe, seed)
        idx = tokens(4, BLOCK, seed=seed + 1)
        logits, grads = step(model, idx, autocast=False)
        bf16_logits, bf16_grads = step(model, idx, autocast=True)
        floor_logits, floor_grads = step(rounded(model), idx, autocast=False)
        measured = {
            "logits": (logit_error(bf16_logits, logits), logit_error(floor_logits, logits)),
            "gradients": (gradient_error(bf16_grads, grads), gradient_error(floor_grads, grads)),
        }
        if POS_ENCODINGS[pe].extrapolates:
            long = tokens(1, LONG, seed=seed + 11)
            exact = long_logits(model, long, autocast=False)
            measured["long"] = (
                logit_error(long_logits(model, long, autocast=True), exact),
                logit_error(long_logits(rounded(model), long, autocast=False), exact),
            )
        for k, (err, floor) in measured.items():
            worst = out.get(k, (0.0, 0.0))
            out[k] = (max(worst[0], err), max(worst[1], floor))
    return out


@pytest.fixture(scope="module")
def rope():
    return errors("rope")


@pytest.mark.parametrize("pe", ENCODINGS)
def test_bf16_autocast_is_as_close_to_float32_as_ropes(pe, rope):
    """Under bf16 autocast a training step's logits and gradients, and the logits at 16x the block,
    are within 2x RoPE's error of float32's on the same inputs, or within 2x what rounding the
    model's own parameters to bf16 does (in float32; at least 2%): no encoding computes in bf16 what
    its formula needs exact. RoPE itself is no worse than it was (the error of the logits: max|Δ| /
    max|logits|; of the gradients: the worst ‖Δg‖ / ‖g‖ of a tensor)."""
    for k, bound in ROPE_BEFORE.items():
        assert rope[k][0] <= bound, (k, rope[k])
    for k, (err, floor) in errors(pe).items():
        allowed = max(2 * rope[k][0], 2 * floor, ROUNDING)
        assert err <= allowed, (
            f"{pe}'s {k} are off by {err:.2%} under autocast (RoPE's {rope[k][0]:.2%}, "
            f"{floor=:.2%})"
        )


HOOKS = ("embed", "rotary", "score_bias", "content_bias", "forget")


@pytest.mark.parametrize("pe", ENCODINGS)
@pytest.mark.parametrize("train", [True, False])
def test_what_an_encoding_computes_under_autocast_is_its_float32(pe, train, monkeypatch):
    """Every hook an encoding's forward calls under bf16 autocast (its embedding, rotation, score
    bias, CoPE's gates, their sum and its interpolation, FoX's forget gates) returns what it returns
    outside autocast in float32 from the same inputs (bf16 ones as float32): autocast's bf16
    products would move CoPE's positions and FoX's sums."""
    model = model_for(pe, seed=0).train(train)
    pe_module = model.encoding
    calls = []
    for name in HOOKS:
        hook = getattr(pe_module, name)

        def spy(*args, hook=hook, name=name):
            out = hook(*args)
            calls.append((name, hook, args, out))
            return out

        monkeypatch.setattr(pe_module, name, spy)
    idx = tokens(2, BLOCK)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(idx, targets=idx)
    as_float32 = lambda t: (
        t.float() if isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16 else t
    )  # noqa: E731
    for name, hook, args, out in calls:
        if out is None:
            continue
        with torch.no_grad():
            exact = hook(*tree_map(as_float32, args))
        got = tree_map(lambda t: t.detach(), out)
        torch.testing.assert_close(
            got,
            exact,
            rtol=1e-6,
            atol=1e-6,
            check_dtype=False,
            msg=lambda m, name=name: f"{name}: {m}",
        )
