"""
nanoPE's GPT as a Hugging Face transformers model, for an export folder that carries its own code
(export/hf.py copies this file into the folder beside nanoPE's model.py, shape.py, fast_paths.py and
generate.py, byte for byte). Loaded with

    AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)

which runs this folder's Python code: read model.py and this file first. The model is nanoPE's own
GPT: every logit comes from model.py, nothing here computes attention or positions.

- Padding: a row's masked tokens (attention_mask 0, left or right padding) are left out, and its
  real tokens run through the model on their own, positions counting from its first real token; rows
  with the same mask run together. Each row's logits are then exactly those it has alone; a padded
  position's logits are 0.
- Tokens the model has no embedding for (a character-level tokenizer's <|endoftext|>, which is also
  its start of text and padding) read as config.read_eot_as, a newline: where texts start. A padded
  position is left out anyway.
- Generation: transformers' generate() and its loop, with generate.py's KVCache behind transformers'
  Cache interface (NanoPECache), each step the one generate.py's generate (sample.py's generation)
  takes: the model attends to at most config.max_context tokens (default block_size); past that, the
  absolute encodings (sinusoidal, learned) start again from the last max_context tokens at position
  0 and the others keep a rolling cache whose keys keep their positions; dynamic NTK past its
  training length runs the window again each step, and so does every step of
  generate(use_cache=False), as sample.py --no_cache. A forward without a cache (scoring) reads the
  whole sequence.
- The code check: config.json records the sha256 of model.py, shape.py, fast_paths.py, generate.py
  and this file at export; a folder whose code differs (edited, or mixed with another export's
  files) is refused at load, as its weights were trained for other code.
"""

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from torch.nn import functional as F
from transformers import Cache, GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .generate import KVCache, context_window, next_logits
from .model import GPT, GPTConfig

SUPPORTED = "transformers 5.23 or newer"  # the releases this code is tested on: 5.23 and 5.24
if tuple(int(x) for x in transformers.__version__.split(".")[:2]) < (5, 23):
    raise ImportError(
        f"this export needs {SUPPORTED}, and transformers {transformers.__version__} is installed"
    )
# the name transformers gives the cache between generate()'s steps: "cache" from 5.24,
# "past_key_values" before
CACHE = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def code_sha256(folder: Path, names) -> dict[str, str | None]:
    """The sha256 of each named code file in folder (None where it is missing)."""
    files = {name: folder / name for name in names}
    return {
        name: hashlib.sha256(f.read_bytes()).hexdigest() if f.is_file() else None
        for name, f in files.items()
    }


# what forward() and generate() answer to positions handed to them, which a nanoPE model computes
# itself
POSITIONS_REFUSED = (
    "a nanoPE model takes input_ids and attention_mask only (positions follow from the mask; a "
    "model trained with "
    "packing=documents also restarts them at each end-of-text token, and keeps the documents "
    "apart: join packed "
    "examples with it); leave out position_ids and inputs_embeds"
)


class NanoPEConfig(PretrainedConfig):
    """model_args: GPTConfig's fields, as the checkpoint stores them; code_sha256: each code file's
    at export; max_context: the longest context generation attends to (sample.py's --max_context;
    None: block_size); read_eot_as: the token that ids past the model's vocabulary read as (None:
    there are none)."""

    model_type = "nanope"

    def __init__(
        self,
        model_args: dict | None = None,
        code_sha256: dict | None = None,
        max_context: int | None = None,
        read_eot_as: int | None = None,
        **kwargs,
    ):
        self.model_args = dict(model_args or {})
        self.code_sha256 = dict(code_sha256 or {})
        self.max_context, self.read_eot_as = max_context, read_eot_as
        a = self.model_args
        # the names transformers and lm-eval read (export/hf.py gives max_position_embeddings too)
        self.vocab_size = a.get("vocab_size")
        self.hidden_size = a.get("n_embd")
        self.num_hidden_layers = a.get("n_layer")
        self.num_attention_heads = a.get("n_head")
        kwargs.setdefault("tie_word_embeddings", True)  # GPT ties lm_head to the token embeddings
        super().__init__(**kwargs)


class CodeMismatchError(ValueError):
    pass


# --------------------------------------------------------------------------------------------------
# The cache: generate.py's KVCache, behind transformers' Cache interface


@dataclass
class Rows:
    """Rows of a batch that share their padding, so their tokens sit at the same positions and share
    one KVCache."""

    index: torch.Tensor  # (n,) the rows
    tokens: torch.Tensor  # (n, t) their real tokens so far, padding left out
    kv: KVCache | None = None  # None until the first forward that writes it


class NanoPECache(Cache):
    """What generate() carries from step to step: one generate.py KVCache for each group of rows
    with the same padding (positions count from a row's first real token, and a KVCache holds one
    set of positions), and the tokens each group has read. model.py's attention writes the KVCache
    itself, so update() is never called; the model decides what each step feeds it
    (NanoPEForCausalLM.next_logits). use_kv=False: the tokens alone, each step runs the window again
    (generate(use_cache=False))."""

    def __init__(self, use_kv: bool = True):
        # transformers' per-layer caches: none, the KVCache holds every layer
        super().__init__(layers=[])
        self.use_kv = use_kv
        self.groups: list[Rows] = []
        # columns of input_ids read so far, padding included: what prepare_inputs_for_generation
        # skips
        self.seen = 0

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def update(self, *args, **kwargs):
        raise NotImplementedError("a nanoPE model writes its KVCache itself")

    def reorder_cache(self, beam_idx: torch.Tensor):
        raise NotImplementedError(
            "beam search is not supported by a nanoPE model: use greedy search or sampling"
        )


# --------------------------------------------------------------------------------------------------
# The model


class NanoPEForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = NanoPEConfig
    base_model_prefix = "gpt"
    _tied_weights_keys = {"gpt.lm_head.weight": "gpt.transformer.wte.weight"}
    _no_split_modules = ["Block"]

    def __init__(self, config: NanoPEConfig):
        # the files that run (transformers' copy of the folder's): every one config.json records,
        # and this one
        names = sorted(set(config.code_sha256) | {Path(__file__).name})
        found = code_sha256(Path(__file__).parent, names)
        if config.code_sha256 != found:
            bad = [n for n in names if config.code_sha256.get(n) != found[n]]
            raise CodeMismatchError(
                f"this folder's code ({', '.join(bad)}) is not the code it was exported with: "
                "config.json records "
                f"sha256 {', '.join(str(config.code_sha256.get(n))[:12] for n in bad)}, the folder "
                "has "
                f"{', '.join(str(found[n])[:12] for n in bad)} (edited, or files mixed from "
                "another export); export "
                "the run again with nanoPE's python -m export"
            )
        super().__init__(config)
        # not on from_pretrained's meta device: encodings compute from their sizes at init (T5's
        # last bucket) and keep buffers out of the weights (ALiBi's slopes); the weights are then
        # loaded over these
        device = torch.get_default_device()
        with torch.device("cpu" if device.type == "meta" else device):
            self.gpt = GPT(GPTConfig(**config.model_args))
        self.computed_buffers = {name: b.clone() for name, b in self.named_non_persistent_buffers()}
        self.post_init()

    def initialize_weights(self):
        """from_pretrained replaces the buffers that are not weights (ALiBi's slopes) by empty
        tensors on their device and calls this to fill them: with the values GPT computed at init.
        GPT initialises its weights itself."""
        for name, value in self.computed_buffers.items():
            self.get_buffer(name).copy_(value)

    def _init_weights(self, module):
        pass  # GPT's own init, above; from_pretrained loads every weight

    def get_input_embeddings(self):
        return self.gpt.transformer.wte

    def get_output_embeddings(self):
        return self.gpt.lm_head

    def readable(self, idx: torch.Tensor) -> torch.Tensor:
        """idx with the tokenizer's <|endoftext|>, where the model has no embedding for it, read as
        config.read_eot_as; any other id the model has no embedding for is an error naming it."""
        if idx.numel() == 0:
            raise ValueError("input_ids is empty: give every row at least one token")
        V = self.config.vocab_size
        # a character tokenizer's, after its characters
        eot = V if self.config.read_eot_as is not None else None
        past = (idx >= V) & (idx != eot) if eot is not None else idx >= V
        if bool(past.any()) or bool((idx < 0).any()):
            bad = idx[past | (idx < 0)][0].item()
            raise ValueError(
                f"input_ids holds the id {bad}, which this model has no embedding for (its "
                f"vocabulary is 0 … {V - 1}"
                + (f", and {eot} is the end of text" if eot is not None else "")
                + "): encode the text with this folder's tokenizer"
            )
        return idx if eot is None else idx.masked_fill(idx == eot, self.config.read_eot_as)

    def logits(self, idx: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, T, V) of tokens idx (B, T); with mask (B, T), each row's unmasked tokens run
        alone (positions from its first), rows of the same mask together; masked positions get
        zeros."""
        if mask is None or bool(mask.all()):
            return self.gpt(idx)[0]
        out = idx.new_zeros(*idx.shape, self.config.vocab_size, dtype=self.gpt.lm_head.weight.dtype)
        patterns, group = torch.unique(mask.bool(), dim=0, return_inverse=True)  # (G, T), (B,)
        for g, keep in enumerate(patterns):
            rows = (group == g).nonzero()[:, 0]  # (n,), (t,)
            cols = keep.nonzero()[:, 0]
            if len(cols):
                out[rows[:, None], cols] = self.gpt(idx[rows[:, None], cols])[0]  # (n, t, V)
        return out

    def context_window(self) -> int:
        """The longest context generation attends to: config.max_context, by default block_size."""
        return context_window(self.gpt, self.config.max_context)

    def next_logits(
        self, idx: torch.Tensor, mask: torch.Tensor | None, cache: NanoPECache
    ) -> torch.Tensor:
        """Logits (B, 1, V) of the token after idx (B, T), the tokens the cache has not read (the
        prompt first, with its mask, then one token a step). Each group of rows takes the step
        sample.py's generation takes: a prefill that starts a KVCache, one token through it, or the
        whole window again where no cache can be exact."""
        if not cache.groups:  # the prompt: rows that share their padding share their positions
            keep = torch.ones_like(idx, dtype=torch.bool) if mask is None else mask.bool()
            if not bool(keep.any(1).all()):
                row = int((~keep.any(1)).nonzero()[0, 0])
                raise ValueError(
                    f"row {row} of attention_mask is all zeros: its prompt is empty; give every "
                    "row at least one token"
                )
            patterns, group = torch.unique(keep, dim=0, return_inverse=True)  # (G, T), (B,)
            for g, cols in enumerate(patterns):
                rows = (group == g).nonzero()[:, 0]
                cache.groups.append(Rows(rows, idx[rows[:, None], cols.nonzero()[:, 0]]))
            news = [rows.tokens for rows in cache.groups]
        else:
            if mask is not None and not bool(mask[:, -idx.size(1) :].all()):
                raise ValueError(
                    "with a cache, the new tokens must all be unmasked: padding goes in the prompt"
                )
            news = [idx[rows.index] for rows in cache.groups]
            for rows, new in zip(cache.groups, news, strict=True):
                rows.tokens = torch.cat([rows.tokens, new], dim=1)
        cache.seen += idx.size(1)
        if len(cache.groups) == 1:
            return self.group_step(cache.groups[0], news[0], cache.use_kv)[:, None]
        out = idx.new_zeros(
            idx.size(0), 1, self.config.vocab_size, dtype=self.gpt.lm_head.weight.dtype
        )
        for rows, new in zip(cache.groups, news, strict=True):
            out[rows.index, 0] = self.group_step(rows, new, cache.use_kv)
        return out

    def group_step(self, rows: Rows, new: torch.Tensor, use_kv: bool) -> torch.Tensor:
        """Logits (n, V) of the next token of a group whose tokens end in new: the step sample.py's
        generation takes (generate.py's next_logits), on the group's own KVCache."""
        logits, rows.kv = next_logits(
            self.gpt, rows.tokens, new, rows.kv, self.context_window(), use_kv
        )
        return logits

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        past_key_values: NanoPECache | None = None,
        cache: NanoPECache | None = None,
        use_cache: bool | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """Logits of every position; with labels (B, T; -100 ignored), the next-token loss. With
        use_cache or a past_key_values (generate() passes both), the logits (B, 1, V) of the next
        token only, and the cache. Positions come from attention_mask alone: position_ids and
        inputs_embeds are errors, not silently ignored."""
        if position_ids is not None or inputs_embeds is not None:
            raise ValueError(POSITIONS_REFUSED)
        idx = self.readable(input_ids)
        # its name since transformers 5.24
        past_key_values = cache if cache is not None else past_key_values
        if past_key_values is None and not use_cache:
            logits = self.logits(idx, attention_mask)
            loss = None
            if labels is not None:  # position t predicts token t + 1
                loss = F.cross_entropy(
                    logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100
                )
            return CausalLMOutputWithPast(loss=loss, logits=logits)
        if labels is not None:
            raise ValueError(
                "labels with a cache: a loss needs every position's logits; call without use_cache"
            )
        cache = NanoPECache() if past_key_values is None else past_key_values
        return CausalLMOutputWithPast(
            logits=self.next_logits(idx, attention_mask, cache), **{CACHE: cache}
        )

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # forward() makes its own cache, a NanoPECache, on the first step

    def generate(self, *args, position_ids=None, inputs_embeds=None, **kwargs):
        """transformers' generate(), refusing positions handed to it as forward() does (its steps
        would drop them: the positions generate() makes itself from attention_mask,
        prepare_inputs_for_generation leaves out)."""
        if position_ids is not None or inputs_embeds is not None:
            raise ValueError(POSITIONS_REFUSED)
        return super().generate(*args, **kwargs)

    def prepare_inputs_for_generation(
        self, input_ids, past_key_values=None, attention_mask=None, use_cache=True, cache=None, **kw
    ):
        """What each of generate()'s steps feeds forward(): the tokens the cache has not read, and
        the cache, which without use_cache holds the tokens alone (a NanoPECache is made here then,
        as forward() would not make one)."""
        past_key_values = cache if cache is not None else past_key_values
        if past_key_values is None:
            past_key_values = NanoPECache(use_kv=use_cache)
        return {
            "input_ids": input_ids[:, past_key_values.get_seq_length() :],
            "attention_mask": attention_mask,
            CACHE: past_key_values,
        }
