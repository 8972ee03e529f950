"""The house rules, kept by tests: the walk a reader takes through a generation (counted by the
interpreter, listed in docs/development.md, quoted by the README) and the size budgets of the files
a reader holds."""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ENCODINGS

from generate import generate
from model import GPT, GPTConfig

ROOT = Path(__file__).resolve().parent.parent
DEVELOPMENT = ROOT / "docs" / "development.md"

# The most definitions each encoding's walk may take today (the goals, in docs/development.md, are
# lower: a change lowers a ceiling as it meets it, and one that needs more makes room first)
WALK_CEILING = {"rope": 18, "alibi": 20}
WALK_CEILING_ANY = 24  # every other encoding's


def definition(code) -> str | None:
    """The project's definition a code object belongs to, as `module.Qualified.name` (a class's
    __init__ as the class, a nested function, lambda or comprehension as the definition around it),
    or None outside the project's files."""
    path = Path(code.co_filename)
    if path.parent != ROOT:
        return None
    name = code.co_qualname.split(".<locals>")[0].removesuffix(".__init__")
    return f"{path.stem}.{name}"


def walk(encoding: str) -> list[str]:
    """Every definition of the project's files that runs while a tiny model generates 3 tokens
    greedily through its KV cache on a CPU, each once, in the order they first run."""
    torch.manual_seed(0)
    config = GPTConfig(
        block_size=16, vocab_size=32, n_layer=2, n_head=2, n_embd=16, pos_encoding=encoding
    )
    model = GPT(config).eval()
    idx = torch.randint(0, 32, (1, 4))
    seen: dict[str, None] = {}

    def profile(frame, event, arg):
        if event == "call" and (name := definition(frame.f_code)):
            seen.setdefault(name, None)

    sys.setprofile(profile)
    try:
        generate(model, idx, 3, temperature=0)
    finally:
        sys.setprofile(None)
    return list(seen)


@pytest.fixture(scope="module")
def walks() -> dict[str, list[str]]:
    return {e: walk(e) for e in ENCODINGS}


def documented_walks() -> tuple[set[str], dict[str, tuple[int, set[str]]]]:
    """docs/development.md's list of the definitions every walk takes, and its table: each
    encoding's count and the definitions it takes beyond that list."""
    text = DEVELOPMENT.read_text()
    shared = re.search(r"^Every encoding's walk takes these \d+: (.*)$", text, re.M)
    assert shared, "docs/development.md has no line 'Every encoding's walk takes these N: ...'"
    rows = {
        m[1]: (int(m[2]), set(re.findall(r"`([\w.]+)`", m[3])))
        for m in re.finditer(r"^\| `(\w+)` \| (\d+) \| (.*) \|$", text, re.M)
    }
    return set(re.findall(r"`([\w.]+)`", shared[1])), rows


def test_the_walk_is_within_its_ceiling(walks):
    """A new token's walk, for every encoding, takes no more definitions than its ceiling."""
    for e, names in walks.items():
        ceiling = WALK_CEILING.get(e, WALK_CEILING_ANY)
        assert len(names) <= ceiling, (
            f"{e}'s walk takes {len(names)} definitions, over {ceiling}: {names}"
        )


def test_the_docs_list_the_walk_the_run_takes(walks):
    """docs/development.md lists exactly the definitions each encoding's walk runs: the shared ones,
    then each encoding's own (a change to the walk changes the list)."""
    shared = set.intersection(*(set(w) for w in walks.values()))
    documented_shared, rows = documented_walks()
    assert documented_shared == shared, (
        f"the shared list differs: the run adds {sorted(shared - documented_shared)}, "
        f"drops {sorted(documented_shared - shared)}"
    )
    assert set(rows) == set(walks), (
        f"the table's encodings {sorted(rows)} are not the registry's {sorted(walks)}"
    )
    for e, names in walks.items():
        count, own = rows[e]
        assert (count, own) == (len(names), set(names) - shared), (
            f"{e}: the docs say {count} definitions and {sorted(own)}, the run takes {len(names)} "
            "and "
            f"{sorted(set(names) - shared)}"
        )


def test_the_readme_quotes_the_walk(walks):
    """The README's counts of the walk are the run's, for RoPE and ALiBi."""
    readme = (ROOT / "README.md").read_text()
    m = re.search(r"(\d+)\s+definitions\s+for\s+RoPE\s+and\s+(\d+)\s+for\s+ALiBi", readme)
    assert m, "the README has no 'N definitions for RoPE and M for ALiBi'"
    assert (int(m[1]), int(m[2])) == (len(walks["rope"]), len(walks["alibi"]))


def test_the_readme_table_is_the_registry():
    """The README's table of encodings has a row for each encoding of the registry, and no other (a
    new encoding meets this test, not a silent gap)."""
    readme = (ROOT / "README.md").read_text()
    rows = re.findall(
        r"^\| "
        r"`(\w+)` \|",
        readme.split("## Quickstart")[0],
        re.M,
    )[1:]  # after the header
    assert rows == ENCODINGS, (
        f"the README's table lists {rows}; the registry has {ENCODINGS}: add or remove a row"
    )


def test_lists_of_encodings_are_the_registry_s():
    """The lists of encodings kept outside the registry name only its encodings (a renamed or
    removed one is seen)."""
    from compare import sweep

    assert set(sweep.EXTEND_ENCODINGS) <= set(ENCODINGS), set(sweep.EXTEND_ENCODINGS) - set(
        ENCODINGS
    )


def test_the_walk_counts_what_runs():
    """The counter sees a definition that runs and not one that does not: a nested function counts
    as the one around it, a class's __init__ as the class."""
    names = walk("rope")
    assert "model.RoPE.rotate" in names and "generate.KVCache" in names
    assert "model.ALiBi.score_bias" not in names and not any(
        "<" in n or "__init__" in n for n in names
    )


# --------------------------------------------------------------------------------------------------
# Sizes: what a reader holds. Ceilings today; the goals (docs/development.md) are lower, and a
# change lowers a ceiling as it meets it

# Sizes in statements: the ast.stmt nodes that ast.walk finds, docstrings included, a count that
# packing lines cannot lower
MODEL_FILES = ("model.py", "fast_paths.py", "generate.py", "shape.py")
STATEMENT_CEILINGS = {
    "model.py": 648,
    "the model's files": 1482,
    "the GPT class": 115,
    "a function of the model's files": 40,
    "train.py": 299,
}
README_CEILING = 15000  # characters
LINE_LENGTH = 100  # pyproject's, for ruff format and E501 on every file


def statements(node: ast.AST) -> int:
    return sum(isinstance(n, ast.stmt) for n in ast.walk(node))


def sizes() -> dict[str, int]:
    """The statement counts that STATEMENT_CEILINGS bounds (a function's: the largest)."""
    trees = {name: ast.parse((ROOT / name).read_text()) for name in (*MODEL_FILES, "train.py")}
    nodes = [n for name in MODEL_FILES for n in ast.walk(trees[name])]
    functions = [n for n in nodes if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    (gpt,) = [
        n for n in ast.walk(trees["model.py"]) if isinstance(n, ast.ClassDef) and n.name == "GPT"
    ]
    return {
        "model.py": statements(trees["model.py"]),
        "the model's files": sum(statements(trees[name]) for name in MODEL_FILES),
        "the GPT class": statements(gpt),
        "a function of the model's files": max(statements(f) for f in functions),
        "train.py": statements(trees["train.py"]),
    }


def test_the_files_keep_their_size_budgets():
    """model.py, the model's files, the GPT class, every function of the model's files and
    train.py stay within their statements, and the README within its characters."""
    for what, n in sizes().items():
        assert n <= STATEMENT_CEILINGS[what], (
            f"{what}: {n} statements, over {STATEMENT_CEILINGS[what]}"
        )
    n = len((ROOT / "README.md").read_text())
    assert n <= README_CEILING, f"README.md has {n} characters, over its budget of {README_CEILING}"


def test_every_file_keeps_the_line_length():
    """Every Python file is formatted by ruff at pyproject's line length, with no line longer."""
    import subprocess

    assert f"line-length = {LINE_LENGTH}\n" in (ROOT / "pyproject.toml").read_text()
    for check in (["format", "--check"], ["check", "--select", "E501"]):
        r = subprocess.run(
            [sys.executable, "-m", "ruff", *check, "."], cwd=ROOT, capture_output=True, text=True
        )
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


def test_the_docs_state_the_budgets():
    """docs/development.md's table of budgets states this file's ceilings."""
    text = DEVELOPMENT.read_text().split("### Budgets")[1].split("###")[0]
    rows = {m[1]: int(m[2]) for m in re.finditer(r"^\| (.+?) \| (\d+) \| \d+ \|$", text, re.M)}
    assert rows == {
        **{f"{what}, statements": n for what, n in STATEMENT_CEILINGS.items()},
        "`README.md`, characters": README_CEILING,
        "the walk (below) of RoPE, definitions": WALK_CEILING["rope"],
        "the walk of ALiBi, definitions": WALK_CEILING["alibi"],
        "the walk of any other encoding, definitions": WALK_CEILING_ANY,
    }


def test_what_the_documented_commands_write_is_ignored_by_git():
    """Every file or folder a command in the README or docs/ writes at the top of a clone (--out,
    --out_dir, --plot: exports, runs, studies, plots) is ignored by git, so a clone holding only
    those is clean (a study's report marks a tree with changes git sees as "with uncommitted
    changes")."""
    import subprocess

    outputs = set()
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for command in re.findall(r"python (?:[\w/]+\.py|-m [\w.]+) [^`\n]*", doc.read_text()):
            outputs |= {m[1] for m in re.finditer(r"--(?:out|out_dir|plot)[= ]([\w./-]+)", command)}
    assert {"hf-rope", "probe.png", "out-rope", "sweep-cpu"} <= outputs, outputs
    written = lambda name: (
        ["train.bin", "val.bin", "meta.json"] if name.startswith("data/") else ["a_file"]
    )  # noqa: E731
    paths = [
        name if "." in name else f"{name}/{f}" for name in sorted(outputs) for f in written(name)
    ]
    ignored = subprocess.run(
        ["git", "check-ignore", *paths], cwd=ROOT, capture_output=True, text=True
    ).stdout.split()
    assert sorted(ignored) == sorted(paths), sorted(set(paths) - set(ignored))


def test_the_top_level_is_the_commands_and_the_model():
    """At the top of the repository: the two commands, the model and the few modules a reader of
    model.py opens beside it (at most 6 Python files); the library, the comparison's tools and the
    export sit in folders of their own."""
    top = sorted(p.name for p in ROOT.glob("*.py"))
    assert top == [
        "fast_paths.py",
        "generate.py",
        "model.py",
        "sample.py",
        "shape.py",
        "train.py",
    ], top
    assert all((ROOT / folder / "__init__.py").is_file() for folder in ("lib", "compare", "export"))


def test_training_imports_none_of_the_comparison_s_tools():
    """train.py (and everything it imports) loads no module of compare/: the rows it trains on, text
    or a task's sequences, come from lib/batches.py."""
    import subprocess

    code = (
        "import sys, train; print(sorted(m for m in sys.modules if m.split('.')[0] in ('compare', "
        "'export')))"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert r.stdout.strip() == "[]", r.stdout


def test_no_file_packs_assignments_into_tuples():
    """No assignment of a tuple literal holding a computed value to a tuple of targets (`a, b =
    f(x), g(y)`: one statement per value; a swap, names and constants alone, is fine), in every
    file git tracks."""
    import subprocess

    tracked = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True)

    def computed(e: ast.expr) -> bool:
        constant = isinstance(e, ast.UnaryOp) and isinstance(e.operand, ast.Constant)
        return not (isinstance(e, ast.Name | ast.Constant) or constant)

    packed = [
        f"{path.relative_to(ROOT)}:{n.lineno}"
        for path in (ROOT / name for name in tracked.stdout.split())
        if "fixtures" not in path.parts
        for n in ast.walk(ast.parse(path.read_text()))
        if isinstance(n, ast.Assign)
        and any(isinstance(t, ast.Tuple) for t in n.targets)
        and isinstance(n.value, ast.Tuple)
        and any(computed(e) for e in n.value.elts)
    ]
    assert not packed, packed


def test_the_model_s_docstrings_are_short():
    """Every docstring of the model's files is at most 3 lines (a line or two; the spec lives in
    docs/development.md)."""
    long = [
        f"{name}: {getattr(n, 'name', 'the module')}"
        for name in MODEL_FILES
        for n in ast.walk(ast.parse((ROOT / name).read_text()))
        if isinstance(n, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and len((ast.get_docstring(n, clean=False) or "").splitlines()) > 3
    ]
    assert not long, long


@pytest.mark.parametrize(
    "module", ["compare.bench", "compare.eval_length", "compare.probe", "compare.sweep",
               "compare.synthetic", "compare.tasks", "export.hf"],
)  # fmt: skip
def test_each_tool_names_the_one_way_to_run_it(module, capsys):
    """A tool's --help (and every usage error) names the command that runs it, python -m ...,
    not its file."""
    import importlib

    with pytest.raises(SystemExit):
        importlib.import_module(module).main(["--help"])
    command = "export" if module == "export.hf" else module
    assert capsys.readouterr().out.startswith(f"usage: python -m {command} ")
    # run by its path: one line naming that command, before any import of the project
    path = ROOT / (module.replace(".", "/") + ".py")
    r = subprocess.run([sys.executable, path, "--help"], capture_output=True, text=True, cwd=ROOT)
    assert (r.returncode, r.stdout) == (1, "")
    assert r.stderr == f"run it from the repository's root as: python -m {command}\n"


@pytest.mark.parametrize(
    "module", ["compare.eval_length", "compare.probe", "compare.synthetic", "export.hf"]
)
def test_a_tool_of_run_folders_shows_them_without_out_dir(module, capsys):
    """train.py's and sample.py's --out_dir=<folder>, given to a tool that takes the runs' folders
    as its arguments: one line that shows the command without it."""
    import importlib

    with pytest.raises(SystemExit) as stop:
        importlib.import_module(module).main(["--out_dir=out-rope", "--lengths", "64"])
    command = "export" if module == "export.hf" else module
    assert stop.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"python -m {command}: error: --out_dir is train.py's and sample.py's; here the folders "
        f"come as arguments: python -m {command} out-rope ..."
    )
