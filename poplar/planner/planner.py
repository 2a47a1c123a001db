"""The planner: the best stage and allocation for a profiled cluster, beside the baselines.

:func:`make_plan` plans every requested ZeRO stage with :func:`~poplar.planner.search.allocate`,
computes the ``uniform`` (DeepSpeed-style) and ``proportional`` (Whale-style: by rated
speed) baselines, the ``measured-peak`` split (by each device's measured peak samples/s, a
stronger heuristic than Whale's) and the ``ideal`` bound on the same cost model, and
picks the stage with the highest predicted throughput among those every device can run.
On several nodes it plans every stage twice, flat and shaped to the nodes (hybrid
sharding; the two-level all-reduce in stage 0), and picks the stage and shape together;
the reason says what the flat shape of the chosen stage would leave exposed.
A stage where some device cannot hold even one sample is left out, and said so; if that
is every stage, those devices are left out of the plan (the job must then be launched
without them), and said so. Every subset of the kinds is weighed too, in every stage and
shape (:mod:`poplar.planner.subsets`), and its fastest taken where it pays
(:mod:`poplar.planner.taking_part`). One stage's plans: :mod:`poplar.planner.stage_plan`.
"""

from __future__ import annotations

import functools
import gc

from poplar.planner.result import (BASELINES, EVEN_SHARES, MEMORY_SHARES, Allocation, PlanningError,  # noqa: F401
                                   PlanResult, StagePlan)
from poplar.planner.shape import node_shape
from poplar.planner.stage_plan import ALLOCATIONS, TIE, limits_at, plan_stage, ranks_said  # noqa: F401
from poplar.planner.subsets import MOST_PREDICTED, weigh_kinds
from poplar.planner.taking_part import EXHAUSTIVE_RANKS, best_speed, leaving_out, taking_part
from poplar.profile.profile import Profile
from poplar.stages import parse_stages

CANDIDATES_KEPT = 12     # candidates a result keeps to show


def _collector_paused(planner):
    """``planner`` run with Python's cyclic garbage collector paused: a plan makes hundreds of thousands of small
    objects (the schedules' events), freed as they go by their counts (they hold no cycles); the collector, started by
    their number, would walk every object of the process again and again (a simulator's: half the time of a plan
    of Llama-70B on 4,096 GPUs)."""
    @functools.wraps(planner)
    def paused(*args, **kwargs):
        if not gc.isenabled():
            return planner(*args, **kwargs)
        gc.disable()
        try:
            return planner(*args, **kwargs)
        finally:
            gc.enable()
    return paused


@_collector_paused
def make_plan(profile: Profile, global_batch: int, stages=(0, 1, 2, 3), may_leave_out: bool = True) -> PlanResult:
    """Plan ``global_batch`` samples per step on the profiled cluster; see the module's docstring.
    ``may_leave_out``: False where every rank must take part (a process group already started: the integrations,
    torchrun): every kind is weighed together only (each stage and shape), and a kind left out is refused (a plan
    of fewer ranks than the launch).

    Raises :class:`PlanningError` when no stage can run (the message says what to change).
    """
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise PlanningError(f"global batch {global_batch!r}: give a positive whole number of samples")
    stages = parse_stages(stages)
    world = profile.world_size
    if global_batch < world:
        raise PlanningError(
            f"a global batch of {global_batch} cannot give each of the {world} ranks a sample: raise it to at "
            f"least {world} (or, better, a few samples per rank), or launch fewer ranks")
    every = list(range(world))
    whole = {s: plan_stage(profile, s, global_batch, every) for s in stages}
    results, excluded_ranks, why_out = leaving_out(profile, stages, global_batch, whole)
    if all(r.excluded for r in results.values()):
        why = "; ".join(f"stage {s}: {r.excluded}" for s, r in results.items())
        raise PlanningError(f"no stage can run this job: {why}. {_smallest_need(profile, stages)}Use a smaller "
                            "model or sequence, devices with more memory, or profile the higher ZeRO stages")
    ranks = next(r.ranks for r in results.values() if not r.excluded)
    shaped = ({s: plan_stage(profile, s, global_batch, ranks, shaped=True) for s in stages}
              if node_shape(profile, ranks) is not None else {})
    candidates = weigh_kinds(profile, stages, global_batch, best_speed({**results, **{-1 - s: sp for s, sp in
                                                                                         shaped.items()}}),
                             MOST_PREDICTED if world > EXHAUSTIVE_RANKS else None, every_kind=not may_leave_out)
    taking = taking_part(profile, stages, global_batch, whole, (results, shaped, ranks), candidates)
    if taking is not None:
        results, shaped, ranks, excluded_ranks, why_out = taking
    options = [r for r in [*results.values(), *shaped.values()] if not r.excluded]
    ranked = sorted(options, key=lambda r: -r.poplar.predicted.samples_per_s)
    best = ranked[0]
    pred = best.poplar.predicted
    reason = f"{best.label}: {pred.samples_per_s:.1f} samples/s predicted (step {1000 * pred.step_s:.1f} ms)"
    if len(ranked) > 1:
        nxt = ranked[1].poplar.predicted
        reason += f", {100 * (pred.samples_per_s / nxt.samples_per_s - 1):.1f}% above {ranked[1].label}, the next best"
    reason += _shape_note(best, results, shaped)
    left_out = [f"{r.label} left out: {r.excluded}" for r in [*results.values(), *shaped.values()] if r.excluded]
    if left_out:
        reason += "; " + "; ".join(left_out)
    reason += _coarse_hybrid_note(profile, shaped)
    if excluded_ranks:
        kinds = sorted({profile.ranks[r] for r in excluded_ranks})
        reason += (f". {ranks_said(excluded_ranks).capitalize()} ({', '.join(kinds)}) {why_out}: this plan is for "
                   f"{ranks_said(ranks)} (poplar train and bench run it there, the others sitting out)")
    return PlanResult(plan=best.poplar.plan, stage=best.stage, predicted=pred, stages=results, ranks=best.ranks,
                      reason=reason, excluded_ranks=excluded_ranks, profile=profile, shaped=shaped,
                      candidates=candidates[:CANDIDATES_KEPT], weighed=len(candidates))


def _smallest_need(profile: Profile, stages: list[int]) -> str:
    """The least memory a device needs in any stage profiled: its model states there, before any activation."""
    need = {s: max(d.stages[s].state_bytes for d in profile.devices.values()) for s in stages
            if all(s in d.stages for d in profile.devices.values())}
    if not need:
        return ""
    s = min(need, key=need.get)
    largest = max(d.memory_gb for d in profile.devices.values()) * 2**30
    return (f"The least it needs is ZeRO-{s}'s model states, {_size(need[s])} a device, plus a sample's "
            f"activations (the largest device here has {_size(largest)}). ")


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def _coarse_hybrid_note(profile: Profile, shaped: dict[int, StagePlan]) -> str:
    """Where a hybrid stage's update was scaled from the flat one without ZeRO-0's (the whole model's) to go by."""
    if not any(s >= 1 and not sp.excluded for s, sp in shaped.items()):
        return ""
    if all(0 in d.stages and d.stages[0].points or d.memory_bandwidth_gbs for d in profile.devices.values()):
        return ""
    return ("; hybrid stages' update estimated as the flat one's times the world over the node's ranks (ZeRO-0 "
            "not timed on every kind, no memory bandwidth known): profile stage 0 too for a closer estimate")


def _shape_note(best: StagePlan, flat: dict[int, StagePlan], shaped: dict[int, StagePlan]) -> str:
    """Why this shape: the communication the other shape of the same stage would leave exposed."""
    other = (flat if best.shaped else shaped).get(best.stage)
    if other is None or other.excluded:
        return ""
    mine, theirs = best.poplar.predicted, other.poplar.predicted
    named = lambda sp: sp.label if sp.shaped else f"{sp.label} flat"   # noqa: E731
    return (f" ({named(other)} would expose {1000 * theirs.comm_s:.1f} ms of communication a step, "
            f"{named(best)} {1000 * mine.comm_s:.1f} ms)")
