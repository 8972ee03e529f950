"""
Sample from a trained model, rebuilt (with its tokenizer) from the checkpoint alone:
    python sample.py --out_dir=out-rope
    python sample.py --out_dir=out-rope --start=FILE:prompt.txt --max_context=1024 --top_p=0.9
    python sample.py --out_dir=out-rope --max_context=1024 --rope_scaling=yarn  # 4x 256, YaRN
    python sample.py --out_dir=out-rope --ckpt=ckpt_best.pt   # the lowest-val-loss checkpoint
    python sample.py --init_from=gpt2 --start="Hello, I'm a language model,"
"""

import math
import os
import sys
import time
from functools import partial
from pathlib import Path

import torch

from generate import cache_size, context_window, generate, sampling_problem
from lib.checkpoint import CheckpointError, checkpoints, load_checkpoint, model_from_checkpoint
from lib.configurator import ConfigError, configure, require, script_usage
from lib.devices import (
    DTYPES,
    allow_tf32,
    autocast,
    check_device,
    default_device,
    default_dtype,
    device_memory,
    forward_bytes,
    gb,
    missing,
)
from lib.options import idle_option
from lib.tokenizer import CharTokenizer, GPT2Tokenizer, IdsTokenizer, tokenizer_from_meta
from model import GPT, ROPE_SCALINGS

# --------------------------------------------------------------------------------------------------
defaults = dict(
    init_from="resume",  # 'resume' (from out_dir/ckpt.pt) or a GPT-2 name: 'gpt2', 'gpt2-medium', …
    out_dir="out",  # folder holding ckpt.pt
    # the checkpoint in out_dir: ckpt.pt (the latest) or ckpt_best.pt (lowest val loss)
    ckpt="ckpt.pt",
    start="\n",  # the prompt, or "FILE:prompt.txt" to read it from a file
    num_samples=3,  # >= 1
    max_new_tokens=500,  # >= 1
    temperature=0.8,  # >= 0: 1.0 unchanged, < 1 more conservative, 0 greedy
    top_k=200,  # keep only the top_k (>= 1) likeliest tokens (None: all)
    top_p=None,  # nucleus sampling, in (0, 1]: the fewest tokens whose probability reaches top_p
    # longest context attended to (default block_size; may exceed it if the encoding extrapolates)
    max_context=None,
    # re-run the whole context every token instead of using the KV cache (nanoGPT's way)
    no_cache=False,
    seed=1337,
    device=default_device(),  # cpu, cuda, cuda:1, mps
    # float32 | bfloat16 | float16; empty: bfloat16 where supported on GPU, else float16; CPU
    # float32
    dtype="",
    # torch.compile the one-token decode step (a CUDA graph on GPU): slower start, faster tokens
    compile=False,
    # RoPE models, to read past the training length: linear | ntk | dynamic_ntk | yarn | llama3
    rope_scaling="",
    # rope_scaling's factor s >= 1 (default: max_context / block_size; dynamic_ntk: 1)
    rope_factor=0.0,
)


def check_options(cfg: dict) -> None:
    """The ranges of the sampling options, checked before any work; each error names the value and
    the rule."""

    need = partial(require, cfg, sep=": ")

    need(cfg["num_samples"] >= 1, "num_samples", "must be >= 1")
    need(cfg["max_new_tokens"] >= 1, "max_new_tokens", "must be >= 1")
    # generate()'s rule
    if problem := sampling_problem(cfg["temperature"], cfg["top_k"], cfg["top_p"]):
        need(False, *problem)
    mc = cfg["max_context"]
    need(
        mc is None or (type(mc) is int and mc >= 1),
        "max_context",
        "must be an integer >= 1, or None (block_size)",
    )
    need(
        cfg["rope_scaling"] in ("", *ROPE_SCALINGS),
        "rope_scaling",
        f"choose one of {', '.join(ROPE_SCALINGS)}",
    )
    need(
        cfg["rope_factor"] == 0 or 1 <= cfg["rope_factor"] < math.inf,
        "rope_factor",
        "must be a number >= 1 (0: the default)",
    )
    need(cfg["dtype"] in ("", *DTYPES), "dtype", "choose float32, bfloat16 or float16")
    need(
        cfg["ckpt"] != "", "ckpt", "name a checkpoint file in out_dir, e.g. ckpt.pt or ckpt_best.pt"
    )
    need(0 <= cfg["seed"] < 2**64, "seed", "must be an integer from 0 to 2**64 - 1")
    check_device(cfg["device"])


def checkpoint_advice(out_dir: Path, ckpt_path: Path) -> str:
    """What to do when ckpt_path cannot be loaded: advice that train.py accepts for out_dir, and
    that never has it replace a run that might still be read."""
    if out_dir.is_file():
        return (
            f"--out_dir={out_dir} is a file; give the folder that holds the checkpoint, e.g. "
            f"--out_dir={out_dir.parent}"
        )
    # nothing there
    if not os.path.lexists(ckpt_path) and not os.path.lexists(ckpt_path.with_suffix(".dcp")):
        found = [path.name for path in checkpoints(out_dir)]
        if found:  # --ckpt=ckpt.pt reads a sharded ckpt.dcp where it is alone
            return (
                f"{out_dir} holds {', '.join(found)}: sample from one with "
                f"--ckpt={found[0].replace('.dcp', '.pt')}"
            )
        return f"Train a model first, e.g.: python train.py config/rope.py --out_dir={out_dir}"
    best = out_dir / "ckpt_best.pt"
    if best != ckpt_path:
        try:
            load_checkpoint(best)
            return (
                f"A run cannot be resumed from it either; {best} is readable: sample from it with "
                "--ckpt=ckpt_best.pt"
            )
        except CheckpointError:
            pass
    # a sharded checkpoint whose folder of shards is missing or incomplete
    if not ckpt_path.is_file():
        return (
            "Restore the folder its link names (the run's shards/, copied whole), or start afresh "
            f"in {out_dir}, "
            f"replacing the run: python train.py config/rope.py --out_dir={out_dir} "
            "--overwrite=True"
        )
    # unreadable: nothing can resume from it, so never suggest training into this out_dir again
    return (
        "A run cannot be resumed from it either; train a new model into a new folder, e.g. "
        f"--out_dir={out_dir}-2, "
        f"and keep {out_dir} as it is"
    )


def load(cfg: dict) -> tuple[GPT, CharTokenizer | GPT2Tokenizer | IdsTokenizer]:
    """The model and tokenizer of out_dir's checkpoint; an error names what is wrong and what to
    do."""
    out_dir = Path(cfg["out_dir"])
    ckpt_path = out_dir / cfg["ckpt"]
    try:
        ckpt = load_checkpoint(ckpt_path)
    except CheckpointError as e:
        sys.exit(f"error: {e}\n{checkpoint_advice(out_dir, ckpt_path)}")
    model = model_from_checkpoint(ckpt)
    V = model.config.vocab_size
    if "tokenizer" in ckpt:
        tok = tokenizer_from_meta(ckpt["tokenizer"])
        if tok.vocab_size > V or (isinstance(tok, CharTokenizer) and tok.vocab_size != V):
            sys.exit(
                f"error: {ckpt_path}'s tokenizer has {tok.vocab_size} tokens but its model's "
                f"vocabulary is {V}: "
                "the dataset's meta.json disagreed with itself when this model trained; re-run the "
                "dataset's "
                "prepare.py and train again"
            )
    elif V >= GPT2Tokenizer.vocab_size:  # a nanoGPT checkpoint: GPT-2's BPE, as it assumes
        tok = GPT2Tokenizer()
    else:
        sys.exit(
            f"error: {ckpt_path} does not record its tokenizer and its vocabulary is not GPT-2's"
        )
    return model, tok


def generation_bytes(model: GPT, prompt: int, new: int, window: int, cache: bool) -> int:
    """The least memory generate takes: the tokens, the KV cache (keys and values of every layer,
    fp32, for the window and a prompt's chunk) and the largest forward (the prompt's prefill, or
    without the cache the whole window)."""
    c = model.config
    kv = 8 * c.n_layer * c.n_embd * cache_size(model.encoding, window, prompt) if cache else 0
    return (
        8 * (prompt + new)
        + kv
        + forward_bytes(model, min(prompt, window) if cache else window, logits=False)
    )


def main(argv: list[str]) -> None:
    if "--help" in argv or "-h" in argv:
        print(script_usage(__file__, __doc__))
        return
    cfg = configure(defaults, argv)
    check_options(cfg)
    device = cfg["device"]
    dtype = cfg["dtype"] or default_dtype(cfg["device"])
    torch.manual_seed(cfg["seed"])
    allow_tf32(device)

    # ----------------------------------------------------------------------------------------------
    # model and tokenizer
    if cfg["init_from"] == "resume":
        model, tok = load(cfg)
    else:
        if problem := missing("transformers", f"init_from={cfg['init_from']!r}"):
            sys.exit(f"error: {problem}")
        try:
            model = GPT.from_pretrained(cfg["init_from"])
            tok = GPT2Tokenizer()
        # offline, a misspelled name, no transformers
        except (OSError, ImportError, ValueError) as e:
            sys.exit(f"error: cannot load GPT-2 weights from init_from={cfg['init_from']!r}: {e}")
    model.eval().to(device)
    given = {k: cfg[k] for k in ("rope_scaling", "rope_factor") if cfg[k]}  # "" and 0: not given
    for name, value in given.items():
        if problem := idle_option(model.config.pos_encoding, name, value, given):
            sys.exit(f"error: {problem}")
    if cfg["rope_scaling"]:
        try:
            pe = model.encoding
            length = cfg["max_context"] or model.config.block_size
            T = model.config.block_size
            default = pe.default_factor(cfg["rope_scaling"], length, T) if pe.rope_scalable else 1.0
            model.set_rope_scaling(cfg["rope_scaling"], cfg["rope_factor"] or default)
        except ValueError as e:
            sys.exit(f"error: {e}")
    ctx = autocast(device, dtype)

    # ----------------------------------------------------------------------------------------------
    # prompt
    start = cfg["start"]
    if start.startswith("FILE:"):
        try:
            start = Path(start[5:]).read_text(encoding="utf-8")
        except OSError as e:
            sys.exit(f"error: cannot read the prompt file: {e}")
        except UnicodeDecodeError as e:
            sys.exit(
                f"error: the prompt file {start[5:]} is not UTF-8 text (byte {e.start}: "
                f"{e.reason}); give a text file"
            )
    try:
        ids = tok.encode(start)
        max_context = context_window(model, cfg["max_context"])
    except ValueError as e:
        sys.exit(f"error: {e}")
    if not ids:
        example = "0 17 5" if isinstance(tok, IdsTokenizer) else "Once upon a time"
        sys.exit(
            "error: the prompt is empty after tokenization; pass --start with some, e.g. "
            f"--start='{example}'"
        )
    if not model.encoding.extrapolates and len(ids) > max_context:
        sys.exit(
            f"error: the prompt is {len(ids)} tokens, but this "
            f"{model.config.pos_encoding}-position model takes at "
            f"most {max_context}; shorten the prompt"
        )
    # the context never outgrows the prompt and the new tokens: a longer window changes only the
    # memory it takes
    max_context = min(max_context, len(ids) + cfg["max_new_tokens"])
    need = generation_bytes(
        model, len(ids), cfg["max_new_tokens"], max_context, not cfg["no_cache"]
    )
    memory = device_memory(device)
    if memory and need > memory:
        sys.exit(
            f"error: generating {cfg['max_new_tokens']} tokens with a context of {max_context} "
            "needs at least "
            f"{gb(need)}, more than the {gb(memory)} of {device}; use a smaller --max_context or "
            "--max_new_tokens"
        )
    x = torch.tensor(ids, dtype=torch.long, device=device)[None]

    # ----------------------------------------------------------------------------------------------
    # generate
    with torch.no_grad(), ctx:
        for _ in range(cfg["num_samples"]):
            t0 = time.perf_counter()
            y = generate(
                model,
                x,
                cfg["max_new_tokens"],
                temperature=cfg["temperature"],
                top_k=cfg["top_k"],
                top_p=cfg["top_p"],
                use_cache=not cfg["no_cache"],
                max_context=max_context,
                compile=cfg["compile"],
            )
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            print(tok.decode(y[0].tolist()))
            n = y.size(1) - x.size(1)
            print(
                f"--------------- {n} tokens in {dt:.2f}s ({n / dt:.1f} tokens/s)", file=sys.stderr
            )


def cli(argv: list[str]) -> None:
    """main as a command: a bad option is one line on stderr and exit status 1, never a
    traceback."""
    try:
        main(argv)
    except ConfigError as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    cli(sys.argv[1:])
