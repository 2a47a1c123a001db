"""The engine's schedule followed unit by unit: when each collective can start and what it leaves exposed.

The ranks of a process group run the same sequence of collectives on it (the engine
issues them in one fixed unit order), so a collective starts once the *last* of its
ranks has issued it and its group's link is free of the ones before it (collectives of
one process group run one after another, in issue order, as NCCL's do on their stream
and gloo's on its thread). A rank computes until it must wait for a collective's result;
the time it waits is exposed. Flat, every collective is the world's; hybrid (shard
groups), a group's gathers and reduce-scatters hold its own link, and the sums across
groups the world's.

A rank's step is a list of events (:class:`Compute`, :class:`Issue`, :class:`Wait`),
written by :func:`micro_step_events` from the engine's schedule for a stage:

- forward, unit by unit in the forward order; in ZeRO-3 each unit is gathered first
  (the root before anything, then each next unit prefetched while the current one
  computes, as :mod:`poplar.engine.unshard` does); the root's own forward (its
  embeddings) before the layers;
- the root's middle: the head, the loss and the head's backward;
- backward in the reverse order: each layer, gathered again in ZeRO-3 (the next one
  prefetched), its gradient collective issued once its backward is done, then the
  root's own backward (the embeddings' gradient) and its collective, last. Stages 2-3
  wait for the oldest reduction once more than ``max_inflight`` are in flight; every
  reduction is waited for at the micro-step's end.

Where a unit's compute falls comes from the profile's measured step anatomy
(:class:`~poplar.profile.profile.StepAnatomy`), per device kind; a profile without one
shares the compute by the units' forward FLOPs, the backward twice the forward, and
puts all of the root's in its middle.

Steps follow each other: a rank starts its next step as soon as its own is done. Where
every rank waits for the others at a step's start or end (flat ZeRO-1/2: the parameters'
all-gathers after the update; ZeRO-3: the batch check before the root's first gather),
one step from a common start is what each step of a run takes. Elsewhere (ZeRO-0; hybrid
ZeRO-1/2) a rank's update overlaps another's next step, which takes the first step's
offsets: :meth:`StepSchedule.run` follows two steps and takes the second.

>>> root = UnitTimes(forward_s=0.5, backward_s=0.5, reduce_s=1.5, middle_s=2.0)
>>> layer = UnitTimes(forward_s=1.0, backward_s=2.0, reduce_s=1.5)
>>> events = micro_step_events([root, layer], gathers=False, reduces=True)
>>> run_ranks([events])    # the root's reduction starts only when the layer's is done
(8.5, [6.0])
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from poplar.split import near_equal
from poplar.planner.events import Compute, Issue, Wait, follow_ranks, repeated, run_ranks


@dataclass(frozen=True)
class UnitTimes:
    """One unit in one micro-step: its compute and its collectives' times on the link."""

    forward_s: float
    backward_s: float
    gather_s: float = 0.0    # ZeRO-3: all-gather of its parameters
    reduce_s: float = 0.0    # its gradient collective (all-reduce, or reduce-scatter)
    middle_s: float = 0.0    # the root's: between the last layer's forward and its backward


def micro_step_events(units: list[UnitTimes], *, gathers: bool, reduces: bool, prefetch: bool = True,
                      max_inflight: int | None = None, tag: str = "", link: str = "") -> list:
    """One micro-step's events; ``units[0]`` is the root, the others in forward order; collectives on ``link``."""
    ev: list = []
    gathered: set[int] = set()

    def gather(i: int, wait: bool) -> None:
        key = f"{tag}g{i}{'b' if backward else ''}"
        if i not in gathered:
            ev.append(Issue(key, units[i].gather_s, link))
            gathered.add(i)
        if wait:
            ev.append(Wait(key))

    backward = False
    if gathers:
        gather(0, wait=True)
        if prefetch and len(units) > 1:
            gather(1, wait=False)
    ev.append(Compute(units[0].forward_s))
    for i in range(1, len(units)):
        if gathers:
            gather(i, wait=True)
            if prefetch and i + 1 < len(units):
                gather(i + 1, wait=False)
        ev.append(Compute(units[i].forward_s))
    ev.append(Compute(units[0].middle_s))     # the root stays gathered: the head, the loss, the head's backward
    backward, gathered = True, set()
    pending: list[str] = []
    for i in range(len(units) - 1, 0, -1):
        if gathers:
            gather(i, wait=True)
            if prefetch and i > 1:
                gather(i - 1, wait=False)
        ev.append(Compute(units[i].backward_s))
        if reduces:
            _reduce(ev, pending, Issue(f"{tag}r{i}", units[i].reduce_s, link), max_inflight)
    ev.append(Compute(units[0].backward_s))
    if reduces:
        _reduce(ev, pending, Issue(f"{tag}r0", units[0].reduce_s, link), max_inflight)
        ev.extend(Wait(k) for k in pending)
    return ev


def _reduce(ev: list, pending: list[str], issue: Issue, max_inflight: int | None) -> None:
    """Issue a gradient collective; past ``max_inflight`` in flight, wait for the oldest."""
    ev.append(issue)
    pending.append(issue.key)
    while max_inflight is not None and len(pending) > max_inflight:
        ev.append(Wait(pending.pop(0)))


FORWARD_SHARE = 1 / 3     # of a micro-step's compute: the backward does about twice the forward's FLOPs
STEADY_STEPS = 2          # steps followed where the ranks do not start a step together: the last is the steady one


@dataclass(frozen=True)
class Shape:
    """Collectives shaped to shard groups: the plan's ranks of each group, and the groups' profiled figures."""

    groups: list[list[int]]   # plan ranks
    inside: list              # per group: its collectives among its own ranks (a CommProfile)
    across: object            # the sum across groups (a ShapedComm)

    @cached_property
    def rank_groups(self) -> list[int]:
        """Each plan rank's group."""
        out = [0] * sum(len(g) for g in self.groups)
        for j, g in enumerate(self.groups):
            for r in g:
                out[r] = j
        return out

    @cached_property
    def links(self) -> list[int]:
        """Each group's sort of link: the first group whose collectives among its ranks take the same times."""
        firsts: dict[str, int] = {}
        return [firsts.setdefault(comm.model_dump_json(), j) for j, comm in enumerate(self.inside)]


class StepSchedule:
    """A profiled model's step in one ZeRO stage, as events per rank, for :class:`~poplar.planner.cost.CostModel`.

    Each unit computes its share of a micro-step (as the kind's step anatomy says; else its
    FLOPs' share of the forward, or of its parameters where the profile has no FLOPs) and
    moves its own parameters.
    With a :class:`Shape` (hybrid; two-level in stage 0) each group gathers and
    reduce-scatters on its own link, and in the last micro-step each unit's shard is
    summed across groups once its reduce-scatter is done (stage 0 then gathers the sum
    back inside the group), as :mod:`poplar.engine.grad_reduce` does.
    """

    def __init__(self, profile, stage: int, shape: Shape | None = None, gather_scale: float = 1.0,
                 group_stages: list[int] | None = None):
        model = profile.model
        self.numels = list(model.unit_numels) or [model.trained_params]
        weights = model.unit_flops if len(model.unit_flops) == len(self.numels) and sum(model.unit_flops) > 0 \
            else self.numels
        self.shares = [w / sum(weights) for w in weights]
        self.stage, self.shape = stage, shape
        self.stages = list(group_stages) if group_stages else [stage] * (len(shape.groups) if shape else 1)
        self.mixed = len(set(self.stages)) > 1     # groups in unlike stages: every rank joins the norm's all-reduce
        self.max_inflight, self.prefetch = profile.engine.max_inflight_reduces, profile.engine.prefetch
        comms = shape.inside if shape else [profile.comm]
        reduce_op = "all_reduce" if stage == 0 and not shape else "reduce_scatter"
        # each group's collectives at each unit's size, read once for groups of alike links (64 nodes, one link);
        # uneven shares: each rank's slice padded to the largest (gather_scale x the even gather's bytes)
        read: dict[str, tuple[list[float], list[float]]] = {}
        keys = [c.model_dump_json() for c in comms]
        for key, c in zip(keys, comms):
            if key not in read:
                read[key] = ([c.seconds(reduce_op, n) for n in self.numels],
                             [c.seconds("all_gather", n * gather_scale) for n in self.numels])
        self.reduce_s = [read[key][0] for key in keys]
        self.gather_s = [read[key][1] for key in keys]
        self.across_s = [shape.across.across_seconds(n) for n in self.numels] if shape else []
        self.sum_s = [shape.across.sum_seconds(n) for n in self.numels] if shape else []
        # the step's own all-reduces of a few numbers over the world (batch check, loss, norm): latency only
        self.small_s = profile.comm.seconds("all_reduce", 1)
        # by the distinct ranks (group, kind, samples, micro-steps): a schedule is one cost model's, whose kinds
        # every call passes (CostModel.schedule)
        self._steps: dict[tuple, float] = {}
        self._micro: dict[tuple, list] = {}
        self._links: dict[tuple, tuple[int, list[dict[str, float]]]] = {}

    def step_s(self, plan, rank_kinds: list[str], kinds: dict) -> float:
        """The plan's step time: every distinct rank (group, kind and micro-batches) followed together; a group
        alike another (links, and its ranks' kinds and micro-batches) runs as it does, and stands for it."""
        distinct = self._distinct(plan, rank_kinds)
        if distinct not in self._steps:     # the search asks for some plans' ranks again
            self._steps[distinct] = self.run(self._ranks(distinct, kinds))
        return self._steps[distinct]

    def link_s(self, plan, rank_kinds: list[str], kinds: dict) -> float:
        """The most seconds one link's collectives take in a step of ``plan``, one after another: no step is
        shorter. Every rank on a link issues its collectives and waits for each before its step ends, so from a
        common start the step lasts them all; in a run of steps, so does the step of the link's last rank to end
        the one before (it issues every one of the next step's after that end). The ranks of a link issue the
        same collectives there (:meth:`_on_links`): the most any of them does is the link's."""
        most: dict[str, float] = {}
        for g, micro, kc in self._ranks(self._distinct(plan, rank_kinds), kinds):
            for link, seconds in self._on_links(g, micro, kc).items():
                most[link] = max(most.get(link, 0.0), seconds)
        return max(most.values(), default=0.0)

    def _on_links(self, group: int, micro: list[tuple[float, float]], kind_cost) -> dict[str, float]:
        """The seconds of the collectives a rank of ``group`` issues on each link in a step of ``len(micro)``
        micro-steps. They are the group's (its links' times at each unit's size) whatever the rank's kind and
        micro-batches (those set its compute and waits only), and each micro-step before the last issues those
        of the one before it (ZeRO-2/3) or none (ZeRO-0/1): drawn on from a step of one micro-step and of two,
        written once for groups of one sort of link in one stage (their own link named for each)."""
        sort = (self.shape.links[group] if self.shape else 0, self.stages[group])
        if sort not in self._links:
            self._links[sort] = (group, [self._issued(self.rank_events(micro[:1] * n, kind_cost, group))
                                         for n in (1, 2)])
        first, (one, two) = self._links[sort]
        own = {f"n{first}": f"n{group}"} if self.shape else {}
        return {own.get(link, link): one.get(link, 0.0) + (len(micro) - 1) * (two[link] - one.get(link, 0.0))
                for link in two}

    @staticmethod
    def _issued(events: list) -> dict[str, float]:
        """The seconds of the collectives ``events`` issue, by link."""
        on: dict[str, float] = {}
        for e in events:
            if type(e) is Issue:
                on[e.link] = on.get(e.link, 0.0) + e.seconds
        return on

    def _ranks(self, distinct: tuple, kinds: dict) -> list[tuple]:
        return [(g, [(m, float(kinds[k].g[m])) for m in near_equal(b, a)], kinds[k]) for g, k, b, a in distinct]

    def _distinct(self, plan, rank_kinds: list[str]) -> tuple:
        """The plan's distinct ranks (group, kind, samples, micro-steps), a group alike another standing for it."""
        sizes = list(zip(rank_kinds, plan.local_batch_sizes, plan.accum_steps))
        group = [0] * len(sizes)
        if self.shape:
            members: list[set] = [set() for _ in self.shape.groups]
            for r, j in enumerate(self.shape.rank_groups):
                members[j].add(sizes[r])
            firsts: dict = {}
            stand_in = [firsts.setdefault((link, frozenset(m)), j) for j, (link, m) in
                        enumerate(zip(self.shape.links, members))]
            group = [stand_in[j] for j in self.shape.rank_groups]
        return tuple(dict.fromkeys((g, *size) for g, size in zip(group, sizes)))

    @property
    def ranks_start_together(self) -> bool:
        """Whether every rank waits for all the others at each step's start or end, so that each step starts
        on every rank at once: flat ZeRO-1/2 at the world's parameter all-gathers after the update, ZeRO-3 at
        the batch check before the root's first gather. In ZeRO-0 nothing after the gradients' all-reduces
        waits for the other ranks (the loss's all-reduce is issued before the update), nor in hybrid ZeRO-1/2
        anything after the norm's but the group's own gathers: a rank done with its update starts its next
        step while another is still in its own."""
        return set(self.stages) == {3} or (self.stage in (1, 2) and self.shape is None)

    def run(self, ranks: list[tuple]) -> float:
        """The step time for ranks given as (group, each micro-step's (micro-batch, compute seconds), the
        kind's :class:`~poplar.planner.cost.KindCost`): one step from a common start where the ranks start
        every step together, else the steady time of a step in a run of them (training's, and what ``poplar
        bench`` measures), each rank's next step begun when its own is done: the second of two followed (the
        first one's ends hang on its last collectives only, so the second repeats)."""
        events = [self.rank_events(micro, kind_cost, g) for g, micro, kind_cost in ranks]
        if self.ranks_start_together:
            end, _ = run_ranks(events)
            return end
        _, _, ends = follow_ranks([repeated(e, STEADY_STEPS) for e in events])
        return max(e[-1] - e[-2] for e in ends)

    def rank_events(self, micro: list[tuple[float, float]], kind_cost, group: int = 0) -> list:
        """One rank's step: its micro-steps, the update, and in ZeRO-1/2 the parameters gathered after it."""
        stage = self.stages[group]
        every = stage >= 2          # ZeRO-2/3 reduce (and all ranks run as many micro-steps) every time
        link = f"n{group}" if self.shape else ""
        gather_s = self.gather_s[group]
        events: list = []
        placed = 0.0     # of the step's work before the loss's all-reduce, what the last micro-step's end holds
        for j, (m, c) in enumerate(micro):
            last = j == len(micro) - 1
            tag = f"{link}.{j if every else ''}."
            micro_events = self._micro_step_events((kind_cost, m, c, group), gathers=stage == 3,
                                                   reduces=every or last, max_inflight=self.max_inflight if every
                                                   else None, tag=tag, link=link, prefetch=self.prefetch)
            if last:
                micro_events, placed = self._finishing(micro_events, tag, self._anatomy(kind_cost, m))
            events += self._sum_across(micro_events, tag, link, gather_s, stage) if self.shape and last \
                else micro_events
        anatomy = self._anatomy(kind_cost, micro[-1][0])
        return self._step_ends(self._checked(events), kind_cost.per_step_s, anatomy, link, gather_s, placed, stage)

    def _micro_step_events(self, micro: tuple, **how) -> list:
        """:func:`micro_step_events` of a micro-step ``micro`` (kind's cost, samples, seconds, group), written once
        a schedule for micro-steps alike (a rank's accumulation, and the plans a search tries, repeat them); the
        list is shared: read, never changed."""
        key = (micro, *sorted(how.items()))
        if key not in self._micro:
            kind_cost, m, c, group = micro
            units = [UnitTimes(f, b, g, r, mid) for (f, b, mid), g, r in
                     zip(self._split(kind_cost, m, c), self.gather_s[group], self.reduce_s[group])]
            self._micro[key] = micro_step_events(units, **how)
        return self._micro[key]

    def _finishing(self, events: list, tag: str, anatomy) -> tuple[list, float]:
        """The last micro-step's end as the engine runs it: after the root's gradient collective, the work before
        the first wait for one, then each reduced unit's own work once it is waited for (the later ones in flight
        meanwhile), shared by the units' sizes (the measured seconds: ``anatomy``; None: none placed); the
        events, and the seconds placed."""
        root = next((i for i, e in enumerate(events) if isinstance(e, Issue) and e.key == f"{tag}r0"), None)
        if anatomy is None or root is None:
            return events, 0.0
        waits = [e for e in events[root + 1:] if isinstance(e, Wait)]
        if len(waits) != len(events) - root - 1 or not waits:   # not only the reductions' waits after the root's
            return events, 0.0
        sizes = [self.numels[int(w.key[len(tag) + 1:])] for w in waits[:-1]]
        out = [*events[:root + 1], Compute(anatomy.before_waits_s)]
        for w, n in zip(waits, sizes):
            out += [w, Compute(anatomy.between_waits_s * n / sum(sizes))]
        return [*out, waits[-1]], anatomy.before_waits_s + (anatomy.between_waits_s if sizes else 0.0)

    def _anatomy(self, kind_cost, m: float):
        anatomy = kind_cost.anatomy(m)
        return anatomy if anatomy is not None and len(anatomy.forward) == len(self.numels) else None

    def _split(self, kind_cost, m: float, c: float) -> list[tuple[float, float, float]]:
        """Each unit's (forward, backward, middle) seconds of a micro-step of ``m`` samples computing ``c``."""
        anatomy = self._anatomy(kind_cost, m)
        if anatomy is None:      # by FLOPs: the root's all in its middle
            return [(0.0, 0.0, c * w) if i == 0 else (c * FORWARD_SHARE * w, c * (1 - FORWARD_SHARE) * w, 0.0)
                    for i, w in enumerate(self.shares)]
        total = sum(anatomy.forward) + sum(anatomy.backward) + anatomy.root_middle
        scale = c / total if total > 0 else 0.0
        return [(scale * f, scale * b, scale * anatomy.root_middle if i == 0 else 0.0)
                for i, (f, b) in enumerate(zip(anatomy.forward, anatomy.backward))]

    def _checked(self, events: list) -> list:
        """The batch check: its all-reduce issued as the step starts, waited for before the first collective."""
        first = next(i for i, e in enumerate(events) if isinstance(e, Issue))
        return [Issue("check", self.small_s), *events[:first], Wait("check"), *events[first:]]

    def _step_ends(self, events: list, per_step_s: float, anatomy, link: str, gather_s: list[float],
                   placed: float, stage: int) -> list:
        """After the micro-steps: the loss all-reduced (waited for last), in ZeRO-1-3 the squared norm (waited
        for before the update), the update, and in ZeRO-1/2 the parameters gathered after it. The ``anatomy``
        (None: none measured) places the step's own work out of ``per_step_s``: before the loss's all-reduce,
        before the norm's, and around the gathers; ``placed``: seconds of the first already in the events. Where
        the groups' stages differ every rank joins the norm's all-reduce (the engine's)."""
        before_loss, before_norm = (anatomy.before_loss_s, anatomy.before_norm_s) if anatomy else (0.0, 0.0)
        gathering = stage in (1, 2)
        issue, copy = (anatomy.gather_issue_s, anatomy.gather_copy_s) if anatomy and gathering else (0.0, 0.0)
        events = [*events, Compute(max(0.0, before_loss - placed)), Issue("loss", self.small_s), Compute(before_norm)]
        if stage >= 1 or self.mixed:
            events += [Issue("norm", self.small_s), Wait("norm")]
        events.append(Compute(max(0.0, per_step_s - before_loss - before_norm - issue - copy)))
        if gathering:
            events += self._gathers(link, gather_s, issue, copy)
        return [*events, Wait("loss")]

    def _gathers(self, link: str, gather_s: list[float], issue: float, copy: float) -> list:
        """ZeRO-1/2's parameters gathered after the update, unit by unit as the engine issues them: each one's
        slice made ready before its launch (the first's with the update), each copied out once it is waited for;
        ``issue`` and ``copy``: those seconds in all, shared by the units' sizes."""
        later, whole = sum(self.numels[1:]), sum(self.numels)
        out: list = []
        for i, s in enumerate(gather_s):
            if i and later:
                out.append(Compute(issue * self.numels[i] / later))
            out.append(Issue(f"{link}.p{i}", s, link))
        for i in range(len(gather_s)):
            out += [Wait(f"{link}.p{i}"), Compute(copy * self.numels[i] / whole)]
        return out

    def _sum_across(self, events: list, tag: str, link: str, gather_s: list[float], stage: int) -> list:
        """The last micro-step's events with each unit's sum across groups issued once its reduce is waited for."""
        out, summed = [], []
        for e in events:
            out.append(e)
            if isinstance(e, Wait) and e.key.startswith(f"{tag}r"):
                i = int(e.key[len(tag) + 1:])
                out.append(Issue(f"x{i}", self.across_s[i]))
                summed.append(i)
        for i in summed:
            out += [Wait(f"x{i}"), Compute(self.sum_s[i])]    # the parts added, once they are across
            if stage == 0:   # the two-level all-reduce's last level: the sums gathered inside the group
                out.append(Issue(f"{link}.ga{i}", gather_s[i], link))
        if stage == 0:
            out += [Wait(f"{link}.ga{i}") for i in summed]
        return out
