"""A front end's own batch settings, split evenly as its framework splits them: :class:`BatchSettings`.

One of the ways an integration gets its plan (:func:`~poplar.integrations.session.resolve_planning`), beside a
plan given or loaded and one profiled and planned on a cluster: with no plan and no cluster, the batch settings
the user already wrote give every rank the same micro-batch and accumulation count. DeepSpeed's
``train_batch_size``, ``train_micro_batch_size_per_gpu`` and ``gradient_accumulation_steps``; Lightning's train
``DataLoader`` ``batch_size`` and ``accumulate_grad_batches`` (and ``PoplarStrategy(global_batch=)``); the HF
Trainer's ``per_device_train_batch_size`` and ``gradient_accumulation_steps``. DeepSpeed's rules decide
(``deepspeed/runtime/config.py``, ``_set_batch_related_parameters``): any two of the three give the third, the
global batch alone gives every rank ``global / ranks`` in one micro-batch, the micro-batch alone one accumulation
step; and ``global = micro x accumulation x ranks`` must hold, or the settings are refused in one line that
says what to give.

>>> s = BatchSettings(global_batch=16, micro_batch=None, accum_steps=2, names=DEEPSPEED)
>>> s.even_split(world_size=2)
(4, 2)
>>> print(s.plan(world_size=2, zero_stage=3))
Plan(stage 3, global batch 16: r0:4x2, r1:4x2)
>>> BatchSettings(10, None, None, DEEPSPEED).even_split(3)
Traceback (most recent call last):
...
ValueError: train_batch_size 10 is not a multiple of the 3 ranks (DeepSpeed gives every rank the same micro-batch): give train_batch_size 9 or 12, or a cluster (or a plan) to have Poplar split it unevenly
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from poplar.plan import Plan, check_global_batch


@dataclass(frozen=True)
class BatchNames:
    """What a front end calls its three batch settings, and whose even split it takes (for its lines)."""

    global_batch: str
    micro_batch: str
    accum_steps: str
    splits: str
    derived: str      # how the three are made to agree, other than by giving the global batch they make


DEEPSPEED = BatchNames("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                       "DeepSpeed", "leave one of the three out to have it derived (DeepSpeed refuses it too)")
LIGHTNING = BatchNames("global_batch", "the train DataLoader's batch_size", "accumulate_grad_batches", "DDP",
                       "leave global_batch out (it is then batch_size x accumulate_grad_batches x ranks, as DDP's)")
HF = BatchNames("the global batch", "per_device_train_batch_size", "gradient_accumulation_steps", "DDP",
                "leave it out")

CLUSTER_NOTE = "give a cluster (cluster= or POPLAR_CLUSTER) or a plan to have Poplar plan the split for mixed GPUs"


@dataclass(frozen=True)
class BatchSettings:
    """A front end's three batch settings as the user gave them (None: left out)."""

    global_batch: int | None
    micro_batch: int | None
    accum_steps: int | None
    names: BatchNames

    def __post_init__(self):
        for name, v in self._given():
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} = {v!r} must be a positive integer")
        if self.global_batch is None and self.micro_batch is None:
            raise ValueError(f"give {self.names.global_batch} (the samples of every optimizer step) or "
                             f"{self.names.micro_batch} (each rank's micro-batch)")

    def _given(self) -> list[tuple[str, int]]:
        n = self.names
        return [(name, v) for name, v in ((n.global_batch, self.global_batch), (n.micro_batch, self.micro_batch),
                                          (n.accum_steps, self.accum_steps)) if v is not None]

    def global_batch_size(self, world_size: int) -> int:
        """The samples of every optimizer step (a planned split may share them unevenly): the global batch where
        given (the three, where all are given, must agree), else micro-batch x accumulation x ranks."""
        if self.global_batch is None:
            return self.micro_batch * (self.accum_steps or 1) * world_size
        if self.micro_batch is not None and self.accum_steps is not None:
            self.even_split(world_size)
        return self.global_batch

    def even_split(self, world_size: int) -> tuple[int, int]:
        """``(micro_batch, accum_steps)``, the same on every rank, as DeepSpeed derives them; a one-line
        ValueError where DeepSpeed refuses them."""
        batch, micro, accum = self.global_batch, self.micro_batch, self.accum_steps
        if batch is None:
            return micro, accum or 1
        if micro is None:
            micro = batch // (world_size * (accum or 1))
        accum = accum if accum is not None else batch // (micro * world_size) if micro else 0
        if micro * accum * world_size != batch:
            raise ValueError(self._refusal(world_size))
        return micro, accum

    def _refusal(self, world_size: int) -> str:
        n, batch = self.names, self.global_batch
        if self.micro_batch is not None and self.accum_steps is not None:
            want = self.micro_batch * self.accum_steps * world_size
            return (f"{n.global_batch} {batch} != {n.micro_batch} {self.micro_batch} x {n.accum_steps} "
                    f"{self.accum_steps} x {_ranks(world_size)}: give {n.global_batch} {want}, or {n.derived}")
        parts = [f"{name} {v}" for name, v in self._given()[1:]] + ([f"the {world_size} ranks"] if world_size > 1
                                                                      else [])
        unit = (self.micro_batch or 1) * (self.accum_steps or 1) * world_size
        near = " or ".join(str(v) for v in (batch // unit * unit, batch // unit * unit + unit) if v > 0)
        what = (f"a multiple of {parts[0]}" if len(parts) == 1 else
                "a multiple of " + " x ".join(parts) + f" = {unit}")
        return (f"{n.global_batch} {batch} is not {what} ({n.splits} gives every rank the same micro-batch): give "
                f"{n.global_batch} {near}, or a cluster (or a plan) to have Poplar split it unevenly")

    def plan(self, world_size: int, zero_stage: int) -> Plan:
        """The uniform plan: every rank the even split's micro-batch and accumulation, in ``zero_stage``."""
        micro, accum = self.even_split(world_size)
        check_global_batch(micro * accum * world_size, world_size)
        return Plan(zero_stage, [micro] * world_size, accum)

    def line(self, plan: Plan) -> str:
        """The one line rank 0 prints when this split is trained: what each rank takes, and what plans it instead."""
        micro, accum = plan.micro_batch_sizes[0], plan.accum_steps[0]
        who = "the one rank" if plan.world_size == 1 else f"each of the {plan.world_size} ranks"
        return (f"poplar: no plan and no cluster: {who} takes {micro} samples x "
                f"{accum} accumulation step{'s' if accum != 1 else ''} ({plan.global_batch_size} a step, ZeRO "
                f"stage {plan.zero_stage}), as {self.names.splits} splits it; {CLUSTER_NOTE}")


def _ranks(n: int) -> str:
    return f"{n} rank{'s' if n != 1 else ''}"


def even_plan(world_size: int, settings: BatchSettings, stages=(0,)) -> Plan:
    """The even split of ``settings`` over ``world_size`` ranks in the lowest of ``stages`` (the stage named, or 0
    as DDP and DeepSpeed default to), said in one line by rank 0."""
    plan = settings.plan(world_size, min(stages))
    if launched_rank() == 0:
        print(settings.line(plan), flush=True)
    return plan


def launched_rank() -> int:
    """This process's rank: the process group's, else the launcher's ``RANK`` (0 in a plain run)."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", 0))


def launched_world_size() -> int:
    """The ranks launched: the process group's, else the launcher's ``WORLD_SIZE`` (1 in a plain run), known
    before any process group is made."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", 1))
