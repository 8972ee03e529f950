"""nanoPE's model: a decoder-only GPT (GPT-2's) whose attention takes any encoding of POS_ENCODINGS,
or none; its decoding with generate.py's KV cache equals its full forward. Top to bottom: encodings,
config, chunk positions, attention, the transformer, the GPT; positions travel as a Chunk."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, make_dataclass, replace
from functools import partial
from typing import Any

import torch
import torch.nn as nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

# an export's folder is a package (transformers copies what `from .` imports); via the module, for
# tests' spies
try:
    from . import fast_paths
    from .fast_paths import AttentionOptions
    from .shape import (
        ModelShape,
        Option,
        at_most,
        boolean,
        finite,
        greater,
        number,
        one_of,
        optional,
        positive_int,
    )
except ImportError:
    import fast_paths
    from fast_paths import AttentionOptions
    from shape import (
        ModelShape,
        Option,
        at_most,
        boolean,
        finite,
        greater,
        number,
        one_of,
        optional,
        positive_int,
    )

# ---- Positional encodings: nothing outside this section names one; code asks the object or
# POS_ENCODINGS.


class PositionalEncoding(nn.Module):
    """The base of every encoding (no positions); a subclass overrides the hooks: `embed`, `rotary`,
    `score_bias`."""

    # depends on positions only through i - j: a rolling KV cache stays exact past the window
    relative = True
    # generation past the window keeps positions counting (a rolling cache); False: crop, restart at
    # 0
    rolling = True
    extrapolates = True  # has an encoding for any position (False: none past the block size)
    # adds a bias to attention scores, so SDPA's causal (flash) path cannot be used
    has_score_bias = False
    # the score bias is a function of i - j alone, one constant from this distance on
    far_distance = None
    max_length = math.inf  # the longest sequence it has positions for (a learned table's rows)
    cache_span = math.inf  # the longest span of positions a KV cache stays exact for
    # takes rope_scaling (set_rope_scaling, eval_length's and sample.py's --rope_scaling)
    rope_scalable = False
    # a score bias of each layer's own: h in score_bias(h, i, j) counts every layer's heads
    per_layer = False
    lr_scale = 1.0  # train.py's default pe_lr_scale: how many times faster its parameters learn
    # transformers' exact equivalent; None: export/hf.py ships nanoPE's own code
    hf_architecture: str | None = None
    # config key -> Option: GPTConfig has a field for each, train.py a key
    options: dict[str, Option] = {}
    # it overrides embed / rotary / forget (derived: the model calls no no-op)
    embeds = rotates = forgets = False
    summary = ""  # one line for --help

    def __init__(self, config: GPTConfig):
        super().__init__()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        overrides = lambda hook: getattr(cls, hook) is not getattr(PositionalEncoding, hook)  # noqa: E731
        cls.embeds = overrides("embed")
        cls.rotates = overrides("rotary")
        cls.forgets = overrides("forget")

    @classmethod
    def resolve(cls, config: GPTConfig) -> None:
        """Fill the options' derived defaults, check each and check(config): a ValueError naming
        rule and fix."""
        for name, opt in cls.options.items():
            if getattr(config, name) is None and opt.derive is not None:
                setattr(config, name, opt.derive(config))
            problem = opt.check(getattr(config, name))
            if problem:
                raise ValueError(f"{name}={getattr(config, name)!r} {problem}")
        cls.check(config)

    @classmethod
    def check(cls, config: GPTConfig) -> None:
        """Raise ValueError, naming the fix, where config cannot build this encoding (checks across
        options)."""

    def embed(self, pos: torch.Tensor) -> torch.Tensor | None:
        # (T,) -> (T, C); (B, T) -> (B, T, C) for positions of each row (packing="documents")
        return None

    def rotary(
        self, pos: torch.Tensor, window: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        # (T,) -> cos, sin, each (T, hs/2) float32, for apply_rotary; (B, T) -> each (B, 1, T, hs/2)
        return None

    def score_bias(self, h: torch.Tensor, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor | None:
        # head h, query position i, key position j: broadcastable int tensors -> float32 bias
        return None

    # or layer -> fast_paths.MLPBias: the score bias as a small MLP of each pair's input (FIRE's)
    layer_bias = None
    # or layer -> fast_paths.GateCounts: a bias of positions counted by gates of q·k (CoPE's)
    counts = None
    # its bias reads the layer's q, k or input (CoPE, FoX): content_bias, not score_bias
    reads_content = False

    def forget(self, layer: int, x: torch.Tensor) -> torch.Tensor | None:
        # the layer's input x (B, T, C) -> (B, nh, T) float64: what each token adds to a running sum
        return None

    def content_bias(self, layer: int, q, k, visible, order, sums) -> torch.Tensor | None:
        # q (B, nh, bq, hs) over k (B, nh, nk, hs), where each sees (visible), the keys' order by
        # position (None: in
        # order), forget's running sums at q and k ((B, nh, bq), (B, nh, nk)) -> (B, nh, bq, nk)
        # float32
        return None

    def no_decay(self) -> list[nn.Parameter]:
        """Parameters AdamW must not decay: a score bias's (a decayed bias is pulled toward "no
        preference")."""
        return list(self.parameters()) if self.has_score_bias else []

    def position_params(self) -> int:
        """Parameters that are a table of positions (left out of the model's size, as nanoGPT
        does)."""
        return 0

    def crop(self, block_size: int) -> None:
        """Shrink the training context: a table of positions drops its rows."""

    def extend(self, block_size: int) -> None:
        """Lengthen the training context (a run extended to a longer block): a table of positions
        gains rows."""


class NoPE(PositionalEncoding):
    """No positional information: the causal mask alone orders tokens (Kazemnejad et al. 2023)."""

    summary = "no positions: the causal mask alone orders tokens (NoPE)"
    hf_architecture = "gpt2"


class Sinusoidal(PositionalEncoding):
    """Sin/cos of the position added to the tokens (Vaswani et al. 2017, §3.5), /√C lest it drown
    GPT-2's tokens."""

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
            raise ValueError(
                "pos_encoding='sinusoidal' needs an even n_embd (sin/cos pairs), "
                f"got {config.n_embd}"
            )

    def embed(self, pos):
        inv_freq = 10000.0 ** (
            -torch.arange(0, self.n_embd, 2, device=pos.device, dtype=torch.float32) / self.n_embd
        )
        # (T, C/2), or (B, T, C/2) for positions of each row
        angle = pos.float()[..., None] * inv_freq
        # (T, C): sin on even dims, cos on odd
        pe = torch.stack([angle.sin(), angle.cos()], dim=-1).flatten(-2)
        return pe / math.sqrt(self.n_embd)


class Learned(PositionalEncoding):
    """A trainable table of absolute positions, GPT-2's `wpe` (Radford et al. 2019): a row per
    position < block_size."""

    summary = "a trainable table of positions added to the token embeddings (GPT-2's)"
    hf_architecture = "gpt2"

    relative = False
    rolling = False
    extrapolates = False

    def __init__(self, config: GPTConfig):
        super().__init__(config)
        self.weight = nn.Parameter(torch.randn(config.block_size, config.n_embd) * 0.02)

    @property
    def max_length(self) -> int:
        return len(self.weight)  # a row per position, none past it

    def embed(self, pos):
        return F.embedding(pos, self.weight)

    def position_params(self):
        return self.weight.numel()

    def crop(self, block_size):
        self.weight = nn.Parameter(self.weight[:block_size].detach().clone())

    def extend(self, block_size):
        # position interpolation (Chen et al. 2023): row p lerps old rows at p·L0/block_size
        L0 = self.weight.size(0)
        # (block_size,)
        x = (torch.arange(block_size, dtype=torch.float64) * L0 / block_size).clamp(max=L0 - 1)
        lo = x.floor().long()
        hi = (lo + 1).clamp(max=L0 - 1)
        frac = (x - lo).to(self.weight.dtype)[:, None]
        w = self.weight.detach()
        self.weight = nn.Parameter(torch.lerp(w[lo], w[hi], frac))  # (block_size, C)


class BiasRPE(PositionalEncoding):
    """A trainable scalar per head and clamped i - j added to the scores (Shaw et al. 2018), shared
    by the layers."""

    summary = "a trainable bias per head and clamped distance, added to attention scores"

    has_score_bias = True
    # its biases start at zero: Adam moves a parameter about one learning rate per step
    lr_scale = 30.0
    options = {
        "rpe_max_distance": Option(
            None,
            "distances clamp to ±(r_max - 1), 2·r_max - 1 biases per head; None: block_size // 2, "
            "so the far "
            "entry that every longer distance reads is trained within the training length",
            optional(positive_int),
            derive=lambda config: max(config.block_size // 2, 1),
        )
    }

    def __init__(self, config: GPTConfig):
        super().__init__(config)
        self.max_distance = config.rpe_max_distance
        # distances >= r_max - 1 share the clamped entry
        self.far_distance = config.rpe_max_distance - 1
        # (nh, 2r-1)
        self.weight = nn.Parameter(torch.zeros(config.n_head, 2 * config.rpe_max_distance - 1))

    def score_bias(self, h, i, j):
        r = self.max_distance
        return self.weight[h, (i - j).clamp(-(r - 1), r - 1) + (r - 1)].float()


class T5(PositionalEncoding):
    """T5's bias (Raffel et al. 2020, §2.1), causal: a scalar per head and bucket of i - j (half
    exact, half log)."""

    summary = "a trainable bias per head and log-spaced bucket of distances (T5's)"

    has_score_bias = True
    lr_scale = 30.0  # as bias_rpe's
    options = {
        "t5_num_buckets": Option(
            32, "biases per head, half exact distances, half log-spaced", positive_int
        ),
        "t5_max_distance": Option(
            None,
            "distances from here on share the last bucket; None: block_size // 2 (at least "
            "t5_num_buckets), so "
            "that bucket is trained within the training length",
            optional(positive_int),
            derive=lambda config: max(config.block_size // 2, config.t5_num_buckets),
        ),
    }

    def __init__(self, config: GPTConfig):
        super().__init__(config)
        self.num_buckets = config.t5_num_buckets
        self.max_distance = config.t5_max_distance
        # (nh, buckets)
        self.weight = nn.Parameter(torch.zeros(config.n_head, config.t5_num_buckets))
        n = torch.arange(max(self.max_distance, self.num_buckets) + 1)
        # the first distance in the last bucket
        self.far_distance = int((self.bucket(n) < self.num_buckets - 1).sum())

    @classmethod
    def check(cls, config):
        if config.t5_num_buckets < 2 or config.t5_max_distance <= config.t5_num_buckets // 2:
            raise ValueError(
                f"t5_num_buckets={config.t5_num_buckets} and "
                f"t5_max_distance={config.t5_max_distance}: T5 needs "
                "at least 2 buckets and a max distance above half of them (e.g. 32 and 128)"
            )

    # Mesh TensorFlow's _relative_position_bucket
    def bucket(self, n: torch.Tensor) -> torch.Tensor:
        exact = self.num_buckets // 2
        n = n.clamp(min=0)  # the future is masked anyway
        log_ratio = torch.log(n.clamp(min=exact).float() / exact) / math.log(
            self.max_distance / exact
        )
        far = (exact + (log_ratio * (self.num_buckets - exact)).long()).clamp(
            max=self.num_buckets - 1
        )
        return torch.where(n < exact, n, far)

    def score_bias(self, h, i, j):
        return self.weight[h, self.bucket(i - j)].float()


class Kerple(PositionalEncoding):
    """KERPLE's log variant (Chi et al. 2022): -r1·log(1 + r2·(i - j)), r1, r2 > 0 trainable per
    head, paper's init."""

    summary = "a bias -r1·log(1 + r2·distance), r1 and r2 trainable per head (KERPLE)"

    has_score_bias = True
    options = {
        "kerple_per_layer": Option(
            False, "(r1, r2) of each layer's own, as the paper's model; False: shared", boolean
        )
    }

    def __init__(self, config: GPTConfig):
        super().__init__(config)
        self.per_layer = config.kerple_per_layer
        # h in score_bias() counts every layer's heads
        n = config.n_head * (config.n_layer if self.per_layer else 1)
        # (n,) r1 ~ U(0, 2), kept positive
        self.log_r1 = nn.Parameter((torch.rand(n) * 2).clamp(min=0.01).log())
        # (n,) r2 ~ U(0, 1), the log finite
        self.log_r2 = nn.Parameter(torch.rand(n).clamp(min=0.01).log())

    def score_bias(self, h, i, j):
        # a bf16 model's bias in float32 too
        dtype = torch.promote_types(self.log_r1.dtype, torch.float32)
        n = (i - j).clamp(min=0).to(dtype)
        return -self.log_r1.to(dtype).exp()[h] * torch.log1p(self.log_r2.to(dtype).exp()[h] * n)


ROPE_SCALINGS = ("none", "linear", "ntk", "dynamic_ntk", "yarn", "llama3")
# the published constants, which export/hf.py also writes into GPT-NeoX's rope_parameters
# YaRN's ramp bounds in rotations per L0 (Peng et al. 2023, recommended for LLaMA)
YARN_ALPHA, YARN_BETA = 1.0, 32.0
# Llama 3.1's low/high frequency factors (its rope_scaling, Meta 2024)
LLAMA3_LOW, LLAMA3_HIGH = 1.0, 4.0
WITHOUT_SCALING = (
    "does nothing without a RoPE scaling: add --rope_scaling (linear, ntk, yarn, llama3 or "
    "dynamic_ntk)"
)


class RoPE(PositionalEncoding):
    """Rotary (Su et al. 2021): each pair (2k, 2k+1) of q, k turned by p·θ_k, θ_k = base^(-2k/d), so
    q·k reads i - j; rope_fraction < 1: the fastest pairs (p-RoPE); scalings read rope_factor times
    past L0 = rope_original_max_len."""

    summary = "rotates q and k by the position (rotary); scalings read past the training length"
    hf_architecture = "gpt_neox"

    rope_scalable = True
    options = {
        "rope_base": Option(10000.0, "θ_k = base^(-2k/d)", greater(1.0, "must be > 1")),
        "rope_fraction": Option(
            1.0,
            "the fraction of each head's pairs that rotate (the fastest; p-RoPE)",
            lambda v: (
                None
                if number(v) and 0.0 < v <= 1.0
                else "must be in (0, 1] (1: every pair rotates)"
            ),
        ),
        "rope_scaling": Option(
            "none",
            "to run past the training length: " + " | ".join(ROPE_SCALINGS),
            one_of(ROPE_SCALINGS, "a RoPE scaling"),
        ),
        "rope_factor": Option(
            1.0,
            "rope_scaling's s: the context is stretched s times",
            greater(1.0, "must be a number >= 1", equal=True),
            idle=lambda options: None if options["rope_scaling"] != "none" else WITHOUT_SCALING,
        ),
        "rope_original_max_len": Option(
            None,
            "rope_scaling's L0, the original training length (None: block_size)",
            optional(positive_int),
            idle=lambda options: None if options["rope_scaling"] != "none" else WITHOUT_SCALING,
        ),
    }

    def __init__(self, config: GPTConfig):
        super().__init__(config)
        d = self.head_dim = config.n_embd // config.n_head
        self.base = config.rope_base
        self.scaling = config.rope_scaling
        self.factor = float(config.rope_factor)
        self.rotating = round(config.rope_fraction * d / 2)  # pairs that rotate
        self.original = config.rope_original_max_len or config.block_size
        self.mscale = 0.1 * math.log(self.factor) + 1.0 if self.scaling == "yarn" else 1.0
        # NTK's base · s^(d/(d-2)), the exponent as in Hugging Face's dynamic variant
        # (export/hf.py's rope_theta)
        self.theta_base = (
            self.base * self.factor ** (d / (d - 2)) if self.scaling == "ntk" else self.base
        )
        # dynamic_ntk re-keys past L0
        self.cache_span = self.original if self.scaling == "dynamic_ntk" else math.inf
        # YaRN's ramp, over the pair index k: dim(r) is the k whose wavelength 2π/θ_k fits r times
        # into L0
        dim = lambda r: d * math.log(self.original / (2 * math.pi * r)) / (2 * math.log(self.base))  # noqa: E731
        self.low = max(math.floor(dim(YARN_BETA)), 0)
        self.high = min(math.ceil(dim(YARN_ALPHA)), d - 1)
        if self.high == self.low:
            self.high += 0.001  # a step, not a division by zero
        # θ is fixed by the config (dynamic_ntk's alone moves with the length): float32 bits, as
        # ALiBi's slopes
        self.register_buffer(
            "theta_bits", self.inv_freq(torch.device("cpu")).view(torch.int32), persistent=False
        )

    @staticmethod
    def default_factor(scaling: str, length: int, train_len: int) -> float:
        """The s that reads `length` tokens of a model trained at `train_len`; 1 for dynamic_ntk (it
        scales itself)."""
        return 1.0 if scaling == "dynamic_ntk" else max(1.0, length / train_len)

    @classmethod
    def check(cls, config):
        d = config.n_embd // config.n_head
        if d % 2:
            raise ValueError(
                f"pos_encoding='rope' rotates pairs of dims, so the head dim n_embd/n_head={d} "
                "must be even; "
                "change n_embd or n_head"
            )
        if config.rope_scaling == "ntk" and d <= 2:
            raise ValueError("rope_scaling='ntk' needs a head dim > 2 (its exponent is d/(d-2))")
        if round(config.rope_fraction * d / 2) < 1:
            raise ValueError(
                f"rope_fraction={config.rope_fraction} rotates no pair of a head dim "
                f"of {d}; raise it"
            )

    def inv_freq(self, device: torch.device, length: torch.Tensor | None = None) -> torch.Tensor:
        """θ_k (hs/2,) float32, scaled; length (0-d, or (B, T, 1) by documents: θ (B, T, hs/2)):
        dynamic_ntk's only."""
        d = self.head_dim
        s = self.factor
        k = torch.arange(0, d // 2, device=device, dtype=torch.float32)
        theta = self.theta_base ** (-2 * k / d)
        if self.scaling == "linear":  # position interpolation (Chen et al. 2023)
            theta = theta / s
        # ramp 0: keep θ_k (high frequency); ramp 1: interpolate θ_k / s
        elif self.scaling == "yarn":
            ramp = ((k - self.low) / (self.high - self.low)).clamp(0, 1)
            theta = theta / s * ramp + theta * (1 - ramp)
        # smooth 1: keep θ_k (short wavelength); smooth 0: interpolate θ_k / s
        elif self.scaling == "llama3":
            turns = self.original * theta / (2 * math.pi)  # L0 / wavelength
            smooth = ((turns - LLAMA3_LOW) / (LLAMA3_HIGH - LLAMA3_LOW)).clamp(0, 1)
            theta = theta / s * (1 - smooth) + theta * smooth
        elif self.scaling == "dynamic_ntk" and length is not None:
            # 1 up to L0: unscaled
            ratio = (s * length.float() / self.original - (s - 1)).clamp(min=1.0)
            theta = theta * ratio ** (-2 * k / (d - 2))  # (base · ratio^(d/(d-2)))^(-2k/d)
        # partial RoPE: the slowest pairs do not turn
        return torch.where(k < self.rotating, theta, 0.0)

    def rotary(self, pos, window=None):
        length = None
        # L is the span the queries see: the last position + 1, at most the window
        if self.scaling == "dynamic_ntk":
            # (B, T, 1) by documents
            length = pos.max() + 1 if pos.dim() == 1 else document_lengths(pos)[..., None]
            length = length if window is None else length.clamp(max=window)
        theta = (
            self.theta_bits.view(torch.float32)
            if length is None
            else self.inv_freq(pos.device, length)
        )
        angle = pos.float()[..., None] * theta  # (T, hs/2)
        if angle.dim() == 3:  # positions of each row (B, T): (B, 1, T, hs/2), over the heads
            angle = angle[:, None]
        turning = torch.arange(self.head_dim // 2, device=pos.device) < self.rotating
        # (hs/2,) YaRN's 0.1·ln(s) + 1, rotated pairs only (as HF)
        scale = torch.where(turning, self.mscale, 1.0)
        return angle.cos() * scale, angle.sin() * scale

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate pairs (x1, x2) of x (B, nh, T, hs) by cos, sin (T, hs/2) in float32: (x1 +
        i·x2)(cos + i·sin)."""
        x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)  # (B, nh, T, hs/2) each
        return (
            torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2).type_as(x)
        )


# attention rotates q and k by what `rotary` gives (cos, sin), with RoPE's rotation
apply_rotary = RoPE.rotate


def document_lengths(pos: torch.Tensor) -> torch.Tensor:
    """Each token's document's length (B, T), from positions in documents (B, T), each from 0: what
    its queries see."""
    doc = (pos == 0).cumsum(1)  # (B, T): the document of each token, counted along the row
    last = pos.new_zeros(pos.size(0), pos.size(1) + 1).scatter_reduce(1, doc, pos, "amax")
    return last.gather(1, doc) + 1


def alibi_slopes(n_head: int) -> torch.Tensor:
    """ALiBi's slopes as the paper's code: 2^(-8/n)…; else the largest power of two c's, then every
    other of 2c's."""

    def geometric(n):
        start = 2.0 ** (-(2.0 ** -(math.log2(n) - 3)))
        return [start ** (i + 1) for i in range(n)]

    c = 2 ** math.floor(math.log2(n_head))
    return torch.tensor(geometric(c) + geometric(2 * c)[0::2][: n_head - c], dtype=torch.float32)


class ALiBi(PositionalEncoding):
    """ALiBi (Press et al. 2021): -m_h·(i - j) on score (i, j), from i - j in float32 (not j alone,
    which grows)."""

    summary = "a bias -slope·distance per head, the paper's fixed slopes (ALiBi)"
    hf_architecture = "mpt"

    has_score_bias = True

    def __init__(self, config: GPTConfig):
        super().__init__(config)
        # float32 bits in an int buffer: it moves with the model, and .to(bfloat16) can't round
        # 2^-0.5 to 0.70703125
        # (nh,)
        self.register_buffer(
            "slope_bits", alibi_slopes(config.n_head).view(torch.int32), persistent=False
        )
        # (nh,) in the model's dtype
        self.register_buffer("slopes", alibi_slopes(config.n_head), persistent=False)

    def score_bias(self, h, i, j):
        # a half-precision model's are rounded: the bits
        exact = self.slopes.dtype in (torch.float32, torch.float64)
        return -(self.slopes if exact else self.slope_bits.view(torch.float32))[h] * (i - j).float()


class FIRE(PositionalEncoding):
    """FIRE (Li et al. 2023): f(ψ(i - j) / (ψ(max(L, i)) + ε)), ψ(x) = log(|c|·x + 1), f a ReLU MLP
    (1 -> 32 -> nh) per layer; c, L = |m|·L0 trainable. Dividing by ψ(max(L, i)) maps distances into
    [0, 1]: long contexts interpolate."""

    summary = "a learned MLP of the distance over the query's position, per layer (FIRE)"

    # the query's position matters (its rolling cache is exact against a forward at its positions)
    relative = False
    has_score_bias = True
    per_layer = True
    units = 32  # f's hidden units
    eps = 1e-6  # keeps x finite where ψ(max(L, i)) is 0 (L = 0 at position 0)

    def __init__(self, config: GPTConfig):
        super().__init__(config)
        layers = config.n_layer
        nh = config.n_head
        n = self.units
        self.n_head = nh
        self.c = nn.Parameter(torch.full((layers,), 0.1))  # (layers,) used as |c|
        # (layers,) m: Adam moves L by a fraction of itself
        self.L_multiplier = nn.Parameter(torch.ones(layers))
        self.register_buffer("init_L", torch.tensor(float(config.block_size)))  # L0, fixed
        self.w1 = nn.Parameter(torch.randn(layers, n))  # (layers, 32)
        self.b1 = nn.Parameter(torch.rand(layers, n) * 2 - 1)  # (layers, 32)
        # (layers, nh, 32): starts small, near NoPE
        self.w2 = nn.Parameter(torch.randn(layers, nh, n) * 0.02)

    def score_bias(self, h, i, j):
        # a row per (layer, head), read at h: inductor's CPU backend fails on the gradient of rows
        # read by h // n_head
        f = self.layer_bias(slice(None))  # every layer's parameters, (layers, ...)
        c, threshold, w1, b1 = (
            t.repeat_interleave(self.n_head, 0)[h] for t in (f.c, f.threshold, f.w1, f.b1)
        )
        # w1, b1, w2: h's shape + (32,)
        return self.mlp(self.input(c, threshold, i, j), w1, b1, f.w2.flatten(0, 1)[h])

    def input(self, c, threshold, i, j):
        """The MLP's input x = ψ(i - j) / (ψ(max(L, i)) + ε), ψ(x) = log(c·x + 1)."""
        psi = lambda x: torch.log1p(c * x)  # noqa: E731
        # a float32 bias (float64 for a float64 model)
        dtype = torch.promote_types(c.dtype, torch.float32)
        return psi((i - j).clamp(min=0).to(dtype)) / (
            psi(torch.maximum(threshold, i.to(dtype))) + self.eps
        )

    @staticmethod
    def mlp(
        x: torch.Tensor,
        w1: torch.Tensor,
        b1: torch.Tensor,
        w2: torch.Tensor,
        together: bool = False,
    ):
        """f(x) = Σ_u relu(x·w1_u + b1_u)·w2_u, u the last dim: a unit at a time (one output's
        memory), or together."""
        if together:
            return (torch.relu(x[..., None] * w1 + b1) * w2).sum(-1)
        out = torch.relu(x * w1[..., 0] + b1[..., 0]) * w2[..., 0]
        for u in range(1, w1.size(-1)):
            out = out + torch.relu(x * w1[..., u] + b1[..., u]) * w2[..., u]
        return out

    def layer_bias(self, layer: int | slice) -> fast_paths.MLPBias:
        """Layer `layer`'s bias (every layer's at a slice) as an MLP of each pair's input, its
        parameters read once: c used as |c|, and the threshold L = |m|·L0."""
        c = self.c[layer].abs()
        threshold = (self.L_multiplier * self.init_L).abs()[layer]
        return fast_paths.MLPBias(
            self.input, self.mlp, c, threshold, self.w1[layer], self.b1[layer], self.w2[layer]
        )


class CoPE(PositionalEncoding):
    """CoPE (Golovneva et al. 2024): gates σ(q_i·k_j/√d) (its authors' code; eq. 3 omits √d) count
    the keys, p_ij = Σ_{t=j..i} g_it < p_max, and the score is q_i·k_j/√d + q_i·e[p_ij], e read
    between ⌊p⌋ and ⌈p⌉ (not divided)."""

    summary = (
        "positions counted by gates of the content, σ(q·k/√d), with learned vectors per layer "
        "(CoPE)"
    )

    has_score_bias = reads_content = per_layer = True
    options = {
        "cope_p_max": Option(
            64, "the most positions a query counts (the rest read p_max - 1)", positive_int
        ),
        "cope_gates": Option(
            "scaled",
            "σ(q·k/√d) | unscaled: σ(q·k)",
            one_of(("scaled", "unscaled"), "a gate"),
            before="unscaled",
        ),
    }

    @classmethod
    def check(cls, config):
        at_most(
            "cope_p_max",
            config.cope_p_max,
            16 * config.block_size,
            "no query counts more keys at 16 x block_size",
        )

    def __init__(self, config: GPTConfig):
        super().__init__(config)
        self.p_max = config.cope_p_max
        hs = config.n_embd // config.n_head
        self.gate_scale = hs**-0.5 if config.cope_gates == "scaled" else 1.0
        # each layer's, its heads' too; 0: NoPE
        self.e = nn.Parameter(torch.zeros(config.n_layer, self.p_max, hs))

    def positions(self, q, k, visible, order) -> torch.Tensor:  # p_ij (B, nh, bq, nk) in q's dtype
        # 0 where unseen
        g = torch.sigmoid((q @ k.transpose(-2, -1)) * self.gate_scale).masked_fill(~visible, 0.0)
        if order is not None:  # count along positions: the keys in order, then back
            g = g[..., order]
        # Σ over the keys from j on (a suffix sum: the near keys' exact)
        p = g.flip(-1).cumsum(-1).flip(-1)
        return (p if order is None else p[..., order.argsort()]).clamp(max=self.p_max - 1)

    def content_bias(self, layer, q, k, visible, order, sums):
        # float32 at least: bf16 moves positions by up to 0.3
        with torch.autocast(q.device.type, enabled=False):
            q, k, e = (
                t.to(torch.promote_types(q.dtype, torch.float32)) for t in (q, k, self.e[layer])
            )
            p = self.positions(q, k, visible, order)  # (B, nh, bq, nk)
            z = q @ e.T  # (B, nh, bq, p_max)
            w = p - p.floor()  # the interpolation's weight, through which the gates learn
            return z.gather(-1, p.ceil().long()) * w + z.gather(-1, p.floor().long()) * (1 - w)

    def counts(self, layer: int) -> fast_paths.GateCounts:
        return fast_paths.GateCounts(self.e[layer], self.gate_scale)


class FoX(PositionalEncoding):
    """The forgetting gate (Lin et al. 2025, FoX): per layer and head f_t = σ(w·x_t + b) from the
    layer's input, and D_ij = Σ_{t=j+1..i} log f_t added to the score: c_i - c_j for c the running
    sum of log f (float64)."""

    summary = "a data-dependent decay: the sum of log forget gates between key and query (FoX)"

    has_score_bias = reads_content = per_layer = True
    options = {
        "fox_gate_bias": Option(0.0, "b's initial value (0: f = 1/2, as the authors' code)", finite)
    }

    @classmethod
    def check(cls, config):
        why = f"log σ(b) summed over block_size={config.block_size} tokens would overflow float32"
        at_most(
            "fox_gate_bias",
            config.fox_gate_bias,
            torch.finfo(torch.float32).max / config.block_size,
            why,
        )

    def __init__(self, config: GPTConfig):
        super().__init__(config)
        shape = (config.n_layer, config.n_head)
        # (layers, nh, C), as c_attn's init
        self.w = nn.Parameter(torch.randn(*shape, config.n_embd) * 0.02)
        self.b = nn.Parameter(torch.full(shape, float(config.fox_gate_bias)))  # (layers, nh)

    def no_decay(self):
        return [self.b]  # w is a projection, decayed like c_attn's

    def forget(self, layer, x):
        # float32 at least: bf16 gates' rounding adds up in the sum
        with torch.autocast(x.device.type, enabled=False):
            x, w, b = (
                t.to(torch.promote_types(x.dtype, torch.float32))
                for t in (x, self.w[layer], self.b[layer])
            )
            return F.logsigmoid(x @ w.T + b).transpose(1, 2).double()  # (B, nh, T)

    def content_bias(self, layer, q, k, visible, order, sums):
        c, key_c = sums  # in float32 (float64 for a float64 model)
        return (c[..., :, None] - key_c[..., None, :]).to(
            torch.promote_types(q.dtype, torch.float32)
        )


POS_ENCODINGS = {
    "sinusoidal": Sinusoidal,
    "learned": Learned,
    "bias_rpe": BiasRPE,
    "t5": T5,
    "kerple": Kerple,
    "rope": RoPE,
    "alibi": ALiBi,
    "fire": FIRE,
    "cope": CoPE,
    "fox": FoX,
    "none": NoPE,
}


# ---- The config: the model's shape (shape.py), and every encoding's options (declared by the
# encoding, a field here)

ENCODING_OPTIONS: dict[str, tuple[str, Option]] = {  # option name -> (its encoding, the Option)
    name: (enc, opt) for enc, cls in POS_ENCODINGS.items() for name, opt in cls.options.items()
}


def resolve_encoding_options(config: ModelShape) -> None:
    """The chosen encoding's options: derived defaults filled, values checked (only the chosen
    encoding's)."""
    if problem := one_of(tuple(POS_ENCODINGS), "a positional encoding")(config.pos_encoding):
        raise ValueError(f"pos_encoding={config.pos_encoding!r} {problem}")
    ModelShape.__post_init__(config)
    POS_ENCODINGS[config.pos_encoding].resolve(config)


GPTConfig = make_dataclass(
    "GPTConfig",
    [(name, Any, field(default=opt.default)) for name, (_, opt) in ENCODING_OPTIONS.items()],
    bases=(ModelShape,),
    namespace={
        "__post_init__": resolve_encoding_options,
        "__module__": __name__,
        "__doc__": "ModelShape's fields, then a field per encoding option (its name and default "
        "are the encoding's).",
    },
)


# ---- A chunk's positions


@dataclass(frozen=True)
class Chunk:
    """A forward's positions, derived once (GPT.chunk): embedding, RoPE read `pos`; mask, bias
    compare it to key_pos."""

    pos: torch.Tensor  # (T,) the tokens' absolute positions, the queries'
    # (Tk,) the keys' positions: pos, or with a cache every slot's (KVCache.EMPTY where unused)
    key_pos: torch.Tensor
    # (T,) the cache slots the chunk's keys and values go to; None without a cache
    slots: torch.Tensor | None
    # query i sees key j only where i - j < window; None: every key up to its own position
    window: int | None
    consecutive: bool  # the positions step by one, so that a band of i - j is a band of distances
    # packing="documents": each query's document's start (B, T); None: one stream
    starts: torch.Tensor | None = None
    key_starts: torch.Tensor | None = None  # (B, Tk) each key's
    cached: bool = False  # the keys come from a KV cache (they are not the queries' own)

    def document_positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The queries' and keys' positions, in their documents under packing="documents" ((B, T),
        (B, Tk))."""
        if self.starts is None:
            return self.pos, self.key_pos
        return self.pos - self.starts, self.key_pos - self.key_starts

    def block(self, i0: int, i1: int, j0: int, j1: int) -> Chunk:
        """Queries i0 … i1 - 1 over keys j0 … j1 - 1 (bias_blocks'), not consecutive; a cached
        chunk's whole: itself."""
        if self.cached and (i0, i1, j0, j1) == (0, len(self.pos), 0, len(self.key_pos)):
            return self
        cut = lambda t, a, b: None if t is None else t[..., a:b]  # noqa: E731  the last dim: (T,) or (B, T)
        return replace(
            self,
            pos=self.pos[i0:i1],
            key_pos=self.key_pos[j0:j1],
            slots=cut(self.slots, i0, i1),
            consecutive=False,
            starts=cut(self.starts, i0, i1),
            key_starts=cut(self.key_starts, j0, j1),
        )


def document_starts(
    idx: torch.Tensor, pos: torch.Tensor, eot_token: int, cache=None, doc_start=None
) -> torch.Tensor:
    """Where each token's document starts (B, T): its last end-of-text token, else the row's start
    (the chunk's, the cache's, or doc_start (B,), where a document begun before idx began).
    Positions must increase along the row."""
    if doc_start is not None:
        before = doc_start
    elif cache is None or cache.starts is None:  # the row starts here
        before = pos[:1].expand(idx.size(0))  # (B,)
    else:  # the document of the cache's last token goes on
        before = cache.starts[:, (cache.next_pos - 1) % cache.size]
    marks = torch.where(idx == eot_token, pos, before[:, None])  # (B, T)
    return marks.cummax(dim=1).values


# ---- Attention: the reference is SDPA, causal or under a mask of positions, plus any score bias;
# or a fast_paths one


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    score_bias: torch.Tensor | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """SDPA of q (B, nh, Tq, hs) over k, v (B, nh, Tk, hs): causal, or plus score_bias (nh, Tq, Tk)
    or (B, nh, Tq, Tk), -inf where unseen; under a bias, bf16 q attend in float32 like FlexAttention
    (SDPA would round it; fast_paths' too)."""
    if score_bias is None:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
    # 4-D: CPUs take their flash kernel
    bias = score_bias if score_bias.dim() == 4 else score_bias[None]
    # float64 q: the bias as float64 (the CPU flash kernel's mask)
    work = torch.promote_types(q.dtype, torch.float32)
    with torch.autocast(q.device.type, enabled=False):  # autocast would take SDPA back to bf16
        y = F.scaled_dot_product_attention(
            q.to(work), k.to(work), v.to(work), attn_mask=bias.to(work), dropout_p=dropout_p
        )
    return y.to(q.dtype)


def pair_bias(
    pe: PositionalEncoding, layer: int, heads: torch.Tensor, chunk: Chunk, recompute: bool = False
):
    """One layer's bias (nh, Tq, Tk), or (B, nh, Tq, Tk) by documents, at its heads (nh,) as
    score_bias counts them: score_bias, or the fast paths' evaluation of a layer_bias (FIRE's).
    recompute: autograd keeps only the bias."""
    if pe.layer_bias is not None:
        doc_pos = chunk.document_positions() if chunk.starts is not None else None
        own_keys = chunk.consecutive and not chunk.cached
        return fast_paths.mlp_matrix(
            pe.layer_bias(layer), chunk.pos, chunk.key_pos, own_keys, doc_pos, recompute
        )
    # (nh, 1, 1), (Tq, 1), (Tk,)
    heads = heads[:, None, None]
    i = chunk.pos[:, None]
    j = chunk.key_pos
    # each row's positions in its documents: (B, nh, Tq, Tk)
    if chunk.starts is not None and not pe.relative:
        i, j = chunk.document_positions()  # (B, Tq), (B, Tk)
        heads = heads[None]
        i = i[:, None, :, None]
        j = j[:, None, None, :]
    if recompute:
        return checkpoint(pe.score_bias, heads, i, j, use_reentrant=False)
    return pe.score_bias(heads, i, j)


def distance_table(
    pe: PositionalEncoding, layer: int, heads: torch.Tensor, chunk: Chunk
) -> torch.Tensor | None:
    """One layer's bias (nh, D) over distances 0 … D - 1 (the last for every longer one) where it is
    a function of i - j alone (FIRE's: below its threshold) and D is known without reading
    positions; else None. Not for a cache."""
    if pe.layer_bias is not None:
        return (
            fast_paths.mlp_table(pe.layer_bias(layer), chunk.pos, chunk.document_positions()[0])
            if chunk.consecutive
            else None
        )
    if not pe.relative or pe.reads_content:  # a bias of the content has no table
        return None
    if pe.far_distance is not None:  # every distance from it on reads one entry
        D = pe.far_distance + 1
    elif chunk.consecutive:  # the keys are the queries' own: distances up to T - 1
        D = len(chunk.pos)
    else:
        return None
    D = D if chunk.window is None else min(D, chunk.window)
    # (nh, D)
    return pe.score_bias(heads[:, None], torch.arange(D, device=chunk.pos.device)[None], 0)


def attention_for(
    chunk: Chunk,
    pe: PositionalEncoding,
    config: GPTConfig,
    attention_options: AttentionOptions,
    dropout_p: float,
    layer: int = 0,
    cache=None,
) -> Callable:
    """This forward's attention (q, k, v, x) -> y, chosen once: SDPA (causal, or under the mask of
    what each query sees), or with a score bias the builder fast_paths.kernel chooses, or the
    reference (the bias at every pair). docs/development.md has the table."""
    documents = chunk.starts is not None
    if not pe.has_score_bias and chunk.window is None and not chunk.cached and not documents:
        # causal over the queries' own keys
        return lambda q, k, v, x: attend(q, k, v, dropout_p=dropout_p)

    # whether query i sees key j: causal, in the window and document
    def seen(c: Chunk = chunk) -> torch.Tensor:
        visible = fast_paths.sees(c.pos[:, None] - c.key_pos, c.window)  # (Tq, Tk)
        if not documents:
            return visible[None]  # (1, Tq, Tk)
        every = slice(None)
        # (B, 1, Tq, Tk)
        return (visible & fast_paths.same_document(c.starts, c.key_starts, every, every))[:, None]

    if not pe.has_score_bias:  # SDPA under the mask of what each query sees
        mask = seen()
        return lambda q, k, v, x: F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=dropout_p
        )
    first = layer * config.n_head if pe.per_layer else 0  # the layer's first head in score_bias
    heads = torch.arange(config.n_head, device=chunk.pos.device) + first  # (nh,)
    trainable = torch.is_grad_enabled() and any(p.requires_grad for p in pe.parameters())
    own_keys = chunk.consecutive and not chunk.cached

    # (nh, Tq, Tk) or (B, nh, ...)
    def bias_matrix(c: Chunk = chunk, recompute: bool = trainable) -> torch.Tensor:
        return pair_bias(pe, layer, heads, c, recompute).masked_fill(~seen(c), float("-inf"))

    # a bias of i - j alone as its table (on a CPU, or training), any bias by rows
    device = chunk.pos.device.type
    table = (
        distance_table(pe, layer, heads, chunk)
        if (device == "cpu" or trainable) and not chunk.cached
        else None
    )
    build = fast_paths.kernel(
        attention_options,
        trainable=trainable,
        own_keys=own_keys,
        device=device,
        dropout=dropout_p > 0,
        cached=chunk.cached,
        has_table=table is not None,
        queries=len(chunk.pos),
        head_dim=config.n_embd // config.n_head,
        sums=pe.forgets,
        content=pe.reads_content,
    )
    if build is None:  # the reference
        matrix = bias_matrix()
        return lambda q, k, v, x: attend(q, k, v, score_bias=matrix, dropout_p=dropout_p)
    content = pe.reads_content  # the bias reads q, k or x: built as each layer runs
    bias = fast_paths.LayerBias(
        chunk.pos,
        chunk.key_pos,
        chunk.window,
        own_keys,
        (chunk.starts, chunk.key_starts) if documents else None,
        attention_options,
        attend=partial(attend, dropout_p=dropout_p),
        block=chunk.block,
        seen=seen,
        score=pe.score_bias,
        first_head=first,
        table=table,
        matrix=partial(bias_matrix, recompute=False),
        content_bias=partial(pe.content_bias, layer) if content else None,
        forget=partial(pe.forget, layer) if pe.forgets else None,
        sums=None if cache is None else partial(cache.sums, layer, chunk=chunk),
        counts=pe.counts and partial(pe.counts, layer),  # CoPE's counted positions
    )
    return build(bias)  # the one call into the kernels


# ---- The transformer


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig, layer_idx: int):
        super().__init__()
        # q, k, v for all heads
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.layer_idx = layer_idx

    def forward(self, x, rope, attention, cache=None, slots=None):
        """attention: attention_for's (q, k, v) -> y; with a cache, k and v go to slots (T,),
        attention reads all."""
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        # (B, nh, T, hs)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if rope is not None:
            q = apply_rotary(q, *rope)
            k = apply_rotary(k, *rope)
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v, slots)  # (B, nh, Tk, hs)
        y = attention(q, k, v, x)  # (B, nh, T, hs)
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
        self.checkpointing = "none"  # activation checkpointing, a training setting (shape.py)

    def forward(self, x, rope, attention, cache=None, slots=None):
        attention_sublayer = lambda x: x + self.attn(self.ln_1(x), rope, attention, cache, slots)  # noqa: E731
        mlp_sublayer = lambda x: x + self.mlp(self.ln_2(x))  # noqa: E731
        if cache is not None or not torch.is_grad_enabled() or self.checkpointing == "none":
            return mlp_sublayer(attention_sublayer(x))
        # "selective": where (T, T) tensors live
        x = checkpoint(attention_sublayer, x, use_reentrant=False)
        return (
            checkpoint(mlp_sublayer, x, use_reentrant=False)
            if self.checkpointing == "full"
            else mlp_sublayer(x)
        )


# ---- The GPT GPT-2's weights that transformers' Conv1D stores (in, out), nn.Linear's transposed:
# from_hf and export/hf.py read them
CONV1D_WEIGHTS = (
    "attn.c_attn.weight",
    "attn.c_proj.weight",
    "mlp.c_fc.weight",
    "mlp.c_proj.weight",
)


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                encoding=POS_ENCODINGS[config.pos_encoding](config),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config, i) for i in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # tied embeddings
        # what kernel() and its builders read; replaced, never edited
        self.attention_options = AttentionOptions()
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2's scaled init of the residual projections
            if name.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @property
    def encoding(self) -> PositionalEncoding:
        """The positional encoding, transformer.encoding (the model's own code reads it there)."""
        return self.transformer.encoding

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def get_num_params(self, non_embedding: bool = True) -> int:
        """Parameter count; by default without the position table (the token table is tied to
        lm_head)."""
        n = sum(p.numel() for p in self.parameters())  # parameters() yields the tied table once
        return n - self.transformer.encoding.position_params() if non_embedding else n

    def crop_block_size(self, block_size: int) -> None:
        """Shrink the training context (e.g. GPT-2's 1024 to 256)."""
        assert block_size <= self.config.block_size
        self.config.block_size = block_size
        self.transformer.encoding.crop(block_size)

    def extend_block_size(self, block_size: int) -> None:
        """Lengthen the training context (a run extended longer): a table of positions is
        interpolated."""
        assert block_size >= self.config.block_size
        self.config.block_size = block_size
        self.transformer.encoding.extend(block_size)

    def configure_optimizers(
        self,
        weight_decay: float,
        learning_rate: float,
        betas: tuple,
        device_type: str,
        pe_lr_scale: float = 1.0,
    ) -> torch.optim.AdamW:
        """AdamW decaying matrices only (no biases, norms, score bias); pe_lr_scale: the encoding's
        groups' lr_scale."""
        no_decay = {id(p) for p in self.transformer.encoding.no_decay()}
        encoding = (
            {id(p) for p in self.transformer.encoding.parameters()} if pe_lr_scale != 1.0 else set()
        )
        groups = {}
        for p in self.parameters():
            if p.requires_grad:
                decay = p.dim() >= 2 and id(p) not in no_decay
                scaled = id(p) in encoding
                groups.setdefault((decay, scaled), []).append(p)
        ordered = sorted(groups.items(), key=lambda kv: (not kv[0][0], kv[0][1]))  # decayed first
        params = [
            {
                "params": ps,
                "weight_decay": weight_decay if decay else 0.0,
                "lr_scale": pe_lr_scale if scaled else 1.0,
            }
            for (decay, scaled), ps in ordered
        ]
        return torch.optim.AdamW(params, lr=learning_rate, betas=betas, fused=device_type == "cuda")

    # ---- Forward: the chunk's positions, the attention each forward takes, the hidden states,
    # logits and loss

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        pos: torch.Tensor | None = None,
        cache=None,  # a generate.KVCache: generation's, which the model writes and never builds
        window: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits (B, T, vocab_size) for every position and, given targets (B, T; -1 is ignored),
        the loss."""
        logits = self.lm_head(self.features(idx, pos, cache, window))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.flatten(0, 1), targets.reshape(-1), ignore_index=-1)
        return logits, loss

    def features(
        self, idx, pos=None, cache=None, window=None, wrap_attention=None, doc_start=None
    ) -> torch.Tensor:
        """Final states (B, T, C) of idx (B, T) at pos (T,) (default arange(T), or on from the
        cache). window W: i sees j iff i - j < W; wrap_attention(fn) -> fn wraps each attention
        (probe); doc_start (B,): see document_starts."""
        T = idx.size(1)
        # a chunk must not evict its own keys
        if cache is not None and T > (most := cache.max_chunk(T, window)):
            chunks = [
                (idx[:, i : i + most], None if pos is None else pos[i : i + most])
                for i in range(0, T, most)
            ]
            return torch.cat(
                [self.features(x, p, cache, window, wrap_attention) for x, p in chunks], dim=1
            )
        return self.chunk_features(
            idx, self.chunk(idx, pos, cache, window, doc_start), cache, wrap_attention
        )

    def chunk(self, idx: torch.Tensor, pos, cache, window: int | None, doc_start=None) -> Chunk:
        """The Chunk of idx (B, T) at pos (None: the next T), checked; with a cache, the cache's
        (KVCache.claim, which generation calls alone: it feeds a cache only chunks that pass these
        checks)."""
        T = idx.size(1)
        start = cache.next_pos if cache is not None else 0
        explicit_pos = pos is not None
        # .max() syncs: only for explicit positions
        last = int(pos.max()) if explicit_pos else start + T - 1
        if last + 1 > self.transformer.encoding.max_length:
            raise ValueError(
                f"pos_encoding={self.config.pos_encoding!r} has no position past "
                f"block_size={self.config.block_size} "
                f"(asked for position {last}); feed at most {self.config.block_size} tokens, or "
                "use an encoding that "
                f"extrapolates ({', '.join(n for n, c in POS_ENCODINGS.items() if c.extrapolates)})"
            )
        span = last + 1 if window is None else min(last + 1, window)
        if cache is not None and span > self.transformer.encoding.cache_span:
            raise ValueError(
                "this encoding changes every key as the length grows past "
                f"{self.transformer.encoding.cache_span} (here {span}; "
                "RoPE's dynamic_ntk scaling does), so no KV cache can be exact there; run without "
                "a cache (generate() "
                "does so by itself)"
            )
        eot = self.config.eot_token if self.config.packing == "documents" else None
        if cache is not None:  # after the checks: a chunk refused leaves the cache as it was
            return cache.claim(idx, window, eot, pos, last)
        pos = torch.arange(T, device=idx.device) if pos is None else pos
        consecutive = not explicit_pos or T == 1 or bool((pos.diff() == 1).all())
        starts = None if eot is None else document_starts(idx, pos, eot, None, doc_start)
        return Chunk(pos, pos, None, window, consecutive, starts=starts, key_starts=starts)

    def chunk_features(
        self, idx: torch.Tensor, chunk: Chunk, cache, wrap_attention=None
    ) -> torch.Tensor:
        """features() of a chunk whose slots are claimed: tensor code only, so a decode step
        compiles to one graph."""
        pe = self.transformer.encoding
        x = self.transformer.wte(idx)  # (B, T, C)
        # or (B, T), in each document
        pos = chunk.pos if chunk.starts is None else chunk.document_positions()[0]
        if pe.embeds:
            # a float32 table must not turn a bf16 model's activations to float32
            x = x + pe.embed(pos).to(x.dtype)
        x = self.transformer.drop(x)
        layers = range(self.config.n_layer) if pe.per_layer else [0]
        dropout_p = self.config.dropout if self.training else 0.0
        attention_options = self.attention_options
        attentions = [
            attention_for(chunk, pe, self.config, attention_options, dropout_p, n, cache)
            for n in layers
        ]
        if wrap_attention is not None:
            attentions = [wrap_attention(a) for a in attentions]
        rope = pe.rotary(pos, chunk.window) if pe.rotates else None
        for i, block in enumerate(self.transformer.h):
            x = block(x, rope, attentions[i % len(attentions)], cache, chunk.slots)
        return self.transformer.ln_f(x)

    def set_rope_scaling(
        self, scaling: str, factor: float = 1.0, original_max_len: int | None = None
    ) -> None:
        """Switch RoPE's scaling at inference (yarn, factor 4: 4x the training length); L0: the
        config's by default."""
        if not self.transformer.encoding.rope_scalable:
            raise ValueError(
                f"rope_scaling applies to RoPE, not pos_encoding={self.config.pos_encoding!r}"
            )
        L0 = original_max_len or self.config.rope_original_max_len
        self.config = replace(
            self.config, rope_scaling=scaling, rope_factor=factor, rope_original_max_len=L0
        )
        # it holds no weights
        encoding = type(self.transformer.encoding)(self.config)
        self.transformer.encoding = encoding.to(self.lm_head.weight.device)

    def generate(self, idx: torch.Tensor, max_new_tokens: int, **options) -> torch.Tensor:
        """nanoGPT's call: extend idx (B, T) by max_new_tokens tokens with generate.py's generate
        (its options)."""
        from generate import generate  # generation is a module of its own, which imports this one

        return generate(self, idx, max_new_tokens, **options)

    @classmethod
    def from_pretrained(cls, model_type: str, dropout: float = 0.0) -> GPT:
        """GPT-2 weights ('gpt2', 'gpt2-medium', 'gpt2-large', 'gpt2-xl', or a local directory) via
        transformers."""
        from transformers import GPT2LMHeadModel

        return from_hf(GPT2LMHeadModel.from_pretrained(model_type), dropout=dropout)


def from_hf(hf_model, dropout: float = 0.0) -> GPT:
    """Build from a `transformers` GPT2LMHeadModel (learned positions, GPT-2's tanh GELU)."""
    c = hf_model.config
    if c.activation_function not in ("gelu_new", "gelu_pytorch_tanh"):
        raise ValueError(
            f"only GPT-2's tanh GELU is supported, this model uses {c.activation_function!r}"
        )
    shape = dict(
        block_size=c.n_positions, vocab_size=c.vocab_size, n_layer=c.n_layer, n_head=c.n_head
    )
    config = GPTConfig(
        **shape,
        n_embd=c.n_embd,
        dropout=dropout,
        bias=True,
        pos_encoding="learned",
        gelu="tanh",
    )
    model = GPT(config)
    # GPT-2's position table (wpe) is our learned encoding's
    theirs = {
        k.replace(".wpe.", ".encoding."): v.t() if k.endswith(CONV1D_WEIGHTS) else v
        for k, v in hf_model.state_dict().items()
    }
    if missing := [k for k in model.state_dict() if k not in theirs]:
        raise ValueError(f"the Hugging Face model lacks weights for {missing[:3]}…")
    # theirs holds buffers ours derives (the causal mask)
    model.load_state_dict(theirs, strict=False)
    return model
