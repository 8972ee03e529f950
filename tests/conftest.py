"""Shared by every test module: the encodings from the registry, a tiny model, and comparisons.
Registering an encoding in model.POS_ENCODINGS puts it under every test parametrized over these
lists."""

import contextlib
import io
import multiprocessing
import os
import signal
import subprocess
import sys

# under pytest-xdist (make test: one worker per core), each worker and the processes its tests start
# use their share of the cores: two workers on two cores with two threads each would fight over them
if workers := int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", 0)):
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // workers))

import pytest  # noqa: E402
import torch  # noqa: E402

from generate import KVCache  # noqa: E402
from model import GPT, POS_ENCODINGS, GPTConfig  # noqa: E402

if not torch.cuda.is_available():
    # FlexAttention called without torch.compile (a CPU's fused path: forward only) runs its math
    # directly instead of tracing it with dynamo again for every new shape, seconds a call; the
    # outputs are the same. Not on a GPU: its tests take the unfused path's backward, which the
    # direct mode does not give
    torch.nn.attention.flex_attention._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = True

ENCODINGS = list(POS_ENCODINGS)
RELATIVE = [e for e in ENCODINGS if POS_ENCODINGS[e].relative]
ABSOLUTE = [e for e in ENCODINGS if not POS_ENCODINGS[e].relative]
# generation past the window keeps positions counting
ROLLING = [e for e in ENCODINGS if POS_ENCODINGS[e].rolling]
# ... crops and restarts them at 0 (nanoGPT)
CROPPING = [e for e in ENCODINGS if not POS_ENCODINGS[e].rolling]
EXTRAPOLATING = [e for e in ENCODINGS if POS_ENCODINGS[e].extrapolates]
BIASED = [e for e in ENCODINGS if POS_ENCODINGS[e].has_score_bias]
# a bias of the content (CoPE, FoX): no score_bias
CONTENT = [e for e in BIASED if POS_ENCODINGS[e].reads_content]
# a bias of positions alone: score_bias, FlexAttention
POSITION_BIASED = [e for e in BIASED if e not in CONTENT]
VOCAB = 64


def pytest_collection_modifyitems(items: list) -> None:
    """The slow tests lead each worker's share. pytest-xdist (worksteal) first gives each of its W
    workers a contiguous share of this list, the first n // W tests to the first, and so on; idle
    workers then take the tail of a busy one's queue. So each share starts with slow tests, a
    module's together (they share start-up costs: the first compile pays for the compiler's),
    modules dealt to the shares in turn; the fast tests fill the shares and end them, where they can
    be taken by whichever worker is free. With the slow tests in one share, one worker had more than
    half of the run's time to itself."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", 1))
    slow = [item for item in items if item.get_closest_marker("slow")]
    fast = [item for item in items if not item.get_closest_marker("slow")]
    modules = list(dict.fromkeys(item.path for item in slow))
    shares = [
        [item for item in slow if modules.index(item.path) % workers == w] for w in range(workers)
    ]
    ordered = []
    left = len(items)
    for w, share in enumerate(shares):
        size = left // (workers - w)  # as xdist splits the list
        left -= size
        fill = max(0, size - len(share))
        ordered += share + fast[:fill]
        fast = fast[fill:]
    items[:] = ordered + fast


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from scratch: dynamo keeps the graphs of earlier tests on GPT.forward, and
    past its limit of 8 recompilations silently runs eager, which would make a later compile test
    pass without compiling."""
    yield
    if "torch._dynamo" in sys.modules:
        torch._dynamo.reset()


@contextlib.contextmanager
def signal_handlers_kept():
    """Puts back the SIGINT and SIGTERM handlers that train.py installs when it runs in this
    process."""
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)


def train_in_process(argv: list[str]) -> None:
    """train.py's main in this process (no interpreter start-up), with the signal handlers it
    installs put back."""
    import train

    with signal_handlers_kept():
        train.main(argv)


def run_cli(cli, argv: list[str]) -> subprocess.CompletedProcess:
    """A script's command-line entry point (train.cli, sample.cli, export.main) run in this process,
    as `python script.py argv` would run it: SystemExit("message") is the message on stderr and
    status 1, argparse's exit its own status. Any other exception propagates, failing the test as a
    traceback would. Saves the interpreter's start (two seconds of importing torch) per call."""
    out = io.StringIO()
    err = io.StringIO()
    code = 0
    with signal_handlers_kept(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            cli(argv)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else int(e.code is not None)
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


def forkserver():
    """multiprocessing's forkserver context, its server preloading what the checkpoint tests'
    writers and train.py import (torch._dynamo too: AdamW's first call imports it): a fresh process
    forked from it starts at once, where a spawned one would spend two seconds importing torch. A
    process has one server, started with the preload list of the first caller: every test here asks
    for the same list."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(
        ["torch", "torch._dynamo", "checkpoint", "torch.distributed.checkpoint", "train"]
    )
    return ctx


def train_py_forked(argv: list[str], cwd: str, env: dict, log: str | None) -> None:
    """`python train.py argv` in a process forked from forkserver(): its own session, folder,
    environment and output, as compare/sweep.py starts one."""
    os.setsid()
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    if threads := env.get("OMP_NUM_THREADS"):
        # the server's OpenMP read the variable when it imported torch
        torch.set_num_threads(int(threads))
    if log:
        fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
    sys.argv = ["train.py", *argv]
    import train

    # its SystemExit("message") is the message on stderr and status 1, as Python's own
    train.cli(argv)


class ForkedTrainPy:
    """The part of subprocess.Popen compare/sweep.py uses, for its `python train.py ...` commands:
    the run forked from forkserver() (0.1 s to start, not 2.7). For the tests of a study's logic,
    which start 8 or 9 runs each; the tests of how compare/sweep.py starts, stops and reads its
    processes (Ctrl-C, a run stopped from outside, a sweep's first test) start real ones."""

    def __init__(
        self,
        cmd: list[str],
        cwd,
        env: dict,
        stdout=None,
        stderr=None,
        start_new_session: bool = True,
    ):
        assert cmd[0] == sys.executable and cmd[1] == "train.py" and start_new_session, cmd
        log = stdout.name if stdout is not None else None
        self.process = forkserver().Process(
            target=train_py_forked, args=(cmd[2:], str(cwd), dict(env), log)
        )
        self.process.start()
        self.pid = self.process.pid

    @property
    def returncode(self) -> int | None:
        return self.process.exitcode

    def poll(self) -> int | None:
        return self.process.exitcode

    def send_signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def wait(self) -> int:
        self.process.join()
        return self.process.exitcode


@pytest.fixture
def forked_train_py(monkeypatch):
    """compare/sweep.py's training runs forked from a server that has imported torch and train.py
    (ForkedTrainPy)."""
    import types

    from compare import sweep

    monkeypatch.setattr(sweep, "subprocess", types.SimpleNamespace(Popen=ForkedTrainPy))


@pytest.fixture
def flex_backward(monkeypatch) -> None:
    """FlexAttention's own backward on a CPU: its dense math, forward and backward (the check that
    refuses a CPU's backward lifted), so that the tests run the real call where a GPU runs its
    kernel."""
    monkeypatch.setattr(
        torch.nn.attention.flex_attention, "_validate_device", lambda *tensors: None
    )


@pytest.fixture
def cuda(monkeypatch, flex_backward) -> str:
    """The device of a CUDA test: "cuda" on a GPU; elsewhere the GPU's kernels emulated on the CPU
    ("cpu"): the kernel table answers for device "cuda" (FlexAttention's head-size floor included),
    FlexAttention runs its own dense forward and backward (its check that refuses a CPU's backward
    lifted), .cuda() leaves tensors and modules where they are, and torch.compile traces with
    aot_eager (Dynamo's graph and AOTAutograd's backward over eager kernels: inductor's CPU code is
    not what a GPU runs)."""
    if torch.cuda.is_available():
        return "cuda"
    import fast_paths

    table = fast_paths.kernel
    monkeypatch.setattr(
        fast_paths,
        "kernel",
        lambda options, **facts: table(options, **(facts | {"device": "cuda"})),
    )
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *args, **kw: self)
    monkeypatch.setattr(torch.nn.Module, "cuda", lambda self, *args, **kw: self)
    # without CUDA graphs (mode) or inductor's options, which aot_eager does not take
    compile_ = torch.compile
    aot_eager = lambda model=None, mode=None, options=None, **kw: compile_(
        model, **kw, backend="aot_eager"
    )  # noqa: E731
    monkeypatch.setattr(torch, "compile", aot_eager)
    return "cpu"


def tiny(pe: str, block_size: int = 16, n_layer: int = 2, seed: int = 0, **kw) -> GPT:
    """A small random model in eval mode, its weights perturbed so every parameter (the bias-RPE
    table too, which starts at zero) shapes the output and greedy choices are far from ties."""
    torch.manual_seed(seed)
    config = GPTConfig(
        block_size=block_size,
        vocab_size=VOCAB,
        n_layer=n_layer,
        pos_encoding=pe,
        **{"n_head": 4, "n_embd": 32, "rpe_max_distance": 5, **kw},
    )
    model = GPT(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return model.eval()


def tokens(B: int, T: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


def cached_logits(
    model: GPT, idx: torch.Tensor, chunks: list[int], window: int | None = None, extra: int = 0
) -> torch.Tensor:
    """Logits of idx fed through one KV cache in chunks of the given sizes. The cache has the fewest
    slots that can work (the window, or every token) plus `extra`: the model splits chunks that
    would evict needed keys."""
    size = (idx.size(1) if window is None else window) + extra
    cache = KVCache(model.config.n_layer, size)
    out = []
    t = 0
    for n in chunks:
        out.append(model(idx[:, t : t + n], cache=cache, window=window)[0])
        t += n
    assert t == idx.size(1)
    return torch.cat(out, dim=1)


def greedy_reference(model: GPT, idx: torch.Tensor, steps: int, logits_fn) -> torch.Tensor:
    """Greedy decoding by re-running a full forward each step: logits_fn(model, idx) -> (B, V)."""
    for _ in range(steps):
        idx = torch.cat([idx, logits_fn(model, idx).argmax(-1, keepdim=True)], dim=1)
    return idx


def close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-5) -> None:
    torch.testing.assert_close(a, b, atol=tol, rtol=tol)
