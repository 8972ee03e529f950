"""
nanoPE's GPT as a Hugging Face transformers model, for an export folder that carries its own code (export.py copies
this file into the folder beside model.py, nanoPE's model.py byte for byte). Loaded with

    AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)

which runs this folder's Python code: read model.py and this file first. The model is nanoPE's own GPT: every
logit comes from model.py, nothing here computes attention or positions.

- Padding: a row's masked tokens (attention_mask 0, left or right padding) are left out, and its real tokens run
  through the model on their own, positions counting from its first real token; rows with the same mask run together.
  Each row's logits are then exactly those it has alone; a padded position's logits are 0.
- Generation: transformers' generate() and its loop, with no KV cache: each step runs the whole sequence again
  (the logits of a full forward, past the training length too, at a cost quadratic in the length).
- The code check: config.json records the sha256 of model.py and of this file at export; a folder whose code differs
  (edited, or mixed with another export's files) is refused at load, as its weights were trained for other code.
"""

import hashlib
from pathlib import Path

import torch
from torch.nn import functional as F
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .model import GPT, GPTConfig

CODE_FILES = ("model.py", "modeling_nanope.py")  # the code config.json's code_sha256 records


def code_sha256(folder: Path) -> dict[str, str]:
    """The sha256 of each code file in folder."""
    return {name: hashlib.sha256((folder / name).read_bytes()).hexdigest() for name in CODE_FILES}


class NanoPEConfig(PretrainedConfig):
    """model_args: GPTConfig's fields, as the checkpoint stores them; code_sha256: what CODE_FILES were at export."""

    model_type = "nanope"

    def __init__(self, model_args: dict | None = None, code_sha256: dict | None = None, **kwargs):
        self.model_args = dict(model_args or {})
        self.code_sha256 = dict(code_sha256 or {})
        a = self.model_args
        # the names transformers and lm-eval read (export.py gives max_position_embeddings too)
        self.vocab_size, self.hidden_size = a.get("vocab_size"), a.get("n_embd")
        self.num_hidden_layers, self.num_attention_heads = a.get("n_layer"), a.get("n_head")
        kwargs.setdefault("tie_word_embeddings", True)  # GPT ties lm_head to the token embeddings
        super().__init__(**kwargs)


class CodeMismatchError(ValueError):
    pass


class NanoPEForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = NanoPEConfig
    base_model_prefix = "gpt"
    _tied_weights_keys = {"gpt.lm_head.weight": "gpt.transformer.wte.weight"}
    _no_split_modules = ["Block"]

    def __init__(self, config: NanoPEConfig):
        found = code_sha256(Path(__file__).parent)  # the files that run: transformers' copy of the folder's
        if config.code_sha256 != found:
            bad = [n for n in CODE_FILES if config.code_sha256.get(n) != found[n]]
            raise CodeMismatchError(
                f"this folder's code ({', '.join(bad)}) is not the code it was exported with: config.json records "
                f"sha256 {', '.join(str(config.code_sha256.get(n))[:12] for n in bad)}, the folder has "
                f"{', '.join(found[n][:12] for n in bad)} (edited, or files mixed from another export); export the "
                "run again with nanoPE's export.py"
            )
        super().__init__(config)
        # not on from_pretrained's meta device: encodings compute from their sizes at init (T5's last bucket) and
        # keep buffers out of the weights (ALiBi's slopes); the weights are then loaded over these
        device = torch.get_default_device()
        with torch.device("cpu" if device.type == "meta" else device):
            self.gpt = GPT(GPTConfig(**config.model_args))
        self.computed_buffers = {name: b.clone() for name, b in self.named_non_persistent_buffers()}
        self.post_init()

    def initialize_weights(self):
        """from_pretrained replaces the buffers that are not weights (ALiBi's slopes) by empty tensors on their device
        and calls this to fill them: with the values GPT computed at init. GPT initialises its weights itself."""
        for name, value in self.computed_buffers.items():
            self.get_buffer(name).copy_(value)

    def _init_weights(self, module):
        pass  # GPT's own init, above; from_pretrained loads every weight

    def get_input_embeddings(self):
        return self.gpt.transformer.wte

    def get_output_embeddings(self):
        return self.gpt.lm_head

    def logits(self, idx: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, T, V) of tokens idx (B, T); with mask (B, T), each row's unmasked tokens run alone (positions
        from its first), rows of the same mask together; masked positions get zeros."""
        if mask is None or bool(mask.all()):
            return self.gpt(idx)[0]
        out = idx.new_zeros(*idx.shape, self.config.vocab_size, dtype=self.gpt.lm_head.weight.dtype)
        patterns, group = torch.unique(mask.bool(), dim=0, return_inverse=True)  # (G, T), (B,)
        for g, keep in enumerate(patterns):
            rows, cols = (group == g).nonzero()[:, 0], keep.nonzero()[:, 0]  # (n,), (t,)
            if len(cols):
                out[rows[:, None], cols] = self.gpt(idx[rows[:, None], cols])[0]  # (n, t, V)
        return out

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        past_key_values=None,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """Logits of every position; with labels (B, T; -100 ignored), the next-token loss. Positions come from
        attention_mask alone: position_ids, inputs_embeds and a cache are errors, not silently ignored."""
        if position_ids is not None or inputs_embeds is not None or past_key_values is not None:
            raise ValueError(
                "a nanoPE model takes input_ids and attention_mask only (positions follow from the mask, and it keeps "
                "no cache); leave out position_ids, inputs_embeds and past_key_values"
            )
        logits = self.logits(input_ids, attention_mask)
        loss = None
        if labels is not None:  # position t predicts token t + 1
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits)

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # generate() makes no cache: each step runs the whole sequence

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, **kwargs):
        return {"input_ids": input_ids, "attention_mask": attention_mask}
