"""The cost model: how long a step of a given plan takes, predicted from a `Profile`.

Compute. A device kind's profile gives, per stage, the time of a step with one
micro-batch of ``m`` samples, ``t(m)`` (a spline through measured points), of which
``per_step_s`` is spent once per step (synchronisation, the optimizer update). A
micro-step of ``m`` samples therefore costs ``g(m) = t(m) - per_step_s``, and a rank that takes ``b``
samples in ``a`` near-equal micro-batches is busy ``sum g(m_j) + per_step_s``. The
model reads ``g`` on whole micro-batch sizes ``1..max_micro_batch`` and makes it
non-decreasing (a larger micro-batch never takes less time; a measured dip is noise).

Communication. The profile times all-reduce, reduce-scatter and all-gather of the
whole model and of a tiny buffer; a unit's collective on ``n`` parameters takes the tiny
one's time (the latency) plus its share ``n / numel`` of the rest. What of it is exposed
is found by following the engine's schedule unit by unit (:mod:`poplar.planner.schedule`):
each unit computes its share of a micro-step (its share of the model's forward FLOPs; the
backward twice the forward), a unit's gradient collective is issued when its backward is
done, ZeRO-3 gathers each unit before it computes (the next one prefetched), the
collectives hold the link one after another in issue order, each starting when the last
rank has issued it, and a rank waits where the engine waits:

- ZeRO-0/1: the gradient collectives of the last micro-step only (a rank's earlier
  micro-steps accumulate); ZeRO-1 then all-gathers the updated parameters unit by unit,
  which nothing overlaps.
- ZeRO-2: reduce-scatters on every micro-step (at most two in flight), then the
  parameter all-gathers.
- ZeRO-3: on every micro-step every unit gathered for its forward and again for its
  backward, and its gradient reduce-scattered. Parameters stay sharded after the step.

Whatever the compute, the root unit's collectives cannot hide (its gradient is the last
to be ready; in ZeRO-3 it is gathered before anything runs): that part is
:meth:`CostModel.comm_s`, all that is charged where there is no collective profile.
Each rank waits for the slowest at the collectives it shares with them (in ZeRO-2/3 on
every micro-step, where every rank runs the same number), so the step takes the slowest
rank's busy time plus the communication the schedule leaves exposed. In ZeRO-0 nothing
after the gradients' all-reduces waits for the other ranks: a rank's update overlaps
another's next step, and the step is that of a run of steps, not one from a common start.

Shaped (``shaped=True``, on several nodes): the plan runs hybrid over the nodes (the
two-level all-reduce in stage 0). Each node's collectives take the times the profiler
measured inside it, the sums across nodes theirs, and each kind's stage profile is the
flat one estimated for its node's copy of the states (:mod:`poplar.planner.shape`). Given a
``shape`` of groups of several nodes (:mod:`poplar.planner.groups`), the same with its
groups' figures, each kind's profile estimated for its smallest group's copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from poplar.plan import Plan
from poplar.planner.schedule import Shape, StepSchedule
from poplar.planner.shape import flat_comm, node_shape, shaped_stage
from poplar.planner.shares import fractions, gather_buffer_bytes, gather_scale, stage_at_share
from poplar.profile.profile import Profile, StageProfile


class KindCost:
    """One device kind in one stage: the time of any (samples, accumulation) it can hold."""

    def __init__(self, kind: str, sp: StageProfile):
        self.kind, self.stage_profile = kind, sp
        self._anatomies: dict = {}
        self.max_micro_batch = sp.max_micro_batch
        self.per_step_s = float(sp.per_step_s)
        m = np.arange(1, self.max_micro_batch + 1, dtype=float)
        if self.max_micro_batch > 0:
            if not sp.points:
                raise ValueError(f"{kind}: the profile has no measured points for a stage where micro-batch "
                                 f"{self.max_micro_batch} fits; profile it again")
            raw = np.asarray(sp.time(m)) - self.per_step_s
        else:
            raw = np.zeros(0)
        # g[m] for m = 0..M+1 (g[0] and g[M+1] are never weighted: helpers for vectorised sums)
        g = np.zeros(self.max_micro_batch + 2)
        g[1:self.max_micro_batch + 1] = np.maximum.accumulate(np.maximum(raw, 1e-9)) if raw.size else raw
        g[-1] = g[-2]
        self.g = g
        per_sample = g[1:self.max_micro_batch + 1] / m if raw.size else np.array([np.inf])
        # the micro-batch with the most samples per second of forward and backward, and its cost a sample
        self.best_micro_batch = int(np.argmin(per_sample)) + 1 if raw.size else 0
        self.cheapest_sample_s = float(np.min(per_sample))

    def anatomy(self, micro_batch: float):
        """The kind's step anatomy at ``micro_batch`` (None without one), computed once per size."""
        if micro_batch not in self._anatomies:
            self._anatomies[micro_batch] = self.stage_profile.anatomy_at(micro_batch)
        return self._anatomies[micro_batch]

    def fits(self) -> bool:
        return self.max_micro_batch > 0

    def busy(self, samples, accum):
        """Seconds of a step of ``samples`` in ``accum`` near-equal micro-batches (arrays allowed)."""
        samples, accum = np.asarray(samples), np.asarray(accum)
        q, r = np.divmod(samples, accum)
        return r * self.g[np.minimum(q + 1, self.max_micro_batch + 1)] + (accum - r) * self.g[q] + self.per_step_s


def unhidden_comm_s(comm, model, stage: int, accum: int) -> float:
    """The flat collectives of a step of ``accum`` micro-steps in ``stage`` that nothing can hide: the root's (its
    gradient is the last ready; in ZeRO-3 it is gathered before anything runs), and in ZeRO-1/2 the parameters'
    all-gather after the update; 0 without collectives (``comm`` None)."""
    if comm is None:
        return 0.0
    full = float(model.trained_params)
    last = float(model.unit_numels[0]) if model.unit_numels else full
    if stage == 0:
        return comm.seconds("all_reduce", last)
    gather = comm.seconds("all_gather", full) if stage in (1, 2) else accum * comm.seconds("all_gather", last)
    return gather + (accum if stage >= 2 else 1) * comm.seconds("reduce_scatter", last)


def link_floor_s(comm, model, stage: int, accum: int = 1) -> float:
    """The seconds a link carries in a step of ``accum`` micro-steps in ``stage`` (``comm``: its collectives among
    the ranks that share a copy of the states; 0 without): each collective of the whole model's parameters at once
    (no step is shorter, whatever overlaps it: the units' own latencies only add). ZeRO-0 all-reduces the
    gradients once; ZeRO-1 reduce-scatters them once and gathers the parameters after the update; ZeRO-2 reduce-
    scatters on every micro-step; ZeRO-3 also gathers the parameters for each micro-step's forward and backward."""
    if comm is None:
        return 0.0
    full = float(model.trained_params)
    if stage == 0:
        return comm.seconds("all_reduce", full)
    reduces = comm.seconds("reduce_scatter", full) * (accum if stage >= 2 else 1)
    if stage < 3:
        return reduces + comm.seconds("all_gather", full)
    root = float(model.unit_numels[0]) if model.unit_numels else 0.0    # gathered once a micro-step, the rest twice
    return reduces + accum * comm.seconds("all_gather", 2 * full - root)


@dataclass
class Prediction:
    """Predicted figures of one plan."""

    step_s: float
    busy_s: list[float]               # per rank (in the plan's order)
    comm_s: float                     # exposed communication per step
    global_batch: int
    seq_len: int

    @property
    def idle_s(self) -> list[float]:
        return [self.step_s - b for b in self.busy_s]

    @property
    def samples_per_s(self) -> float:
        return self.global_batch / self.step_s

    @property
    def tokens_per_s(self) -> float:
        return self.samples_per_s * self.seq_len

    def to_dict(self) -> dict:
        return {"step_s": self.step_s, "samples_per_s": self.samples_per_s, "tokens_per_s": self.tokens_per_s,
                "exposed_comm_s": self.comm_s, "busy_s": self.busy_s, "idle_s": self.idle_s}


@dataclass
class CostModel:
    """Predicted step times of plans for one stage of a profiled cluster.

    ``ranks``: the profile's ranks the plans are for (all of them by default; a subset
    when devices that cannot hold the model are left out).
    """

    profile: Profile
    stage: int
    ranks: list[int] = field(default_factory=list)
    shaped: bool = False
    shares: list[float] | None = None   # flat, stages 1-3: each plan rank's weight of the states (None: even)
    shape: Shape | None = None          # shaped: the groups (None: the nodes, poplar.planner.groups for others)
    group_stages: list[int] | None = None   # shaped: each group's own stage (``stage`` the highest; None: all in it)

    def __post_init__(self):
        if not self.ranks:
            self.ranks = list(range(self.profile.world_size))
        kinds = [self.profile.ranks[r] for r in self.ranks]
        self.shaped = self.shaped or self.shape is not None
        if self.group_stages is not None:
            self._check_group_stages()
        stages = self.rank_stages()
        missing = sorted({(s, k) for k, s in zip(kinds, stages) if s not in self.profile.devices[k].stages})
        if missing:
            said = ", ".join(f"stage {s} for {k}" for s, k in missing)
            raise ValueError(f"the profile has no {said}: profile that stage or leave it out (--stages)")
        if self.shaped and self.shape is None:
            self.shape = node_shape(self.profile, self.ranks)
        if not self.shaped and self.profile.comm is not None:    # a flat plan within one node: its own links
            comm = flat_comm(self.profile, self.ranks)
            if comm is not self.profile.comm:
                self.profile = self.profile.model_copy(update={"comm": comm})
        if self.shaped and self.shape is None:
            raise ValueError("a shaped plan needs several nodes, and a profile that timed the collectives on them")
        # a kind in groups of unlike stages is priced in each as its own ("kind@z1"): each key's kind and stage
        keys = [k if self.group_stages is None else f"{k}@z{s}" for k, s in zip(kinds, stages)]
        self._kind_stage = {key: (k, s) for key, k, s in zip(keys, kinds, stages)}
        kinds = keys
        first = {k: i for i, k in reversed(list(enumerate(kinds)))}   # each kind's first plan rank
        if self.shares is not None and (self.shaped or self.stage == 0 or len(self.shares) != len(self.ranks)
                                        or len({(k, s) for k, s in zip(kinds, self.shares)}) != len(first)):
            raise ValueError("shares are planned flat, in stages 1-3, one weight a plan rank, alike within a kind")
        self.fraction = fractions(self.shares) if self.shares else None
        if self.fraction is None and self.stage and not self.shaped and len(self.ranks) < self.profile.world_size:
            # the profile is at an even share over the cluster's ranks: these few, the others left out, hold more
            self.fraction = fractions([1.0] * len(self.ranks))
        model = self.profile.model   # every rank holds the uneven gathers' buffers alike (ZeRO-3)
        self._buffers = (gather_buffer_bytes(self.fraction, self.stage, model.unit_numels, model.dtype)
                         if self.fraction else 0.0)
        self._first = first
        self.rank_kinds = kinds
        self.kinds: dict[str, KindCost] = {k: KindCost(k, self._stage_profile(k)) for k in dict.fromkeys(kinds)}
        self._rank_index = {k: np.array([i for i, x in enumerate(kinds) if x == k]) for k in self.kinds}

    @property
    def shard_groups(self) -> list[list[int]] | None:
        """The plans' shard groups (plan ranks): the nodes when shaped, else None (flat)."""
        return self.shape.groups if self.shape else None

    def shaped_plan(self, plan: Plan) -> Plan:
        """``plan``'s split in this model's shard groups and their stages."""
        return plan.with_shard_groups(self.shard_groups, self.group_stages)

    def _check_group_stages(self) -> None:
        if self.shape is None or len(self.group_stages) != len(self.shape.groups) \
                or max(self.group_stages) != self.stage:
            raise ValueError(f"group stages {self.group_stages}: one a shard group, the highest the cost model's "
                             f"stage ({self.stage})")
        self.group_stages = list(self.group_stages)
        if len(set(self.group_stages)) == 1:     # alike: a plain hybrid plan
            self.group_stages = None

    def rank_stages(self) -> list[int]:
        """Each plan rank's ZeRO stage: its group's."""
        if self.group_stages is None:
            return [self.stage] * len(self.ranks)
        return [self.group_stages[j] for j in self.shape.rank_groups]

    def device_kind(self, key: str) -> str:
        """The device kind a key of :attr:`kinds` prices (the kind itself, or one of its stages: "kind@z1")."""
        return self._kind_stage[key][0]

    def _stage_profile(self, key: str) -> StageProfile:
        kind, stage = self._kind_stage[key]
        sp = self.profile.stage(kind, stage)
        dev, model = self.profile.devices[kind], self.profile.model
        # the whole model's update, where the kind's ZeRO-0 step was timed (else its per_step_s is no update: 0)
        full = dev.stages.get(0)
        full = full if full is not None and full.points else None
        if self.fraction is not None:
            return stage_at_share(sp, stage=self.stage, precision=model.dtype, n_params=model.trained_params,
                                  world=self.profile.world_size, capacity=dev.memory_gb * 2**30,
                                  fraction=self.fraction[self._first[key]], full=full,
                                  buffers=self._buffers, uneven=len(set(self.fraction)) > 1,
                                  bandwidth_gbs=dev.memory_bandwidth_gbs)
        if self.shape is None:
            return sp
        sizes = [len(g) for g in self.shape.groups if any(self.rank_kinds[i] == key for i in g)]
        return shaped_stage(sp, stage=stage, n_params=model.trained_params, world=self.profile.world_size,
                            group=min(sizes), capacity=dev.memory_gb * 2**30, precision=model.dtype,
                            full=full, bandwidth_gbs=dev.memory_bandwidth_gbs)

    # -- communication ------------------------------------------------------------------
    def comm_s(self, accum: int) -> float:
        """Communication of a step of ``accum`` micro-steps that nothing can hide, however the compute falls:
        the root's collectives (a lower bound of what :meth:`predict` finds exposed)."""
        comm = self.profile.comm if len(self.ranks) > 1 else None    # a rank alone has no one to move anything to
        return unhidden_comm_s(comm, self.profile.model, self.stage, accum)

    # -- a whole plan -------------------------------------------------------------------
    def predict(self, plan: Plan) -> Prediction:
        busy = self.busy_s(plan)
        if self.profile.comm is None or len(self.ranks) < 2:
            step = max(busy) + self.comm_s(int(max(plan.accum_steps)))
        else:
            step = self.schedule.step_s(plan, self.rank_kinds, self.kinds)
        return Prediction(step_s=step, busy_s=busy, comm_s=step - max(busy), global_batch=plan.global_batch_size,
                          seq_len=self.profile.model.seq_len)

    def floor_s(self, plan: Plan) -> float:
        """No step of ``plan`` is shorter: its busiest rank's compute (:meth:`busy_s`) and, where the schedule is
        followed, its busiest link's collectives (:meth:`~poplar.planner.schedule.StepSchedule.link_s`)."""
        busy = max(self.busy_s(plan))
        if self.profile.comm is None or len(self.ranks) < 2:
            return busy
        return max(busy, self.schedule.link_s(plan, self.rank_kinds, self.kinds))

    def busy_s(self, plan: Plan) -> list[float]:
        """Each rank's compute seconds in ``plan`` (in its order): no step of it is shorter than the most of them
        (a rank's scheduled compute adds up to at least its busy time, and its collectives only add waits)."""
        if plan.world_size != len(self.ranks):
            raise ValueError(f"the plan has {plan.world_size} ranks, the cost model {len(self.ranks)}")
        if plan.zero_stage != self.stage:
            raise ValueError(f"the plan is for stage {plan.zero_stage}, the cost model for stage {self.stage}")
        if plan.shard_groups is not None and plan.group_stages != (tuple(self.group_stages) if self.group_stages
                                                                    else None):
            raise ValueError(f"the plan's groups are in stages {plan.group_stages}, the cost model's in "
                             f"{self.group_stages or 'stage ' + str(self.stage)}")
        if plan.shard_groups is not None and [list(g) for g in plan.shard_groups] != self.shard_groups:
            raise ValueError(f"the plan is {plan.shape}, the cost model for "
                             f"{'flat' if not self.shape else 'the nodes ' + str(self.shard_groups)}")
        samples, accum = np.array(plan.local_batch_sizes), np.array(plan.accum_steps)
        busy = np.zeros(len(self.ranks))
        for kind, idx in self._rank_index.items():
            kc = self.kinds[kind]
            over = [i for i in idx if plan.micro_batch_sizes[i] > kc.max_micro_batch]
            if over:
                i = over[0]
                raise ValueError(f"rank {self.ranks[i]} ({kind}): micro-batch {plan.micro_batch_sizes[i]} is over "
                                 f"its stage-{self.rank_stages()[i]} limit {kc.max_micro_batch}")
            busy[idx] = kc.busy(samples[idx], accum[idx])
        return busy.tolist()

    @cached_property
    def schedule(self) -> StepSchedule:
        scale = gather_scale(self.fraction) if self.fraction is not None else 1.0
        return StepSchedule(self.profile, self.stage, self.shape, scale, self.group_stages)
