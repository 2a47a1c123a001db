"""A step's figures as every rank saw it: :class:`StepFigures`, gathered by one small all-gather.

Every front end gathers them after a step (``poplar train``'s step log,
:class:`~poplar.train.metrics.StepLog`; the integrations' plan following,
:class:`~poplar.integrations.step_plans.FollowedPlan`), and the re-planner reads them
(:class:`~poplar.runtime.replanner.Replanner`): every rank holds the same figures, so every
rank decides alike. Times are on the devices' clock (an emulated cluster's declared
seconds); ``overruns`` are the spans whose real work ran past an emulated device's time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StepFigures:
    """One step as every rank saw it: the slowest rank's time, each rank's busy time and MFU peak; the spans whose
    real work ran past an emulated device's time (``overruns``, all ranks') and the most device seconds they
    added to one rank's step (``late_s``)."""

    step_s: float
    busy_s: list[float]
    overruns: int
    peaks: list[float]
    grad_norm: float | None
    late_s: float = 0.0

    @classmethod
    def gather(cls, device, comm, before: tuple[int, float], peak: float, grad_norm: float | None) -> StepFigures:
        """Every rank calls this (one small all-gather); ``before``: ``device.lateness()`` as the step began."""
        overruns, late_s = device.lateness()
        mine = torch.tensor([device.step_s, device.compute_s, overruns - before[0], peak, late_s - before[1]],
                            dtype=torch.float64, device=device.torch_device)
        every = torch.zeros(comm.world_size * 5, dtype=torch.float64, device=mine.device)
        comm.all_gather(every, mine)
        rows = every.view(comm.world_size, 5).tolist()
        return cls(step_s=max(r[0] for r in rows), busy_s=[r[1] for r in rows],
                   overruns=int(sum(r[2] for r in rows)), peaks=[r[3] for r in rows],
                   grad_norm=grad_norm if grad_norm is None or math.isfinite(grad_norm) else None,
                   late_s=max(r[4] for r in rows))
