"""The profiling procedure for one device in one stage, written once for the profiler and the simulator.

What a stage profile holds and in which order it is found is decided here: the largest
micro-batch beside the model states (and beside none of the sharded ones, where that is
more), the sizes timed up to it, the once-per-step part, the same at unlike shares, the
step's anatomy at a middle size and the largest; a device that holds a sample only beside
a smaller share, and a profile timed at another share than an even one, are written
here too. How each answer is found is a :class:`Measure`'s: the profiler's runs engines
on the rank's device and agrees with the other ranks (:mod:`poplar.profile.rank`), the
simulator's prices steps counted once on fake tensors for one device kind
(:mod:`poplar.simulate.profile`).
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

from poplar.profile.probe import grow_then_bisect
from poplar.profile.profile import AT_LARGER_SHARE, FITS_WITH_LESS, NOT_TIMED, StageProfile, StepAnatomy
from poplar.profile.timing import point_sizes


class States(NamedTuple):
    """A stage's model states on one device, as the engine accounts them."""

    fits_one: bool      # micro-batch 1 fits this device beside them
    before: int         # bytes before any step, the optimizer's to come included
    most: int | None    # at their most, after two steps; None: a device profiled together does not fit one sample
    sharded: int = 0    # bytes of them held only as this device's share (none in stage 0)
    units: tuple[int, ...] = ()   # the engine's units' parameters


class Measure(Protocol):
    """What the procedure asks of a way of measuring, for one device in one stage."""

    headroom: int       # bytes kept free beside the states: a step holds its whole local batch at once

    def largest(self, held: int, limit: int) -> int:
        """The largest micro-batch, up to ``limit``, that fits beside ``held`` bytes."""

    def everyone(self, flag: bool) -> bool:
        """Whether ``flag`` holds for every device measured together."""

    def agree_sizes(self, mine: list[int]) -> list[list[int]]:
        """Every device's sizes to time, from this one's: row ``i``, each device's micro-batch in round ``i``."""

    def time_points(self, rows: list[list[int]]) -> tuple[list[tuple[int, float]], float]:
        """This device's ``(micro_batch, seconds)`` at ``rows``, and the once-per-step part."""

    def share_steps(self, row: list[int], micro_step: float) -> tuple[list, list]:
        """The once-per-step part and the parameter gathers' own work at unlike shares, at ``row`` (this device's
        micro-step there: ``micro_step`` seconds); empty where not measured."""

    def anatomy(self, row: list[int]) -> StepAnatomy | None:
        """The step's anatomy at ``row``; None where the model's layers give no marks."""

    def note(self, what: str) -> None:
        """Progress."""


def anatomy_rows(n: int) -> list[int]:
    """The rows of ``n`` timed sizes the anatomy is measured at: a middle size and the largest."""
    return sorted({n // 2, n - 1})


def timed_stage(m: Measure, states: States, n_points: int, max_micro_batch: int) -> StageProfile:
    """The stage timed beside ``states`` (every device measured together holds a sample there)."""
    state = states.most
    limit = m.largest(state + m.headroom, max_micro_batch)
    if not m.everyone(limit > 0):   # the headroom left no room for a sample on some device
        m.note("done")
        return StageProfile(max_micro_batch=min(limit, 1), state_bytes=state, note=NOT_TIMED)
    memory = [(state, limit)]
    if states.sharded and limit < max_micro_batch:   # beside none of the sharded states: how it grows
        fewer = state - states.sharded
        memory.insert(0, (fewer, m.largest(fewer + m.headroom, max_micro_batch)))
    rows = m.agree_sizes(point_sizes(limit, n_points))
    points, per_step = m.time_points(rows)
    share_steps, share_gathers = m.share_steps(rows[0], points[0][1] - per_step)
    m.note("anatomy")
    measured = [m.anatomy(rows[i]) for i in anatomy_rows(len(rows))]
    anatomy = sorted((a for a in measured if a is not None), key=lambda a: a.micro_batch)
    m.note("done")
    return StageProfile(max_micro_batch=limit, state_bytes=state, points=points, per_step_s=per_step,
                        anatomy=anatomy, memory_points=memory, share_steps=share_steps,
                        share_gathers=share_gathers)


def with_less(m: Measure, sp: StageProfile, capacity: int) -> StageProfile:
    """A device timed beside none of the sharded states: its second memory point the most states beside which one
    sample fits (none fits beside its even share), so the planner can read any share between."""
    chunk = max(1, (capacity - sp.state_bytes) // 1024)

    def fits(k: int) -> bool:
        return m.largest(sp.state_bytes + k * chunk + m.headroom, 1) == 1
    most = sp.state_bytes + grow_then_bisect(fits, limit=1024) * chunk
    return sp.model_copy(update={"note": FITS_WITH_LESS, "memory_points": [(sp.state_bytes, sp.max_micro_batch),
                                                                            (most, 1)]})


def at_even_share(sp: StageProfile, sharded: int, even: int, capacity: int) -> StageProfile:
    """``sp``, timed holding ``sharded`` bytes of the sharded states, as at an even share of them (``even`` bytes):
    its states shifted by the difference, its largest micro-batch read off its memory points there."""
    if sharded == even or not sp.points:
        return sp
    state = sp.state_bytes - sharded + even
    return sp.model_copy(update={"state_bytes": state, "note": sp.note or AT_LARGER_SHARE,
                                 "max_micro_batch": sp.max_micro_batch_at(state, capacity)})
