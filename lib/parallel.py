"""
The processes of a training run (started, and stopped by Ctrl-C together), and what differs between
its parallel strategies. train.py's loop asks the strategy (a Strategy: a few methods); it never
asks which strategy runs. The two are siblings:

- Replicated: one process, or DDP under torchrun: every process holds the whole model, its gradients
  and AdamW's state, and DDP averages the gradients.
- Sharded: FSDP2 (torch.distributed.fsdp.fully_shard): each process holds 1/N of every parameter,
  gradient and AdamW state, and gathers a block's weights just before the block runs. Its
  checkpoints are sharded too (lib/checkpoint.py); alone, it trains unsharded and still writes them.

FSDP and DTensor take about a second to import: they are imported where a sharded run uses them, so
that every other start of train.py does not pay for them.
"""

import contextlib
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from lib.devices import allow_tf32


@dataclass
class Processes:
    """This process's place in the run: alone, or one of torchrun's processes."""

    distributed: bool
    rank: int
    local_rank: int
    world_size: int
    device: str  # cuda:<local_rank> for each of torchrun's GPU processes

    @property
    def master(self) -> bool:
        return self.rank == 0  # the one that logs and writes what only one process writes

    @property
    def device_type(self) -> str:
        return "cuda" if self.device.startswith("cuda") else self.device.split(":")[0]

    def log(self, *args) -> None:
        if self.master:
            print(*args, flush=True)

    def reduce(self, t: torch.Tensor, op: str) -> torch.Tensor:
        """t reduced over the processes ("sum", "avg" or "max"), in place; t itself when alone."""
        if self.distributed:
            dist.all_reduce(
                t,
                op={"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX}[
                    op
                ],
            )
        return t

    def gather(self, obj) -> list:
        """obj of every process, in rank order (a picklable object: RNG states for a checkpoint)."""
        if not self.distributed:
            return [obj]
        out = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()


def start_processes(device: str, backend: str, seed: int) -> Processes:
    """Join torchrun's process group if there is one (a GPU each), seed this process, allow TF32
    matmuls."""
    distributed = int(os.environ.get("RANK", -1)) != -1
    rank, local_rank, world_size = 0, 0, 1
    if distributed:
        dist.init_process_group(
            backend=backend or ("nccl" if device.startswith("cuda") else "gloo")
        )
        rank = dist.get_rank()
        local_rank = int(os.environ["LOCAL_RANK"])
        world_size = dist.get_world_size()
        if device.startswith("cuda"):
            device = f"cuda:{local_rank}"
            torch.cuda.set_device(device)
    torch.manual_seed(seed + rank)
    allow_tf32(device)
    return Processes(distributed, rank, local_rank, world_size, device)


def stop_on_signals(procs: Processes, trained: Callable[[], bool]) -> torch.Tensor:
    """A flag that Ctrl-C or SIGTERM raises (the loop then saves and stops, once Strategy.any has
    every process agree on it); a second signal quits at once. Before this process has trained an
    iteration (the first evaluation, the first compile), there is nothing to save: it quits at once,
    and the checkpoint it started from (if any) stays."""
    stop = torch.zeros(
        1, device=procs.device if procs.distributed and procs.device_type == "cuda" else "cpu"
    )

    def on_signal(signum, frame):
        name = signal.Signals(signum).name
        if stop.item():
            raise KeyboardInterrupt
        if not trained():
            procs.log(
                f"\n{name}: nothing trained yet in this run, so nothing to save: stopping now"
            )
            raise SystemExit(128 + signum)
        stop.fill_(1)
        procs.log(
            f"\n{name}: saving a checkpoint after this iteration or evaluation (again to "
            "quit at once)"
        )

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    return stop


def held_bytes(tensors, whole: bool = False) -> int:
    """The bytes of these tensors that this process holds (its own shards of FSDP's DTensors, which
    have to_local), or with whole, the bytes of the whole tensors."""
    local = [t.to_local() if hasattr(t, "to_local") and not whole else t for t in tensors]
    return sum(t.numel() * t.element_size() for t in local)


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [
        v
        for state in optimizer.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor)
    ]


class Strategy:
    """What the loop asks of a parallel strategy. Each strategy overrides the first four (how the
    model is made the strategy's, called, synchronized and clipped); the rest (agreeing on a flag,
    the memory line, leaving the process group) is the same for all."""

    name: str  # train.py's `parallel` option
    sharded: bool  # checkpoints: sharded (ckpt.dcp, each process its own shards) or one ckpt.pt

    def __init__(self, procs: Processes):
        self.procs = procs

    def prepare(self, model: torch.nn.Module, dtype: str) -> None:
        """Make the model this strategy's, before the optimizer takes its parameters."""
        raise NotImplementedError

    def wrap(self, model: torch.nn.Module, compile: bool) -> torch.nn.Module:
        """The module the loop calls (net): the model, compiled where compile is set."""
        raise NotImplementedError

    def sync_gradients(self, net: torch.nn.Module, sync: bool) -> None:
        """Whether net's next backward averages the gradients over the processes: only on an
        iteration's last micro-step, so that gradient accumulation communicates once."""
        raise NotImplementedError

    def clip(self, model: torch.nn.Module, max_norm: float) -> torch.Tensor:
        """Clip the gradients at max_norm (inf: no clipping); return their norm over every process's
        gradients."""
        raise NotImplementedError

    def any(self, flags: torch.Tensor) -> torch.Tensor:
        """flags (float 0/1) raised on any process, the same on every one: one process stopping
        alone would leave the others waiting in their next collective."""
        return self.procs.reduce(flags, "max")

    def memory_line(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str | None:
        """What each process holds, for the log after the first step (AdamW's state exists from
        then): parameters and AdamW's state, held of whole, and the peak allocation on CUDA. None
        for one process."""
        if not self.procs.distributed:
            return None
        (p, p_all), (o, o_all) = [
            (held_bytes(ts) / 2**20, held_bytes(ts, whole=True) / 2**20)
            for ts in (list(model.parameters()), optimizer_tensors(optimizer))
        ]
        cuda = self.procs.device_type == "cuda"
        peak = torch.cuda.max_memory_allocated(self.procs.device) / 2**20 if cuda else None
        return (
            f"memory per process ({self.name}): parameters {p:,.2f} MiB of {p_all:,.2f}, AdamW's "
            "state "
            f"{o:,.2f} MiB of "
            f"{o_all:,.2f}" + (f", peak allocated {peak:,.0f} MiB" if peak is not None else "")
        )

    def finish(self) -> None:
        """Leave the process group once every process is done. gloo aborts a process whose peer
        closes its connections while a message is still in flight; so first a barrier (rank 0 may
        still be writing the checkpoint), then a second round over the rendezvous store, which is
        not a gloo connection: no process tears its group down before every process has returned
        from the barrier."""
        if not self.procs.distributed:
            return
        dist.barrier()
        # private, hence the guard
        store = getattr(dist.distributed_c10d, "_get_default_store", lambda: None)()
        if store is not None:
            # a store that is already gone: nothing left to wait for
            with contextlib.suppress(RuntimeError):
                store.set(f"nanope/finished/{self.procs.rank}", "1")
                store.wait([f"nanope/finished/{r}" for r in range(self.procs.world_size)])
        dist.destroy_process_group()


class Replicated(Strategy):
    """One process, or DDP: a whole copy of the model in each process."""

    name = "ddp"
    sharded = False  # checkpoints: one ckpt.pt, written by the first process

    def prepare(self, model: torch.nn.Module, dtype: str) -> None:
        """Nothing to do: DDP's wrapper is the module the loop calls (see wrap)."""

    def wrap(self, model: torch.nn.Module, compile: bool) -> torch.nn.Module:
        """Under torchrun, in DDP, which broadcasts the first process's weights and averages the
        gradients."""
        net = torch.compile(model) if compile else model
        if self.procs.distributed:
            net = DDP(
                net,
                device_ids=[self.procs.local_rank] if self.procs.device_type == "cuda" else None,
            )
        return net

    def sync_gradients(self, net: torch.nn.Module, sync: bool) -> None:
        if self.procs.distributed:
            net.require_backward_grad_sync = sync  # DDP's flag, on its wrapper

    def clip(self, model: torch.nn.Module, max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)


class Sharded(Strategy):
    """FSDP2: each process holds 1/N of the model, its gradients and AdamW's state."""

    name = "fsdp"
    sharded = True  # checkpoints: ckpt.dcp, each process its own shards

    def prepare(self, model: torch.nn.Module, dtype: str) -> None:
        """Shard each block's attention and MLP (one group a block), then the rest (embeddings, the
        encoding's tables, MLPs and slopes, the norms, the tied head), over the processes. In
        bfloat16 a block's weights are gathered in bf16 (half the traffic) for autocast's bf16
        matmuls; the rest stays float32, as do the residual stream, the RoPE angles (bf16 inputs
        would round them) and the norms (a CPU's layer_norm takes no bf16 weights with float32
        inputs); the master weights, AdamW and the gradient reductions are float32. Alone, nothing
        to shard: the model trains as it is."""
        if not self.procs.distributed:
            return
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        # every process starts from the first one's weights (each seeded its own), as DDP does
        with torch.no_grad():
            for t in model.state_dict().values():
                dist.broadcast(t, src=0)
        mp = MixedPrecisionPolicy()  # float32 throughout
        if dtype == "bfloat16":
            mp = MixedPrecisionPolicy(
                torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False
            )
        for block in model.transformer.h:
            fully_shard([block.attn, block.mlp], mp_policy=mp)
            for module in (block.attn, block.mlp):
                # nn.Linear with a bias returns a view of its matmul for a (B, T, C) input, and FSDP
                # warns that an in-place op on a view would skip its backward hook. Nothing here
                # writes in place, but its hook gets a fresh tensor (the copy runs before FSDP's
                # post-forward: prepend), so the warning never has to be judged harmless
                module.register_forward_hook(
                    lambda m, args, out: out.clone() if out._is_view() else out, prepend=True
                )
        fully_shard(model)

    def wrap(self, model: torch.nn.Module, compile: bool) -> torch.nn.Module:
        return torch.compile(model) if compile else model  # FSDP shards the module itself

    def sync_gradients(self, net: torch.nn.Module, sync: bool) -> None:
        if self.procs.distributed:
            # the FSDP module's, reached through torch.compile's wrapper too
            net.set_requires_gradient_sync(sync)

    def clip(self, model: torch.nn.Module, max_norm: float) -> torch.Tensor:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        # a DTensor: the norm over every shard
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


STRATEGIES = {s.name: s for s in (Replicated, Sharded)}  # train.py's `parallel` option: ddp | fsdp


def strategy(parallel: str, procs: Processes) -> Strategy:
    """The strategy named by train.py's `parallel` option (ddp also covers a single process)."""
    return STRATEGIES[parallel](procs)
