"""
Export a checkpoint to a Hugging Face `transformers` directory (safetensors, config, tokenizer) that
`AutoModelForCausalLM.from_pretrained(dir)` and `AutoTokenizer.from_pretrained(dir)` load, no
network. An encoding that an existing architecture computes exactly goes to it (the encoding
declares it, `hf_architecture`), and loads with no code of ours:

    learned, sinusoidal, none -> GPT-2 (GPT2LMHeadModel): its position table holds the learned rows,
        the sinusoids, or zeros; n_positions rows (default: block_size for learned, 16x block_size
        for the others, the longest length the project evaluates; raise it with --n_positions)
    rope -> GPT-NeoX (GPTNeoXForCausalLM, sequential residual), any rope_fraction, and the linear,
        ntk, yarn and llama3 scalings (dynamic_ntk with rope_fraction 1)
    alibi -> MPT (MptForCausalLM): the same slopes for any head count, exact GELU, no biases (a
        model trained with bias=False; one with biases is an error that gives the difference
        dropping them would make)

Every other encoding (hf_architecture None; and any encoding with --remote_code) exports as a folder
that carries its own code, loaded with trust_remote_code=True: nanoPE's model.py byte for byte, and
export/modeling_nanope.py, a transformers wrapper (a config, a Cache around generate.py's KVCache,
and a PreTrainedModel whose generate steps as sample.py does) that imports it. config.json records
the code's sha256, and the wrapper refuses to load other code.

The tokenizer: GPT-2's for a GPT-2 BPE run; for a character-level run, its characters and
<|endoftext|> after them (the end of text, start of text and padding), a character outside them
encoding as a space. Only an export that carries nanoPE's code reads <|endoftext|>: the other
architectures' vocabulary is the characters (docs/export.md).

    python -m export out-rope --out hf-rope
    python -m export out-sinusoidal --out hf-sin --n_positions=4096 --dtype=bfloat16
    python -m export out-bias_rpe --out hf-bias_rpe

Nothing but an earlier export is ever replaced: --out must be new, empty, or (with --overwrite) a
folder this script wrote (its nanope.json lists its files, each a name an export writes, and it
holds nothing else), and never the run's folder or one above it. The export is written in a new
folder beside --out and renamed into place; every check comes before any work.
"""

import argparse
import dataclasses
import hashlib
import json
import os
import shutil
import sys
import uuid
from pathlib import Path

if not __package__:  # run by its path, where the project's modules are not importable
    sys.exit("run it from the repository's root as: python -m export")

import torch

from lib.checkpoint import CheckpointError, load_checkpoint, model_from_checkpoint
from lib.devices import DTYPES, device_memory, missing
from lib.outputs import cannot_write
from lib.runs import add_run_folders
from lib.tokenizer import GPT2_EOT, GPT2_RANKS, tokenizer_from_meta
from model import CONV1D_WEIGHTS, GPT, LLAMA3_HIGH, LLAMA3_LOW, YARN_ALPHA, YARN_BETA

# tiktoken's r50k_base split pattern (GPT-2's)
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# the code a remote-code export carries: nanoPE's model.py, shape.py, fast_paths.py and generate.py
# as they are, and the transformers wrapper that imports them; config.json records each one's
# sha256, which the wrapper checks at load
CODE_FILES = (
    Path(__file__).resolve().parents[1] / "model.py",
    Path(__file__).resolve().parents[1] / "shape.py",
    Path(__file__).resolve().parents[1] / "fast_paths.py",
    Path(__file__).resolve().parents[1] / "generate.py",
    Path(__file__).resolve().parent / "modeling_nanope.py",
)
REMOTE_MODULE = "modeling_nanope"
# what an export wrote before nanope.json listed its files
LEGACY_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "nanope.json",
    "tokenizer.json",
    "tokenizer_config.json",
)
# every file an export writes: the only ones --overwrite deletes, whatever an export's nanope.json
# lists
EXPORT_FILES = frozenset(LEGACY_FILES) | {src.name for src in CODE_FILES}
# the end of text, as GPT-2 names it; a character-level tokenizer gets it after its characters
EOT = "<|endoftext|>"
SPECIAL_TOKENS = ("eos_token", "bos_token", "pad_token")  # each is EOT
HF_ROPE_TYPES = {
    "none": "default",
    "ntk": "default",
    "linear": "linear",
    "yarn": "yarn",
    "llama3": "llama3",
}


class ExportError(ValueError):
    pass


def architecture(encoding: type) -> str | None:
    """The transformers architecture that computes this encoding exactly (the class declares it), or
    None: the export then carries nanoPE's own code."""
    return encoding.hf_architecture


def gelu_name(model: GPT, tanh: str) -> str:
    # transformers' "gelu" is the exact erf GELU
    return tanh if model.config.gelu == "tanh" else "gelu"


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
        # (n_positions, C) or None (no positions)
        table = model.encoding.embed(torch.arange(n_positions))
    ours = model.state_dict()
    sd = {}
    for k, v in hf.state_dict().items():
        if k == "transformer.wpe.weight":
            sd[k] = torch.zeros_like(v) if table is None else table.to(v.dtype)
        elif k in ours:
            sd[k] = ours[k].t() if k.endswith(CONV1D_WEIGHTS) else ours[k]
        # a bias or LayerNorm shift of a model trained without biases: zero is the same function
        else:
            if not k.endswith("bias"):
                raise ExportError(f"no weight of ours maps to GPT-2's {k}")
            sd[k] = torch.zeros_like(v)
    hf.load_state_dict(sd)
    return hf


def neox_rope(model: GPT) -> dict:
    """GPT-NeoX's rope_parameters for our RoPE. Ours rotates the R fastest pairs of the full
    spectrum, θ_k = base^(-2k/d) for k < R; NeoX spreads its frequencies over its rotated dims 2R:
    θ_k = b^(-2k/2R), equal for b = base^(2R/d). Static NTK is a larger base, so it exports as one;
    dynamic NTK's exponent uses the rotated dims, so it is exact only when every pair rotates."""
    pe = model.encoding
    c = model.config
    d = pe.head_dim
    R = pe.rotating
    scaling = pe.scaling
    s = pe.factor
    if scaling not in HF_ROPE_TYPES and not (scaling == "dynamic_ntk" and 2 * R == d):
        raise ExportError(
            f"rope_scaling={scaling!r} with rope_fraction={c.rope_fraction} has no exact GPT-NeoX "
            "form; export with "
            f"rope_scaling none, linear, ntk, yarn or llama3 (or dynamic_ntk with rope_fraction=1)"
        )
    params = {
        "rope_type": HF_ROPE_TYPES.get(scaling, "dynamic"),
        "rope_theta": pe.theta_base ** (2 * R / d),
        "partial_rotary_factor": 2 * R / d,
    }
    if params["rope_type"] != "default":
        params["factor"] = s
    if scaling in ("yarn", "llama3"):
        params["original_max_position_embeddings"] = pe.original
    if scaling == "yarn":
        params |= {"beta_fast": YARN_BETA, "beta_slow": YARN_ALPHA, "attention_factor": pe.mscale}
    if scaling == "llama3":
        params |= {"low_freq_factor": LLAMA3_LOW, "high_freq_factor": LLAMA3_HIGH}
    return params


def neox_rows(model: GPT) -> torch.Tensor:
    """The order of GPT-NeoX's fused q/k/v rows in ours: NeoX puts each head's q, k, v together
    ((nh, 3, hs) rows), and splits each head's rotated dims in halves (dim k turns with dim R + k),
    where we pair dims 2k, 2k + 1."""
    c = model.config
    pe = model.encoding
    hs = pe.head_dim
    R = pe.rotating
    # (hs,)
    halves = torch.cat(
        [torch.arange(0, 2 * R, 2), torch.arange(1, 2 * R, 2), torch.arange(2 * R, hs)]
    )
    rows = []
    for h in range(c.n_head):
        for j in range(3):  # q, k, v
            within = halves if j < 2 else torch.arange(hs)  # v does not turn
            rows.append(j * c.n_embd + h * hs + within)
    return torch.cat(rows)


def max_positions(model: GPT) -> int:
    """GPT-NeoX's max_position_embeddings: L0 for dynamic NTK (it scales past it, from it); else the
    context the scaling stretches to, as transformers expects it (at least the training length)."""
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
    ours = model.state_dict()
    rows = neox_rows(model)
    names = {
        "gpt_neox.embed_in.weight": "transformer.wte.weight",
        "gpt_neox.final_layer_norm.weight": "transformer.ln_f.weight",
        "gpt_neox.final_layer_norm.bias": "transformer.ln_f.bias",
        "lm_head.weight": "lm_head.weight",
    }
    for i in range(c.n_layer):
        ours_i = f"transformer.h.{i}."
        theirs = f"gpt_neox.layers.{i}."
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
    """MptForCausalLM: ALiBi with the paper's slopes (MPT's equal them for any head count: checked),
    an exact GELU, and no biases anywhere. Its bias is -m·(T - 1 - j), ours -m·(i - j): they differ
    by a constant per query, which the softmax ignores."""
    from transformers import MptConfig, MptForCausalLM
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    c = model.config
    theirs = -build_mpt_alibi_tensor(c.n_head, 2)[:, 0, 0]  # (nh,): the bias at distance 1
    ours = model.encoding.score_bias(torch.arange(c.n_head), torch.tensor(1), torch.tensor(0))
    if not torch.allclose(-theirs, ours, rtol=1e-6, atol=0):
        raise ExportError(
            f"MPT's ALiBi slopes differ from this model's for {c.n_head} heads, by up to "
            f"{(ours + theirs).abs().max():.3g}: no exact export"
        )
    if c.gelu != "exact":
        raise ExportError(
            "MPT's MLP uses the exact GELU and this model was trained with "
            "gelu='tanh': no exact export"
        )
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
        idx = torch.randint(
            0, c.vocab_size, (1, min(c.block_size, 256)), generator=torch.Generator().manual_seed(0)
        )
        with torch.no_grad():
            diff = (hf(idx).logits - model(idx)[0]).abs().max().item()
        raise ExportError(
            f"MPT has no biases and this model has {len(dropped)} non-zero bias tensors: dropping "
            "them changes the "
            f"logits by up to {diff:.3g} on a test sequence; ALiBi exports exactly from a model "
            "trained with bias=False"
        )
    return hf


def write_remote(
    model: GPT, folder: Path, dtype: str, eot: int | None, read_eot_as: int | None
) -> None:
    """nanoPE's own GPT as a folder that carries its code: model.py byte for byte, and
    export/modeling_nanope.py, the transformers wrapper that imports it. config.json maps the Auto
    classes to them and records their sha256 (which the wrapper checks at load); the weights go
    under the wrapper's `gpt.` prefix, lm_head left out as transformers leaves a tied weight out.
    eot: the end of text where the model has it (GPT-2's); read_eot_as: the token that a
    character-level tokenizer's <|endoftext|>, past the model's vocabulary, reads as. Nothing of the
    folder's code runs here."""
    from safetensors.torch import save_file
    from transformers import GenerationConfig, __version__

    for src in CODE_FILES:
        shutil.copyfile(src, folder / src.name)
    T = model.config.block_size
    config = {
        "architectures": ["NanoPEForCausalLM"],
        "auto_map": {
            "AutoConfig": f"{REMOTE_MODULE}.NanoPEConfig",
            "AutoModelForCausalLM": f"{REMOTE_MODULE}.NanoPEForCausalLM",
        },
        "model_type": "nanope",
        "model_args": dataclasses.asdict(model.config),
        "code_sha256": {
            src.name: hashlib.sha256((folder / src.name).read_bytes()).hexdigest()
            for src in CODE_FILES
        },
        # transformers' and lm-eval's notion of the context (lm-eval's default window): the last
        # position of an encoding that stops at block_size, else 16x it (as far as this project
        # evaluates; nothing stops longer)
        "max_position_embeddings": 16 * T if model.encoding.extrapolates else T,
        "read_eot_as": read_eot_as,
        "tie_word_embeddings": True,
        "bos_token_id": eot,
        "eos_token_id": eot,
        "dtype": dtype,
        "transformers_version": __version__,
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    GenerationConfig(bos_token_id=eot, eos_token_id=eot).save_pretrained(folder)
    state = model.state_dict()
    weights = {
        f"gpt.{k}": v.to(DTYPES[dtype]).contiguous()
        for k, v in state.items()
        if k != "lm_head.weight"
    }
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})


def stand_in(chars: str, preferred: str) -> int:
    """The id of the character that stands in for one the model cannot read: preferred where the
    vocabulary has it, else its first character."""
    return chars.index(preferred) if preferred in chars else 0


def hf_tokenizer(meta: dict):
    """A PreTrainedTokenizerFast that encodes and decodes as lib/tokenizer.py's tokenizer for this
    meta (text outside a character vocabulary aside), with the special tokens transformers and
    lm-eval expect: an end of text, which is also the start of text and the padding, at the left
    (decoder-only generation pads there)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    kind = meta["kind"]
    if kind == "gpt2":
        from transformers.convert_slow_tokenizer import TikTokenConverter

        tokenizer_from_meta(meta)  # checks the ranks file's hash
        tok = TikTokenConverter(vocab_file=str(GPT2_RANKS), pattern=GPT2_PATTERN).converted()
        fast = PreTrainedTokenizerFast(
            tokenizer_object=tok,
            padding_side="left",
            **dict.fromkeys(SPECIAL_TOKENS + ("unk_token",), EOT),
        )
        assert fast.convert_tokens_to_ids(EOT) == GPT2_EOT
        return fast
    if kind == "char":  # one token per character, joined back with nothing between
        chars = meta["chars"]
        # a character the model never saw reads as a space: any text evaluates, where ours stops at
        # it
        tok = Tokenizer(
            models.WordLevel(
                {ch: i for i, ch in enumerate(chars)}, unk_token=chars[stand_in(chars, " ")]
            )
        )
        tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
        tok.decoder = decoders.Fuse()
        # <|endoftext|> takes the id after the characters. It cannot be a character's: transformers
        # makes it special, and decoding skips special tokens (lm-eval's outputs would lose every
        # newline if "\n" were the end of text). Text never encodes to it (split_special_tokens): a
        # literal "<|endoftext|>" is characters, as in ours.
        return PreTrainedTokenizerFast(
            tokenizer_object=tok,
            clean_up_tokenization_spaces=False,
            split_special_tokens=True,
            padding_side="left",
            **dict.fromkeys(SPECIAL_TOKENS, EOT),
        )
    if kind == "ids":  # token ids written as numbers separated by spaces
        vocab = {str(i): i for i in range(meta["vocab_size"])}
        tok = Tokenizer(models.WordLevel(vocab, unk_token=None))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        return PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False)
    raise ExportError(f"tokenizer kind {kind!r} does not export")


def check_positions(model: GPT, target: str, n_positions: int | None) -> int | None:
    """The length GPT-2's position table or MPT's ALiBi buffer spans, checked before anything is
    allocated: at least the training length (a shorter one fails on a training-length input), small
    enough to build, and only where the export has such a table (elsewhere the flag would be
    ignored)."""
    T = model.config.block_size
    pe = model.encoding
    if target not in ("gpt2", "mpt"):
        if n_positions is not None:
            raise ExportError(
                "--n_positions sizes GPT-2's position table and MPT's ALiBi buffer; this "
                f"{model.config.pos_encoding} "
                f"export has neither and reads any length its encoding reaches: drop --n_positions"
            )
        return None
    if n_positions is None:
        n_positions = 16 * T if pe.extrapolates else T
    if n_positions < T:
        raise ExportError(
            f"--n_positions={n_positions} is below the training length block_size={T}, which the "
            "model would then "
            f"fail to read: use --n_positions >= {T}"
        )
    if n_positions > pe.max_length:
        raise ExportError(
            f"--n_positions={n_positions}: a learned table has {T} rows; leave it out"
        )
    # float32 values: GPT-2's (n_positions, n_embd) table, built a few times over (init, ours, the
    # copy saved); MPT's (1, nh, 1, n_positions) bias, built again at every forward
    width, what = (
        (model.config.n_embd, "GPT-2's position table")
        if target == "gpt2"
        else (model.config.n_head, "MPT's ALiBi buffer")
    )
    need = 4 * 4 * n_positions * width
    memory = device_memory("cpu")
    if memory is not None and need > memory:
        raise ExportError(
            f"--n_positions={n_positions} makes {what} {n_positions} x {width} float32 values, "
            "about "
            f"{need / 1e9:.3g} GB to build, more than this machine's {memory / 1e9:.3g} GB: lower "
            "--n_positions "
            f"(the default is {16 * T}, as far as this project evaluates)"
        )
    return n_positions


def written_by_export(folder: Path) -> str | None:
    """None where folder is an export this script wrote (its nanope.json, and no file it did not
    write), else what it holds that an export does not."""
    path = folder / "nanope.json"
    if not path.is_file():
        return "it has no nanope.json, the mark of an export"
    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError):
        info = None
    files = info.get("files", LEGACY_FILES) if isinstance(info, dict) else None
    if not isinstance(files, (list, tuple)) or not all(isinstance(f, str) for f in files):
        return 'its nanope.json is not an export\'s (a JSON object whose "files" lists file names)'
    # the list says what a replacement deletes: a name no export writes would delete a file of the
    # user's
    if strays := sorted(set(files) - EXPORT_FILES):
        return f"its nanope.json lists {', '.join(map(repr, strays))}, which no export writes"
    others = sorted(
        p.name + ("/" if p.is_dir() else "")
        for p in folder.iterdir()
        if p.name not in files or not p.is_file() or p.is_symlink()
    )
    if others:
        return (
            "it holds what no export writes "
            f"({', '.join(others[:3])}{', ...' if len(others) > 3 else ''})"
        )
    return None


def check_out(out: Path, overwrite: bool = False, ckpt_path: Path | None = None) -> Path:
    """out is a folder this export may write: new, empty, or (with overwrite) an earlier export,
    never the folder of the checkpoint being exported or one that holds it; and its parent folder
    takes files. Raises ExportError naming the problem and the fix before anything is written;
    returns out, resolved."""
    flag = f"--out {str(out)!r}"
    if out.is_symlink():
        raise ExportError(f"{flag} is a symbolic link; give the folder itself")
    out = out.resolve()
    # the run's folder as given, and the checkpoint's own where ckpt.pt is a link
    runs = (
        []
        if ckpt_path is None
        else [ckpt_path.absolute().parent.resolve(), ckpt_path.resolve().parent]
    )
    for run in runs:
        if run == out or out in run.parents:
            raise ExportError(
                f"{flag} {'is' if run == out else 'holds'} the run being exported ({run}): "
                "replacing it would delete "
                "its checkpoints; write the export elsewhere, e.g. --out "
                f"{run.parent / ('hf-' + run.name)}"
            )
    if out.exists() and not out.is_dir():
        raise ExportError(f"{flag} is a file, and an export is a folder: give a new folder's name")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise ExportError(
                f"{out} exists and is not empty: choose another --out, or pass "
                "--overwrite to replace it"
            )
        problem = written_by_export(out)
        if problem:
            raise ExportError(
                f"--overwrite replaces only an earlier export, and {out} is not one: {problem}; "
                "choose another --out"
            )
    if not out.parent.is_dir():
        raise ExportError(
            f"{flag}: the folder {out.parent} does not exist; create it, or write elsewhere"
        )
    if problem := cannot_write(out.parent):
        raise ExportError(f"{flag}: cannot write in {out.parent} ({problem}); write elsewhere")
    return out


def new_folder(out: Path, kind: str) -> Path:
    """A folder beside out that this process creates (mkdir fails on an existing one, so nothing of
    a user's is reused or later deleted), with the permissions of any new folder (mkdtemp's are the
    owner's alone)."""
    folder = out.parent / f".{out.name}.{uuid.uuid4().hex[:8]}.{kind}"
    folder.mkdir()
    return folder


def replace_folder(tmp: Path, out: Path) -> None:
    """Move the finished export tmp to out: onto nothing or an empty folder, or in place of an
    earlier export, which is moved aside first and deleted only once the new one is in place."""
    if not (out.is_dir() and any(out.iterdir())):
        os.replace(tmp, out)  # POSIX renames a folder onto an empty one
        return
    old = new_folder(out, "old")
    os.replace(out, old)  # onto the empty folder just made
    try:
        os.replace(tmp, out)
    except OSError:
        os.replace(old, out)
        raise
    shutil.rmtree(old)


def export(
    ckpt: dict,
    out: Path,
    dtype: str | None = None,
    n_positions: int | None = None,
    overwrite: bool = False,
    ckpt_path: Path | None = None,
    remote_code: bool = False,
) -> Path:
    """Write the Hugging Face directory for a loaded checkpoint; returns out. dtype: the weights'
    dtype in the files (default: the checkpoint's training dtype where it is bf16/fp16, else
    float32). out must be new or empty, or with overwrite an earlier export; ckpt_path, the
    checkpoint's file, must not be in it."""
    out = check_out(Path(out), overwrite, ckpt_path)
    try:
        model = model_from_checkpoint(ckpt).float().eval()
    # an unknown encoding or option, weights of another shape
    except (TypeError, ValueError, RuntimeError) as e:
        raise ExportError(f"the checkpoint does not build a model of this nanoPE: {e}") from e
    # packing="documents": no transformers architecture keeps a row's documents apart at its
    # end-of-text token
    native = not remote_code and model.config.packing == "stream"
    target = (native and architecture(type(model.encoding))) or "nanope"
    if "tokenizer" not in ckpt:
        raise ExportError(
            "the checkpoint stores no tokenizer (a nanoGPT checkpoint?); retrain with train.py"
        )
    dtype = dtype or ckpt.get("config", {}).get("dtype") or "float32"
    dtype = dtype if dtype in DTYPES else "float32"
    n_positions = check_positions(model, target, n_positions)
    tok = hf_tokenizer(ckpt["tokenizer"])
    if target == "mpt":
        hf = to_mpt(model, n_positions)
    elif target == "gpt2":
        hf = to_gpt2(model, n_positions)
    elif target == "gpt_neox":
        hf = to_neox(model)
    else:  # nanoPE's own code: written below
        hf = None
    # written whole in a new folder beside out, then renamed: never half an export, never a user's
    # folder reused
    tmp = new_folder(out, "tmp")
    try:
        meta = ckpt["tokenizer"]
        eot = GPT2_EOT if meta["kind"] == "gpt2" else None  # generate stops at GPT-2's end of text
        if target == "nanope":
            # a character-level <|endoftext|> (lm-eval's default prefix) reads as a newline, where
            # texts start, or as the token that begins a document where the model packs documents
            read_eot_as = None
            if meta["kind"] == "char":
                documents = model.config.packing == "documents"
                read_eot_as = model.config.eot_token if documents else stand_in(meta["chars"], "\n")
            write_remote(model, tmp, dtype, eot, read_eot_as)
        else:
            hf.config.dtype = dtype
            if eot is not None:
                hf.config.bos_token_id = hf.config.eos_token_id = eot
                hf.generation_config.bos_token_id = hf.generation_config.eos_token_id = eot
            hf.to(DTYPES[dtype]).save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        info = {"pos_encoding": model.config.pos_encoding, "architecture": target, "dtype": dtype}
        # what --overwrite may replace
        info["files"] = sorted([p.name for p in tmp.iterdir()] + ["nanope.json"])
        (tmp / "nanope.json").write_text(json.dumps(info, indent=1))
        replace_folder(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(
        prog="python -m export",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_run_folders(p, "out_dir", help="a training run's folder (its ckpt.pt)")
    p.add_argument("--out", required=True, help="the directory to write")
    p.add_argument(
        "--ckpt", default="ckpt.pt", help="which checkpoint of the run (ckpt_best.pt: the best)"
    )
    p.add_argument(
        "--dtype",
        choices=list(DTYPES),
        default=None,
        help="default: the run's dtype (float32 on CPU)",
    )
    p.add_argument(
        "--n_positions",
        type=int,
        default=None,
        help="GPT-2's position table, MPT's ALiBi buffer: at least block_size (default: 16x "
        "block_size; learned: it)",
    )
    p.add_argument(
        "--overwrite", action="store_true", help="replace --out if it is an earlier export"
    )
    p.add_argument(
        "--remote_code",
        action="store_true",
        help="nanoPE's own model code in the folder (trust_remote_code), also for encodings "
        "transformers has",
    )
    args = p.parse_args(argv)
    if problem := missing("transformers", "python -m export"):
        sys.exit(f"error: {problem}")
    ckpt_path = Path(args.out_dir) / args.ckpt
    try:
        if args.n_positions is not None and args.n_positions < 1:
            raise ExportError(
                f"--n_positions={args.n_positions} must be at least 1 (and at least block_size)"
            )
        # before the checkpoint loads; export() checks again
        check_out(Path(args.out), args.overwrite, ckpt_path)
        ckpt = load_checkpoint(ckpt_path)
        path = export(
            ckpt,
            Path(args.out),
            args.dtype,
            args.n_positions,
            args.overwrite,
            ckpt_path,
            args.remote_code,
        )
    except (CheckpointError, ExportError) as e:
        sys.exit(f"error: {e}")
    remote = ", trust_remote_code=True" if (path / "modeling_nanope.py").exists() else ""
    load = f"AutoModelForCausalLM.from_pretrained({str(path)!r}{remote})"
    print(f"wrote {path}: {load} and AutoTokenizer{' (the same flag)' if remote else ''} load it")
    if not remote and ckpt["tokenizer"]["kind"] == "char":
        print(
            "its model cannot read the tokenizer's <|endoftext|>, which pads batches and starts "
            "lm-eval's texts: for "
            "those, export with --remote_code (docs/export.md)"
        )
    return path


if __name__ == "__main__":
    main()
