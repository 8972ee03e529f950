"""
Export a checkpoint to a Hugging Face `transformers` directory (safetensors, config, tokenizer) that
`AutoModelForCausalLM.from_pretrained(dir)` and `AutoTokenizer.from_pretrained(dir)` load as they are: no
`trust_remote_code`, no network. Each encoding goes to an existing architecture that computes the same function
(the encoding declares it, `hf_architecture`):

    learned, sinusoidal, none -> GPT-2 (GPT2LMHeadModel): its position table holds the learned rows, the sinusoids,
                                 or zeros; n_positions rows (default: block_size for learned, 16x block_size for the
                                 others, the longest length the project evaluates; raise it with --n_positions)
    rope -> GPT-NeoX (GPTNeoXForCausalLM, sequential residual), any rope_fraction, and the linear, ntk, yarn and
            llama3 scalings (dynamic_ntk with rope_fraction 1)
    alibi -> MPT (MptForCausalLM): the same slopes for any head count, exact GELU, no biases (a model trained with
             bias=False; one with biases is an error that gives the difference dropping them would make)

    python export.py out-rope --out hf-rope
    python export.py out-sinusoidal --out hf-sin --n_positions=4096 --dtype=bfloat16

bias_rpe, t5, kerple and fire have no architecture in transformers: a one-line error names those that export.
"""

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

from checkpoint import CheckpointError, load_checkpoint, model_from_checkpoint
from model import GPT, POS_ENCODINGS
from tokenizer import GPT2_EOT, GPT2_RANKS, tokenizer_from_meta

# tiktoken's r50k_base split pattern (GPT-2's)
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
HF_ROPE_TYPES = {"none": "default", "ntk": "default", "linear": "linear", "yarn": "yarn", "llama3": "llama3"}


class ExportError(ValueError):
    pass


def architecture(encoding: type) -> str | None:
    """The transformers architecture that computes this encoding exactly (the class declares it), or None."""
    return encoding.hf_architecture


def gelu_name(model: GPT, tanh: str) -> str:
    return tanh if model.config.gelu == "tanh" else "gelu"  # transformers' "gelu" is the exact erf GELU


def to_gpt2(model: GPT, n_positions: int):
    """GPT2LMHeadModel with our weights: its Conv1D layers store (in, out), nn.Linear (out, in)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    c = model.config
    cfg = GPT2Config(
        vocab_size=c.vocab_size,
        n_positions=n_positions,
        n_embd=c.n_embd,
        n_layer=c.n_layer,
        n_head=c.n_head,
        activation_function=gelu_name(model, "gelu_new"),
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        layer_norm_epsilon=1e-5,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=None,
    )
    hf = GPT2LMHeadModel(cfg)
    with torch.no_grad():
        table = model.encoding.embed(torch.arange(n_positions))  # (n_positions, C) or None (no positions)
    ours = model.state_dict()
    transposed = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
    sd = {}
    for k, v in hf.state_dict().items():
        if k == "transformer.wpe.weight":
            sd[k] = torch.zeros_like(v) if table is None else table.to(v.dtype)
        elif k in ours:
            sd[k] = ours[k].t() if k.endswith(transposed) else ours[k]
        else:  # a bias or LayerNorm shift of a model trained without biases: zero is the same function
            if not k.endswith("bias"):
                raise ExportError(f"no weight of ours maps to GPT-2's {k}")
            sd[k] = torch.zeros_like(v)
    hf.load_state_dict(sd)
    return hf


def neox_rope(model: GPT) -> dict:
    """GPT-NeoX's rope_parameters for our RoPE. Ours rotates the R fastest pairs of the full spectrum,
    θ_k = base^(-2k/d) for k < R; NeoX spreads its frequencies over its rotated dims 2R: θ_k = b^(-2k/2R), equal for
    b = base^(2R/d). Static NTK is a larger base, so it exports as one; dynamic NTK's exponent uses the rotated dims,
    so it is exact only when every pair rotates."""
    pe, c = model.encoding, model.config
    d, R = pe.head_dim, pe.rotating
    scaling, s = pe.scaling, pe.factor
    if scaling not in HF_ROPE_TYPES and not (scaling == "dynamic_ntk" and 2 * R == d):
        raise ExportError(
            f"rope_scaling={scaling!r} with rope_fraction={c.rope_fraction} has no exact GPT-NeoX form; export with "
            f"rope_scaling none, linear, ntk, yarn or llama3 (or dynamic_ntk with rope_fraction=1)"
        )
    base = pe.base * s ** (d / (d - 2)) if scaling == "ntk" else pe.base
    params = {
        "rope_type": HF_ROPE_TYPES.get(scaling, "dynamic"),
        "rope_theta": base ** (2 * R / d),
        "partial_rotary_factor": 2 * R / d,
    }
    if params["rope_type"] != "default":
        params["factor"] = s
    if scaling in ("yarn", "llama3"):
        params["original_max_position_embeddings"] = pe.original
    if scaling == "yarn":
        params |= {"beta_fast": 32.0, "beta_slow": 1.0, "attention_factor": pe.mscale}
    if scaling == "llama3":
        params |= {"low_freq_factor": 1.0, "high_freq_factor": 4.0}
    return params


def neox_rows(model: GPT) -> torch.Tensor:
    """The order of GPT-NeoX's fused q/k/v rows in ours: NeoX puts each head's q, k, v together ((nh, 3, hs) rows),
    and splits each head's rotated dims in halves (dim k turns with dim R + k), where we pair dims 2k, 2k + 1."""
    c, pe = model.config, model.encoding
    hs, R = pe.head_dim, pe.rotating
    halves = torch.cat([torch.arange(0, 2 * R, 2), torch.arange(1, 2 * R, 2), torch.arange(2 * R, hs)])  # (hs,)
    rows = []
    for h in range(c.n_head):
        for j in range(3):  # q, k, v
            within = halves if j < 2 else torch.arange(hs)  # v does not turn
            rows.append(j * c.n_embd + h * hs + within)
    return torch.cat(rows)


def max_positions(model: GPT) -> int:
    """GPT-NeoX's max_position_embeddings: L0 for dynamic NTK (it scales past it, from it); else the context the
    scaling stretches to, as transformers expects it (at least the training length)."""
    pe = model.encoding
    if pe.scaling == "dynamic_ntk":
        return pe.original
    return max(model.config.block_size, int(pe.original * pe.factor))


def to_neox(model: GPT):
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    c = model.config
    cfg = GPTNeoXConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.n_embd,
        num_hidden_layers=c.n_layer,
        num_attention_heads=c.n_head,
        intermediate_size=4 * c.n_embd,
        hidden_act=gelu_name(model, "gelu_pytorch_tanh"),
        max_position_embeddings=max_positions(model),
        layer_norm_eps=1e-5,
        use_parallel_residual=False,
        attention_bias=True,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        tie_word_embeddings=True,
        rope_parameters=neox_rope(model),
    )
    hf = GPTNeoXForCausalLM(cfg)
    ours, rows = model.state_dict(), neox_rows(model)
    names = {
        "gpt_neox.embed_in.weight": "transformer.wte.weight",
        "gpt_neox.final_layer_norm.weight": "transformer.ln_f.weight",
        "gpt_neox.final_layer_norm.bias": "transformer.ln_f.bias",
        "lm_head.weight": "lm_head.weight",
    }
    for i in range(c.n_layer):
        ours_i, theirs = f"transformer.h.{i}.", f"gpt_neox.layers.{i}."
        for a, b in [
            ("input_layernorm", "ln_1"),
            ("post_attention_layernorm", "ln_2"),
            ("attention.query_key_value", "attn.c_attn"),
            ("attention.dense", "attn.c_proj"),
            ("mlp.dense_h_to_4h", "mlp.c_fc"),
            ("mlp.dense_4h_to_h", "mlp.c_proj"),
        ]:
            for p in ("weight", "bias"):
                names[theirs + a + "." + p] = ours_i + b + "." + p
    sd = {}
    for k, v in hf.state_dict().items():
        if k not in names:
            raise ExportError(f"no weight of ours maps to GPT-NeoX's {k}")
        w = ours.get(names[k])
        if w is None:  # a model trained without biases
            w = torch.zeros_like(v)
        elif "query_key_value" in k:
            w = w[rows]
        sd[k] = w
    hf.load_state_dict(sd)
    return hf


def to_mpt(model: GPT, max_seq_len: int):
    """MptForCausalLM: ALiBi with the paper's slopes (MPT's equal them for any head count: checked), an exact GELU,
    and no biases anywhere. Its bias is -m·(T - 1 - j), ours -m·(i - j): they differ by a constant per query, which
    the softmax ignores."""
    from transformers import MptConfig, MptForCausalLM
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    c = model.config
    theirs = -build_mpt_alibi_tensor(c.n_head, 2)[:, 0, 0]  # (nh,): the bias at distance 1
    ours = model.encoding.bias(torch.arange(c.n_head), torch.tensor(1), torch.tensor(0))
    if not torch.allclose(-theirs, ours, rtol=1e-6, atol=0):
        raise ExportError(
            f"MPT's ALiBi slopes differ from this model's for {c.n_head} heads, by up to "
            f"{(ours + theirs).abs().max():.3g}: no exact export"
        )
    if c.gelu != "exact":
        raise ExportError("MPT's MLP uses the exact GELU and this model was trained with gelu='tanh': no exact export")
    cfg = MptConfig(
        d_model=c.n_embd,
        n_heads=c.n_head,
        n_layers=c.n_layer,
        expansion_ratio=4,
        max_seq_len=max_seq_len,
        vocab_size=c.vocab_size,
        resid_pdrop=0.0,
        emb_pdrop=0.0,
        layer_norm_epsilon=1e-5,
        no_bias=True,
        attn_config={"alibi": True, "alibi_bias_max": 8, "attn_pdrop": 0},
        tie_word_embeddings=True,
    )
    hf = MptForCausalLM(cfg)
    names = {
        "transformer.wte.weight": "transformer.wte.weight",
        "transformer.norm_f.weight": "transformer.ln_f.weight",
        "lm_head.weight": "lm_head.weight",
    }
    for i in range(c.n_layer):
        for a, b in [
            ("norm_1", "ln_1"),
            ("attn.Wqkv", "attn.c_attn"),
            ("attn.out_proj", "attn.c_proj"),
            ("norm_2", "ln_2"),
            ("ffn.up_proj", "mlp.c_fc"),
            ("ffn.down_proj", "mlp.c_proj"),
        ]:
            names[f"transformer.blocks.{i}.{a}.weight"] = f"transformer.h.{i}.{b}.weight"
    ours = model.state_dict()
    hf.load_state_dict({k: ours[names[k]] for k in hf.state_dict()})
    dropped = [k for k in ours if k.endswith(".bias") and ours[k].abs().max() > 0]
    if dropped:
        idx = torch.randint(0, c.vocab_size, (1, min(c.block_size, 256)), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            diff = (hf(idx).logits - model(idx)[0]).abs().max().item()
        raise ExportError(
            f"MPT has no biases and this model has {len(dropped)} non-zero bias tensors: dropping them changes the "
            f"logits by up to {diff:.3g} on a test sequence; ALiBi exports exactly from a model trained with bias=False"
        )
    return hf


def hf_tokenizer(meta: dict):
    """A PreTrainedTokenizerFast that encodes and decodes as tokenizer.py's tokenizer for this meta."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    kind = meta["kind"]
    if kind == "gpt2":
        from transformers.convert_slow_tokenizer import TikTokenConverter

        tokenizer_from_meta(meta)  # checks the ranks file's hash
        tok = TikTokenConverter(vocab_file=str(GPT2_RANKS), pattern=GPT2_PATTERN).converted()
        eot = "<|endoftext|>"
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eot, bos_token=eot, unk_token=eot)
        assert fast.convert_tokens_to_ids(eot) == GPT2_EOT
        return fast
    if kind == "char":  # one token per character, joined back with nothing between
        vocab = {ch: i for i, ch in enumerate(meta["chars"])}
        tok = Tokenizer(models.WordLevel(vocab, unk_token=None))
        tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
        tok.decoder = decoders.Fuse()
        return PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False)
    if kind == "ids":  # token ids written as numbers separated by spaces
        vocab = {str(i): i for i in range(meta["vocab_size"])}
        tok = Tokenizer(models.WordLevel(vocab, unk_token=None))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        return PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False)
    raise ExportError(f"tokenizer kind {kind!r} does not export")


def export(ckpt: dict, out: Path, dtype: str | None = None, n_positions: int | None = None) -> Path:
    """Write the Hugging Face directory for a loaded checkpoint; returns out. dtype: the weights' dtype in the files
    (default: the checkpoint's training dtype where it is bf16/fp16, else float32)."""
    model = model_from_checkpoint(ckpt).float().eval()
    target = architecture(type(model.encoding))
    if target is None:
        ok = [name for name, cls in POS_ENCODINGS.items() if architecture(cls)]
        raise ExportError(
            f"pos_encoding={model.config.pos_encoding!r} has no architecture in transformers that computes it "
            f"exactly; the encodings that export: {', '.join(ok)}"
        )
    if "tokenizer" not in ckpt:
        raise ExportError("the checkpoint stores no tokenizer (a nanoGPT checkpoint?); retrain with train.py")
    dtype = dtype or ckpt.get("config", {}).get("dtype") or "float32"
    dtype = dtype if dtype in DTYPES else "float32"
    T = model.config.block_size
    if target == "mpt":
        hf = to_mpt(model, n_positions or 16 * T)
    elif target == "gpt2":
        n_positions = n_positions or (T if model.encoding.max_len is not None else 16 * T)
        if model.encoding.max_len is not None and n_positions > model.encoding.max_len:
            raise ExportError(f"n_positions={n_positions}: a learned table has {model.encoding.max_len} rows")
        hf = to_gpt2(model, n_positions)
    else:
        hf = to_neox(model)
    tok = hf_tokenizer(ckpt["tokenizer"])
    hf.config.torch_dtype = dtype
    if ckpt["tokenizer"]["kind"] == "gpt2":  # generate stops at GPT-2's end of text
        hf.config.bos_token_id = hf.config.eos_token_id = GPT2_EOT
        hf.generation_config.bos_token_id = hf.generation_config.eos_token_id = GPT2_EOT
    tmp = out.with_name(f".{out.name}.tmp")  # written whole, then renamed: never half an export
    shutil.rmtree(tmp, ignore_errors=True)
    hf.to(DTYPES[dtype]).save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    info = {"pos_encoding": model.config.pos_encoding, "architecture": target, "dtype": dtype}
    (tmp / "nanope.json").write_text(json.dumps(info, indent=1))
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir", help="a training run's folder (its ckpt.pt)")
    p.add_argument("--out", required=True, help="the directory to write")
    p.add_argument("--ckpt", default="ckpt.pt", help="which checkpoint of the run (ckpt_best.pt: the best)")
    p.add_argument("--dtype", choices=list(DTYPES), default=None, help="default: the run's dtype (float32 on CPU)")
    p.add_argument("--n_positions", type=int, default=None, help="GPT-2's table (default: 16x block_size; learned: it)")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists and is not empty")
    args = p.parse_args(argv)
    out = Path(args.out)
    if args.n_positions is not None and args.n_positions < 1:
        p.error("--n_positions must be at least 1")
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not args.overwrite:
        sys.exit(f"error: {out} exists and is not empty: choose another --out, or pass --overwrite to replace it")
    try:
        ckpt = load_checkpoint(Path(args.out_dir) / args.ckpt)
        path = export(ckpt, out, args.dtype, args.n_positions)
    except (CheckpointError, ExportError) as e:
        sys.exit(f"error: {e}")
    print(f"wrote {path}: AutoModelForCausalLM.from_pretrained({str(path)!r}) and AutoTokenizer load it")
    return path


if __name__ == "__main__":
    main()
