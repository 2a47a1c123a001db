"""One rank's runtime, for every loop that trains with Poplar: :class:`RankRuntime`.

``poplar train``'s :class:`~poplar.train.trainer.Trainer` and the integrations'
:class:`~poplar.integrations.session.Session` both build their rank here: the engine on
the rank's device (its collectives seen by the device, ``comm=device.comm``), and each
optimizer step run inside the device's step, which times it (and, emulated, paces it
and caps its memory): :class:`~poplar.devices.steps.TimedSteps`, the step loop the
comparisons and the profiler time their steps with too. How the device was chosen and
entered is the caller's (:func:`poplar.devices.rank_device_of`).
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path

from poplar.devices.steps import TimedSteps
from poplar.engine import initialize


class RankRuntime:
    """This rank's engine on its ``device`` (entered), ``optimizer`` a factory of the engine's optimizer,
    ``weights`` where the model's parameters are to be read into the shards (:mod:`poplar.engine.weights`)."""

    def __init__(self, device, model, optimizer, plan, config=None, weights=None):
        self.device = device
        self.engine = initialize(model, optimizer, plan, config, comm=device.comm, weights=weights)
        self.steps = TimedSteps(device, self.engine.held_state)   # every step's figures

    @property
    def steps_s(self) -> list[float]:
        """Each step's time on the device's clock."""
        return self.steps.step_s

    @property
    def step_walls(self) -> list[tuple[float, float]]:
        """When each step began and ended on this host (``time.perf_counter``)."""
        return self.steps.walls

    @property
    def plan(self):
        return self.engine.plan

    def train_batch(self, local_batch, loss_fn) -> float:
        """One optimizer step on this rank's slice (``loss_fn(model, micro_batch)``); the global mean loss."""
        with self.step():
            return self.engine.train_batch(local_batch, loss_fn)

    @contextlib.contextmanager
    def step(self):
        """The context one optimizer step runs in (for loops that drive the micro-steps themselves)."""
        with self.steps.step() as device:
            yield device

    def change_plan(self, plan, scratch: str | Path) -> None:
        """Every rank, between steps: train with ``plan`` from the next step. Another split or shares are cut in
        place (:meth:`~poplar.engine.engine.Engine.set_plan`); another ZeRO stage or shape goes through a checkpoint
        written under ``scratch`` (a folder every rank reads, as the run's checkpoints are), read back resharded,
        then removed."""
        now = self.engine.plan
        if plan.same_shape(now):
            self.engine.set_plan(plan)
            return
        from poplar.runtime.checkpoint import load_checkpoint, save_checkpoint

        scratch, written = Path(scratch), []
        steps = self.engine.global_steps + self.engine.skipped_steps

        def write() -> None:   # into an empty folder (a crashed run's may hold a later step), the very one read back
            self._clear(scratch)
            written.append(save_checkpoint(self.engine, scratch, steps, {}, keep=0))
        self.engine.rebuild(plan, write, lambda: load_checkpoint(self.engine, written[0], {}))
        self._clear(scratch)           # every rank has read it

    def _clear(self, folder: Path) -> None:
        """Every rank: ``folder`` removed (by rank 0), and every rank past that."""
        self.engine.comm.barrier()
        if self.engine.rank == 0:
            shutil.rmtree(folder, ignore_errors=True)
        self.engine.comm.barrier()

    def close(self) -> None:
        self.engine.close()
