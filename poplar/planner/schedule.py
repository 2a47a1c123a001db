"""The engine's schedule followed unit by unit: when each collective can start and what it leaves exposed.

Every rank runs the same sequence of collectives (the engine issues them in one fixed
unit order), so a collective starts once the *last* rank has issued it and the link is
free of the ones before it (collectives of one process group run one after another, in
issue order, as NCCL's do on their stream and gloo's on its thread). A rank computes
until it must wait for a collective's result; the time it waits is exposed.

A rank's step is a list of events (:class:`Compute`, :class:`Issue`, :class:`Wait`),
written by :func:`micro_step_events` from the engine's schedule for a stage:

- forward, unit by unit in the forward order; in ZeRO-3 each unit is gathered first
  (the root before anything, then each next unit prefetched while the current one
  computes, as :mod:`poplar.engine.unshard` does);
- backward in the reverse order: the root's own backward (the head) first, then each
  layer, gathered again in ZeRO-3 (the next one prefetched), its gradient collective
  issued once its backward is done, and the root's last (its embedding gradient
  arrives last). Stages 2-3 wait for the oldest reduction once more than
  ``max_inflight`` are in flight; every reduction is waited for at the micro-step's end.

>>> u = UnitTimes(forward_s=1.0, backward_s=2.0, reduce_s=1.5)
>>> events = micro_step_events([u, u], gathers=False, reduces=True)
>>> run_ranks([events])    # the root's reduction starts only when the layer's is done
(9.0, [6.0])
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class UnitTimes:
    """One unit in one micro-step: its compute and its collectives' times on the link."""

    forward_s: float
    backward_s: float
    gather_s: float = 0.0    # ZeRO-3: all-gather of its parameters
    reduce_s: float = 0.0    # its gradient collective (all-reduce, or reduce-scatter)


@dataclass(frozen=True)
class Compute:
    seconds: float


@dataclass(frozen=True)
class Issue:
    key: str                 # names the collective (the same on every rank)
    seconds: float           # its time on the link once started


@dataclass(frozen=True)
class Wait:
    key: str


def micro_step_events(units: list[UnitTimes], *, gathers: bool, reduces: bool, prefetch: bool = True,
                      max_inflight: int | None = None, tag: str = "") -> list:
    """One micro-step's events; ``units[0]`` is the root, the others in forward order."""
    ev: list = []
    gathered: set[int] = set()

    def gather(i: int, wait: bool) -> None:
        key = f"{tag}g{i}{'b' if backward else ''}"
        if i not in gathered:
            ev.append(Issue(key, units[i].gather_s))
            gathered.add(i)
        if wait:
            ev.append(Wait(key))

    backward = False
    if gathers:
        gather(0, wait=True)
        if prefetch and len(units) > 1:
            gather(1, wait=False)
    for i in range(1, len(units)):
        if gathers:
            gather(i, wait=True)
            if prefetch and i + 1 < len(units):
                gather(i + 1, wait=False)
        ev.append(Compute(units[i].forward_s))
    ev.append(Compute(units[0].forward_s))
    ev.append(Compute(units[0].backward_s))   # the root stays gathered: the head's backward comes first
    backward, gathered = True, set()
    pending: list[str] = []
    for i in range(len(units) - 1, 0, -1):
        if gathers:
            gather(i, wait=True)
            if prefetch and i > 1:
                gather(i - 1, wait=False)
        ev.append(Compute(units[i].backward_s))
        if reduces:
            _reduce(ev, pending, f"{tag}r{i}", units[i].reduce_s, max_inflight)
    if reduces:
        _reduce(ev, pending, f"{tag}r0", units[0].reduce_s, max_inflight)
        ev.extend(Wait(k) for k in pending)
    return ev


def _reduce(ev: list, pending: list[str], key: str, seconds: float, max_inflight: int | None) -> None:
    """Issue a gradient collective; past ``max_inflight`` in flight, wait for the oldest."""
    ev.append(Issue(key, seconds))
    pending.append(key)
    while max_inflight is not None and len(pending) > max_inflight:
        ev.append(Wait(pending.pop(0)))


def run_ranks(ranks: list[list]) -> tuple[float, list[float]]:
    """Follow every rank's events together: the step's end and each rank's busy (compute) time.

    Collectives are started in the order ranks issue them (the same on every rank), each
    when the last rank has issued it and the link is free.
    """
    order = [e.key for e in ranks[0] if isinstance(e, Issue)]
    for r, events in enumerate(ranks[1:], 1):
        if [e.key for e in events if isinstance(e, Issue)] != order:
            raise ValueError(f"rank {r} issues other collectives than rank 0: ranks must run the same sequence")
    clock, busy, pos = [0.0] * len(ranks), [0.0] * len(ranks), [0] * len(ranks)
    done: dict[str, float] = {}
    link_free = 0.0

    def advance(r: int, until: str | None) -> float | None:
        """Run rank ``r`` to its issue of ``until`` (its time then), or to its end."""
        events = ranks[r]
        while pos[r] < len(events):
            e = events[pos[r]]
            pos[r] += 1
            if isinstance(e, Compute):
                clock[r] += e.seconds
                busy[r] += e.seconds
            elif isinstance(e, Wait):
                clock[r] = max(clock[r], done[e.key])
            elif e.key == until:
                return clock[r]
        return None

    for key in order:
        issued = [advance(r, key) for r in range(len(ranks))]
        seconds = next(e.seconds for e in ranks[0] if isinstance(e, Issue) and e.key == key)
        start = max(max(issued), link_free)
        done[key] = link_free = start + seconds
    for r in range(len(ranks)):
        advance(r, None)
    return max(clock), busy


FORWARD_SHARE = 1 / 3     # of a micro-step's compute: the backward does about twice the forward's FLOPs
MAX_INFLIGHT = 2          # ZeRO-2/3 reductions in flight: the engine's default (max_inflight_reduces)


class StepSchedule:
    """A profiled model's step in one ZeRO stage, as events per rank, for :class:`~poplar.planner.cost.CostModel`.

    Each unit computes its share of a micro-step (its FLOPs' share of the forward, or of
    its parameters where the profile has no FLOPs) and moves its own parameters.
    """

    def __init__(self, profile, stage: int):
        model, comm = profile.model, profile.comm
        numels = list(model.unit_numels) or [model.n_params]
        weights = model.unit_flops if len(model.unit_flops) == len(numels) and sum(model.unit_flops) > 0 else numels
        self.shares = [w / sum(weights) for w in weights]
        self.stage = stage
        reduce_op = "all_reduce" if stage == 0 else "reduce_scatter"
        self.reduce_s = [comm.seconds(reduce_op, n) for n in numels]
        self.gather_s = [comm.seconds("all_gather", n) for n in numels]

    def step_s(self, plan, rank_kinds: list[str], kinds: dict) -> float:
        """The plan's step time: every distinct rank (kind and micro-batches) followed together."""
        distinct = dict.fromkeys((rank_kinds[r], tuple(plan.micro_batches(r))) for r in range(plan.world_size))
        end, _ = run_ranks([self.rank_events(kinds[k], mbs) for k, mbs in distinct])
        return end

    def rank_events(self, kind_cost, micro_batches) -> list:
        """One rank's step: its micro-steps, the update, and in ZeRO-1/2 the parameters gathered after it."""
        every = self.stage >= 2          # ZeRO-2/3 reduce (and all ranks run as many micro-steps) every time
        events: list = []
        for j, m in enumerate(micro_batches):
            c = float(kind_cost.g[m])
            units = [UnitTimes(c * FORWARD_SHARE * w, c * (1 - FORWARD_SHARE) * w, g, r)
                     for w, g, r in zip(self.shares, self.gather_s, self.reduce_s)]
            events += micro_step_events(units, gathers=self.stage == 3, reduces=every or j == len(micro_batches) - 1,
                                        max_inflight=MAX_INFLIGHT if every else None, tag=f"{j}." if every else "")
        events.append(Compute(kind_cost.per_step_s))
        if self.stage in (1, 2):
            events += [Issue(f"p{i}", s) for i, s in enumerate(self.gather_s)]
            events += [Wait(f"p{i}") for i in range(len(self.gather_s))]
        return events
