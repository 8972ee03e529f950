"""lib/checkpoint.py's readers on files that are not what they should be: each a CheckpointError
naming the file and the fix, never torch's own exception or its advice to unpickle the file."""

import errno
import os
import shutil
from pathlib import Path

import pytest
import torch

from lib import checkpoint
from lib.checkpoint import CheckpointError, load_checkpoint, save_sharded
from train import new_optimizer


def test_random_bytes_are_not_a_checkpoint_and_no_unpickling_is_suggested(tmp_path):
    """A ckpt.pt of random bytes, and one cut short, are named as such; torch's 'weights_only=False
    will likely succeed' (which would run the file's code) is never passed on."""
    path = tmp_path / "ckpt.pt"
    path.write_bytes(os.urandom(4096))
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(path)
    assert "not a readable checkpoint: it is not a file torch.save wrote" in str(e.value)
    torch.save({"model": {}, "model_args": {}}, path)
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(CheckpointError) as e2:
        load_checkpoint(path)
    assert "it is damaged" in str(e2.value)
    for err in (e, e2):
        assert "weights_only" not in str(err.value) and "\n" not in str(err.value)


def sharded(tmp_path: Path) -> Path:
    """A one-process sharded checkpoint, as train.py --parallel=fsdp writes it (model weights and
    meta.pt)."""
    meta = {"iter_num": 3, "model_args": {}, "config": {}}
    save_sharded({"model": {"w": torch.arange(1000.0)}}, meta, tmp_path, ("ckpt.dcp",))
    return (tmp_path / "ckpt.dcp").resolve()


def test_a_truncated_shard_is_named_before_any_read(tmp_path):
    """A shard file shorter than .metadata says (a copy cut short) is an error naming the file, at
    the check that every reader (resume, sample.py, export/hf.py, lib/checkpoint.py) goes through,
    not torch's CheckpointException."""
    folder = sharded(tmp_path)
    shard = next(folder.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(
        CheckpointError,
        match=rf"damaged: in .*, {shard.name} is shorter than "
        r"its \.metadata says",
    ):
        checkpoint.sharded_folder(tmp_path / "ckpt.dcp")
    with pytest.raises(CheckpointError, match="shorter than its .metadata"):
        # falls back to ckpt.dcp, as sample.py and export/hf.py read it
        load_checkpoint(tmp_path / "ckpt.pt")


def test_a_damaged_shard_of_the_right_size_is_a_checkpoint_error(tmp_path):
    """A shard of the right size whose bytes are wrong reaches torch.distributed.checkpoint's
    reader: its failure comes back as a one-line CheckpointError."""
    folder = sharded(tmp_path)
    shard = next(folder.glob("*.distcp"))
    shard.write_bytes(os.urandom(shard.stat().st_size))
    state = {"model": {"w": torch.empty(1000)}}
    try:
        checkpoint.ShardedCheckpoint(tmp_path / "ckpt.dcp").read(state)
    except CheckpointError as e:
        assert "cannot be read" in str(e) and "\n" not in str(e)
    # raw tensor bytes carry no checksum: random bytes read as other numbers, which is no crash
    else:
        assert not torch.equal(state["model"]["w"], torch.arange(1000.0))


def test_consolidating_a_run_that_cannot_be_written_says_so_first(tmp_path, monkeypatch):
    """lib/checkpoint.py OUT_DIR on a folder it cannot write (read-only) stops before reading the
    shards, with the fix; on a folder without ckpt.dcp it names what is missing."""
    with pytest.raises(CheckpointError, match="no sharded checkpoint .*ckpt.dcp to consolidate"):
        checkpoint.consolidate(tmp_path)
    sharded(tmp_path)
    real = Path.write_bytes

    def read_only(self, data):
        if self.parent == tmp_path:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))
        return real(self, data)

    monkeypatch.setattr(Path, "write_bytes", read_only)
    monkeypatch.setattr(
        checkpoint, "sharded_folder", lambda *a: pytest.fail("read before the write check")
    )
    with pytest.raises(
        CheckpointError, match="cannot write .*ckpt.pt \\(Read-only file system\\); copy the run's"
    ):
        checkpoint.consolidate(tmp_path)


def test_consolidation_never_replaces_a_newer_ckpt_pt(tmp_path, monkeypatch):
    """lib/checkpoint.py OUT_DIR refuses, before reading the shards, to replace a ckpt.pt newer than
    ckpt.dcp (or one whose iteration cannot be read), naming both iterations and the fix; with
    --overwrite it replaces it, and an older ckpt.pt gives way unasked."""
    from dataclasses import asdict

    from conftest import run_cli

    from lib.checkpoint import save_checkpoint
    from model import GPT, GPTConfig

    config = GPTConfig(block_size=8, vocab_size=16, n_layer=1, n_head=2, n_embd=8)
    model = GPT(config)
    cfg = {
        "weight_decay": 0.1,
        "learning_rate": 1e-3,
        "beta1": 0.9,
        "beta2": 0.99,
        "pe_lr_scale": 1.0,
    }
    state = checkpoint.training_state(model, new_optimizer(model, cfg, "cpu"))
    save_sharded(
        state, {"iter_num": 4, "model_args": asdict(config), "config": cfg}, tmp_path, ("ckpt.dcp",)
    )
    path = tmp_path / "ckpt.pt"
    newer = {"model": {}, "model_args": {}, "iter_num": 8}
    with monkeypatch.context() as m:
        m.setattr(
            checkpoint.ShardedCheckpoint, "load_into", lambda *a: pytest.fail("read the shards")
        )
        save_checkpoint(newer, path)
        before = path.read_bytes()
        r = run_cli(checkpoint.main, [str(tmp_path)])
        assert (
            r.returncode == 1
            and f"{path} is at iteration 8, newer than the sharded ckpt.dcp's 4" in r.stderr
        )
        assert (
            f"python -m lib.checkpoint {tmp_path} --overwrite" in r.stderr
            and len(r.stderr.splitlines()) == 1
        )
        assert path.read_bytes() == before
        path.write_bytes(b"my notes")
        r = run_cli(checkpoint.main, [str(tmp_path)])
        assert r.returncode == 1 and "is not a checkpoint whose iteration can be read" in r.stderr
        assert path.read_bytes() == b"my notes"
    save_checkpoint(newer | {"iter_num": 2}, path)
    assert (
        run_cli(checkpoint.main, [str(tmp_path)]).returncode == 0
        and load_checkpoint(path)["iter_num"] == 4
    )
    save_checkpoint(newer, path)
    assert run_cli(checkpoint.main, [str(tmp_path), "--overwrite"]).returncode == 0
    assert load_checkpoint(path)["iter_num"] == 4


def test_latest_and_load_read_both_formats_alike(tmp_path):
    """checkpoint.latest(out_dir) names a run's ckpt.pt, else its sharded ckpt.dcp, else None
    (ckpt.pt where a consolidation left both); the Checkpointer's load() gives a Checkpoint of
    either format alike: every key but the states as meta, and load_into, which puts the saved
    weights and AdamW's state into a fresh model and optimizer."""
    from dataclasses import asdict

    from lib.checkpoint import Checkpointer, latest, save_checkpoint
    from model import GPT, GPTConfig

    config = GPTConfig(block_size=8, vocab_size=16, n_layer=1, n_head=2, n_embd=8)
    cfg = {
        "weight_decay": 0.1,
        "learning_rate": 1e-3,
        "beta1": 0.9,
        "beta2": 0.99,
        "pe_lr_scale": 1.0,
    }
    torch.manual_seed(0)
    model = GPT(config)
    optimizer = new_optimizer(model, cfg, "cpu")
    idx = torch.randint(0, 16, (2, 9))
    model(idx[:, :-1], idx[:, 1:])[1].backward()
    optimizer.step()
    meta = {"iter_num": 4, "model_args": asdict(config), "config": cfg}
    plain = tmp_path / "plain"
    sharded = tmp_path / "sharded"
    assert latest(plain) is None and latest(tmp_path) is None
    save_checkpoint(
        {"model": model.state_dict(), "optimizer": optimizer.state_dict(), **meta},
        plain / "ckpt.pt",
    )
    save_sharded(checkpoint.training_state(model, optimizer), meta, sharded, ("ckpt.dcp",))
    assert (latest(plain), latest(sharded)) == (plain / "ckpt.pt", sharded / "ckpt.dcp")
    for out, is_sharded in ((plain, False), (sharded, True)):
        resumed = Checkpointer(out, sharded=is_sharded).load()
        assert isinstance(resumed, checkpoint.Checkpoint) and resumed.meta["iter_num"] == 4
        assert not {"model", "optimizer"} & resumed.meta.keys()
        fresh = GPT(resumed.model_config)
        fresh_optimizer = new_optimizer(fresh, resumed.config, "cpu")
        resumed.load_into(fresh, fresh_optimizer)
        for k, v in model.state_dict().items():
            assert torch.equal(fresh.state_dict()[k], v), (out.name, k)
        saved = optimizer.state_dict()["state"]
        loaded = fresh_optimizer.state_dict()["state"]
        assert saved.keys() == loaded.keys()
        assert all(torch.equal(saved[i]["exp_avg"], loaded[i]["exp_avg"]) for i in saved)
    shutil.copy(plain / "ckpt.pt", sharded / "ckpt.pt")  # as a consolidation leaves the folder
    assert latest(sharded) == sharded / "ckpt.pt"


# Checkpoints that an earlier version of train.py wrote, at iteration 6 of a 12-iteration run, and
# the model weights of the same run trained straight to 12 by that version
# (tests/fixtures/before_redesign: ALiBi, 1 layer, 16 dims, on the first 200k characters of the
# embedded corpus, in one process; the sharded one with --parallel=fsdp). Today's code must resume
# them and reach the same weights: the keys, the sampler, AdamW's state and the RNGs all carry over.
FIXTURES = Path(__file__).parent / "fixtures" / "before_redesign"
FIXTURE_ARGS = [
    "--device=cpu",
    "--compile=False",
    "--dtype=float32",
    "--n_layer=1",
    "--n_head=2",
    "--n_embd=16",
    "--block_size=32",
    "--batch_size=4",
    "--eval_iters=2",
    "--eval_interval=3",
    "--log_interval=1",
    "--warmup_iters=2",
    "--lr_decay_iters=12",
    "--learning_rate=3e-3",
    "--max_iters=12",
    "--init_from=resume",
]


@pytest.mark.parametrize("kind", ["plain", "sharded"])
@pytest.mark.parametrize(
    "version, encoding", [("before_redesign", "alibi"), ("before_encoding_key", "learned")]
)
def test_checkpoints_of_the_earlier_version_resume_to_its_weights(
    kind, version, encoding, tmp_path
):
    """A ckpt.pt and a sharded ckpt.dcp written by the version before the redesign (ALiBi) and by
    the one before the encoding's key moved from transformer.wpe to encoding (learned) resume in
    today's train.py and reach the weights that version's uninterrupted run reached. Not bit for
    bit: the stored weights were computed on another machine, whose CPU kernels may round
    differently (one float32 ulp, ~4e-9 here, was seen on a CPU with AVX-512). A resume that loses
    anything (AdamW's state, the sampler, the RNGs, the schedule) changes the six steps it trains,
    and each step moves the weights by about the rate, 3e-3: the tolerance is a thousandth of that,
    and the test checks that the six steps do move every tensor far beyond it."""
    from conftest import train_in_process

    from lib.checkpoint import model_state
    from lib.datafiles import prepare_text, read_embedded_corpus

    fixtures = FIXTURES.parent / version
    data = tmp_path / "data"
    prepare_text(read_embedded_corpus()[:200_000], data, "char")
    out = tmp_path / "run"
    if kind == "plain":
        out.mkdir()
        shutil.copy(fixtures / "plain_ckpt.pt", out / "ckpt.pt")
    else:
        shutil.copytree(fixtures / "sharded", out, symlinks=True)
    extra = ["--parallel=fsdp"] if kind == "sharded" else []
    args = [*FIXTURE_ARGS, f"--pos_encoding={encoding}", *extra]
    train_in_process([*args, f"--dataset={data}", f"--out_dir={out}"])
    resumed = load_checkpoint(out / "ckpt.pt")
    # the weights under today's keys
    expected = model_state(torch.load(fixtures / f"{kind}_final_model.pt", weights_only=True))
    assert resumed["iter_num"] == 12 and resumed["model"].keys() == expected.keys()
    # the same run at iteration 6 (both kinds)
    at_6 = load_checkpoint(fixtures / "plain_ckpt.pt")["model"]
    tolerance = 3e-6
    for k, v in expected.items():
        torch.testing.assert_close(resumed["model"][k], v, rtol=0, atol=tolerance, msg=k)
        assert (v - at_6[k]).abs().max() > 100 * tolerance, (
            f"{k}: six steps should move it beyond the tolerance"
        )
