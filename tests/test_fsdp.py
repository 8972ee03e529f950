"""--parallel=fsdp on CPUs (gloo): FSDP2's processes train as one process does, each holding 1/N of
the parameters and of AdamW's state; its sharded checkpoints (ckpt.dcp) resume at another number of
processes, survive a kill mid-save, load in every reader, and consolidate into a ckpt.pt."""

import re
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint
from conftest import forkserver, run_cli
from test_train import ROOT, TINY, assert_ok, tiny_data, torchrun, train_here  # noqa: F401 (a fixture)

import sample
import train as train_py
from lib import checkpoint
from lib.checkpoint import ShardedCheckpoint, load_checkpoint, save_sharded
from model import GPT, POS_ENCODINGS, GPTConfig

# float32 sums in another order: FSDP reduce-scatters each gradient where one process adds its
# micro-batches
TOL = dict(atol=1e-5, rtol=1e-4)
COMMON = ["--dropout=0.0", "--eval_interval=4"]


def train_torchrun(n: int, *args: str) -> subprocess.CompletedProcess:
    return torchrun(n, "train.py", *TINY, *args)


def assert_same_weights(a: Path, b: Path) -> None:
    wa = load_checkpoint(a)["model"]
    wb = load_checkpoint(b)["model"]
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], **TOL, msg=k)


@pytest.mark.slow
def test_fsdp_trains_as_one_process_and_resumes_at_any_count(tiny_data, tmp_path):  # noqa: F811
    """Two FSDP processes give one process's weights (the same global batch of 8 rows); their
    checkpoint, saved at iteration 4, resumed at 1 process and at 4 reaches iteration 8's weights of
    the uninterrupted run. Each process holds half of the parameters and of AdamW's state, as
    train.py measures and logs them. Activation checkpointing (selective at 2 processes, full
    resumed at 4) changes nothing of it."""
    data = f"--dataset={tiny_data}"
    for iters in (4, 8):  # the reference: one process, no sharding
        train_here(
            data,
            *COMMON,
            "--batch_size=8",
            f"--max_iters={iters}",
            f"--out_dir={tmp_path / f'one{iters}'}",
        )
    two = tmp_path / "two"
    # 2 micro-steps a process
    fsdp2 = ["--parallel=fsdp", "--batch_size=2", "--gradient_accumulation_steps=4"]
    ac = "--activation_checkpointing=selective"
    r = train_torchrun(2, data, *COMMON, *fsdp2, ac, "--max_iters=4", f"--out_dir={two}")
    assert_ok(r)
    assert "on 2 process(es) (fsdp)" in r.stdout
    (held,) = re.findall(
        r"parameters ([\d.]+) MiB of ([\d.]+), AdamW's state ([\d.]+) "
        r"MiB of ([\d.]+)",
        r.stdout,
    )
    p, p_all, o, o_all = map(float, held)
    assert p == pytest.approx(p_all / 2, rel=0.05) and o == pytest.approx(o_all / 2, rel=0.05), held
    assert (two / "ckpt.dcp").is_symlink() and not (two / "ckpt.pt").exists()
    assert_same_weights(tmp_path / "one4" / "ckpt.pt", two / "ckpt.pt")  # read from ckpt.dcp
    assert len(list((two / "ckpt.dcp").glob("*.distcp"))) == 2  # each process wrote its own shards

    at1 = tmp_path / "at1"
    at4 = tmp_path / "at4"
    shutil.copytree(two, at1, symlinks=True)
    shutil.copytree(two, at4, symlinks=True)
    train_here(data, *COMMON, *fsdp2, "--max_iters=8", "--init_from=resume", f"--out_dir={at1}")
    fsdp4 = ["--parallel=fsdp", "--batch_size=2", "--gradient_accumulation_steps=4"]
    ac = "--activation_checkpointing=full"
    r = train_torchrun(
        4, data, *COMMON, *fsdp4, ac, "--max_iters=8", "--init_from=resume", f"--out_dir={at4}"
    )
    assert_ok(r)
    assert f"resuming from {at4 / 'ckpt.dcp'} at iteration 4" in r.stdout
    for resumed in (at1, at4):
        assert ShardedCheckpoint(resumed / "ckpt.dcp").meta["iter_num"] == 8
        assert_same_weights(tmp_path / "one8" / "ckpt.pt", resumed / "ckpt.pt")
    assert len(list((at4 / "ckpt.dcp").glob("*.distcp"))) == 4


SHARD_EVERY_ENCODING = """
import copy, sys, torch, torch.distributed as dist
sys.path.insert(0, {root!r})
from model import GPT, GPTConfig, POS_ENCODINGS
from torch.distributed.tensor import DTensor
from lib.parallel import Processes, Sharded
from train import non_finite
dist.init_process_group("gloo")
rank, lines = dist.get_rank(), []
TINY = dict(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=16, dropout=0.0)
adamw = lambda m: m.configure_optimizers(0.1, 1e-3, (0.9, 0.99), "cpu", m.encoding.lr_scale)
strategy = Sharded(Processes(True, rank, rank, 2, "cpu"))
# a non-finite loss on one process stops all of them (none waits alone in all_reduce); fp16's inf
# gradient norms, which the GradScaler skips, stop none
one = torch.tensor(1.0)
a = non_finite(strategy, torch.tensor(float("nan") if rank == 1 else 1.0), one, check_norm=True)
b = non_finite(strategy, one, torch.tensor(float("inf") if rank == 0 else 1.0), check_norm=False)
open({out!r} + f"/non_finite{{rank}}", "w").write(f"{{a}} {{b}}")
idx = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(0))
for pe in POS_ENCODINGS:
    # each process its own initialisation: prepare() starts every one from the first's
    torch.manual_seed(rank)
    model = GPT(GPTConfig(**TINY, pos_encoding=pe))
    ref = copy.deepcopy(model)
    strategy.prepare(model, "float32")
    for t in ref.state_dict().values():
        dist.broadcast(t, src=0)
    opts = [adamw(model), adamw(ref)]
    for step in range(2):
        model(idx[2 * rank : 2 * rank + 2, :-1], idx[2 * rank : 2 * rank + 2, 1:])[1].backward()
        ref(idx[:, :-1], idx[:, 1:])[1].backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert isinstance(p, DTensor), name
        held = torch.tensor(p.to_local().numel())
        dist.all_reduce(held)  # the processes' shards add up to the parameter, each element once
        assert held.item() == q.numel(), name
        # Adam's step is about the rate whatever the gradient's size: a near-zero gradient summed in
        # another order can step the other way. Measured: 1e-5 at most at this rate
        msg = pe + " " + name
        torch.testing.assert_close(p.full_tensor(), q.detach(), atol=5e-5, rtol=1e-4, msg=msg)
    params = model.encoding.named_parameters()
    shards = [f"{{n}}:{{p.to_local().numel()}}/{{p.numel()}}" for n, p in params]
    lines.append(pe + " " + ",".join(shards))
# bf16: the blocks' weights gathered in bf16 for autocast's matmuls, the embeddings (and FIRE's MLP)
# float32 as the master weights; the losses of autocast's run over the whole batch, to bf16's
# precision
for pe in ("rope", "fire"):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY, pos_encoding=pe))
    ref = copy.deepcopy(model)
    strategy.prepare(model, "bfloat16")
    seen = {{}}  # the weights' dtype as each module runs (None: the hook leaves the inputs as is)
    for key, m in (("block", model.transformer.h[0].mlp.c_fc), ("wte", model.transformer.wte)):
        hook = lambda m, a, key=key: seen.setdefault(key, m.weight.dtype) and None
        m.register_forward_pre_hook(hook)
    opts = [adamw(model), adamw(ref)]
    for step in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(idx[2 * rank : 2 * rank + 2, :-1], idx[2 * rank : 2 * rank + 2, 1:])[1]
            ref_loss = ref(idx[:, :-1], idx[:, 1:])[1]
        loss.backward()
        ref_loss.backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean, op=dist.ReduceOp.AVG)
        assert abs(mean.item() - ref_loss.item()) < 2e-3, (pe, step, mean.item(), ref_loss.item())
    assert seen == {{"block": torch.bfloat16, "wte": torch.float32}}, seen
    assert all(p.dtype == torch.float32 for p in model.parameters())
    lines.append(pe + " bf16")
open({out!r} + f"/rank{{rank}}", "w").write("\\n".join(lines))
# as train.py ends: a bare destroy_process_group() right after a collective can abort a peer
strategy.finish()
"""


@pytest.mark.slow
def test_every_encoding_shards_and_trains_as_unsharded(tmp_path):
    """Under FSDP2 (Sharded.prepare) every encoding's parameters (tables, slopes, KERPLE's and
    FIRE's) are sharded like the model's, start from the first process's initialisation, and two
    AdamW steps over two processes give the weights of the same steps unsharded over the whole
    batch. In the same two processes (DDP's and FSDP's alike): non_finite() gives every process the
    same answer. In bfloat16 (RoPE, FIRE): the blocks' weights are gathered in bf16 and the
    embeddings stay float32, the master weights are float32, and the losses are those of autocast
    over the whole batch to bf16's precision."""
    script = tmp_path / "shard.py"
    script.write_text(SHARD_EVERY_ENCODING.format(root=str(ROOT), out=str(tmp_path)))
    r = torchrun(2, str(script))
    assert_ok(r)
    # FSDP's warning that an in-place op could skip its backward hook
    assert "view tensor" not in r.stderr
    assert [(tmp_path / f"non_finite{rank}").read_text() for rank in (0, 1)] == [
        "loss None",
        "loss None",
    ]
    lines = (tmp_path / "rank0").read_text().splitlines()
    assert lines[-2:] == ["rope bf16", "fire bf16"]
    lines = lines[:-2]
    assert [line.split()[0] for line in lines] == list(POS_ENCODINGS)
    # each of the encoding's parameters is split by rows: the first process holds part of it, not
    # all
    held = [
        cell.split(":")[1].split("/")
        for line in lines
        for cell in ",".join(line.split()[1:]).split(",")
        if cell
    ]
    config = dict(block_size=16, vocab_size=64, n_layer=2, n_head=2, n_embd=16)
    assert len(held) == sum(
        len(list(GPT(GPTConfig(**config, pos_encoding=e)).encoding.parameters()))
        for e in POS_ENCODINGS
    )
    assert all(0 < int(mine) < int(whole) for mine, whole in held), lines


def test_one_process_fsdp_reads_consolidates_and_refuses_the_wrong_resume(
    tiny_data,  # noqa: F811
    tmp_path,
    capsys,
):
    """--parallel=fsdp alone trains unsharded and writes ckpt.dcp (saying so); sample.py reads it;
    python lib/checkpoint.py OUT_DIR writes a ckpt.pt from which a plain run continues exactly as
    the sharded run does, and each run's next save removes the other format's now older checkpoint.
    A resume (or an evaluation) with the other strategy, a shard missing, and float16 are each a
    one-line error, and the checkpoint stays. A copy that made ckpt.dcp a folder resumes and
    saves."""
    data = f"--dataset={tiny_data}"
    out = tmp_path / "out"
    train_here(data, *COMMON, "--parallel=fsdp", "--max_iters=4", f"--out_dir={out}")
    assert "parallel=fsdp in one process: it trains unsharded" in capsys.readouterr().out
    assert ShardedCheckpoint(out / "ckpt.dcp").meta["optimizer_saved"]
    r = run_cli(
        sample.cli, [f"--out_dir={out}", "--num_samples=1", "--max_new_tokens=5", "--device=cpu"]
    )
    assert r.returncode == 0 and r.stdout.strip(), r.stderr

    def error(*args: str) -> str:
        r = run_cli(
            train_py.cli, [*TINY, data, *COMMON, "--max_iters=8", f"--out_dir={out}", *args]
        )
        assert (
            r.returncode == 1 and r.stderr.startswith("error: ") and "Traceback" not in r.stderr
        ), r.stderr
        return r.stderr

    assert "resume it with --parallel=fsdp" in error("--init_from=resume")
    assert f"python -m lib.checkpoint {out}" in error("--init_from=resume", "--eval_only=True")
    assert "use --dtype=bfloat16" in error("--parallel=fsdp", "--dtype=float16")
    assert "choose ddp (the default) or fsdp" in error("--parallel=zero")
    shard = next((out / "ckpt.dcp").glob("*.distcp"))
    hidden = shard.rename(tmp_path / shard.name)
    assert f"lacks {shard.name}" in error("--parallel=fsdp", "--init_from=resume")
    hidden.rename(shard)

    r = run_cli(checkpoint.main, [str(out)])
    assert r.returncode == 0 and (out / "ckpt.pt").is_file(), r.stderr
    # AdamW's state, by parameter index
    assert load_checkpoint(out / "ckpt.pt")["optimizer"]["state"]
    plain = tmp_path / "plain"
    sharded = tmp_path / "sharded"
    copied = tmp_path / "copied"
    shutil.copytree(out, plain, symlinks=True)
    shutil.copytree(out, sharded, symlinks=True)
    shutil.copytree(out, copied)  # links followed: ckpt.dcp a folder
    train_here(data, *COMMON, "--max_iters=8", "--init_from=resume", f"--out_dir={plain}")
    train_here(
        data,
        *COMMON,
        "--parallel=fsdp",
        "--max_iters=8",
        "--init_from=resume",
        f"--out_dir={sharded}",
    )
    # the latter from ckpt.dcp
    a = load_checkpoint(plain / "ckpt.pt")
    b = load_checkpoint(sharded / "ckpt.pt")
    assert a["iter_num"] == b["iter_num"] == 8
    for k in a["model"]:
        # one process, the same arithmetic: exact
        assert torch.equal(a["model"][k], b["model"][k]), k
    assert not (sharded / "ckpt.pt").exists() and not (plain / "ckpt.dcp").exists()
    assert not (plain / "shards").exists() or not any((plain / "shards").iterdir())
    assert "unsharded checkpoint (ckpt.pt)" in error(
        "--parallel=fsdp", "--init_from=resume", f"--out_dir={plain}"
    )

    capsys.readouterr()
    assert (copied / "ckpt.dcp").is_dir() and not (copied / "ckpt.dcp").is_symlink()
    train_here(
        data,
        *COMMON,
        "--parallel=fsdp",
        "--max_iters=8",
        "--init_from=resume",
        f"--out_dir={copied}",
    )
    assert "ckpt.dcp was a folder (copied without its link?)" in capsys.readouterr().out
    assert (copied / "ckpt.dcp").is_symlink() and ShardedCheckpoint(copied / "ckpt.dcp").meta[
        "iter_num"
    ] == 8


def test_a_save_missing_a_shard_is_not_linked(tmp_path, monkeypatch):
    """A save whose folder lacks a process's shards (on several machines, an out_dir each machine
    has its own copy of) fails with the reason, and ckpt.dcp keeps naming the last good
    checkpoint."""
    save_sharded({"model": {"w": torch.zeros(8)}}, {"iter_num": 1}, tmp_path, ("ckpt.dcp",))
    good = (tmp_path / "ckpt.dcp").resolve()
    save = torch.distributed.checkpoint.save

    def save_then_lose_a_shard(state, checkpoint_id, **kw):
        save(state, checkpoint_id=checkpoint_id, **kw)
        next(Path(checkpoint_id).glob("*.distcp")).unlink()

    monkeypatch.setattr(torch.distributed.checkpoint, "save", save_then_lose_a_shard)
    with pytest.raises(
        checkpoint.CheckpointError, match="(?s)lacks __0_0.distcp.*a folder that all of them see"
    ):
        save_sharded({"model": {"w": torch.ones(8)}}, {"iter_num": 2}, tmp_path, ("ckpt.dcp",))
    assert (tmp_path / "ckpt.dcp").resolve() == good and ShardedCheckpoint(
        tmp_path / "ckpt.dcp"
    ).meta["iter_num"] == 1


def save_forever(out_dir: Path, ready) -> None:
    """Sharded checkpoints into out_dir, one after another, each a tensor of its iteration; ready
    after the first."""
    i = 0
    while True:
        save_sharded(
            {"model": {"w": torch.full((2_000_000,), float(i))}},
            {"iter_num": i},
            out_dir,
            ("ckpt.dcp",),
        )
        ready.set()
        i += 1


def test_a_killed_sharded_save_leaves_the_last_good_checkpoint(tmp_path):
    """SIGKILL at random moments while sharded checkpoints are written: ckpt.dcp always names a
    whole one, and the next run's start removes the unfinished folders."""
    ctx = forkserver()
    rng = np.random.default_rng(0)
    for _ in range(4):
        ready = ctx.Event()
        p = ctx.Process(target=save_forever, args=(tmp_path, ready))
        p.start()
        assert ready.wait(timeout=120)
        time.sleep(rng.uniform(0.0, 0.5))
        p.kill()
        p.join()
        state = {"model": {"w": torch.empty(2_000_000)}}
        sharded = ShardedCheckpoint(tmp_path / "ckpt.dcp")
        sharded.read(state)
        assert torch.all(state["model"]["w"] == sharded.meta["iter_num"])
        checkpoint.remove_unlinked_shards(tmp_path)
        assert [f.resolve() for f in (tmp_path / "shards").iterdir()] == [
            (tmp_path / "ckpt.dcp").resolve()
        ]
