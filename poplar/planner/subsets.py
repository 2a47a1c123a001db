"""Which kinds take part: every subset of the kinds, each in its best stage and shape.

A plan need not use every card. A kind whose card cannot hold the states in one node
holds every node-hybrid shape back; a kind whose step of one sample is longer than the
others' whole step holds every rank back; over a slow link the flat plan of everyone may
be slower than the hybrid plan of a few. :func:`weigh_kinds` weighs every subset of the
kinds (``2^K - 1`` of them), each in every stage and shape (flat, one node a group, and
groups of several nodes sized to the kinds: :mod:`poplar.planner.groups`), and returns
each candidate's prediction, the fastest first.

Predictions follow the engine's schedule, the costly part at thousands of ranks, so the
search floors every candidate first, kind by kind with no per-rank work, and predicts only
what the floors leave open:

- a subset's *bound*: the batch levelled over its ranks at their flat compute (the fewest
  states a rank of it holds), each rank a sample at least, no collective;
- a candidate's *floor*: the same at the share of the states its shape gives each kind,
  against the collectives its busiest link must carry in a step (a group's inside it, the
  sum across groups, or flat the world's: :func:`~poplar.planner.cost.link_floor_s`); no
  plan of it is faster. Its *likely* figure puts the link's time after the compute;
- candidates are followed through the schedule, the likeliest first, where their floor is
  above the fastest prediction found: every one on a small cluster, by turns at scale
  (:meth:`KindsSearch.weigh`). Those not followed keep their floor (``at most``).

>>> round(_levelled({"a": (2, np.array([0.0, 1.0, 2.0]), 1.0), "b": (1, np.array([0.0, 0.5, 1.0]), 0.5)}, 3), 6)
0.75
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

import numpy as np

from poplar.planner.cost import CostModel, KindCost, link_floor_s, unhidden_comm_s
from poplar.planner.groups import across_groups, fewest_nodes, group_sizes, kind_shapes, node_runs, spanning_comm
from poplar.planner.schedule import Shape
from poplar.planner.search import Infeasible, allocate, fastest_accum_table
from poplar.planner.shape import flat_comm, node_shape, shaped_stage
from poplar.planner.shares import stage_at_share
from poplar.plan import Plan
from poplar.profile.profile import Profile

MOST_KINDS = 10       # kinds weighed in every subset; more, and the subsets are the fastest kinds' first ones
MOST_PREDICTED = 2    # at scale, candidates followed through the schedule in each turn of the search (weigh)
EVERY_OWN_KINDS = 3   # clusters of up to this many kinds weigh every way of giving each kind its own stage


@dataclass(frozen=True)
class Candidate:
    """One subset of the kinds in one stage and shape, and what it was predicted to give."""

    kinds: tuple[str, ...]
    stage: int
    name: str                       # "flat", "one node a group", "2 nodes a group", ...
    samples_per_s: float = 0.0      # followed through the schedule (0: not followed, or no plan)
    floor_samples_per_s: float = 0.0
    why_not: str = ""
    plan: Plan | None = None
    own: tuple[tuple[str, int], ...] = ()   # each kind's own stage where the groups' stages differ (else ())

    @property
    def label(self) -> str:
        return f"stage {self.stage} {self.name}" + (f" ({self.own_said})" if self.own_said else "")

    @property
    def own_said(self) -> str:
        """The kinds in a lower stage than the candidate's, and theirs ("" where none)."""
        return ", ".join(f"{k} ZeRO-{s}" for k, s in self.own if s != self.stage)

    def group_stages(self, profile: Profile, ranks: list[int], shape: Shape) -> list[int] | None:
        """Each of ``shape``'s groups (of ``ranks``, profile ranks) in its kind's own stage (None: all in one)."""
        if not self.own:
            return None
        own = dict(self.own)
        return [own.get(profile.ranks[ranks[g[0]]], self.stage) for g in shape.groups]

    def to_dict(self) -> dict:
        return {"kinds": list(self.kinds), "stage": self.stage, "shape": self.name,
                **({"kind_stages": dict(self.own)} if self.own else {}),
                "samples_per_s": self.samples_per_s or None, "floor_samples_per_s": self.floor_samples_per_s,
                **({"why_not": self.why_not} if self.why_not else {})}


def kind_ranks(profile: Profile, kinds) -> list[int]:
    return [r for r, k in enumerate(profile.ranks) if k in kinds]


def shapes_of(profile: Profile, ranks: list[int], stage: int) -> dict[str, Shape | None]:
    """Every shape a plan of ``ranks`` in ``stage`` may take, by name (None: flat)."""
    out: dict[str, Shape | None] = {"flat": None}
    nodes = node_shape(profile, ranks)
    if nodes is not None:
        out["one node a group"] = nodes
        out.update(kind_shapes(profile, ranks, stage))
    return out


def _levelled(tables: dict[str, tuple[int, np.ndarray, float]], global_batch: int) -> float:
    """The least time within which ranks (``tables[kind] = (count, times, per_sample)``: ``times[b]``, ``b`` samples'
    least time, non-decreasing; past its end each sample at least ``per_sample`` more) take ``global_batch``
    samples, a rank's samples interpolated between whole counts."""
    def samples_within(limit: float) -> float:
        total = 0.0
        for count, t, per_sample in tables.values():
            whole = int(np.searchsorted(t, limit, side="right")) - 1
            if whole >= len(t) - 1:
                total += count * (len(t) - 1 + (limit - t[-1]) / per_sample)
            elif whole >= 0:
                step = t[whole + 1] - t[whole]
                total += count * (whole + (min(1.0, (limit - t[whole]) / step) if step > 0 else 1.0))
        return total

    lo, hi = 0.0, max(float(t[-1]) for _, t, _ in tables.values())
    while samples_within(hi) < global_batch:
        hi *= 2
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if samples_within(mid) < global_batch else (lo, mid)
    return hi


class KindsSearch:
    """Every subset of ``profile``'s kinds in ``stages``, bounded, then predicted (see the module)."""

    def __init__(self, profile: Profile, stages: list[int], global_batch: int,
                 most_predicted: int | None = MOST_PREDICTED, every_kind: bool = False):
        self.profile, self.stages, self.global_batch = profile, stages, global_batch
        self.most_predicted, self.every_kind = most_predicted, every_kind
        self.kinds = list(dict.fromkeys(profile.ranks))
        self.counts = {k: profile.ranks.count(k) for k in self.kinds}
        shaped = profile.comm.shaped if profile.comm is not None else None
        nodes = shaped.groups if shaped is not None else []
        node_kinds = [{profile.ranks[r] for r in g} for g in nodes]
        self.mixed = any(len(k) > 1 for k in node_kinds)
        self.nodes_of = {k: sum(k in ks for ks in node_kinds) for k in self.kinds}
        self.node_ranks = {k: min((len(g) for g, ks in zip(nodes, node_kinds) if k in ks), default=0) for k in self.kinds}
        self._costs: dict[tuple[str, int, int, bool], KindCost | None] = {}
        self._tables: dict[tuple, tuple[int, np.ndarray, float]] = {}
        self._fewest: dict[tuple[str, int], int | None] = {}
        self._ranks: dict[tuple[str, ...], list[int]] = {}
        self._alone: dict[tuple, float] = {}

    def ranks_of(self, subset: tuple[str, ...]) -> list[int]:
        """:func:`kind_ranks` of ``subset``, listed once a subset (thousands of ranks, a thousand candidates)."""
        if subset not in self._ranks:
            self._ranks[subset] = kind_ranks(self.profile, subset)
        return self._ranks[subset]

    def _kind_cost(self, kind: str, stage: int, group: int, flat: bool) -> KindCost | None:
        """A rank of ``kind`` in ``stage`` holding ``1 / group`` of the states, as the cost model prices it (flat: at
        that share of the states, :func:`~poplar.planner.shares.stage_at_share`; else its shard group's copy,
        :func:`~poplar.planner.shape.shaped_stage`); None where it holds no sample."""
        key = (kind, stage, group, flat)
        if key not in self._costs:
            dev, model = self.profile.devices[kind], self.profile.model
            sp = dev.stages.get(stage)
            if sp is not None and sp.points and stage and group < self.profile.world_size:
                full = dev.stages.get(0) if 0 in dev.stages and dev.stages[0].points else None
                how = dict(stage=stage, n_params=model.trained_params, world=self.profile.world_size,
                           capacity=dev.memory_gb * 2**30, precision=model.dtype, full=full,
                           bandwidth_gbs=dev.memory_bandwidth_gbs)
                sp = stage_at_share(sp, fraction=1 / group, **how) if flat else shaped_stage(sp, group=group, **how)
            self._costs[key] = KindCost(kind, sp) if sp is not None and sp.points and sp.max_micro_batch else None
        return self._costs[key]

    def _fewest_nodes(self, kind: str, stage: int) -> int | None:
        if (kind, stage) not in self._fewest:
            self._fewest[(kind, stage)] = fewest_nodes(self.profile, stage, kind, self.node_ranks[kind],
                                                       self.nodes_of[kind])
        return self._fewest[(kind, stage)]

    def shapes(self, subset: tuple[str, ...], stage: int) -> dict[str, dict[str, int]]:
        """The shapes :func:`shapes_of` makes for ``subset`` in ``stage``, by name: the ranks a group of each kind
        (the smallest: whose copy each rank holds the most of)."""
        ranks = sum(self.counts[k] for k in subset)
        out = {"flat": {k: ranks for k in subset}}
        if sum(self.nodes_of[k] for k in subset) < 2 or not all(self.nodes_of[k] for k in subset):
            return out
        out["one node a group"] = {k: self.node_ranks[k] for k in subset}
        need = {k: self._fewest_nodes(k, stage) for k in subset}
        if stage and not self.mixed and None not in need.values():
            sizes = group_sizes(need, {k: self.nodes_of[k] for k in subset})
            out.update({label: {k: n * self.node_ranks[k] for k, n in per_kind.items()}
                        for label, per_kind in sizes.items()})
        return out

    def _compute_s(self, subset: tuple[str, ...], stage: int, groups: dict[str, int], flat: bool,
                   own: dict[str, int] | None = None) -> float:
        """The least time ``subset``'s ranks compute the batch in ``stage`` holding ``1 / groups[kind]`` of the
        states, levelled, each rank a sample at least (inf: a kind holds no sample, or the batch gives some rank
        none; ``own``: each kind's own stage, where they differ)."""
        ranks = sum(self.counts[k] for k in subset)
        costs = {k: self._kind_cost(k, (own or {}).get(k, stage), groups[k], flat) for k in subset}
        if ranks > self.global_batch or any(kc is None for kc in costs.values()):
            return float("inf")
        most = 1 << max(min(self.global_batch - ranks + 1, -(-self.global_batch // ranks) * 2) - 1, 1).bit_length()
        tables = {k: self._table(k, kc, most) for k, kc in costs.items()}
        return max(_levelled(tables, self.global_batch), *(t[1] for _, t, _ in tables.values()))

    def _table(self, kind: str, kc: KindCost, most: int) -> tuple[int, np.ndarray, float]:
        """A kind's least time for each of ``0..most`` samples (its ranks' count, the times, a sample's least cost),
        made once a kind's cost (subsets and shapes share them)."""
        key = (id(kc), most)
        if key not in self._tables:
            t, _ = fastest_accum_table(kc, np.arange(1, most + 1))
            self._tables[key] = (self.counts[kind], np.concatenate([[0.0], np.maximum.accumulate(t)]),
                                 kc.cheapest_sample_s)
        return self._tables[key]

    def floor(self, subset: tuple[str, ...], stage: int, name: str, groups: dict[str, int],
              own: dict[str, int] | None = None) -> tuple[float, float]:
        """The most samples a second a plan of ``subset`` in ``stage`` shaped ``name`` (``groups``: each kind's
        ranks a group) may give: its compute levelled and the collectives it must run on its busiest link (0: a
        kind holds no sample); and, to order the candidates by, the same with the link's time after the
        compute (no collective hidden); ``own``: each kind's own stage (shaped), where the groups' differ."""
        compute = self._compute_s(subset, stage, groups, name == "flat", own)
        if compute == float("inf"):
            return 0.0, 0.0
        if name == "flat":
            ranks = self.ranks_of(subset)
            comm = flat_comm(self.profile, ranks) if len(ranks) > 1 else None
            alone = compute + unhidden_comm_s(comm, self.profile.model, stage, 1)
            link = link_floor_s(comm, self.profile.model, stage)
            return self.global_batch / max(alone, link), self.global_batch / (compute + link)
        inside, across = self._links_s(subset, stage, groups, own)
        return self.global_batch / max(compute, inside, across), self.global_batch / (compute + inside + across)

    def _links_s(self, subset: tuple[str, ...], stage: int, groups: dict[str, int],
                 own: dict[str, int] | None = None) -> tuple[float, float]:
        """The least a step of ``subset`` with shard groups of ``groups[kind]`` ranks keeps a group's link busy (its
        collectives inside the group: a node's as timed, several nodes' as :func:`spanning_comm` estimates), and the
        slow link with the sum across groups of the whole model (:class:`~poplar.planner.groups.AcrossGroups`)."""
        shaped, model = self.profile.comm.shaped, self.profile.model
        inside = 0.0
        for k in subset:
            node = next(c for g, c in zip(shaped.groups, shaped.inside) if self.profile.ranks[g[0]] == k)
            comm = node if groups[k] <= self.node_ranks[k] else spanning_comm(self.profile.comm, groups[k],
                                                                               self.profile.world_size)
            inside = max(inside, link_floor_s(comm, model, (own or {}).get(k, stage)))
        sizes = [len(run) * self.node_ranks[k] for k in subset
                 for run in node_runs(list(range(self.nodes_of[k])), max(groups[k] // self.node_ranks[k], 1))]
        across = across_groups(shaped, min(self.node_ranks[k] for k in subset), sizes)
        return inside, across.across_seconds(model.trained_params)

    def bound(self, subset: tuple[str, ...]) -> float:
        """The most samples a second any plan of ``subset`` may give: its best stage's flat compute (every rank
        holding the fewest states it can), no collective."""
        ranks = sum(self.counts[k] for k in subset)
        return max((self.global_batch / self._compute_s(subset, s, {k: ranks for k in subset}, True)
                    for s in self.stages), default=0.0)

    def subsets(self) -> list[tuple[str, ...]]:
        """Every non-empty subset of the kinds (of the :data:`MOST_KINDS` with the highest bounds alone, and the
        rest beside all of them), the highest bound first."""
        if self.every_kind:
            return [tuple(self.kinds)]
        kinds = sorted(self.kinds, key=lambda k: -self.bound((k,)))
        top, rest = kinds[:MOST_KINDS], kinds[MOST_KINDS:]
        found = [tuple(k for k in self.kinds if k in c)
                 for n in range(1, len(top) + 1) for c in itertools.combinations(top, n)]
        if rest:
            found.append(tuple(self.kinds))
        return sorted(found, key=lambda c: -self.bound(c))

    def weigh(self, beat: float = 0.0) -> list[Candidate]:
        """Every candidate weighed, the fastest prediction first (then those not followed, by floor): every stage and
        shape of every subset floored, then followed through the schedule where its floor is above the fastest
        prediction found (``beat``: a plan's samples a second found before): every one of them (``most_predicted``
        None), or by turns: the likeliest (its floor with no collective hidden), then the other stages and shapes of
        the fastest's kinds, then the other kinds in the fastest's stage and shape, the likeliest first, at most
        ``most_predicted`` of each, until a turn finds nothing faster."""
        weighed = []
        for subset in self.subsets():
            for stage in self.stages:
                for name, groups in self.shapes(subset, stage).items():
                    floor, likely = self.floor(subset, stage, name, groups)
                    weighed.append((likely, Candidate(subset, stage, name, floor_samples_per_s=floor)))
                    for own in self._own_stages(subset, stage, name, groups):
                        floor, likely = self.floor(subset, stage, name, groups, own)
                        weighed.append((likely, Candidate(subset, stage, name, floor_samples_per_s=floor,
                                                          own=tuple(own.items()))))
        order = [c for _, c in sorted(weighed, key=lambda lc: -lc[0])]
        found: dict[tuple, Candidate] = {}
        best = [beat, None]

        def follow(cands: list[Candidate], most: int | None) -> None:
            followed = 0
            for c in cands:
                if most is not None and followed >= most:
                    return
                if c.floor_samples_per_s > best[0] and self._key(c) not in found:
                    c, followed = self._predicted(c), followed + 1
                    found[self._key(c)] = c
                    if c.samples_per_s > best[0]:
                        best[:] = [c.samples_per_s, c]

        follow(order, self.most_predicted or None)
        while self.most_predicted and best[1] is not None:
            before = best[1]
            follow([c for c in order if c.kinds == best[1].kinds], self.most_predicted)
            follow([c for c in order if (c.stage, c.name) == (best[1].stage, best[1].name)], self.most_predicted)
            if best[1] is before:
                break
        out = [found.get(self._key(c), c if c.floor_samples_per_s else replace(
            c, why_not="some kind holds no sample here")) for c in order]
        return sorted(out, key=lambda c: (-c.samples_per_s, -c.floor_samples_per_s))

    def _own_stages(self, subset: tuple[str, ...], stage: int, name: str, groups: dict[str, int]) -> list[dict]:
        """Each kind in its own stage, its groups as ``name`` sizes them for ``stage`` (the highest): where the
        cluster has :data:`EVERY_OWN_KINDS` kinds or fewer, every way of the stages that holds (some kind in
        ``stage``, not all), else each kind in the stage its groups alone run fastest in (:meth:`_kind_alone`);
        none flat, on nodes that mix kinds, or for one kind."""
        if name == "flat" or self.mixed or len(subset) < 2 or not stage:
            return []
        held = {k: [s for s in self.stages if s <= stage and self._kind_cost(k, s, groups[k], False) is not None]
                for k in subset}
        if not all(held.values()):
            return []
        if len(self.kinds) <= EVERY_OWN_KINDS:
            ways = [dict(zip(subset, w)) for w in itertools.product(*held.values())]
        else:
            ways = [{k: max(held[k], key=lambda s: self._kind_alone(k, s, subset, groups)) for k in subset}]
        return [w for w in ways if max(w.values()) == stage and len(set(w.values())) > 1]

    def _kind_alone(self, kind: str, stage: int, subset: tuple[str, ...], groups: dict[str, int]) -> float:
        """Samples a second ``kind``'s groups alone give in ``stage``, its ranks' even part of the batch: their
        compute, against their link's collectives."""
        part = max(round(self.global_batch * self.counts[kind] / sum(self.counts[k] for k in subset)),
                   self.counts[kind])
        key = (kind, stage, groups[kind], part)
        if key not in self._alone:
            kc = self._kind_cost(kind, stage, groups[kind], False)
            per_rank = -(-part // self.counts[kind])
            t, _ = fastest_accum_table(kc, np.arange(per_rank, per_rank + 1))
            inside, _ = self._links_s((kind,), stage, groups)
            self._alone[key] = part / max(float(t[0]), inside)
        return self._alone[key]

    @staticmethod
    def _key(c: Candidate) -> tuple:
        return c.kinds, c.stage, c.name, c.own

    def _predicted(self, c: Candidate) -> Candidate:
        """``c`` followed through the schedule: Poplar's split on its cost model, predicted."""
        ranks = self.ranks_of(c.kinds)
        try:
            shape = shapes_of(self.profile, ranks, c.stage)[c.name]
            cost = CostModel(self.profile, c.stage, ranks, shape=shape,
                             group_stages=c.group_stages(self.profile, ranks, shape))
            plan = cost.shaped_plan(allocate(cost, self.global_batch))
        except (Infeasible, ValueError, KeyError) as e:
            return replace(c, why_not=str(e))
        return replace(c, samples_per_s=cost.predict(plan).samples_per_s, plan=plan)


def weigh_kinds(profile: Profile, stages: list[int], global_batch: int, beat: float = 0.0,
                most_predicted: int | None = MOST_PREDICTED, every_kind: bool = False) -> list[Candidate]:
    """Every subset of the kinds in every stage and shape, the fastest first (:class:`KindsSearch`; ``every_kind``:
    only every kind together)."""
    return KindsSearch(profile, stages, global_batch, most_predicted, every_kind).weigh(beat)
