"""Gradient reduction: the hooks that collect each unit's gradient and the collectives that reduce it.

Post-accumulate-grad hooks add every parameter's gradient into its unit's fp32 flat
gradient. Once every parameter of a unit has its gradient, the unit's collective
(all-reduce in stage 0, reduce-scatter otherwise) is launched asynchronously and
overlaps the rest of the backward pass. Collectives are launched in one fixed unit
order, so every rank issues the same sequence whatever order its autograd finishes
units in. Stages that reduce every micro-step keep at most ``max_inflight`` full-size
gradient buckets alive; older ones are waited for and freed.

Hybrid (shard groups), each unit's reduce runs inside its group, and in a step's last
micro-step, as soon as it is done, the unit's shard is summed across groups
(:meth:`~poplar.engine.flat_unit.FlatUnit.start_across`): the slow links carry one sum a
step, whatever the accumulation, overlapping the rest of the backward pass.
"""

from __future__ import annotations

from collections import deque
from typing import Callable

import torch
from torch.utils.hooks import RemovableHandle

from poplar.engine.flat_unit import FlatUnit
from poplar.engine.unit_state import Slot
from poplar.stages import ZeroStage


class GradReducer:
    """Collects the units' gradients in backward and reduces them across ranks.

    ``before_launch`` runs before the first collective is issued (the engine's batch
    check). ``on_unit_done``: callables run when a unit's backward is done, before its
    parameters are freed (a test samples peak memory there); empty, it costs nothing.
    """

    def __init__(self, units: list[FlatUnit], stage: ZeroStage, max_inflight: int,
                 before_launch: Callable[[], None]):
        self.units, self.stage, self.max_inflight = units, stage, max_inflight
        self._before_launch = before_launch
        self.on_unit_done: list[Callable[[], None]] = []
        self._order = list(reversed(range(len(units))))   # ~ the order backward finishes them
        self._next = 0         # position in _order of the next unit to launch this micro-step
        self._pending: deque[FlatUnit] = deque()   # units whose gradient collective is in flight
        self._across: list[FlatUnit] = []          # hybrid: units whose sum across groups is in flight
        self.hybrid = bool(units) and units[0].layout.hybrid
        self.sync = False      # whether this micro-step reduces (else it only accumulates)
        self.last = False      # whether it is the step's last micro-step

    @property
    def full_buckets_alive(self) -> int | None:
        """Full-size gradient buckets alive at once: the ones in flight and the one filling.

        ``None`` where every unit's full gradient lives through the step (stages 0-1).
        """
        return self.max_inflight + 1 if self.stage.shards_gradients else None

    def register_hooks(self) -> list[RemovableHandle]:
        return [slot.param.register_post_accumulate_grad_hook(self._grad_hook(unit, slot))
                for unit in self.units for slot in unit.slots]

    def _grad_hook(self, unit: FlatUnit, slot: Slot):
        def hook(param: torch.Tensor) -> None:
            if unit.accumulate_grad(slot):
                self._unit_done(unit)
        return hook

    def _unit_done(self, unit: FlatUnit) -> None:
        for fn in self.on_unit_done:
            fn()
        unit.post_backward()
        if self.sync:
            self._launch_ready()

    # -- one step ---------------------------------------------------------------------
    def reset(self) -> None:
        """Clean gradient state, whatever an earlier (possibly failed) step left behind."""
        self._pending.clear()
        self._across.clear()
        for unit in self.units:
            unit.reset_grads()

    def begin_micro_step(self, sync: bool, last: bool) -> None:
        self.sync, self.last = sync, last
        self._next = 0

    def end_micro_step(self) -> None:
        """Units none of whose parameters were used take part too; a syncing micro-step finishes every reduce."""
        for unit in self.units:
            if not unit.grads_ready:
                unit.post_backward()
        if self.sync:
            self._launch_ready(force=True)
            while self._pending:
                self._finish(self._pending.popleft())
        if self.last and self.hybrid:
            gathers = [w for w in (u.finish_across() for u in self._across) if w is not None]
            self._across.clear()
            for w in gathers:
                w.wait()

    def _finish(self, unit: FlatUnit) -> None:
        unit.finish_reduce()
        if self.last and self.hybrid:
            unit.start_across()
            self._across.append(unit)

    # -- the collectives ----------------------------------------------------------------
    def _launch_ready(self, force: bool = False) -> None:
        """Launch gradient collectives in the fixed unit order, as far as units are ready."""
        self._before_launch()
        while self._next < len(self._order):
            unit = self.units[self._order[self._next]]
            if not (unit.grads_ready or force):
                return
            unit.reduce_grads()
            self._pending.append(unit)
            self._next += 1
            if self.stage.shards_gradients:   # full-size buckets are transient: bound how many are alive
                while len(self._pending) > self.max_inflight:
                    self._finish(self._pending.popleft())
