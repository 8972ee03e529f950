"""
nanoPE's model: one decoder-only GPT (the GPT-2 architecture) whose attention takes any positional encoding of
POS_ENCODINGS, or none, and a KV cache whose decoding equals the model's own full forward.

It reads top to bottom: the positional encodings (each a small class: a few hooks, its options, what it can do), the
config (the model's shape and every encoding's options), a chunk's positions and the KV cache, the attention paths
(one table picks the kernel, one builder per path makes it), the transformer, the GPT (its forward, GPT-2's weights),
generation (the Engine: the cache's lifecycle, the decode step, sampling), and last the hand-written autograd kernels
that some attention paths use.

Positions travel as one tensor of absolute positions `pos` (T,), defaulting to arange(T) or continuing the
cache, and with the keys' positions and the window as one Chunk. Everything positional derives from it once per
forward: the embedding added to the tokens, the RoPE angles, the score bias, and the mask, which compares query and
key positions (so it is aligned correctly whether or not keys come from a cache).
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn as nn
from torch.nn import functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from torch.utils.checkpoint import checkpoint

try:  # torch >= 2.9 (return_lse is deprecated there)
    from torch.nn.attention.flex_attention import AuxRequest
except ImportError:  # pragma: no cover
    AuxRequest = None


# ----------------------------------------------------------------------------------------------------------------
# Positional encodings: each a small module with no-op hooks, overriding only what it needs, and declaring its own
# options. Nothing outside this section names an encoding: code elsewhere asks the object (or its class, through
# POS_ENCODINGS), and GPTConfig, train.py's keys and --help read the options from the registry.


@dataclass(frozen=True)
class Option:
    """One setting of an encoding: its default, a one-line help, and a check that says what is wrong with a value
    (the rule and the usual setting) or None. derive fills a default of None from the rest of the config."""

    default: Any
    help: str
    check: Callable[[Any], str | None] = lambda value: None
    derive: Callable[[Any], Any] | None = None


def number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def positive_int(v: Any) -> str | None:
    return None if isinstance(v, int) and not isinstance(v, bool) and v >= 1 else "must be a positive integer"


def boolean(v: Any) -> str | None:
    return None if isinstance(v, bool) else "must be True or False"


def optional(check: Callable[[Any], str | None]) -> Callable[[Any], str | None]:
    return lambda v: None if v is None else check(v)


def greater(bound: float, rule: str, equal: bool = False) -> Callable[[Any], str | None]:
    return lambda v: None if number(v) and (v >= bound if equal else v > bound) else rule


class PositionalEncoding(nn.Module):
    """The base of every encoding: no positional information, and hooks a subclass overrides where it needs them.

    Hooks: `embed` (added to the token embeddings), `rotary` (cos/sin that rotate q and k), `bias` (added to
    attention scores). `bias` is elementwise in the head and the absolute query and key positions, so the same formula
    fills a materialized (nh, Tq, Tk) tensor and runs inside FlexAttention's fused `score_mod`. Class attributes say
    what the rest of the model needs to know; `options` are the encoding's own settings, which GPTConfig holds and
    `resolve` checks, the one place they are validated.
    """

    relative = True  # depends on positions only through i - j: a rolling KV cache stays exact past the window
    rolling = True  # generation past the window keeps positions counting (a rolling cache); False: crop, restart at 0
    extrapolates = True  # has an encoding for any position (False: max_len is the last)
    max_len = None  # the most positions it can encode (None: unbounded)
    has_bias = False  # adds a bias to attention scores, so SDPA's causal (flash) path cannot be used
    bias_span = None  # bias: a function of i - j alone that is one constant from this distance on (None: not so)
    cache_span = None  # the longest span of positions a KV cache stays exact for (None: any)
    rope_scalable = False  # takes rope_scaling (set_rope_scaling, eval_length's and sample.py's --rope_scaling)
    per_layer = False  # bias: one per layer, h in bias(h, i, j) counting the heads of every layer (layer·n_head + head)
    lr_scale = 1.0  # train.py's default pe_lr_scale: how many times faster its parameters learn
    # the Hugging Face transformers architecture that computes it exactly: gpt2, gpt_neox, mpt; None: none does, and
    # export.py exports it with nanoPE's own code (this file and a transformers wrapper, loaded with trust_remote_code)
    hf_architecture: str | None = None
    options: dict[str, Option] = {}  # config key -> Option: GPTConfig has a field for each, train.py a key
    summary = ""  # one line for --help

    def __init__(self, config: GPTConfig):
        super().__init__()

    @classmethod
    def resolve(cls, config: GPTConfig) -> None:
        """Fill the derived defaults of this encoding's options in config, then check them and check(config): a
        ValueError naming the option, the rule and the fix."""
        for name, opt in cls.options.items():
            if getattr(config, name) is None and opt.derive is not None:
                setattr(config, name, opt.derive(config))
            problem = opt.check(getattr(config, name))
            if problem:
                raise ValueError(f"{name}={getattr(config, name)!r} {problem}")
        cls.check(config)

    @classmethod
    def check(cls, config: GPTConfig) -> None:
        """Raise ValueError, naming the fix, where config cannot build this encoding (checks across options)."""

    def reaches(self, length: int) -> bool:
        """Whether it has positions for sequences of `length` tokens (a learned table stops at block_size)."""
        return self.max_len is None or length <= self.max_len

    def cache_exact(self, span: int) -> bool:
        """Whether a KV cache stays exact for queries that see `span` positions (RoPE's dynamic NTK: up to L0)."""
        return self.cache_span is None or span <= self.cache_span

    def embed(self, pos: torch.Tensor) -> torch.Tensor | None:
        return None  # (T,) -> (T, C)

    def rotary(self, pos: torch.Tensor, window: int | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        return None  # (T,) -> cos, sin, each (T, hs/2) float32

    def bias(self, h: torch.Tensor, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor | None:
        return None  # head h, query position i, key position j: broadcastable int tensors -> float32 bias

    def layer_bias(self, first: int, n_head: int, chunk: Chunk, recompute: bool = False) -> torch.Tensor:
        """One layer's bias (nh, Tq, Tk) over a chunk's queries and keys, heads first … first + n_head - 1: bias at
        every pair. An encoding may compute the same values faster from the chunk's structure (FIRE). recompute: a
        trainable bias is recomputed in the backward, so that autograd keeps the (nh, Tq, Tk) bias, not every
        intermediate of its formula (FIRE's MLP would keep dozens of bias-sized tensors per layer)."""
        heads = torch.arange(n_head, device=chunk.pos.device)[:, None, None] + first
        return recomputed(self.bias, recompute)(heads, chunk.pos[:, None], chunk.keys)

    def no_decay(self) -> list[nn.Parameter]:
        """Parameters AdamW must not decay: a score bias's (a decayed bias is pulled toward "no preference")."""
        return list(self.parameters()) if self.has_bias else []

    def position_params(self) -> int:
        """Parameters that are a table of positions (left out of the model's size, as nanoGPT does)."""
        return 0

    def crop(self, block_size: int) -> None:
        """Shrink the training context (GPT-2's 1024 to 256): a table of positions drops its rows."""

    def extend(self, block_size: int) -> None:
        """Lengthen the training context (a run extended to a longer block): a table of positions gains rows."""


class NoPE(PositionalEncoding):
    """No positional information at all: the causal mask alone orders tokens (Kazemnejad et al. 2023)."""

    summary = "no positions: the causal mask alone orders tokens (NoPE)"
    hf_architecture = "gpt2"


class Sinusoidal(PositionalEncoding):
    """Fixed sin/cos of the absolute position added to the token embeddings (Vaswani et al. 2017, §3.5):
    PE[p, 2i] = sin(p / 10000^(2i/C)), PE[p, 2i+1] = cos(p / 10000^(2i/C)), computed from `pos` (any length).
    Scaled by 1/√C: Vaswani et al. multiply the token embeddings by √C instead, which gives the same ratio; unscaled,
    the table (norm √(C/2)) drowns GPT-2's 0.02-std token embeddings, and the model trains far worse."""

    summary = "fixed sin/cos of the position added to the token embeddings"
    hf_architecture = "gpt2"

    relative = False
    rolling = False

    def __init__(self, config: GPTConfig):
        super().__init__(config)
        self.n_embd = config.n_embd

    @classmethod
    def check(cls, config):
        if config.n_embd % 2:
            raise ValueError(f"pos_encoding='sinusoidal' needs an even n_embd (sin/cos pairs), got {config.n_embd}")

    def embed(self, pos):
        inv_freq = 10000.0 ** (-torch.arange(0, self.n_embd, 2, device=pos.device, dtype=torch.float32) / self.n_embd)
        angle = pos.float()[:, None] * inv_freq  # (T, C/2)
        pe = torch.stack([angle.sin(), angle.cos()], dim=-1).flatten(1)  # (T, C): sin on even dims, cos on odd
        return pe / math.sqrt(self.n_embd)


class Learned(PositionalEncoding):
    """A trainable table of absolute-position embeddings, GPT-2's `wpe` (Radford et al. 2019). Cannot go
    past block_size: there is no row for a longer position."""

    summary = "a trainable table of positions added to the token embeddings (GPT-2's)"
    hf_architecture = "gpt2"

    relative = False
    rolling = False
    extrapolates = False

    def __init__(self, config: GPTConfig):
        super().__init__(config)
        self.max_len = config.block_size
        self.weight = nn.Parameter(torch.randn(config.block_size, config.n_embd) * 0.02)

    def embed(self, pos):
        return F.embedding(pos, self.weight)

    def position_params(self):
        return self.weight.numel()

    def crop(self, block_size):
        self.weight = nn.Parameter(self.weight[:block_size].detach().clone())
        self.max_len = block_size

    def extend(self, block_size):
        """Position interpolation for a table (as Chen et al. 2023 do for RoPE's angles): row p of the new table is the
        old one read at p·L0/L, linearly between its rows, so the longer context spans the positions trained; for
        L = s·L0, row s·k is the old row k. The last s - 1 rows, past the old last row, repeat it."""
        L0 = self.weight.size(0)
        x = (torch.arange(block_size, dtype=torch.float64) * L0 / block_size).clamp(max=L0 - 1)  # (L,)
        lo = x.floor().long()
        hi, frac = (lo + 1).clamp(max=L0 - 1), (x - lo).to(self.weight.dtype)[:, None]
        w = self.weight.detach()
        self.weight = nn.Parameter(torch.lerp(w[lo], w[hi], frac))  # (L, C)
        self.max_len = block_size


class BiasRPE(PositionalEncoding):
    """One trainable scalar per head and clamped relative distance i - j, added to the attention scores
    (Shaw et al. 2018, simplified to scalars as in T5, Raffel et al. 2020), shared by all layers.
    Table index = clamp(i - j, -(r_max - 1), r_max - 1) + r_max - 1; biases start at zero, and learn 30 times faster
    than the rest: Adam moves a parameter about one learning rate per step, too little for a table from zero."""

    summary = "a trainable bias per head and clamped distance, added to attention scores"

    has_bias = True
    lr_scale = 30.0
    options = {
        "rpe_max_distance": Option(
            None,
            "distances clamp to ±(r_max - 1), 2·r_max - 1 biases per head; None: block_size // 2, so the far "
            "entry that every longer distance reads is trained within the training length",
            optional(positive_int),
            derive=lambda config: max(config.block_size // 2, 1),
        )
    }

    def __init__(self, config: GPTConfig):
        super().__init__(config)
        self.max_distance = config.rpe_max_distance
        self.bias_span = config.rpe_max_distance - 1  # distances >= r_max - 1 share the clamped entry
        self.weight = nn.Parameter(torch.zeros(config.n_head, 2 * config.rpe_max_distance - 1))  # (nh, 2r-1)

    def bias(self, h, i, j):
        r = self.max_distance
        return self.weight[h, (i - j).clamp(-(r - 1), r - 1) + (r - 1)].float()


class T5(PositionalEncoding):
    """T5's relative attention bias (Raffel et al. 2020, §2.1), causal: one trainable scalar per head and bucket of the
    distance n = i - j, shared by all layers. Buckets 0 … B/2 - 1 hold n exactly; the other B/2 are log-spaced up to
    max_distance, and every farther distance shares the last (Mesh TensorFlow's `_relative_position_bucket`,
    bidirectional=False). The "T5 bias" of the ALiBi paper's comparison. Biases start at zero and learn 30 times
    faster, as bias_rpe's."""

    summary = "a trainable bias per head and log-spaced bucket of distances (T5's)"

    has_bias = True
    lr_scale = 30.0
    options = {
        "t5_num_buckets": Option(32, "biases per head, half exact distances, half log-spaced", positive_int),
        "t5_max_distance": Option(
            None,
            "distances from here on share the last bucket; None: block_size // 2 (at least t5_num_buckets), so "
            "that bucket is trained within the training length",
            optional(positive_int),
            derive=lambda config: max(config.block_size // 2, config.t5_num_buckets),
        ),
    }

    def __init__(self, config: GPTConfig):
        super().__init__(config)
        self.num_buckets, self.max_distance = config.t5_num_buckets, config.t5_max_distance
        self.weight = nn.Parameter(torch.zeros(config.n_head, config.t5_num_buckets))  # (nh, buckets)
        n = torch.arange(max(self.max_distance, self.num_buckets) + 1)
        self.bias_span = int((self.bucket(n) < self.num_buckets - 1).sum())  # the first distance in the last bucket

    @classmethod
    def check(cls, config):
        if config.t5_num_buckets < 2 or config.t5_max_distance <= config.t5_num_buckets // 2:
            raise ValueError(
                f"t5_num_buckets={config.t5_num_buckets} and t5_max_distance={config.t5_max_distance}: T5 needs "
                "at least 2 buckets and a max distance above half of them (e.g. 32 and 128)"
            )

    def bucket(self, n: torch.Tensor) -> torch.Tensor:
        exact = self.num_buckets // 2
        n = n.clamp(min=0)  # the future is masked anyway
        log_ratio = torch.log(n.clamp(min=exact).float() / exact) / math.log(self.max_distance / exact)
        far = (exact + (log_ratio * (self.num_buckets - exact)).long()).clamp(max=self.num_buckets - 1)
        return torch.where(n < exact, n, far)

    def bias(self, h, i, j):
        return self.weight[h, self.bucket(i - j)].float()


class Kerple(PositionalEncoding):
    """KERPLE's logarithmic variant (Chi et al. 2022): bias -r1·log(1 + r2·(i - j)), with r1, r2 > 0 trainable per
    head (kept positive as exponentials). It grows without bound, like ALiBi, but slower. Initialised as the paper's
    code: r1 ~ U(0, 2), r2 ~ U(0, 1) (floored at 0.01, so the log stays finite). The paper's model has a pair per
    head in each layer (kerple_per_layer); the default shares one pair per head across layers, as ALiBi shares its
    slopes: the comparison's numbers in docs/results.md use it."""

    summary = "a bias -r1·log(1 + r2·distance), r1 and r2 trainable per head (KERPLE)"

    has_bias = True
    options = {
        "kerple_per_layer": Option(
            False, "(r1, r2) of each layer's own, as the paper's model; False: shared by the layers", boolean
        )
    }

    def __init__(self, config: GPTConfig):
        super().__init__(config)
        self.per_layer = config.kerple_per_layer
        n = config.n_head * (config.n_layer if self.per_layer else 1)  # h in bias() counts every layer's heads
        self.log_r1 = nn.Parameter((torch.rand(n) * 2).clamp(min=0.01).log())  # (n,)
        self.log_r2 = nn.Parameter(torch.rand(n).clamp(min=0.01).log())  # (n,)

    def bias(self, h, i, j):
        n = (i - j).clamp(min=0).float()
        return -self.log_r1.exp()[h] * torch.log1p(self.log_r2.exp()[h] * n)


ROPE_SCALINGS = ("none", "linear", "ntk", "dynamic_ntk", "yarn", "llama3")
# the published constants, which export.py also writes into GPT-NeoX's rope_parameters
YARN_ALPHA, YARN_BETA = 1.0, 32.0  # YaRN's ramp bounds in rotations per L0 (Peng et al. 2023, recommended for LLaMA)
LLAMA3_LOW, LLAMA3_HIGH = 1.0, 4.0  # Llama 3.1's low/high frequency factors (its rope_scaling, Meta 2024)


class RoPE(PositionalEncoding):
    """Rotary position embedding (Su et al. 2021, RoFormer): rotate each pair (2k, 2k+1) of q and k by the
    angle p·θ_k, θ_k = base^(-2k/d), so q·k depends on positions only through i - j. Angles in float32.

    rope_fraction < 1 rotates only the fastest pairs, k < round(fraction·d/2), and leaves the slowest unrotated (θ = 0),
    as p-RoPE does (Barbero et al. 2024: the lowest frequencies carry little position and act as semantic channels);
    GPT-NeoX's rotary_pct instead rotates its first quarter with the whole range of frequencies squeezed into it.

    Scalings stretch the context s = rope_factor times past L0 = rope_original_max_len:
    linear (position interpolation, Chen et al. 2023): θ_k / s. ntk (bloc97 2023): base · s^(d/(d-2)).
    dynamic_ntk: base · (s·L/L0 - (s-1))^(d/(d-2)) for the current length L > L0: every key, in every layer, changes
    whenever L does, so past L0 no KV cache can be exact; generate() recomputes there, features() refuses a cache.
    yarn (Peng et al. 2023): θ_k kept for dims that turn more than β=32 times in L0, θ_k / s for those turning less
    than α=1 time, a linear ramp between (its bounds clamped to [0, d - 1], as the authors' code and Hugging Face);
    cos and sin scaled by 0.1·ln(s) + 1 (the attention temperature), of the rotated pairs only: with rope_fraction < 1
    the pairs that do not turn pass through unscaled, as in Hugging Face's partial rotary. llama3 (Llama 3.1): θ_k kept
    where the wavelength 2π/θ_k is under L0/4, θ_k / s where it is over L0/1, a smooth blend in L0/wavelength between.
    """

    summary = "rotates q and k by the position (rotary); scalings read past the training length"
    hf_architecture = "gpt_neox"

    rope_scalable = True
    options = {
        "rope_base": Option(10000.0, "θ_k = base^(-2k/d)", greater(1.0, "must be > 1")),
        "rope_fraction": Option(
            1.0,
            "the fraction of each head's pairs that rotate (the fastest; p-RoPE)",
            lambda v: None if number(v) and 0.0 < v <= 1.0 else "must be in (0, 1] (1: every pair rotates)",
        ),
        "rope_scaling": Option(
            "none",
            "to run past the training length: " + " | ".join(ROPE_SCALINGS),
            lambda v: (
                None if v in ROPE_SCALINGS else f"is not a RoPE scaling; valid choices: {', '.join(ROPE_SCALINGS)}"
            ),
        ),
        "rope_factor": Option(
            1.0, "rope_scaling's s: the context is stretched s times", greater(1.0, "must be a number >= 1", equal=True)
        ),
        "rope_original_max_len": Option(
            None, "rope_scaling's L0, the original training length (None: block_size)", optional(positive_int)
        ),
    }

    def __init__(self, config: GPTConfig):
        super().__init__(config)
        d = self.head_dim = config.n_embd // config.n_head
        self.base, self.scaling, self.factor = config.rope_base, config.rope_scaling, float(config.rope_factor)
        self.rotating = round(config.rope_fraction * d / 2)  # pairs that rotate
        self.original = config.rope_original_max_len or config.block_size
        self.mscale = 0.1 * math.log(self.factor) + 1.0 if self.scaling == "yarn" else 1.0
        # θ_k = theta_base^(-2k/d) (export.py's rope_theta): NTK's is base · s^(d/(d-2)), the original exponent as in
        # Hugging Face's dynamic variant (one textbook's s^(2/(d-2)) is not it)
        self.theta_base = self.base * self.factor ** (d / (d - 2)) if self.scaling == "ntk" else self.base
        self.cache_span = self.original if self.scaling == "dynamic_ntk" else None
        # YaRN's ramp, over the pair index k: dim(r) is the k whose wavelength 2π/θ_k fits r times into L0
        dim = lambda r: d * math.log(self.original / (2 * math.pi * r)) / (2 * math.log(self.base))  # noqa: E731
        self.low, self.high = max(math.floor(dim(YARN_BETA)), 0), min(math.ceil(dim(YARN_ALPHA)), d - 1)
        if self.high == self.low:
            self.high += 0.001  # a step, not a division by zero

    @staticmethod
    def default_factor(scaling: str, length: int, train_len: int) -> float:
        """The factor s a scaling takes to read `length` tokens of a model trained at `train_len`: length / train_len
        (1 up to it), and 1 for dynamic_ntk, which scales with the length by itself (s = L / L0 would square it)."""
        return 1.0 if scaling == "dynamic_ntk" else max(1.0, length / train_len)

    @classmethod
    def check(cls, config):
        d = config.n_embd // config.n_head
        if d % 2:
            raise ValueError(
                f"pos_encoding='rope' rotates pairs of dims, so the head dim n_embd/n_head={d} must be even; "
                "change n_embd or n_head"
            )
        if config.rope_scaling == "ntk" and d <= 2:
            raise ValueError("rope_scaling='ntk' needs a head dim > 2 (its exponent is d/(d-2))")
        if round(config.rope_fraction * d / 2) < 1:
            raise ValueError(f"rope_fraction={config.rope_fraction} rotates no pair of a head dim of {d}; raise it")

    def inv_freq(self, device: torch.device, length: torch.Tensor | None = None) -> torch.Tensor:
        """θ_k (hs/2,) float32, scaled; length (a 0-d tensor, the sequence length L) matters for dynamic_ntk only."""
        d, s = self.head_dim, self.factor
        k = torch.arange(0, d // 2, device=device, dtype=torch.float32)
        theta = self.theta_base ** (-2 * k / d)
        if self.scaling == "linear":
            theta = theta / s
        elif self.scaling == "yarn":  # ramp 0: keep θ_k (high frequency); ramp 1: interpolate θ_k / s
            ramp = ((k - self.low) / (self.high - self.low)).clamp(0, 1)
            theta = theta / s * ramp + theta * (1 - ramp)
        elif self.scaling == "llama3":  # smooth 1: keep θ_k (short wavelength); smooth 0: interpolate θ_k / s
            turns = self.original * theta / (2 * math.pi)  # L0 / wavelength
            smooth = ((turns - LLAMA3_LOW) / (LLAMA3_HIGH - LLAMA3_LOW)).clamp(0, 1)
            theta = theta / s * (1 - smooth) + theta * smooth
        elif self.scaling == "dynamic_ntk" and length is not None:
            ratio = (s * length.float() / self.original - (s - 1)).clamp(min=1.0)  # 1 up to L0: unscaled
            theta = theta * ratio ** (-2 * k / (d - 2))  # (base · ratio^(d/(d-2)))^(-2k/d)
        return torch.where(k < self.rotating, theta, 0.0)  # partial RoPE: the slowest pairs do not turn

    def rotary(self, pos, window=None):
        length = None
        if self.scaling == "dynamic_ntk":  # L is the span the queries see: the last position + 1, at most the window
            length = pos.max() + 1 if window is None else (pos.max() + 1).clamp(max=window)
        angle = pos.float()[:, None] * self.inv_freq(pos.device, length)  # (T, hs/2)
        # YaRN's temperature on the rotated pairs alone: pairs that do not turn pass through unscaled, as in Hugging
        # Face's partial rotary, which applies cos and sin to the rotary dims only
        turning = torch.arange(self.head_dim // 2, device=pos.device) < self.rotating
        scale = torch.where(turning, self.mscale, 1.0)  # (hs/2,)
        return angle.cos() * scale, angle.sin() * scale


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs of x (B, nh, T, hs) by angles with cos, sin (T, hs/2), in float32."""
    pairs = x.float().unflatten(-1, (-1, 2))  # (B, nh, T, hs/2, 2)
    if torch.compiler.is_compiling():
        # real arithmetic, which inductor fuses into one kernel (it has no complex codegen)
        x1, x2 = pairs.unbind(-1)
        return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2).type_as(x)
    # eager: one complex multiply, (x1 + i·x2)(cos + i·sin), one kernel where the real arithmetic takes six
    return torch.view_as_real(torch.view_as_complex(pairs) * torch.complex(cos, sin)).flatten(-2).type_as(x)


def alibi_slopes(n_head: int) -> torch.Tensor:
    """ALiBi's head slopes exactly as the paper's reference code (Press et al. 2021): a geometric sequence from
    2^(-8/n) for n a power of two; otherwise the slopes of the largest power of two c < n, then every other slope
    of the 2c-head sequence (1/2 … 1/256 then 2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5 for 12 heads)."""

    def geometric(n):
        start = 2.0 ** (-(2.0 ** -(math.log2(n) - 3)))
        return [start ** (i + 1) for i in range(n)]

    c = 2 ** math.floor(math.log2(n_head))
    return torch.tensor(geometric(c) + geometric(2 * c)[0::2][: n_head - c], dtype=torch.float32)


class ALiBi(PositionalEncoding):
    """Attention with linear biases (Press et al. 2021): add -m_h·(i - j) to the score of query i and key j.
    Computed from i - j in float32, never from j alone: that would grow with absolute position."""

    summary = "a bias -slope·distance per head, the paper's fixed slopes (ALiBi)"
    hf_architecture = "mpt"

    has_bias = True

    def __init__(self, config: GPTConfig):
        super().__init__(config)
        self.register_buffer("slopes", alibi_slopes(config.n_head), persistent=False)  # (nh,)

    def bias(self, h, i, j):
        return -self.slopes[h] * (i - j).float()


class FIRE(PositionalEncoding):
    """FIRE, functional interpolation for relative positions (Li et al. 2023): bias f(ψ(i - j) / (ψ(max(L, i)) + ε))
    with ψ(x) = log(|c|·x + 1), f a small MLP (1 -> 32, ReLU, -> one output per head) of each layer's own, c and the
    threshold L trainable. Dividing by ψ of the query's position maps every distance the query can see into [0, 1],
    so a longer context interpolates between trained inputs instead of reaching new ones (L keeps short contexts
    from being stretched). The bias depends on i, not only on i - j: the cache and every attention path pass absolute
    positions, and generation past the window keeps them counting (a rolling cache, exact against a forward over the
    same positions), as FIRE is meant to read positions past its training length. As the paper's reference code: c
    starts at 0.1; L = |m|·L0 with a learned multiplier m from 1 and a fixed L0 (block_size), so Adam's steps of about
    the learning rate move L by a fraction of itself, not by tokens; ε = 1e-6 keeps L = 0 finite at position 0. f has
    no output bias: a constant per head is lost in the softmax. f's output layer starts small, so training starts
    near NoPE. c, L and f's first layer are the layer's, shared by its heads: x and the hidden units are computed once
    a layer, and only the output layer per head. A query within L (i <= L) has x of i - j alone, so in training and
    prefill its row is a gather from f run on the T distances (layer_bias); only the queries past L take f per pair."""

    summary = "a learned MLP of the distance over the query's position, per layer (FIRE)"

    relative = False  # the query's position matters (its rolling cache is exact against a forward at its positions)
    has_bias = True
    per_layer = True
    hidden = 32
    eps = 1e-6
    few = 1 << 14  # MLP inputs up to which its hidden units are kept (16,384 x 32 floats: 2 MiB), see mlp

    def __init__(self, config: GPTConfig):
        super().__init__(config)
        L, nh, n = config.n_layer, config.n_head, self.hidden
        self.n_head = nh
        self.c = nn.Parameter(torch.full((L,), 0.1))  # (L,) used as |c|
        self.L_multiplier = nn.Parameter(torch.ones(L))  # (L,) the threshold is |m|·L0
        self.register_buffer("init_L", torch.tensor(float(config.block_size)))  # L0, fixed
        self.w1, self.b1 = nn.Parameter(torch.randn(L, n)), nn.Parameter(torch.rand(L, n) * 2 - 1)  # (L, 32)
        self.w2 = nn.Parameter(torch.randn(L, nh, n) * 0.02)  # (L, nh, 32)

    def bias(self, h, i, j):
        # every parameter as a row per (layer, head), read at h (which may span layers: probe.py's): inductor's CPU
        # backend fails to compile the gradient of a row read by several heads at once (h // n_head)
        per_head = lambda p: p.repeat_interleave(self.n_head, 0)  # noqa: E731  (L, ...) -> (L·nh, ...)
        c, threshold = per_head(self.c).abs()[h], (per_head(self.L_multiplier) * self.init_L).abs()[h]
        w1, b1, w2 = per_head(self.w1)[h], per_head(self.b1)[h], self.w2.flatten(0, 1)[h]  # h's shape + (32,)
        return self.mlp(self.input(c, threshold, i, j), w1, b1, w2)

    def input(self, c, threshold, i, j):
        """The MLP's input x = ψ(i - j) / (ψ(max(L, i)) + ε), ψ(x) = log(c·x + 1)."""
        psi = lambda x: torch.log1p(c * x)  # noqa: E731
        dtype = torch.promote_types(c.dtype, torch.float32)  # a float32 bias (float64 for a float64 model)
        return psi((i - j).clamp(min=0).to(dtype)) / (psi(torch.maximum(threshold, i.to(dtype))) + self.eps)

    @staticmethod
    def mlp(x, w1, b1, w2, few: bool = False):
        """f(x): x (...), w1 and b1 (..., 32), w2 (..., 32), broadcast together -> (...). few: x holds at most FIRE.few
        values (the T distances of a block, a decode step's row)."""
        # Few inputs, or compiled with a gradient: one broadcast expression. Few: its (..., 32) hidden units cost less
        # than one bias, in a handful of operations where a loop over the units takes hundreds. Compiled: inductor
        # fuses it into its reductions without storing the hidden units (the same peak memory as ScalarMLP, a much
        # smaller graph to compile than 32 units unrolled). Else, with a gradient, eager: ScalarMLP keeps x alone for
        # the backward; without one (and in FlexAttention's score_mod, which works on scalars): the plain units.
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (x, w1, b1, w2))
        if few or (grad and torch.compiler.is_compiling()):
            return (torch.relu(x[..., None] * w1 + b1) * w2).sum(-1)
        return (ScalarMLP.apply if grad else scalar_mlp)(x, w1, b1, w2)

    def layer_bias(self, first: int, n_head: int, chunk: Chunk, recompute: bool = False) -> torch.Tensor:
        """One layer's (nh, Tq, Tk) bias, its x and hidden units computed once for the layer's heads. Where the chunk's
        queries are its own keys at consecutive positions (training, a prefill), i - j takes T values, and for a query
        within the threshold (i <= L) x depends on i - j alone: those rows are a gather from the MLP run on the T
        distances, as bias-RPE's are, the same values. Only the queries past L (a suffix: positions ascend) need the
        MLP on each of their pairs, normalised by their own position."""
        layer, pos = first // n_head, chunk.pos
        c, threshold = self.c[layer].abs(), (self.L_multiplier[layer] * self.init_L).abs()
        w1, b1, w2 = self.w1[layer], self.b1[layer], self.w2[layer][:, None, None]  # (32,), (32,), (nh, 1, 1, 32)
        operands = (c, threshold, w1, b1, w2)

        def pairs(queries: torch.Tensor) -> Callable:  # the bias of these queries over every key: (nh, Tq, Tk)
            few = len(queries) * len(chunk.keys) <= self.few  # little to keep for the backward: nothing to recompute

            def f(c, threshold, w1, b1, w2):
                return self.mlp(self.input(c, threshold, queries[:, None], chunk.keys), w1, b1, w2, few=few)

            return recomputed(f, recompute and not few)

        if chunk.cached or not chunk.consecutive or len(pos) < 2:
            return pairs(pos)(*operands)
        T = len(pos)
        rel = (pos[:, None] - pos[None, :]).clamp(min=0)  # (T, T): 0 … T - 1

        def by_distance(c, threshold, w1, b1, w2, rows: int = T):  # the first `rows` queries, within L
            d = torch.arange(T, device=pos.device)
            table = self.mlp(self.input(c, threshold, d, 0), w1, b1, w2[:, 0], few=T <= self.few)  # (nh, T): L >= d
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


POS_ENCODINGS = {
    "sinusoidal": Sinusoidal,
    "learned": Learned,
    "bias_rpe": BiasRPE,
    "t5": T5,
    "kerple": Kerple,
    "rope": RoPE,
    "alibi": ALiBi,
    "fire": FIRE,
    "none": NoPE,
}


# ----------------------------------------------------------------------------------------------------------------
# The config: the model's shape, and every encoding's options (declared by the encoding, gathered here)


@dataclass
class ModelShape:
    """GPTConfig's fields that every model has; GPTConfig adds each encoding's options."""

    block_size: int = 1024  # training context length (the most a `learned` model can take)
    vocab_size: int = 50304  # GPT-2's 50257, padded up to a multiple of 64 for speed
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True  # biases in Linears and LayerNorms, like GPT-2; False is a bit better and faster
    pos_encoding: str = "learned"  # a name of POS_ENCODINGS
    gelu: str = "exact"  # exact (nanoGPT's, faster on CPU) | tanh (GPT-2's own; from_hf uses it)

    def __post_init__(self):
        if self.pos_encoding not in POS_ENCODINGS:
            raise ValueError(
                f"pos_encoding={self.pos_encoding!r} is not a positional encoding; "
                f"valid choices: {', '.join(POS_ENCODINGS)}"
            )
        for name in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd"):
            if problem := positive_int(getattr(self, name)):
                raise ValueError(f"{name}={getattr(self, name)!r} {problem}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout={self.dropout!r} must be in [0, 1)")
        if self.gelu not in ("exact", "tanh"):
            raise ValueError(f"gelu={self.gelu!r} is not a GELU; valid choices: exact, tanh")


# every encoding's options by name, with the encoding they belong to
ENCODING_OPTIONS: dict[str, tuple[str, Option]] = {
    name: (enc, opt) for enc, cls in POS_ENCODINGS.items() for name, opt in cls.options.items()
}


@dataclass
class GPTConfig(ModelShape):
    """The model's shape (ModelShape) and every encoding's options, each a field of its own name. The encodings
    declare their options (ENCODING_OPTIONS: default, help, check); these fields repeat the names and defaults so a
    reader and an editor see them, and a test holds the two equal. Only the chosen encoding's options are checked."""

    rpe_max_distance: int | None = None  # bias_rpe: distances clamp to ±(r_max - 1); None: block_size // 2
    t5_num_buckets: int = 32  # t5: biases per head, half exact distances, half log-spaced
    t5_max_distance: int | None = None  # t5: farther distances share the last bucket; None: block_size // 2
    kerple_per_layer: bool = False  # kerple: (r1, r2) of each layer's own; False: shared by the layers
    rope_base: float = 10000.0  # rope: θ_k = base^(-2k/d)
    rope_fraction: float = 1.0  # rope: the fraction of each head's pairs that rotate (p-RoPE below 1)
    rope_scaling: str = "none"  # rope: none | linear | ntk | dynamic_ntk | yarn | llama3 (ROPE_SCALINGS)
    rope_factor: float = 1.0  # rope: the scaling's s, the context stretched s times
    rope_original_max_len: int | None = None  # rope: the scaling's L0; None: block_size

    def __post_init__(self):
        super().__post_init__()
        POS_ENCODINGS[self.pos_encoding].resolve(self)  # the chosen encoding's options: derived defaults, checks


# ----------------------------------------------------------------------------------------------------------------
# A chunk's positions, and the KV cache


@dataclass(frozen=True)
class Chunk:
    """The positions of one forward's chunk of tokens, derived once (GPT._chunk) and read by everything positional
    after it: the embedding and RoPE read `pos`; the mask and the bias compare `pos` with `keys`, so cached keys line
    up whatever Tq and Tk are and whatever slot holds them; attention_path reads the facts."""

    pos: torch.Tensor  # (T,) the tokens' absolute positions, the queries'
    keys: torch.Tensor  # (Tk,) the keys' positions: pos, or with a cache every slot's (KVCache.EMPTY where unused)
    slots: torch.Tensor | None  # (T,) the cache slots the chunk's keys and values go to; None without a cache
    window: int | None  # query i sees key j only where i - j < window; None: every key up to its own position
    consecutive: bool  # the positions step by one, so that a band of i - j is a band of distances

    @property
    def cached(self) -> bool:
        """The keys come from a KV cache (they are not the queries' own)."""
        return self.slots is not None

    def sees(self, rel: torch.Tensor) -> torch.Tensor:
        """Whether a query sees a key at i - j = rel (an int tensor): causal, and inside the window if there is one."""
        return rel >= 0 if self.window is None else (rel >= 0) & (rel < self.window)


class KVCache:
    """Preallocated keys (after rotation) and values of every layer, each (B, nh, S, hs), in a ring of S slots:
    position p lives in slot p % S, and `pos` (S,) holds each slot's absolute position (EMPTY, in the future of
    every query, where unused). Fixed shapes and in-place writes let a compiled decode step run as one CUDA graph.

    Its bookkeeping changes in one method, `claim`, which the model calls once per chunk before the forward that
    writes it (GPT._chunk); `update` writes a layer's keys and values into the slots claim returned.

    Writing a chunk of T tokens evicts the S keys before them, so with a window W a chunk of up to S - W + 1
    tokens stays exact (the model splits longer ones); without a window the cache holds S tokens in all.
    Positions must be consecutive, as they are when `pos` is left to the model."""

    EMPTY = 2**62

    def __init__(self, n_layer: int, size: int):
        if size < 1:
            raise ValueError(f"KVCache size={size} must be a positive number of slots")
        self.size = size
        self.k: list[torch.Tensor | None] = [None] * n_layer
        self.v: list[torch.Tensor | None] = [None] * n_layer
        self.pos: torch.Tensor | None = None  # (S,) absolute position held by each slot
        self.next_pos = 0  # absolute position of the next token
        self.length = 0  # tokens written so far

    def max_chunk(self, T: int, window: int | None) -> int:
        """The most tokens one forward may write without evicting a key that one of its queries needs (the model splits
        a longer chunk); a ValueError where the cache cannot serve the window, or has no room for T more tokens."""
        if window is not None and self.size < window:
            raise ValueError(f"a KV cache of {self.size} slots cannot serve a window of {window} tokens")
        if window is None and self.length + T > self.size:
            raise ValueError(
                f"the KV cache holds {self.size} tokens and has {self.length}; {T} more do not fit "
                "(make a bigger cache, or pass a window to roll it)"
            )
        return self.size - self.length if window is None else self.size - window + 1

    def claim(self, pos: torch.Tensor, last: int) -> torch.Tensor:
        """Take the slots of a chunk at positions pos (T,), the last of them `last` (a host int, so counting needs no
        sync), and count its tokens; return the slots (T,). `self.pos` then holds the keys' positions."""
        if self.pos is None:
            self.pos = torch.full((self.size,), self.EMPTY, dtype=torch.long, device=pos.device)
        slots = pos % self.size
        self.pos.index_copy_(0, slots, pos)
        self.next_pos, self.length = last + 1, self.length + len(pos)
        return slots

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write one layer's k, v (B, nh, T, hs) into the chunk's slots (T,) and return every slot's keys and values."""
        if self.k[layer] is None:
            shape = (k.size(0), k.size(1), self.size, k.size(3))
            self.k[layer] = torch.zeros(shape, dtype=k.dtype, device=k.device)
            self.v[layer] = torch.zeros(shape, dtype=v.dtype, device=v.device)
        self.k[layer].index_copy_(2, slots, k)
        self.v[layer].index_copy_(2, slots, v)
        return self.k[layer], self.v[layer]


# ----------------------------------------------------------------------------------------------------------------
# Attention paths: which kernel computes attention, chosen once per forward by one table (attention_path) from the
# model's AttentionOptions and the chunk's facts, and built by that path's builder (ATTENTION_BUILDERS)


@dataclass(frozen=True)
class AttentionOptions:
    """What attention_path reads from the user, held as `model.attention_options`. To change it (train.py's kernel
    fallbacks), replace it: model.attention_options = dataclasses.replace(model.attention_options, fused=False).

    fused: a score bias through FlexAttention. None (the default): where it is fused and has a backward, compiled on
    CUDA. True: wherever the table allows it. False: never, and no BiasAttention either: the materialized reference
    path for every bias (a fallback that always compiles).
    flex_kernel_options: FlexAttention's Triton options, e.g. {"num_stages": 1} (less shared memory per block);
    None: its defaults."""

    fused: bool | None = None
    flex_kernel_options: dict | None = None


def attention_path(
    options: AttentionOptions,
    *,
    bias: bool,
    band: bool,
    trainable: bool,
    window: bool,
    cached: bool,
    consecutive: bool,
    device: str,
    compiling: bool,
    dropout: bool,
    fits: bool,
) -> str:
    """The kernel that computes attention: the first row of this table that matches.

    | score bias | fused      | its gradient     | cache | device, compile | dropout | window | path           |
    |------------|------------|------------------|-------|-----------------|---------|--------|----------------|
    | none       | ·          | ·                | no    | ·               | ·       | no     | sdpa_causal    |
    | a band one | yes, fits  | yes, consecutive | no    | ·               | no      | ·      | flex_band      |
    | any        | yes, fits  | none             | ·     | ·               | no      | ·      | flex           |
    | any        | not False  | yes              | ·     | CPU, eager (1)  | no      | ·      | bias_attention |
    | every other case                                                                      | sdpa_mask      |

    - sdpa_causal: SDPA with is_causal (its flash kernel): no bias, and the keys are the queries' own.
    - flex_band: FlexAttention reads the bias as a constant, and BandBiasGrad gives its table the gradient from a
      band of distances. FlexAttention's own gradient for a bias parameter adds every (query, key) pair's share into
      the table's few entries with atomics, which serialise, and can need more shared memory than a GPU has per
      block: so a trainable bias is fused only as a band bias, its positions stepping by one (the band reads i - j as
      a distance), without a cache. Other trainable biases (KERPLE, FIRE) take a materialized path.
    - flex: FlexAttention, the encoding's bias as its score_mod, under a block mask.
    - bias_attention: BiasAttention over the materialized bias: SDPA's CPU flash kernel, which gives a bias no
      gradient, with a backward that does. (1) Compiled too where the keys are the queries' own (consecutive, no
      cache): then its backward's blocks have sizes known before the data, so Dynamo traces it (faster than the math
      path inductor fuses for bias-RPE and FIRE, as fast for KERPLE: BENCHMARKS.md); elsewhere compiled takes
      sdpa_mask.
    - sdpa_mask: SDPA under a materialized bool mask (Tq, Tk), or float bias with -inf (nh, Tq, Tk): the reference.

    The facts (bools, but device: "cpu", "cuda", ...): bias, the encoding adds a score bias (has_bias); band, that bias
    depends on i - j alone and is one constant from some distance on (bias_span); trainable, it has parameters and
    autograd is recording; window and cached, a sliding window or a KV cache (keys that are not the queries' own);
    consecutive, the positions step by one; compiling, torch.compile is tracing; dropout, training with dropout > 0
    (neither fused kernel has it); fits, FlexAttention takes this head dim on this device (flex_fits).
    fused is options.fused, and where that is None, compiling on CUDA: FlexAttention is a fused kernel only when
    compiled, and has no backward on a CPU."""
    fused = (compiling and device == "cuda") if options.fused is None else options.fused
    if not bias and not window and not cached:
        return "sdpa_causal"
    flex = bias and fused and not dropout and fits
    own_keys = consecutive and not cached  # the keys are the queries' own: key j is query j
    if flex and trainable and band and own_keys:
        return "flex_band"
    if flex and not trainable:
        return "flex"
    if (
        bias
        and trainable
        and device == "cpu"
        and (own_keys or not compiling)
        and not dropout
        and options.fused is not False
    ):
        return "bias_attention"
    return "sdpa_mask"


FLEX_MIN_HEAD_DIM = 16  # on CUDA: Triton's tl.dot needs at least 16
# what attention does where the fused kernel cannot be used: the last kernel fallback, and a head dim under the minimum
MATERIALIZED = "attention adds a materialized bias instead (slower, memory quadratic in the context)"


def flex_fits(head_dim: int, device_type: str) -> bool:
    """Whether FlexAttention takes this head dim on this device (GPT.fused_attention_note tells the user why not)."""
    return device_type != "cuda" or head_dim >= FLEX_MIN_HEAD_DIM


# The builders, one per path: (chunk, bias, dropout_p, kernel_options) -> attention, a function (q, k, v) -> y of
# q (B, nh, Tq, hs) and k, v (B, nh, Tk, hs) whose every path compares absolute positions (chunk.pos, chunk.keys).
# Built once per forward (per layer for a per-layer bias), so what it materializes is shared by the layers.


# eq=False: hashed by identity. Dynamo (torch 2.11) hashes an object it calls, and a field-wise hash of one built
# while tracing fails: its fields are not on the object yet
@dataclass(frozen=True, eq=False)
class LayerBias:
    """The encoding's score bias as one layer's attention adds it: bias(h, i, j) for the layer's heads h = 0 … nh - 1
    (a per-layer encoding's bias counts every layer's heads: this layer's start at `first`)."""

    encoding: PositionalEncoding
    n_head: int
    first: int  # the layer's first head in encoding.bias: layer·n_head for a per-layer bias, else 0
    trainable: bool  # autograd records the encoding's parameters

    def __call__(self, h: torch.Tensor, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor | None:
        return self.encoding.bias(h + self.first, i, j)

    def matrix(self, chunk: Chunk) -> torch.Tensor:
        """The layer's (nh, Tq, Tk) bias over the chunk's queries and keys, recomputed in the backward if trainable."""
        return self.encoding.layer_bias(self.first, self.n_head, chunk, recompute=self.trainable)


def sdpa_causal(chunk: Chunk, bias: LayerBias, dropout_p: float, kernel_options: dict | None) -> Callable:
    return lambda q, k, v: attend(q, k, v, None, dropout_p)


def flex_band(chunk: Chunk, bias: LayerBias, dropout_p: float, kernel_options: dict | None) -> Callable:
    # the kernel reads the bias as a constant table of distances 0 … R, BandBiasGrad gives the table its gradient
    R, device, pos, keys = bias.encoding.bias_span, chunk.pos.device, chunk.pos, chunk.keys
    table = bias(torch.arange(bias.n_head, device=device)[:, None], torch.arange(R + 1, device=device)[None], 0)
    frozen = table.detach()  # (nh, R + 1)
    score_mod = lambda s, b, h, i, j: s + frozen[h, (pos[i] - keys[j]).clamp(0, R)].to(s.dtype)  # noqa: E731
    block_mask = flex_block_mask(chunk)

    def attention(q, k, v):
        y, lse = flex_attention_lse(q, k, v, score_mod, block_mask, kernel_options)
        return BandBiasGrad.apply(y, lse, q, k, v, table, chunk.window)

    return attention


def flex(chunk: Chunk, bias: LayerBias, dropout_p: float, kernel_options: dict | None) -> Callable:
    pos, keys = chunk.pos, chunk.keys
    score_mod = lambda s, b, h, i, j: s + bias(h, pos[i], keys[j]).to(s.dtype)  # noqa: E731
    block_mask = flex_block_mask(chunk)
    return lambda q, k, v: flex_attention(
        q, k, v, score_mod=score_mod, block_mask=block_mask, kernel_options=kernel_options
    )


def bias_attention(chunk: Chunk, bias: LayerBias, dropout_p: float, kernel_options: dict | None) -> Callable:
    scores = materialized(chunk, bias)  # (nh, Tq, Tk)
    own_keys = chunk.consecutive and not chunk.cached  # key j is query j: query i sees keys 0 … i at most
    function = OwnKeysBiasAttention if own_keys else BiasAttention
    return lambda q, k, v: function.apply(q, k, v, scores.to(q.dtype))


def sdpa_mask(chunk: Chunk, bias: LayerBias, dropout_p: float, kernel_options: dict | None) -> Callable:
    mask = materialized(chunk, bias)
    return lambda q, k, v: attend(q, k, v, mask, dropout_p)


# attention_path's answers, each the name of the builder it picks: the one list of the paths
ATTENTION_BUILDERS = {build.__name__: build for build in (sdpa_causal, flex_band, flex, bias_attention, sdpa_mask)}
ATTENTION_PATHS = tuple(ATTENTION_BUILDERS)


def flex_block_mask(chunk: Chunk):
    """FlexAttention's block mask for the chunk: which (query, key) blocks hold any pair a query sees."""
    pos, keys = chunk.pos, chunk.keys
    return create_block_mask(
        lambda b, h, i, j: chunk.sees(pos[i] - keys[j]), None, None, len(pos), len(keys), device=pos.device
    )


def materialized(chunk: Chunk, bias: LayerBias) -> torch.Tensor:
    """The reference paths' mask: the bias (nh, Tq, Tk) float32 with -inf where a query does not see a key, or without
    a bias the bool mask (Tq, Tk)."""
    rel = chunk.pos[:, None] - chunk.keys[None, :]  # (Tq, Tk): i - j
    allowed = chunk.sees(rel)
    if not bias.encoding.has_bias:
        return allowed
    scores = bias.matrix(chunk)
    return scores.masked_fill(~allowed, float("-inf"))


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, dropout_p: float = 0.0
) -> torch.Tensor:
    """SDPA of q (B, nh, Tq, hs) over k, v (B, nh, Tk, hs): causal within the chunk (mask None), or under a
    materialized bool mask or float bias (nh or 1, Tq, Tk)."""
    if mask is None:  # plain causal attention over this chunk alone: SDPA's fused (flash) path
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
    if mask.dtype == torch.bool or q.dtype not in (torch.float16, torch.bfloat16):  # reference path: a mask or bias,
        # (nh or 1, Tq, Tk); 4-D, so CPUs take their flash kernel
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[None], dropout_p=dropout_p)
    # a float32 bias with bf16/fp16 q: SDPA would round the bias to q's dtype (ALiBi's -m·3000 to steps of 1/16 where
    # m = 1/256), while FlexAttention adds it in float32. Attend in float32, so evaluation sees training's bias.
    with torch.autocast(q.device.type, enabled=False):
        y = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask[None], dropout_p=dropout_p)
    return y.to(q.dtype)


# Kernel fallbacks: a fused attention kernel that the compiler cannot build for this model on this GPU (Triton's shared
# memory, an unsupported shape) is replaced, never a crash. In order: the same kernel with one pipeline stage (less
# shared memory per block, which is what a bias's kernels run out of first: e.g. 245,760 bytes asked of an H200's
# 232,448 for bias-RPE at GPT-2 124M, block 1024, bf16), then a materialized bias (always compiles). Each replaces
# fields of the model's AttentionOptions.
KERNEL_FALLBACKS = [
    (
        "FlexAttention retries with kernel_options num_stages=1 (less shared memory)",
        {"flex_kernel_options": {"num_stages": 1}},
    ),
    (MATERIALIZED, {"fused": False}),
]


def compiler_failure(e: BaseException | None) -> bool:
    """Whether e, or an exception it came from, is the compiler's (Dynamo's backend, Inductor, Triton): a kernel that
    could not be built for these shapes on this GPU, not a mistake in the model or its inputs."""
    from torch._dynamo.exc import BackendCompilerFailed
    from torch._inductor import exc as inductor_exc  # imported here: torch does not load inductor until it compiles

    kinds = (BackendCompilerFailed, getattr(inductor_exc, "InductorError", BackendCompilerFailed))
    while e is not None:
        name = f"{type(e).__module__}.{type(e).__name__}"
        if isinstance(e, kinds) or name.startswith("triton.") or name.endswith("NoTritonConfigsError"):
            return True
        e = e.__cause__ or e.__context__
    return False


def fall_back(model: GPT, error: BaseException) -> str | None:
    """If error is the compiler failing to build the fused attention kernel that the default options chose, move
    model.attention_options to the next of KERNEL_FALLBACKS and say what changed (one line); None where there is
    nothing to fall back from or to (the caller re-raises)."""
    options = model.attention_options
    if not (model.encoding.has_bias and options.fused is None and compiler_failure(error)):
        return None
    for what, settings in KERNEL_FALLBACKS:
        if any(getattr(options, k) != v for k, v in settings.items()):
            model.attention_options = replace(options, **settings)
            first_line = next((ln for ln in str(error).splitlines() if ln.strip()), type(error).__name__)[:200]
            return f"the fused attention kernel (FlexAttention) failed to compile ({first_line}); {what}"
    return None


def with_kernel_fallbacks(model: GPT, step: Callable, before_retry: Callable | None = None, log=print):
    """step(), and where the fused attention kernel cannot be compiled, step() again after each fallback (fall_back)
    in turn, one log line each: slower, never a crash. before_retry() puts back what the failed step changed (train.py:
    the sampler, the gradients) and re-wraps the model if the caller compiled a wrapper. A fallback that worked stays
    on the model."""
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
# The transformer


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig, layer_idx: int):
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # q, k, v for all heads
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head, self.n_embd = config.n_head, config.n_embd
        self.layer_idx = layer_idx

    def forward(self, x, rope, attention, cache=None, slots=None):
        """attention: (q, k, v) -> y, from GPT._attention_fn (the path is chosen there, once per forward); with a
        cache, k and v go to the chunk's slots (T,) and attention reads every slot's."""
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v, slots)  # (B, nh, Tk, hs)
        y = attention(q, k, v)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU(approximate="tanh" if config.gelu == "tanh" else "none")
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig, layer_idx: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config, layer_idx)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x, rope, attention, cache=None, slots=None):
        x = x + self.attn(self.ln_1(x), rope, attention, cache, slots)
        return x + self.mlp(self.ln_2(x))


# ----------------------------------------------------------------------------------------------------------------
# The GPT

# GPT-2's weights that transformers' Conv1D stores (in, out), transposed from nn.Linear's (out, in): from_hf and
# export.py's GPT-2 export read them
CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=POS_ENCODINGS[config.pos_encoding](config),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config, i) for i in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # tied embeddings
        self.attention_options = AttentionOptions()  # what attention_path reads; replaced, never edited
        self.engine = Engine(self)  # generation: the KV cache's lifecycle and the one-token decode step
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2's scaled init of the residual projections
            if name.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @property
    def encoding(self) -> PositionalEncoding:
        """The positional encoding module (stored as transformer.wpe, GPT-2's name, so checkpoints keep their keys)."""
        return self.transformer.wpe

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def get_num_params(self, non_embedding: bool = True) -> int:
        """Parameter count; by default without the position table (the token table is tied to lm_head)."""
        n = sum(p.numel() for p in self.parameters())  # parameters() yields the tied table once
        return n - self.encoding.position_params() if non_embedding else n

    def crop_block_size(self, block_size: int) -> None:
        """Shrink the training context (e.g. GPT-2's 1024 to 256): a table of positions drops its rows."""
        assert block_size <= self.config.block_size
        self.config.block_size = block_size
        self.encoding.crop(block_size)

    def extend_block_size(self, block_size: int) -> None:
        """Lengthen the training context (a run fine-tuned longer, train.py --init_from=<run>): a table of positions
        is interpolated to the new length; every other encoding reads any length already."""
        assert block_size >= self.config.block_size
        self.config.block_size = block_size
        self.encoding.extend(block_size)

    def configure_optimizers(
        self,
        weight_decay: float,
        learning_rate: float,
        betas: tuple[float, float],
        device_type: str,
        pe_lr_scale: float = 1.0,
    ) -> torch.optim.AdamW:
        """AdamW with weight decay on matrices and embeddings only: not on biases, norms, or attention-score biases
        (bias-RPE's table is 2-D but a bias). pe_lr_scale != 1 puts the encoding's parameters in groups of their own
        whose "lr_scale" multiplies the schedule's rate (train.py applies it): Adam moves each parameter by about the
        learning rate per step, so a bias table that starts at zero can reach only about the sum of the rates."""
        score_biases = {id(p) for p in self.encoding.no_decay()}
        encoding = {id(p) for p in self.encoding.parameters()} if pe_lr_scale != 1.0 else set()
        groups = {}
        for p in self.parameters():
            if p.requires_grad:
                decay, scaled = p.dim() >= 2 and id(p) not in score_biases, id(p) in encoding
                groups.setdefault((decay, scaled), []).append(p)
        return torch.optim.AdamW(
            [
                {
                    "params": ps,
                    "weight_decay": weight_decay if decay else 0.0,
                    "lr_scale": pe_lr_scale if scaled else 1.0,
                }
                for (decay, scaled), ps in sorted(groups.items(), key=lambda kv: (not kv[0][0], kv[0][1]))
            ],
            lr=learning_rate,
            betas=betas,
            fused=device_type == "cuda",
        )

    def forward_bytes(self, L: int, B: int = 1, logits: bool = True) -> int:
        """The least memory a forward of B windows of L tokens takes without gradients: the hidden states and the
        MLP's (fp32, a layer at a time), the logits and the loss's copy, and for an encoding with a bias the (nh, L, L)
        bias and the (L, L) distances that the reference attention path materializes (once for the batch). A forward
        that needs more than the device has cannot run at all."""
        c = self.config
        square = (4 * c.n_head + 9) * L * L if self.encoding.has_bias else 0
        return B * L * (32 * c.n_embd + (8 * c.vocab_size if logits else 0)) + square

    def estimate_mfu(self, tokens_per_iter: int, dt: float, peak_flops: float) -> float:
        """Model FLOPs utilization: achieved FLOP/s over peak_flops, counting 6N per token for the weights plus
        attention's 12·L·H·Q·T (PaLM, Chowdhery et al. 2022, App. B)."""
        cfg = self.config
        L, H, Q, T = cfg.n_layer, cfg.n_head, cfg.n_embd // cfg.n_head, cfg.block_size
        flops_per_token = 6 * self.get_num_params() + 12 * L * H * Q * T
        return flops_per_token * tokens_per_iter / dt / peak_flops

    # ------------------------------------------------------------------------------------------------------------
    # Forward: the chunk's positions, the hidden states, the attention function each forward picks, logits and loss

    def features(
        self,
        idx: torch.Tensor,
        pos: torch.Tensor | None = None,
        cache: KVCache | None = None,
        window: int | None = None,
    ) -> torch.Tensor:
        """Final hidden states (B, T, C) for tokens idx (B, T) at absolute positions pos (T,).

        pos defaults to arange(T), or continues the cache. With a cache, queries attend to the cached keys too.
        With a window W, query i sees only keys j with i - j < W (a sliding-window causal mask).
        """
        T = idx.size(1)
        if cache is not None and T > (step := cache.max_chunk(T, window)):
            # split so that no chunk evicts a key its own queries need: exact
            chunks = [(idx[:, i : i + step], None if pos is None else pos[i : i + step]) for i in range(0, T, step)]
            return torch.cat([self.features(x, p, cache, window) for x, p in chunks], dim=1)
        return self._features(idx, self._chunk(T, pos, cache, window, idx.device), cache)

    def _chunk(self, T, pos, cache, window, device) -> Chunk:
        """The Chunk of T tokens at positions pos (None: the next T), checked against the encoding, its slots in the
        cache claimed. The one place that advances a cache (KVCache.claim): both features() and the Engine's decode
        step come through here before their forward."""
        start = cache.next_pos if cache is not None else 0
        explicit_pos = pos is not None
        if pos is None:
            pos = torch.arange(start, start + T, device=device)
        last = int(pos.max()) if explicit_pos else start + T - 1  # .max() syncs: only for explicit positions
        pe = self.encoding
        if not pe.reaches(last + 1):
            raise ValueError(
                f"pos_encoding={self.config.pos_encoding!r} has no position past block_size={pe.max_len} "
                f"(asked for position {last}); feed at most {pe.max_len} tokens, or use an encoding that "
                f"extrapolates ({', '.join(n for n, c in POS_ENCODINGS.items() if c.extrapolates)})"
            )
        span = last + 1 if window is None else min(last + 1, window)
        if cache is not None and not pe.cache_exact(span):
            raise ValueError(
                f"this encoding changes every key as the length grows past {pe.cache_span} (here {span}; RoPE's "
                "dynamic_ntk scaling does), so no KV cache can be exact there; run without a cache (generate() does "
                "so by itself)"
            )
        # the band gradient reads i - j as the distance: true of positions that step by one (a range), not of any pos
        consecutive = not explicit_pos or T == 1 or bool((pos.diff() == 1).all())
        if cache is None:
            return Chunk(pos, keys=pos, slots=None, window=window, consecutive=consecutive)
        slots = cache.claim(pos, last)  # after the checks: a chunk refused leaves the cache as it was
        return Chunk(pos, keys=cache.pos, slots=slots, window=window, consecutive=consecutive)

    def _features(self, idx: torch.Tensor, chunk: Chunk, cache: KVCache | None) -> torch.Tensor:
        """features() without the host-side bookkeeping: tensor code only (the chunk's slots already claimed), so a
        decode step compiles to one graph."""
        pe = self.encoding
        x = self.transformer.wte(idx)  # (B, T, C)
        emb = pe.embed(chunk.pos)
        if emb is not None:
            x = x + emb.to(x.dtype)  # a float32 table must not turn a bf16 model's activations to float32
        x = self.transformer.drop(x)
        layers = range(self.config.n_layer) if pe.per_layer else [0]
        attentions = [self._attention_fn(chunk, layer) for layer in layers]
        rope = pe.rotary(chunk.pos, chunk.window)
        for i, block in enumerate(self.transformer.h):
            x = block(x, rope, attentions[i % len(attentions)], cache, chunk.slots)
        return self.transformer.ln_f(x)

    def _attention_fn(self, chunk: Chunk, layer: int = 0) -> Callable:
        """Attention as one function (q, k, v) -> y for this forward: the path attention_path picks for the model's
        options and the chunk's facts, built by that path's builder. layer picks a per-layer bias's heads."""
        pe, cfg, device = self.encoding, self.config, chunk.pos.device
        trainable = torch.is_grad_enabled() and any(p.requires_grad for p in pe.parameters())
        path = attention_path(
            self.attention_options,
            bias=pe.has_bias,
            band=pe.bias_span is not None,
            trainable=trainable,
            window=chunk.window is not None,
            cached=chunk.cached,
            consecutive=chunk.consecutive,
            device=device.type,
            compiling=torch.compiler.is_compiling(),
            dropout=self.training and cfg.dropout > 0,
            fits=flex_fits(cfg.n_embd // cfg.n_head, device.type),
        )
        bias = LayerBias(pe, cfg.n_head, layer * cfg.n_head if pe.per_layer else 0, trainable)
        dropout_p = cfg.dropout if self.training else 0.0
        return ATTENTION_BUILDERS[path](chunk, bias, dropout_p, self.attention_options.flex_kernel_options)

    def fused_attention_note(self, device_type: str) -> str | None:
        """For the user: why the fused bias kernel (FlexAttention) cannot take this model's shapes on this device, and
        what attention does instead; None where it can (flex_fits)."""
        hs = self.config.n_embd // self.config.n_head
        if flex_fits(hs, device_type):
            return None
        return (
            f"FlexAttention needs a head dim of at least {FLEX_MIN_HEAD_DIM} on CUDA (this model has {hs}): "
            + MATERIALIZED
        )

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        pos: torch.Tensor | None = None,
        cache: KVCache | None = None,
        window: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits (B, T, vocab_size) for every position and, given targets (B, T; -1 is ignored), the loss."""
        logits = self.lm_head(self.features(idx, pos, cache, window))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.flatten(0, 1), targets.reshape(-1), ignore_index=-1)
        return logits, loss

    def set_rope_scaling(self, scaling: str, factor: float = 1.0, original_max_len: int | None = None) -> None:
        """Switch RoPE's scaling at inference, no weight changes (e.g. yarn, factor 4: read 4x the training length).
        original_max_len (L0) defaults to the config's, else block_size: the length the model was trained at."""
        if not self.encoding.rope_scalable:
            raise ValueError(f"rope_scaling applies to RoPE, not pos_encoding={self.config.pos_encoding!r}")
        L0 = original_max_len or self.config.rope_original_max_len
        self.config = replace(self.config, rope_scaling=scaling, rope_factor=factor, rope_original_max_len=L0)
        self.transformer.wpe = type(self.encoding)(self.config)  # RoPE holds no weights: nothing is lost
        self.engine = Engine(self)  # its compiled step was traced with the old encoding

    # ------------------------------------------------------------------------------------------------------------
    # Generation: the Engine's (below), here where nanoGPT's callers find it

    def generate(self, idx: torch.Tensor, max_new_tokens: int, *args, **kwargs) -> torch.Tensor:
        """Extend idx (B, T) by max_new_tokens sampled tokens: Engine.generate, which lists the options."""
        return self.engine.generate(idx, max_new_tokens, *args, **kwargs)

    def context_window(self, max_context: int | None = None) -> int:
        """The longest context generation attends to: max_context, by default block_size (Engine.context_window)."""
        return self.engine.context_window(max_context)

    # ------------------------------------------------------------------------------------------------------------
    # GPT-2 weights

    @classmethod
    def from_hf(cls, hf_model, dropout: float = 0.0) -> GPT:
        """Build from a `transformers` GPT2LMHeadModel (learned positions, GPT-2's tanh GELU)."""
        c = hf_model.config
        if c.activation_function not in ("gelu_new", "gelu_pytorch_tanh"):
            raise ValueError(f"only GPT-2's tanh GELU is supported, this model uses {c.activation_function!r}")
        config = GPTConfig(
            block_size=c.n_positions,
            vocab_size=c.vocab_size,
            n_layer=c.n_layer,
            n_head=c.n_head,
            n_embd=c.n_embd,
            dropout=dropout,
            bias=True,
            pos_encoding="learned",
            gelu="tanh",
        )
        model = cls(config)
        sd, sd_hf = model.state_dict(), hf_model.state_dict()
        missing = [k for k in sd if k not in sd_hf]
        if missing:
            raise ValueError(f"the Hugging Face model lacks weights for {missing[:3]}…")
        with torch.no_grad():
            for k in sd:
                w = sd_hf[k]
                sd[k].copy_(w.t() if k.endswith(CONV1D_WEIGHTS) else w)
        return model

    @classmethod
    def from_pretrained(cls, model_type: str, dropout: float = 0.0) -> GPT:
        """GPT-2 weights ('gpt2', 'gpt2-medium', 'gpt2-large', 'gpt2-xl', or a local directory) via transformers;
        downloads when the hub is reachable."""
        from transformers import GPT2LMHeadModel

        return cls.from_hf(GPT2LMHeadModel.from_pretrained(model_type), dropout=dropout)


# ----------------------------------------------------------------------------------------------------------------
# Generation: the inference engine (nanochat's Engine, in this file): the KV cache's lifecycle, the one-token decode
# step (compiled on request), and sampling


class Engine:
    """Generation for one model (its `engine`). The model computes a chunk's logits, claiming the chunk's cache slots
    (GPT._chunk); the engine decides what each step feeds it: a prefill that starts a cache, one token through the
    decode step, or the whole window again where no cache can be exact."""

    def __init__(self, model: GPT):
        self.model = model
        self.compiled_step = None  # step, compiled for this model by the first generate(compile=True)

    def context_window(self, max_context: int | None = None) -> int:
        """The longest context generation attends to: max_context, by default block_size."""
        model = self.model
        W = model.config.block_size if max_context is None else max_context
        if not isinstance(W, int) or W < 1:
            raise ValueError(f"max_context={max_context!r} must be a positive integer")
        pe = model.encoding
        if not pe.reaches(W):
            raise ValueError(
                f"max_context={W} is longer than pos_encoding={model.config.pos_encoding!r} can take "
                f"(block_size={pe.max_len}); use max_context <= {pe.max_len}"
            )
        return W

    @torch.no_grad()
    def generate(
        self,
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
        """Extend idx (B, T) by max_new_tokens sampled tokens; temperature 0 is greedy.

        The model attends to at most max_context tokens (default block_size). Past that, the absolute encodings
        (sinusoidal, learned) crop to the last max_context tokens and restart positions at 0 (nanoGPT's semantics);
        the others keep a rolling cache whose keys keep their positions (a sliding-window causal mask), FIRE too,
        which reads positions past its training length by design. Without the cache every step re-runs the window,
        as nanoGPT does (FIRE's at its own positions). compile=True compiles the one-token decode step (on a GPU as a
        CUDA graph over the preallocated cache).
        """
        W = self.context_window(max_context)
        step = self.compiled(idx.device.type) if compile and use_cache else self.step
        cache, new = None, idx  # new: the tokens the model has not seen yet
        for _ in range(max_new_tokens):
            logits, started = self.next_logits(idx, new, cache, W, use_cache, step)  # cache None without one
            if compile and started is not cache:  # the cache's tensors keep their addresses: CUDA graphs need no copy
                for t in [started.pos, *started.k, *started.v]:
                    torch._dynamo.mark_static_address(t)
            cache, new = started, sample_next(logits, temperature, top_k, top_p, generator)  # new: (B, 1)
            idx = torch.cat([idx, new], dim=1)
        return idx

    def next_logits(
        self, idx: torch.Tensor, new: torch.Tensor, cache: KVCache | None, W: int, use_cache: bool = True, step=None
    ) -> tuple[torch.Tensor, KVCache | None]:
        """Logits (B, vocab_size) of the token after idx (B, T), whose last tokens `new` the cache has not read (at
        first the whole prompt), attending to at most W tokens; and the cache to pass next time. One of: the whole
        window again where no cache can be exact (none asked for; dynamic NTK past L0); a prefill that starts a cache
        (the first step; for a cropping encoding, whenever the window is full); one token through `step`."""
        model, pe = self.model, self.model.encoding
        T = idx.size(1)
        if not use_cache or not pe.cache_exact(min(T, W)):
            absolute = pe.rolling and not pe.relative and T > W  # FIRE reads the window at its own positions
            pos = torch.arange(T - W, T, device=idx.device) if absolute else None
            return model.lm_head(model.features(idx[:, -W:], pos=pos)[:, -1]), cache
        window = W if pe.rolling else None  # rolling: keys keep their positions; else crop to W, positions from 0
        if cache is None or (not pe.rolling and cache.next_pos + 1 > W):  # (re)start: prefill, eagerly
            # a rolling cache holds the window plus the longest chunk written at once (the prompt, in pieces of <= W)
            cache = KVCache(model.config.n_layer, W - 1 + min(new.size(1), W) if pe.rolling else W)
            return model.lm_head(
                model.features(new if pe.rolling else idx[:, -W:], cache=cache, window=window)[:, -1]
            ), cache
        # one token: _chunk claims its slot (host-side), then the step, compiled or not, on tensors
        return (step or self.step)(new, model._chunk(1, None, cache, window, idx.device), cache), cache

    def step(self, idx: torch.Tensor, chunk: Chunk, cache: KVCache) -> torch.Tensor:
        """Logits (B, vocab_size) of one new token idx (B, 1) at chunk.pos (1,), written to the chunk's cache slots
        (claimed by the caller) and attending to every slot: the unit compiled for fast decoding."""
        return self.model.lm_head(self.model._features(idx, chunk, cache)[:, -1])

    def compiled(self, device_type: str) -> Callable:
        """step, compiled once for this model."""
        if self.compiled_step is None:
            if device_type == "cuda":  # one CUDA graph per step, replayed over the static cache
                kw = dict(mode="reduce-overhead")
            else:  # batch-1 matmuls as fused multiply-reductions on every core, faster than MKL's GEMV
                kw = dict(options={"post_grad_fusion_options": {"decompose_mm_pass": {}}})
            # dynamo keeps compiled graphs, and its limit of 8 recompiles, per code object: a copy of the step's code
            # for each model, so that a process that compiles many models (a benchmark, a notebook) never reaches the
            # limit, which fullgraph=True makes an error
            code = Engine.step.__code__.replace()
            step = types.MethodType(types.FunctionType(code, Engine.step.__globals__), self)
            self.compiled_step = torch.compile(step, fullgraph=True, **kw)
        return self.compiled_step


def sample_next(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Sample one token per row of logits (B, V) -> (B, 1). temperature 0 is greedy; top_k keeps the k likeliest
    tokens, top_p the smallest set whose probability reaches p (Holtzman et al. 2019)."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits.float() / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = F.softmax(sorted_logits, dim=-1)
        drop = probs.cumsum(dim=-1) - probs >= top_p  # mass before this token already reaches p (keeps the first)
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return torch.multinomial(F.softmax(logits, dim=-1), num_samples=1, generator=generator)


# ----------------------------------------------------------------------------------------------------------------
# Attention kernels: hand-written autograd where PyTorch's own is too slow or too big. BiasAttention trains a bias
# on a CPU's flash kernel; BandBiasGrad gives a fused kernel's bias table its gradient from a band (linear in T);
# ScalarMLP is FIRE's MLP without one saved tensor per hidden unit.


def recomputed(fn: Callable, recompute: bool) -> Callable:
    """fn, or with recompute fn under activation checkpointing: its intermediates are not kept for the backward but
    computed again there."""
    if not recompute:
        return fn
    return lambda *args: checkpoint(fn, *args, use_reentrant=False)


def scalar_mlp(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """Σ_u relu(x·w1_u + b1_u)·w2_u over the hidden units u (the last dim of w1, b1, w2; their other dims broadcast
    against x's), one unit at a time: the memory of one output, not one per unit."""
    out = torch.relu(x * w1[..., 0] + b1[..., 0]) * w2[..., 0]
    for u in range(1, w1.size(-1)):
        out = out + torch.relu(x * w1[..., u] + b1[..., u]) * w2[..., u]
    return out


class ScalarMLP(torch.autograd.Function):
    """scalar_mlp with a gradient. Autograd would keep each unit's pre-activation, 32 bias-sized tensors; this keeps x
    and recomputes them one unit at a time in the backward."""

    @staticmethod
    def forward(ctx, x, w1, b1, w2):
        ctx.save_for_backward(x, w1, b1, w2)
        return scalar_mlp(x, w1, b1, w2)

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
        return gx.sum_to_size(x.shape), gw1, gb1, gw2


BIAS_ATTENTION_BLOCK = 64  # queries per block of BiasAttention's backward


class BiasAttention(torch.autograd.Function):
    """softmax(q·kᵀ/√hs + bias)·v with a gradient for the bias (nh, Tq, Tk; -inf where masked), on CPUs. SDPA's CPU
    flash kernel takes a bias but returns no gradient for it, so a trainable bias (bias-RPE) would need SDPA's
    unfused math path. Here the forward is the flash kernel, and the backward recomputes the probabilities from its
    log-sum-exp one block of queries at a time, skipping the keys no query of the block sees (half of them, causal):
    which those are, it reads from the mask."""

    @staticmethod
    def forward(ctx, q, k, v, bias):
        y, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=bias[None])
        ctx.save_for_backward(q, k, v, bias, y, lse)
        return y

    @staticmethod
    def backward(ctx, dy):
        return bias_attention_backward(ctx, dy, own_keys=False)


class OwnKeysBiasAttention(BiasAttention):
    """BiasAttention where the keys are the queries' own, in order (training, a prefill): a block of queries
    i0 … i1 - 1 sees keys before i1 at most, sizes known without reading the mask, so Dynamo traces the backward."""

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


def flex_attention_lse(q, k, v, score_mod, block_mask, kernel_options=None):
    """FlexAttention's output (B, nh, T, hs) and its natural-log log-sum-exp (B, nh, T), float32."""
    kw = dict(score_mod=score_mod, block_mask=block_mask, kernel_options=kernel_options)
    if AuxRequest is None:  # pragma: no cover (torch < 2.9)
        return flex_attention(q, k, v, return_lse=True, **kw)
    y, aux = flex_attention(q, k, v, return_aux=AuxRequest(lse=True), **kw)
    return y, aux.lse


class BandBiasGrad(torch.autograd.Function):
    """The identity on attention's output y, whose backward returns the gradient of a bias that depends on the distance
    i - j alone and is one constant from distance R on: table (nh, R + 1) holds the bias at distances 0 … R.

    FlexAttention can differentiate a bias read from a table, but it adds every (query, key) pair's dS into the few
    table entries with atomics, which serialise on them. The kernel here reads the table as a constant, and this
    backward computes the table's gradient from a band instead. dS = P ⊙ (dP - D) sums to zero over each row, so the
    shared far entry's gradient is minus the near ones' sum, and only the band 0 <= i - j < R is needed: q·k and dy·v
    there, in blocks of R queries against 2R keys, recomputing P from the kernel's log-sum-exp. Linear in T.
    Positions must be consecutive (the queries' and the keys' the same range), as in training; window as Chunk's."""

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
    """d loss / d table (nh, R + 1), see BandBiasGrad. q, k, v, y, dy (B, nh, T, hs); lse (B, nh, T); window: a query
    sees keys at i - j < window (None: every earlier key)."""
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
    return torch.cat([near_grad, -near_grad.sum(1, keepdim=True)], dim=1).to(table.dtype)
