"""
nanoGPT-style configuration for the scripts: `python train.py [config files...] [--key=value...]`, later ones win.

Config files are small Python files of assignments. Every key must already have a default: a misspelled key is an
error naming the closest valid one, and values are checked against the default's type (an int is fine for a
float; a default of None takes anything). A bare `--flag` means `--flag=True`.
"""

import ast
import difflib
from pathlib import Path
from types import ModuleType

import torch


class ConfigError(ValueError):
    pass


def configure(defaults: dict, argv: list[str]) -> dict:
    """Return defaults updated by the config files and --key=value overrides in argv."""
    config = dict(defaults)
    for arg in argv:
        if arg.startswith("--"):
            key, eq, text = arg[2:].partition("=")
            _set(config, defaults, key, _parse(text) if eq else True, "the command line")
        else:
            path = Path(arg)
            if not path.is_file():
                raise ConfigError(f"config file {arg!r} not found (options are written --key=value)")
            values: dict = {}
            exec(compile(path.read_text(), str(path), "exec"), {}, values)
            for key, value in values.items():
                if not key.startswith("_") and not isinstance(value, ModuleType):
                    _set(config, defaults, key, value, str(path))
    return config


def _parse(text: str):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text  # a bare string, e.g. --device=cpu


def _set(config: dict, defaults: dict, key: str, value, source: str) -> None:
    if key not in defaults:
        close = difflib.get_close_matches(key, defaults, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else f"; valid keys: {', '.join(sorted(defaults))}"
        raise ConfigError(f"unknown config key {key!r} in {source}{hint}")
    default = defaults[key]
    if default is not None and value is not None:
        if isinstance(default, bool) != isinstance(value, bool):
            raise ConfigError(f"{key}={value!r} in {source}: expected True or False")
        if isinstance(default, float) and isinstance(value, int):
            value = float(value)
        if not isinstance(value, type(default)):
            raise ConfigError(
                f"{key}={value!r} in {source}: expected a {type(default).__name__} like the default {default!r}"
            )
    config[key] = value


def default_device() -> str:
    """The best device here: cuda, then mps, then cpu."""
    if torch.cuda.is_available():
        return "cuda"
    if torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def default_dtype(device: str) -> str:
    """bfloat16 where the GPU supports it, else float16 (with a GradScaler in training); float32 on CPU."""
    if device.startswith("cuda"):
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    return "float32"
