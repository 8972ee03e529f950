"""
nanoGPT-style configuration for the scripts: `python train.py [config files...] [--key=value...]`,
later ones win.

Config files are small Python files of assignments. Every key must already have a default: a
misspelled key is an error naming the closest valid one, and values are checked against the
default's type (an int is fine for a float; a default of None takes anything). A bare `--flag` means
`--flag=True` (for True/False options only).
"""

import ast
import difflib
import traceback
from pathlib import Path
from types import ModuleType


class ConfigError(ValueError):
    pass


def configure(
    defaults: dict, argv: list[str], explicit: set[str] | None = None, owners: dict | None = None
) -> dict:
    """Return defaults updated by the config files and --key=value overrides in argv. explicit, if
    given, receives the keys that a config file or the command line set (to any value, the default's
    too); owners: the option each of some values belongs to, for the hint when one is written as a
    key (--cope: --pos_encoding=cope)."""
    config = dict(defaults)
    explicit = set() if explicit is None else explicit
    for arg in argv:
        if arg.startswith("--"):
            key, eq, text = arg[2:].partition("=")
            default = defaults.get(key)
            if not eq and key in defaults and not isinstance(default, bool | None):
                example = repr(default) if default != "" else "..."
                raise ConfigError(
                    f"--{key} needs a value, e.g. --{key}={example} (only "
                    "True/False options go bare)"
                )
            value = _parse(text) if eq else True
            if isinstance(default, str) and eq and not isinstance(value, str):
                # a string option takes the text as written: --wandb_run_name=2024 is '2024'
                value = text
            _set(config, defaults, key, value, "the command line", owners)
            explicit.add(key)
        else:
            path = Path(arg)
            if not path.is_file():
                raise ConfigError(
                    f"config file {arg!r} not found (options are written --key=value)"
                )
            values = _run_config_file(path)
            for key, value in values.items():
                if not key.startswith("_") and not isinstance(value, ModuleType):
                    _set(config, defaults, key, value, str(path), owners)
                    explicit.add(key)
    return config


def _run_config_file(path: Path) -> dict:
    """The assignments of a config file; a mistake in it is one line naming the file and line, not a
    traceback."""
    values: dict = {}
    try:
        exec(compile(path.read_text(), str(path), "exec"), {}, values)
    except SyntaxError as e:
        raise ConfigError(
            f"{path}, line {e.lineno}: {e.msg} (config files are Python assignments: key = value)"
        ) from e
    # e.g. a NameError for an unquoted string: the file's own bug, reported as such
    except Exception as e:
        line = next(
            (
                f.lineno
                for f in reversed(traceback.extract_tb(e.__traceback__))
                if f.filename == str(path)
            ),
            "?",
        )
        raise ConfigError(f"{path}, line {line}: {type(e).__name__}: {e}") from e
    return values


def _parse(text: str):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text  # a bare string, e.g. --device=cpu


def _set(
    config: dict, defaults: dict, key: str, value, source: str, owners: dict | None = None
) -> None:
    if key not in defaults:
        close = difflib.get_close_matches(key, defaults, n=1)
        hint = (
            f"; did you mean {close[0]!r}?"
            if close
            else f"; valid keys: {', '.join(sorted(defaults))}"
        )
        if key in (owners or {}):  # a value written as a key
            hint = f"; did you mean --{owners[key]}={key}?"
        raise ConfigError(f"unknown config key {key!r} in {source}{hint}")
    default = defaults[key]
    if default is not None and value is not None:
        if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        # bool is a subclass of int: True is no batch size, and 1 is no flag
        if not isinstance(value, type(default)) or isinstance(default, bool) != isinstance(
            value, bool
        ):
            kind = _KINDS.get(type(default), f"a {type(default).__name__}")
            raise ConfigError(
                f"{key}={value!r} in {source}: expected {kind} like the default {default!r}"
            )
    config[key] = value


_KINDS = {int: "an integer", float: "a number", str: "a string", bool: "True or False"}


def script_usage(path: str, doc: str) -> str:
    """A script's --help: its docstring and its `defaults = dict(...)` block, comments and all
    (every key, its default and its choices)."""
    src = Path(path).read_text()
    start = src.index("defaults = dict(\n")
    block = src[start : src.index("\n)\n", start)]
    keys = "\n".join(line.strip() for line in block.splitlines()[1:])
    return (
        f"{doc.strip()}\n\nOptions (--key=value, or key = value in a config file), with their "
        f"defaults:\n{keys}"
    )


def require(cfg: dict, ok: bool, key: str, rule: str, sep: str = " ") -> None:
    """A range check of an option: unless ok, a ConfigError naming the key, its value and the rule
    (NaN fails every comparison, so it lands here too)."""
    if not ok:
        raise ConfigError(f"{key}={cfg[key]!r}{sep}{rule}")
