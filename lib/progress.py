"""
A training run's clock and its log lines: the time per iteration, the run's estimate, and each
log_interval's loss, speed, MFU and ETA (train.py's Progress).
"""

import time

import torch

from lib.devices import estimate_mfu, peak_flops

ESTIMATE_AFTER = 10  # iterations timed before the whole run's time is estimated


class Progress:
    """The run's clock and its log lines: the time per iteration (averaged past the first ones:
    compilation, warm-up), the run's estimate after ESTIMATE_AFTER iterations, and each
    log_interval's loss, speed, MFU and ETA."""

    def __init__(self, run):
        self.run = run
        self.start_iter = run.iter_num
        self.dt_avg = None
        self.eval_dt = 0.0
        self.t0 = time.time()
        self.flops = peak_flops(run.procs.device)

    def evaluated(self, seconds: float) -> None:
        self.eval_dt = seconds
        self.t0 = time.time()

    def left(self) -> tuple[int, int]:
        """Iterations and evaluations left after this one."""
        left = self.run.cfg["max_iters"] - self.run.iter_num - 1
        return left, left // self.run.cfg["eval_interval"] + 1

    def stepped(self, loss: torch.Tensor, lr: float, wandb) -> None:
        run = self.run
        cfg = self.run.cfg
        log = self.run.procs.log
        t1 = time.time()
        dt = t1 - self.t0
        self.t0 = t1
        # skip the first iterations (compilation, warm-up) in the average
        if run.iter_num > self.start_iter + 1:
            self.dt_avg = dt if self.dt_avg is None else 0.9 * self.dt_avg + 0.1 * dt
        if run.iter_num == self.start_iter and (
            line := run.strategy.memory_line(run.model, run.optimizer)
        ):
            log(line)  # AdamW's state exists from the first step
        left, evals = self.left()
        if run.iter_num == self.start_iter + ESTIMATE_AFTER and left > 0:
            log(
                f"this run: about {format_duration(self.dt_avg * left + self.eval_dt * evals)} "
                f"more ({left:,} "
                f"iterations at {self.dt_avg * 1000:.0f} ms, {evals} evaluations at "
                f"{self.eval_dt:.1f} s)"
            )
        if run.iter_num % cfg["log_interval"] == 0 and run.procs.master:
            eta = (self.dt_avg or dt) * left + self.eval_dt * evals
            tok_s = run.tokens_per_iter / dt
            per_process = run.tokens_per_iter // run.procs.world_size
            mfu = (
                estimate_mfu(run.model, per_process, self.dt_avg or dt, self.flops)
                if self.flops
                else None
            )
            log(
                f"iter {run.iter_num}: loss {loss.item():.4f}, time {dt * 1000:.1f}ms, "
                f"{tok_s:,.0f} tok/s"
                + (f", mfu {mfu * 100:.1f}%" if mfu is not None else "")
                + f", eta {format_duration(eta)}"
            )
            if wandb:
                metrics = {
                    "iter": run.iter_num,
                    "train/loss_step": loss.item(),
                    "lr": lr,
                    "tokens_per_sec": tok_s,
                }
                wandb.log(metrics | ({"mfu": mfu} if mfu is not None else {}))


def format_duration(seconds: float) -> str:
    seconds = int(seconds)
    h = seconds // 3600
    m = seconds // 60 % 60
    s = seconds % 60
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"
