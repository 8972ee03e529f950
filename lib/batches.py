"""
The rows a run trains and evaluates on, from one object: text read from the dataset's token files
(with retrieval tasks in the same tokens in a fraction of the training rows: task_fraction), or a
synthetic task's sequences (task).
"""

from dataclasses import dataclass

import numpy as np
import torch

from lib import synthetic_tasks
from lib.datafiles import SPLITS, Data, get_batch
from lib.parallel import Processes
from lib.text_tasks import check_training_tasks, mix_tasks


@dataclass
class Batches:
    cfg: dict  # train.py's options
    data: Data
    procs: Processes

    def __post_init__(self) -> None:
        # a task that does not fit the block: before any work
        check_training_tasks(self.cfg, self.data.task_tok)

    def batch(
        self, split: str, generator: torch.Generator, step: tuple[int, int] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This process's share of a batch x, y (B, T). A synthetic task's rows come from a seed
        that generator draws (so the sampler's state is still one generator state), the split and
        the rank. step (iteration, micro-step) asks for a training batch with its retrieval tasks,
        seeded by it rather than by a saved state, so that a resumed run draws the same tasks."""
        p = self.procs
        cfg = self.cfg
        B = self.cfg["batch_size"]
        T = self.cfg["block_size"]
        if cfg["task"]:
            seed = int(torch.randint(2**62, (1,), generator=generator))
            rng = np.random.default_rng([seed, SPLITS.index(split), p.rank])
            # validation reads the rows the evaluation scores (no curriculum, the full task), so
            # that "learned" and the 1x column of compare/synthetic.py measure one distribution
            train = split == "train"
            mix = cfg["task_mix"] if train else 0.0
            previous = cfg["task_prev_tokens"] and train
            opts = synthetic_tasks.task_options(cfg)
            x, y = synthetic_tasks.batch(
                cfg["task"], cfg["task_vocab"], B, T, rng, train, mix, previous, **opts
            )
            return x.to(p.device), y.to(p.device)
        x, y = get_batch(
            self.data.dir,
            split,
            B,
            T,
            generator,
            self.data.vocab_size,
            p.device,
            p.rank,
            p.world_size,
        )
        if step is None:
            return x, y
        return mix_tasks(
            x, y, cfg["task_fraction"], self.data.task_tok, (cfg["task_seed"], *step, p.rank)
        )
