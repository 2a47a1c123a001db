"""Collectives shaped to the nodes, for the planner: the groups, and what a group's copy costs a rank.

Hybrid sharding keeps one copy of the sharded states per node, sharded over the node's
``n`` ranks instead of the world's ``N``: each rank holds more of them, so it has room
for fewer samples, and its optimizer updates a larger shard. The profile measured every
stage flat; from that measurement this module estimates the shaped one:

- the states a stage shards (fp32 master in mixed precision, AdamW's two moments and
  the gradient shard, from ZeRO-1; the parameters, in ZeRO-3) grow from ``1/N`` to
  ``1/n`` of the model's;
- a sample's activations are at most ``(capacity - states) / max_micro_batch`` (what the
  largest micro-batch that fitted left room for), so the largest micro-batch that fits
  beside the larger states is at least the room left divided by that;
- the update's time (``per_step_s``) grows with the shard: linearly between the stage's
  own (a shard of ``1/N``) and ZeRO-0's (the whole model) where ZeRO-0 was profiled, so
  an update that is mostly fixed costs (kernel launches) stays so; else the states it holds more read and
  written at the kind's memory bandwidth, where the profile knows it; else ``N / n`` times
  (:func:`~poplar.planner.shares.update_at`).

Stage 0 shards nothing: its two-level all-reduce changes only the communication.

>>> sp = StageProfile(max_micro_batch=10, state_bytes=1000, points=[(1, 1.0), (10, 2.0)], per_step_s=0.1)
>>> out = shaped_stage(sp, stage=3, n_params=100, world=4, group=2, capacity=2000, precision="fp32")
>>> out.state_bytes, out.max_micro_batch, round(out.per_step_s, 3)     # 16 bytes a parameter: 1/2 - 1/4 more
(1400, 6, 0.2)
>>> zero0 = sp.model_copy(update={"per_step_s": 0.4})                   # the whole model's update: 0.4
>>> round(shaped_stage(sp, stage=3, n_params=100, world=4, group=2, capacity=2000, precision="fp32",
...                    full=zero0).per_step_s, 3)                        # a third of the way from 1/4 to 1
0.2
"""

from __future__ import annotations

import math

from poplar.planner.schedule import Shape
from poplar.planner.shares import update_at
from poplar.profile.profile import Profile, StageProfile
from poplar.stages import stage as zero_stage


def shaped_stage(sp: StageProfile, *, stage: int, n_params: int, world: int, group: int, capacity: float,
                 precision: str, full: StageProfile | None = None, bandwidth_gbs: float | None = None) -> StageProfile:
    """``sp`` (measured flat over ``world`` ranks) estimated for a shard group of ``group`` ranks (``full``: the
    kind's ZeRO-0 profile, where there is one; ``bandwidth_gbs``: its memory bandwidth, where known)."""
    if group >= world or stage == 0:
        return sp
    more = zero_stage(stage).sharded_bytes_per_param(precision) * n_params * (1 / group - 1 / world)
    state = sp.state_bytes + more
    per_step = update_at(sp, 1 / group, 1 / world, full, more, bandwidth_gbs)
    if sp.max_micro_batch == 0 or state >= capacity:
        return sp.model_copy(update={"state_bytes": int(state), "max_micro_batch": 0, "points": [],
                                     "per_step_s": per_step})
    per_sample = max(capacity - sp.state_bytes, 1.0) / sp.max_micro_batch
    largest = min(sp.max_micro_batch, math.floor((capacity - state) / per_sample))
    points = [(m, t - sp.per_step_s + per_step) for m, t in sp.points if m <= largest]
    if largest > 0 and not points:   # every measured point is too large now: the compute scales down from the first
        m0, t0 = sp.points[0]
        points = [(largest, (t0 - sp.per_step_s) * largest / m0 + per_step)]
    return sp.model_copy(update={"state_bytes": int(state), "max_micro_batch": max(largest, 0), "points": points,
                                 "per_step_s": per_step})


def node_shape(profile: Profile, ranks: list[int]) -> Shape | None:
    """The shard groups of ``ranks`` (profile ranks, in the plan's order) by node; None on one node."""
    shaped = profile.comm.shaped if profile.comm is not None else None
    if shaped is None:
        return None
    groups, inside = [], []
    index = {r: i for i, r in enumerate(ranks)}
    for node, comm in zip(shaped.groups, shaped.inside):
        members = sorted(index[r] for r in node if r in index)
        if members:
            groups.append(members)
            inside.append(comm)
    if len(groups) < 2:
        return None
    order = sorted(range(len(groups)), key=lambda j: groups[j][0])   # as a Plan lists its groups
    return Shape([groups[j] for j in order], [inside[j] for j in order], shaped)


def flat_comm(profile: Profile, ranks: list[int]):
    """The collectives of a flat plan of ``ranks`` (profile ranks): those inside their node where they all sit on
    one node of a cluster of several (a node alone does not cross the slow link), else the profile's."""
    shaped = profile.comm.shaped if profile.comm is not None else None
    if shaped is None:
        return profile.comm
    mine = set(ranks)
    for node, comm in zip(shaped.groups, shaped.inside):
        if mine <= set(node):
            return comm
    return profile.comm
