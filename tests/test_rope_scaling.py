"""RoPE scaling (linear, NTK, dynamic NTK, YaRN): golden values from the published formulas, and an
exact KV cache."""

import math
from dataclasses import replace

import pytest
import torch
from conftest import cached_logits, close, greedy_reference, tiny, tokens

from generate import KVCache
from model import ROPE_SCALINGS, GPTConfig, RoPE

SCALINGS = list(ROPE_SCALINGS)


def rope(d: int, L0: int, scaling: str, factor: float, base: float = 10000.0) -> RoPE:
    return RoPE(
        GPTConfig(
            n_embd=d,
            n_head=1,
            block_size=L0,
            pos_encoding="rope",
            rope_base=base,
            rope_scaling=scaling,
            rope_factor=factor,
        )
    )


def theta(d: int, base: float = 10000.0) -> torch.Tensor:
    return torch.tensor([base ** (-2 * k / d) for k in range(d // 2)], dtype=torch.float64)


def test_linear_divides_every_frequency():
    got = rope(64, 256, "linear", 4.0).inv_freq("cpu").double()
    close(got, theta(64) / 4, tol=1e-6)


def test_ntk_base_matches_the_original_formula():
    """bloc97's base · s^(d/(d-2)): base 12,286 for s = 5000/4096, d = 64 (a textbook's s^(2/(d-2))
    gives 10,065)."""
    s = 5000 / 4096
    got = rope(64, 4096, "ntk", s).inv_freq("cpu").double()
    base = 10000 * s ** (64 / 62)
    assert round(base) == 12286
    close(got, theta(64, base), tol=1e-6)
    # θ_1 = base'^(-2/64): the textbook's base would put it measurably elsewhere
    assert abs(got[1].item() - 12286 ** (-2 / 64)) < 1e-6
    assert abs(got[1].item() - 10065 ** (-2 / 64)) > 1e-3


def test_dynamic_ntk_base_follows_the_length():
    """Unscaled up to L0; at L = 2·L0 with s = 2, base · (s·L/L0 - (s - 1))^(d/(d-2)) = base ·
    3^(d/(d-2))."""
    pe = rope(32, 128, "dynamic_ntk", 2.0)
    close(pe.inv_freq("cpu", torch.tensor(100)).double(), theta(32), tol=1e-6)
    close(pe.inv_freq("cpu", torch.tensor(128)).double(), theta(32), tol=1e-6)
    close(
        pe.inv_freq("cpu", torch.tensor(256)).double(), theta(32, 10000 * 3 ** (32 / 30)), tol=1e-6
    )


def test_yarn_matches_the_paper():
    """LLaMA's setting (d = 128, base 10^4, L0 = 4096), s = 16. dim(r) = d·ln(L0/(2πr))/(2·ln base):
    dim(32) = 20.95, dim(1) = 45.03, so dims k <= 20 are kept (they turn > 32 times in L0), k >= 46
    divided by s, a linear ramp between. A port that blends the other way round interpolates the
    fast dims and keeps the slow ones: k = 0 catches it."""
    pe = rope(128, 4096, "yarn", 16.0)
    assert (pe.low, pe.high) == (20, 46)
    got = pe.inv_freq("cpu").double()
    t = theta(128)
    close(got[:21], t[:21], tol=1e-7)
    close(got[46:], t[46:] / 16, tol=1e-7)
    ramp = (33 - 20) / (46 - 20)  # 0.5
    assert abs(got[33].item() - (t[33] / 16 * ramp + t[33] * (1 - ramp)).item()) < 1e-7
    assert abs(pe.mscale - (0.1 * math.log(16) + 1)) < 1e-12  # 1.2773
    cos, sin = pe.rotary(torch.tensor([0, 5]))
    # the temperature scales cos and sin alike
    close(cos[0], torch.full((64,), 0.1 * math.log(16) + 1))
    close(cos[1] ** 2 + sin[1] ** 2, torch.full((64,), (0.1 * math.log(16) + 1) ** 2))


def test_factor_one_changes_nothing():
    """s = 1 is the identity for the static scalings (YaRN's temperature is 0.1·ln 1 + 1 = 1).
    Dynamic NTK still stretches past L0 (its ratio is s·L/L0 - (s - 1) = L/L0 there), so it is the
    identity up to L0 only."""
    model = tiny("rope", block_size=16)
    idx = tokens(2, 24)
    expected = model(idx)[0]
    for scaling in SCALINGS:
        model.set_rope_scaling(scaling, 1.0)
        close(model(idx[:, :16])[0], expected[:, :16])
        if scaling != "dynamic_ntk":
            close(model(idx)[0], expected)


STATIC = [s for s in SCALINGS if s != "dynamic_ntk"]


@pytest.mark.parametrize("scaling", STATIC)
@pytest.mark.parametrize("chunks", [[24], [10, 1, 1, 5, 7], [1] * 24])
def test_cache_is_exact_with_scaling(scaling, chunks):
    """Static scalings: cached logits equal the full forward at every position, past block_size, and
    in a rolling window."""
    model = tiny("rope", block_size=8, rope_scaling=scaling, rope_factor=4.0)
    idx = tokens(2, 24)
    close(cached_logits(model, idx, chunks), model(idx)[0])
    close(cached_logits(model, idx, chunks, window=6, extra=2), model(idx, window=6)[0])


@pytest.mark.parametrize("scaling", STATIC)
def test_generation_with_scaling_equals_full_forwards(scaling):
    model = tiny("rope", block_size=8, rope_scaling=scaling, rope_factor=2.0)
    idx = tokens(1, 3)
    expected = greedy_reference(model, idx, 20, lambda m, x: m(x)[0][:, -1])
    assert torch.equal(model.generate(idx, 20, temperature=0, max_context=23), expected)
    windowed = greedy_reference(model, idx, 20, lambda m, x: m(x, window=6)[0][:, -1])
    assert torch.equal(model.generate(idx, 20, temperature=0, max_context=6), windowed)


@pytest.mark.parametrize("W", [6, 12, 23])
def test_dynamic_ntk_generation_caches_up_to_L0_then_recomputes(W):
    """Dynamic NTK changes every key (in every layer: deeper keys depend on earlier layers) whenever
    the length grows past L0, so no cache is exact there. generate() caches up to L0 = 8 and
    recomputes the last W tokens past it, which equals greedy full forwards over the last W tokens.
    W = 6 never passes L0: the rolling cache runs throughout, and equals the sliding-window forward
    as without scaling."""
    model = tiny("rope", block_size=8, rope_scaling="dynamic_ntk", rope_factor=3.0)
    idx = tokens(2, 3)
    if W <= 8:
        expected = greedy_reference(model, idx, 20, lambda m, x: m(x, window=W)[0][:, -1])
    else:
        expected = greedy_reference(model, idx, 20, lambda m, x: m(x[:, -W:])[0][:, -1])
    assert torch.equal(model.generate(idx, 20, temperature=0, max_context=W), expected)
    cache = KVCache(model.config.n_layer, 16)
    close(model(idx, cache=cache)[0], model(idx)[0])  # inside L0 the cache is exact
    model(tokens(2, 5), cache=cache)
    with pytest.raises(ValueError, match="dynamic_ntk.*no KV cache can be exact"):
        model(tokens(2, 1), cache=cache)  # position 8: length 9 > L0
    assert (
        model(tokens(2, 24))[0] - tiny("rope", block_size=8)(tokens(2, 24))[0]
    ).abs().max() > 1e-3


def test_set_rope_scaling_and_errors():
    model = tiny("rope", block_size=16)
    model.set_rope_scaling("yarn", 4.0)
    assert model.config.rope_scaling == "yarn" and model.encoding.mscale > 1
    with pytest.raises(ValueError, match="rope_scaling='yarm'.*linear, ntk, dynamic_ntk, yarn"):
        model.set_rope_scaling("yarm", 4.0)
    with pytest.raises(ValueError, match="rope_factor=0.5"):
        GPTConfig(pos_encoding="rope", rope_scaling="linear", rope_factor=0.5)
    with pytest.raises(ValueError, match="rope_original_max_len"):
        GPTConfig(pos_encoding="rope", rope_original_max_len=0)
    with pytest.raises(ValueError, match="applies to RoPE, not pos_encoding=.alibi."):
        tiny("alibi").set_rope_scaling("yarn", 2.0)


def hf_inv_freq(
    kind: str, d: int, L0: int, factor: float, base: float = 10000.0
) -> tuple[torch.Tensor, float]:
    """Hugging Face's inverse frequencies and attention factor for rope_type `kind` (a Llama config,
    head dim d)."""
    pytest.importorskip("transformers")  # CI has it; a bare GPU machine may not
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {
        "rope_type": kind,
        "rope_theta": base,
        "factor": factor,
        "original_max_position_embeddings": L0,
    }
    if kind == "llama3":
        params |= {"low_freq_factor": 1.0, "high_freq_factor": 4.0}
    config = LlamaConfig(
        hidden_size=d, num_attention_heads=1, max_position_embeddings=L0 * 4, rope_parameters=params
    )
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[kind](config, "cpu")
    return inv_freq.double(), attention_factor


@pytest.mark.parametrize(
    "d, L0, factor, base", [(128, 8192, 8.0, 500000.0), (32, 64, 4.0, 10000.0)]
)
def test_llama3_equals_hugging_face(d, L0, factor, base):
    """llama3 scaling gives Hugging Face's `llama3` rope type's frequencies: Llama 3.1's own setting
    (d = 128, base 500,000, L0 = 8192, s = 8; fast dims kept, slow ones divided by 8, a smooth blend
    between) and a small one."""
    expected, attention_factor = hf_inv_freq("llama3", d, L0, factor, base)
    got = rope(d, L0, "llama3", factor, base).inv_freq("cpu").double()
    close(got, expected, tol=1e-6)
    assert attention_factor == 1.0 and rope(d, L0, "llama3", factor, base).mscale == 1.0
    t = theta(d, base)
    # both ends of the blend
    assert torch.isclose(got[0], t[0]) and torch.isclose(got[-1], t[-1] / factor)


@pytest.mark.parametrize("d, L0, factor", [(32, 64, 4.0), (128, 4096, 16.0), (64, 256, 2.0)])
def test_yarn_equals_hugging_face(d, L0, factor):
    """yarn gives Hugging Face's frequencies and temperature, also where the ramp's bounds fall
    outside the pairs (L0 = 64, head dim 32, config/cpu.py's setting: the ramp is clamped to start
    at pair 0, not at pair -2)."""
    expected, attention_factor = hf_inv_freq("yarn", d, L0, factor)
    pe = rope(d, L0, "yarn", factor)
    close(pe.inv_freq("cpu").double(), expected, tol=1e-6)
    assert abs(pe.mscale - attention_factor) < 1e-9
    assert pe.low >= 0


@pytest.mark.parametrize("fraction, turning", [(1.0, 16), (0.5, 8), (0.25, 4), (0.05, 1)])
def test_partial_rope_rotates_the_fastest_pairs(fraction, turning):
    """rope_fraction rotates the first round(fraction·d/2) pairs, the fastest, with RoPE's own θ_k,
    and leaves the slowest unrotated (angle 0 at every position), p-RoPE's choice; q·k then depends
    on i - j only in the turning pairs, and the unrotated dims of q and k pass through unchanged."""
    pe = RoPE(
        GPTConfig(n_embd=32, n_head=1, block_size=64, pos_encoding="rope", rope_fraction=fraction)
    )
    got = pe.inv_freq("cpu").double()
    close(got[:turning], theta(32)[:turning], tol=1e-7)
    assert (got[turning:] == 0).all()
    cos, sin = pe.rotary(torch.arange(10))
    assert (cos[:, turning:] == 1).all() and (sin[:, turning:] == 0).all()


def test_yarn_temperature_scales_only_the_rotated_pairs():
    """YaRN under partial RoPE: the rotated pairs' cos and sin carry the attention factor 0.1·ln(s)
    + 1, the pairs that do not turn pass through unscaled (cos 1, sin 0), as Hugging Face applies
    cos and sin to the rotary dims only."""
    cfg = GPTConfig(
        n_embd=32,
        n_head=1,
        block_size=64,
        pos_encoding="rope",
        rope_fraction=0.5,
        rope_scaling="yarn",
    )
    pe = RoPE(replace(cfg, rope_factor=4.0))
    m = 0.1 * math.log(4.0) + 1
    cos, sin = pe.rotary(torch.arange(50))
    close(cos[:, :8] ** 2 + sin[:, :8] ** 2, torch.full((50, 8), m * m))
    assert (cos[:, 8:] == 1).all() and (sin[:, 8:] == 0).all()


def test_partial_rope_model_has_an_exact_cache():
    """A partial-RoPE model's KV cache equals its full forward, past block_size and in a rolling
    window."""
    model = tiny("rope", block_size=8, rope_fraction=0.5)
    idx = tokens(2, 20)
    close(cached_logits(model, idx, [7, 1, 12]), model(idx)[0])
    close(cached_logits(model, idx, [3, 17], window=6, extra=2), model(idx, window=6)[0])
    with pytest.raises(ValueError, match="rope_fraction=0.01 rotates no pair"):
        GPTConfig(n_embd=32, n_head=4, pos_encoding="rope", rope_fraction=0.01)
