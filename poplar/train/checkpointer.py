"""The trainer's checkpointing: when to save, what a checkpoint must share with the run, where to resume.

The format and its guarantees (sharded, atomic, checked, reshardable) are
:mod:`poplar.runtime.checkpoint`'s; this component decides when and with what.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch

from poplar.runtime.checkpoint import (CheckpointError, check_resumable, complete_checkpoints, find_resumable,
                                     latest_checkpoint, load_checkpoint, save_checkpoint)
from poplar.train.config import CheckpointSettings
from poplar.models.workload import Workload


EXPECTED_KEYS = ("workload", "global_batch", "seed", "data")   # what expected_meta holds


def expected_meta(settings: CheckpointSettings, wl: Workload, global_batch: int) -> dict:
    """What a checkpoint must share with the run that resumes it; world, plan and stage may change."""
    return dict(zip(EXPECTED_KEYS, (wl.identity(), global_batch, settings.seed, settings.data)))


def check_resume(settings: CheckpointSettings, wl: Workload, global_batch: int) -> None:
    """Before anything is profiled or written: a resume that would fail (damaged checkpoints, another run's) fails now."""
    if settings.resume:
        check_resumable(settings.root, expected_meta(settings, wl, global_batch))


class Checkpointer:
    """Saves every ``checkpoint_every`` steps, at the end and when asked to stop; resumes from the newest intact one.

    ``on_shard_written(step)`` runs between a rank's shard and the checkpoint's completion
    (where a test injects a crash).
    """

    def __init__(self, settings: CheckpointSettings, engine, wl: Workload, world_size: int,
                 on_shard_written: Callable[[int], None] | None = None):
        self.settings, self.engine = settings, engine
        self.root = settings.root
        self.expect = expected_meta(settings, wl, engine.plan.global_batch_size)
        self.meta = {**self.expect, "world_size": world_size, "zero_stage": engine.plan.zero_stage,
                     "plan": engine.plan.to_dict()}
        self._on_shard_written = on_shard_written

    def resume(self, rank: int) -> int:
        """Load the newest intact checkpoint (if ``settings.resume`` and one exists); the step it ends."""
        if not self.settings.resume:
            return 0
        path = self._resumable(rank)
        if path is None:
            return 0
        start = load_checkpoint(self.engine, path, self.expect)["step"]
        if rank == 0:
            print(f"resuming after step {start} from {path}", flush=True)
        return start

    def _resumable(self, rank: int) -> Path | None:
        """The newest intact checkpoint, chosen by rank 0 (it reports damaged ones) and the same on every rank."""
        comm = self.engine.comm
        step = torch.tensor([-1], dtype=torch.int64, device=self.engine.device)
        if rank == 0:
            path = find_resumable(self.root, report=lambda line: print(f"poplar: {line}", file=sys.stderr, flush=True))
            if path is not None:
                step[0] = int(path.name.split("-")[1])
            elif complete_checkpoints(self.root):
                step[0] = -2
        comm.broadcast(step, src=0)
        if int(step) == -2:
            raise CheckpointError(f"no intact checkpoint under {self.root} (every one is damaged, see above): "
                                  "start a new run with another --out")
        return None if int(step) < 0 else self.root / f"step-{int(step):08d}"

    def plan_changed(self, plan, at_step: int) -> None:
        self.meta["plan"], self.meta["plan_changed_at_step"] = plan.to_dict(), at_step

    def step_done(self, done: int, last: int, stopping: bool) -> Path | None:
        """After step ``done`` (from 1): save if it is due, the last step, or the run is stopping."""
        every = self.settings.every
        if (every and done % every == 0) or done == last or stopping:
            return save_checkpoint(self.engine, self.root, done, self.meta, keep=self.settings.keep,
                                   on_shard_written=self._on_shard_written)
        return None

    def where(self, step: int) -> str:
        """Where the run stands, for the line a dead rank's watch prints."""
        return (f"during step {step + 1}; last complete checkpoint: {latest_checkpoint(self.root) or 'none'}"
                f" (continue with `poplar train --resume --out {self.settings.out}`)")
