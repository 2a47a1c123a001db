"""The four ZeRO stages, defined once: what each one shards and what follows from it.

Every unit of the model is one flat buffer; rank ``r`` owns the ``r``-th equal slice
(its shard). A stage decides which of the training state is kept only as a shard:

=====  ===================  ================================  ==========================
stage  model parameters     fp32 master + optimizer states    gradients
=====  ===================  ================================  ==========================
0      full                 full                              full, all-reduced once
1      full                 shard                             full, reduce-scattered once
2      full                 shard                             shard, reduce-scattered
                                                              every micro-step
3      shard, gathered for  shard                             shard, as stage 2
       the unit's forward
       and backward
=====  ===================  ================================  ==========================

The plan, the engine and the cost model read these facts from here.

>>> stage(2).reduces_every_micro_step, stage(1).equal_accum_steps
(True, False)
>>> stage(4)
Traceback (most recent call last):
...
ValueError: zero_stage = 4: choose one of 0, 1, 2, 3
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ZeroStage:
    """One ZeRO stage: which training state each rank holds only its shard of."""

    number: int
    shards_optimizer: bool    # fp32 master weights and optimizer states
    shards_gradients: bool
    shards_parameters: bool   # the model's (compute-precision) parameters
    description: str

    @property
    def reduces_every_micro_step(self) -> bool:
        """Gradients are reduced in every micro-step, not once per optimizer step.

        A sharded gradient has no full accumulator to sum micro-steps into, so each
        micro-step's full gradient is reduce-scattered into the shard right away.
        """
        return self.shards_gradients

    @property
    def equal_accum_steps(self) -> bool:
        """Every rank must run the same number of micro-steps: a collective in each needs every rank."""
        return self.reduces_every_micro_step

    def sharded_bytes_per_param(self, precision: str) -> int:
        """Bytes of each parameter's training state this stage keeps only as a shard.

        >>> stage(1).sharded_bytes_per_param("bf16"), stage(3).sharded_bytes_per_param("fp32")
        (16, 16)
        """
        if not self.shards_optimizer:
            return 0
        master = 4 if precision != "fp32" else 0        # in fp32 the master is the parameter itself
        params = (2 if precision != "fp32" else 4) if self.shards_parameters else 0
        return master + OPTIMIZER_BYTES_PER_MASTER_BYTE * 4 + 4 + params   # + the fp32 gradient shard

    def uneven_gather_bytes(self, fractions: list[float], unit_numels: list[int], precision: str) -> float:
        """What ZeRO-3's all-gathers in flight (the unit computing and the one prefetched) hold besides their
        outputs where ranks hold unlike slices, every slice padded to the largest and this rank's copy
        (:attr:`poplar.engine.flat_unit.FlatUnit.gather_buffer_numel`); 0 for even slices and in the other
        stages.

        >>> [stage(s).uneven_gather_bytes([0.75, 0.25], [100], "fp32") for s in (2, 3)]
        [0.0, 1800.0]
        """
        if not self.shards_parameters or len(set(fractions)) <= 1 or not unit_numels:
            return 0.0
        width = 2 if precision != "fp32" else 4
        return 2 * (len(fractions) + 1) * max(fractions) * max(unit_numels) * width

    def __str__(self) -> str:
        return f"ZeRO-{self.number}"


# AdamW, the optimizer the profiler runs and the engine is measured with: two moments the size of the fp32 master.
OPTIMIZER_BYTES_PER_MASTER_BYTE = 2


def frozen_bytes_per_param(precision: str) -> int:
    """Bytes of each frozen parameter (LoRA's base weights) on every rank, in every stage: its weight alone, in the
    compute precision (no gradient, no fp32 master, no optimizer state; no unit holds it, so no stage shards it).

    >>> frozen_bytes_per_param("bf16"), frozen_bytes_per_param("fp16"), frozen_bytes_per_param("fp32")
    (2, 2, 4)
    """
    return 4 if precision == "fp32" else 2


STAGES: dict[int, ZeroStage] = {s.number: s for s in (
    ZeroStage(0, False, False, False, "replicate everything; all-reduce gradients once per step"),
    ZeroStage(1, True, False, False, "shard optimizer states and fp32 master; reduce-scatter gradients once per step"),
    ZeroStage(2, True, True, False, "also shard gradients: reduce-scatter them in every micro-step"),
    ZeroStage(3, True, True, True, "also shard parameters: all-gather each unit for its forward and backward"),
)}


def stage(number: int) -> ZeroStage:
    """The stage numbered ``number`` (0-3); a clear ``ValueError`` for anything else."""
    if isinstance(number, bool) or number not in tuple(STAGES):   # a tuple: unhashable input fails clearly too
        raise ValueError(f"zero_stage = {number!r}: choose one of {', '.join(map(str, STAGES))}")
    return STAGES[int(number)]



def parse_stages(stages) -> list[int]:
    """The stages a command may use, sorted, once each: from ``"0,1,3"`` or a list of numbers.

    The one check of a stage list (command lines, the training config, the planner).

    >>> parse_stages("3, 0,1"), parse_stages([2, 2])
    ([0, 1, 3], [2])
    >>> parse_stages("0,7")
    Traceback (most recent call last):
    ...
    ValueError: choose stages from 0, 1, 2, 3, e.g. 0,1,2,3 (got '0,7')
    """
    items = [s.strip() for s in stages.split(",") if s.strip()] if isinstance(stages, str) else stages
    try:
        numbers = {s if isinstance(s, int) and not isinstance(s, bool) else int(s, 10) for s in items}
    except (TypeError, ValueError):   # "1.5", "one", a bool, a number that is not whole
        numbers = {None}
    if not numbers or any(n not in STAGES for n in numbers):
        raise ValueError(f"choose stages from {', '.join(map(str, STAGES))}, e.g. {','.join(map(str, STAGES))} "
                         f"(got {stages!r})")
    return sorted(numbers)
