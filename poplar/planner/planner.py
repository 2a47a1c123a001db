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
without them), and said so.
"""

from __future__ import annotations

import functools
import gc
import math
from dataclasses import replace

import numpy as np

from poplar.plan import Plan
from poplar.planner.bound import ideal_samples_per_s
from poplar.planner.cost import CostModel
from poplar.planner.result import (BASELINES, EVEN_SHARES, MEMORY_SHARES, Allocation, PlanningError,  # noqa: F401
                                   PlanResult, StagePlan)
from poplar.planner.search import Infeasible, allocate, measured_proportional, proportional, uniform
from poplar.planner.schedule import Shape
from poplar.planner.shape import node_shape
from poplar.planner.subsets import MOST_PREDICTED, Candidate, kind_ranks, shapes_of, weigh_kinds
from poplar.planner.shares import (POWERS, PROPORTIONAL, fractions, gather_buffer_bytes, room_shares, stage_at_share,
                                    weights)
from poplar.profile.profile import Profile
from poplar.stages import parse_stages

ALLOCATIONS = {"poplar": allocate, "uniform": uniform, "proportional": proportional,
               "measured-peak": measured_proportional}
TIE = 0.01   # predicted gains below this are not worth a split other than a baseline's (see plan_stage)
SLOW_SHARE = 0.5   # a kind whose step of one sample is this much of the plan's step: planned without it too


EXHAUSTIVE_RANKS = 256   # up to this many ranks every candidate above the fastest found is predicted (else at most
                         # MOST_PREDICTED of them, the likeliest first: poplar.planner.subsets)
CANDIDATES_KEPT = 12     # candidates a result keeps to show


RUNS_SHOWN = 4   # a rank list of more runs of consecutive ranks says how many, and the first and last runs


def _rank_list(ranks: list[int]) -> str:
    """Ranks as runs (``0-3, 8, 12, 13``); a list of many runs as its count, first runs and last (reasons read
    at thousands of ranks).

    >>> _rank_list([0, 1, 2, 3, 8, 12, 13]), _rank_list(list(range(0, 40, 2))), _rank_list(list(range(688)))
    ('0-3, 8, 12, 13', '20 ranks: 0, 2, 4, ..., 38', '0-687')
    """
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    text = [", ".join(map(str, range(a, b + 1))) if b - a < 2 else f"{a}-{b}" for a, b in runs]
    if len(text) <= RUNS_SHOWN:
        return ", ".join(text)
    return f"{len(ranks)} ranks: {', '.join(text[:RUNS_SHOWN - 1])}, ..., {text[-1]}"


NAMED = 8    # ranks a reason names one by one; more are counted (reasons read at thousands of ranks)


def _ranks(ranks: list[int]) -> str:
    """``rank 0-3, 8`` for a few ranks, ``512 ranks`` for many.

    >>> _ranks([1, 2]), _ranks(list(range(4096)))
    ('rank 1, 2', '4,096 ranks')
    """
    return f"rank {_rank_list(ranks)}" if len(ranks) <= NAMED else f"{len(ranks):,} ranks"


def _unfit_message(kinds: list[str], ranks: list[int], label: str) -> str:
    return f"{', '.join(kinds)} ({_ranks(ranks)}) cannot hold the model and one sample in {label}"


def _not_profiled_to_plan(profile: Profile, stage: int, ranks: list[int], label: str) -> str:
    """Why the profile cannot plan ``stage`` on ``ranks`` ("" where it can): a rank whose device does not hold the
    model states and a sample, or one that fits but was not timed (a device beside it did not fit)."""
    if any(stage not in profile.devices[profile.ranks[r]].stages for r in ranks):
        return f"stage {stage} was not profiled"
    profiles = {r: profile.stage(profile.ranks[r], stage) for r in ranks}
    unfit = [r for r, sp in profiles.items() if sp.max_micro_batch == 0]
    if unfit:
        return _unfit_message(sorted({profile.ranks[r] for r in unfit}), unfit, label)
    untimed = {profile.ranks[r]: sp for r, sp in profiles.items() if not sp.points}
    return "; ".join(f"{k} {sp.note or 'has no measured points: profile it again'}" for k, sp in sorted(untimed.items()))


def plan_stage(profile: Profile, stage: int, global_batch: int, ranks: list[int] | None = None,
               shaped: bool = False, shape: Shape | None = None, shape_name: str = "",
               ideal: bool = True) -> StagePlan:
    """Poplar's allocation, the baselines and the ideal bound for one stage (``shaped``: over the nodes; ``shape``:
    over other shard groups, named ``shape_name``, :mod:`poplar.planner.groups`; ``ideal``: False, no bound, 0: it
    is the costly part at thousands of ranks, and a stage not chosen need not show one)."""
    ranks = ranks if ranks is not None else list(range(profile.world_size))
    shaped = shaped or shape is not None
    out = StagePlan(stage=stage, ranks=ranks, shaped=shaped, shape_name=shape_name if shape is not None else "")
    out.excluded = _not_profiled_to_plan(profile, stage, ranks, out.label)
    if out.excluded:
        if not shaped and _fits_with_less(profile, stage, ranks):   # only some uneven shares may hold it
            out.allocations = {n: Allocation(n, None, None, why_not=out.excluded) for n in ALLOCATIONS}
            _plan_shares(out, profile, global_batch)
        return out
    cost = CostModel(profile, stage, ranks, shaped, shape=shape)
    # a shape may not fit where the flat profile did: hybrid states, sharded over fewer ranks, are larger
    unfit = [r for r in ranks if not cost.kinds[profile.ranks[r]].fits()]
    if unfit:
        out.excluded = _unfit_message(sorted({profile.ranks[r] for r in unfit}), unfit, out.label)
        return out
    for name, fn in ALLOCATIONS.items():
        try:
            plan = fn(cost, global_batch).with_shard_groups(cost.shard_groups)
            out.allocations[name] = Allocation(name, plan, cost.predict(plan))
        except Infeasible as e:
            out.allocations[name] = Allocation(name, None, None, why_not=str(e))
    # The search fills every rank to the least busy time in whole samples; a baseline's
    # split can still be predicted a little faster (its accumulation counts, its
    # rounding). Poplar runs the best plan it has seen.
    for name in ALLOCATIONS:
        a = out.allocations[name]
        if a.plan is not None and out.poplar.plan is not None and a.predicted.step_s < out.poplar.predicted.step_s:
            out.allocations["poplar"] = Allocation("poplar", a.plan, a.predicted)
    # A split predicted to gain less than TIE over a baseline's is a gain the cost model
    # cannot tell from its own error: Poplar keeps the fastest baseline's split (uniform's
    # among equals, the simplest), which then measures as well as the baseline by
    # construction, and is never predicted slower than another baseline.
    runs = [out.allocations[n] for n in BASELINES if n in out.allocations and out.allocations[n].plan is not None]
    fastest, best = min(runs, key=lambda a: a.predicted.step_s, default=None), out.poplar
    if fastest is not None and best.plan is not None and fastest.plan != best.plan \
            and fastest.predicted.step_s <= best.predicted.step_s * (1 + TIE):
        out.allocations["poplar"] = Allocation("poplar", fastest.plan, fastest.predicted)
    if out.poplar.plan is None:
        out.excluded = out.poplar.why_not
    out.ideal_samples_per_s = ideal_samples_per_s(cost, global_batch) if ideal else 0.0
    if not shaped and not out.excluded and _shares_known(profile, stage, ranks):
        _plan_shares(out, profile, global_batch)
    return out


def _shares_known(profile: Profile, stage: int, ranks: list[int]) -> bool:
    """Whether uneven shares can matter: a sharded stage, kinds of unlike memory, each with its memory points (one
    where its limit is the largest micro-batch searched: it has room to spare), and some kind whose micro-batch grows
    as it holds less (else memory binds no one: the even split stands)."""
    kinds = {profile.ranks[r] for r in ranks}
    if stage == 0 or len({profile.devices[k].memory_gb for k in kinds}) < 2:
        return False
    points = [sorted(profile.stage(k, stage).memory_points) for k in kinds]
    return all(points) and any(len(p) >= 2 and p[0][1] > p[-1][1] for p in points)


def _fits_with_less(profile: Profile, stage: int, ranks: list[int]) -> bool:
    """Whether every kind that holds no sample at an even share was timed where it holds less (the simulator's
    :data:`~poplar.profile.profile.FITS_WITH_LESS`), the rest timed as usual: uneven shares may fit them all."""
    if any(stage not in profile.devices[profile.ranks[r]].stages for r in ranks):
        return False
    profiles = [profile.stage(profile.ranks[r], stage) for r in ranks]
    return _shares_known(profile, stage, ranks) and all(sp.points for sp in profiles) and all(
        sp.max_micro_batch or max(m for _, m in sp.memory_points) > 0 for sp in profiles)


def _plan_shares(out: StagePlan, profile: Profile, global_batch: int) -> None:
    """Uneven shares of the states (:mod:`poplar.planner.shares`): Poplar's split for each set of shares tried that
    lets some kind take a larger micro-batch than even shares do (any other only adds to the gathers), searched on
    the compute alone (the collectives' schedule is the costly part of a prediction at scale); the fastest,
    predicted with its collectives, is Poplar's where it gains more than :data:`TIE` over even shares (or where no
    even share holds every kind). Even and memory-proportional shares stay beside it."""
    kinds = [profile.ranks[r] for r in out.ranks]
    memory = {k: profile.devices[k].memory_gb for k in kinds}
    even = tuple(profile.stage(k, out.stage).max_micro_batch for k in dict.fromkeys(kinds))
    tried = {f"memory^{p:g}": weights(memory, kinds, p) for p in POWERS}
    tried |= {f"room for {m}": w for m, w in room_shares(profile, out.stage, kinds).items()}
    baseline = f"memory^{PROPORTIONAL:g}"
    compute_only = profile.model_copy(update={"comm": None})
    found: dict[str, tuple[float, Plan | str]] = {}
    seen = {even}
    for name, shares in tried.items():
        limits = limits_at(profile, out.stage, kinds, shares)
        worth = all(limits) and limits not in seen and max(np.subtract(limits, even)) > 0
        seen.add(limits)
        if not all(limits):
            found[name] = (math.inf, f"a kind holds no sample beside its share of {name} shares")
        elif worth or name == baseline:
            cost = CostModel(compute_only, out.stage, out.ranks, shares=shares)
            try:
                plan = (out.poplar.plan if limits == even else allocate(cost, global_batch)).with_shard_shares(shares)
                found[name] = (cost.predict(plan).step_s if worth else math.inf, plan)
            except Infeasible as e:
                found[name] = (math.inf, str(e))
    out.allocations[EVEN_SHARES] = replace(out.poplar, name=EVEN_SHARES)
    out.allocations[MEMORY_SHARES] = _predicted(profile, out.stage, out.ranks, MEMORY_SHARES, found[baseline][1])
    best = min(found, key=lambda n: found[n][0], default=None)
    if best is None or found[best][0] == math.inf:
        return
    chosen = (out.allocations[MEMORY_SHARES] if best == baseline else
              _predicted(profile, out.stage, out.ranks, "poplar", found[best][1]))
    proportional = out.allocations[MEMORY_SHARES]   # with the collectives, the baseline's may come out faster
    if found[baseline][0] < math.inf and proportional.predicted.step_s < chosen.predicted.step_s:
        chosen = proportional
    if out.poplar.plan is None or chosen.predicted.step_s * (1 + TIE) < out.poplar.predicted.step_s:
        out.allocations["poplar"] = Allocation("poplar", chosen.plan, chosen.predicted)
        cost = CostModel(profile, out.stage, out.ranks, shares=list(chosen.plan.shard_shares))
        out.ideal_samples_per_s = max(out.ideal_samples_per_s, ideal_samples_per_s(cost, global_batch))
        out.excluded = ""   # where no even share held every kind, uneven ones do


def limits_at(profile: Profile, stage: int, kinds: list[str], shares: list[float]) -> tuple[int, ...]:
    """Each kind's largest micro-batch (in the order kinds first appear) at its share of the states."""
    total, model = sum(shares), profile.model
    first = {k: s for k, s in zip(kinds, shares)}
    buffers = gather_buffer_bytes(fractions(shares), stage, model.unit_numels, model.dtype)
    return tuple(stage_at_share(profile.stage(k, stage), stage=stage, precision=model.dtype,
                                n_params=model.trained_params, world=profile.world_size, fraction=w / total,
                                buffers=buffers,
                                capacity=profile.devices[k].memory_gb * 2**30).max_micro_batch
                 for k, w in first.items())


def _predicted(profile: Profile, stage: int, ranks: list[int], name: str, plan: Plan | str) -> Allocation:
    """``plan`` (with its shares) predicted with its collectives, or why there is none (``plan``: the reason)."""
    if isinstance(plan, str):
        return Allocation(name, None, None, why_not=plan)
    return Allocation(name, plan, CostModel(profile, stage, ranks, shares=list(plan.shard_shares)).predict(plan))


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
    results, excluded_ranks, why_out = _leaving_out(profile, stages, global_batch, whole)
    if all(r.excluded for r in results.values()):
        why = "; ".join(f"stage {s}: {r.excluded}" for s, r in results.items())
        raise PlanningError(f"no stage can run this job: {why}. {_smallest_need(profile, stages)}Use a smaller "
                            "model or sequence, devices with more memory, or profile the higher ZeRO stages")
    ranks = next(r.ranks for r in results.values() if not r.excluded)
    shaped = ({s: plan_stage(profile, s, global_batch, ranks, shaped=True) for s in stages}
              if node_shape(profile, ranks) is not None else {})
    candidates = weigh_kinds(profile, stages, global_batch, _best_speed({**results, **{-1 - s: sp for s, sp in
                                                                                         shaped.items()}}),
                             MOST_PREDICTED if world > EXHAUSTIVE_RANKS else None, every_kind=not may_leave_out)
    taking_part = _taking_part(profile, stages, global_batch, whole, (results, shaped, ranks), candidates)
    if taking_part is not None:
        results, shaped, ranks, excluded_ranks, why_out = taking_part
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
        reason += (f". {_ranks(excluded_ranks).capitalize()} ({', '.join(kinds)}) {why_out}: this plan is for "
                   f"{_ranks(ranks)} (poplar train and bench run it there, the others sitting out)")
    return PlanResult(plan=best.poplar.plan, stage=best.stage, predicted=pred, stages=results, ranks=best.ranks,
                      reason=reason, excluded_ranks=excluded_ranks, profile=profile, shaped=shaped,
                      candidates=candidates[:CANDIDATES_KEPT], weighed=len(candidates))


def _taking_part(profile: Profile, stages: list[int], global_batch: int, whole: dict[int, StagePlan],
                 planned: tuple[dict, dict, list[int]], candidates: list[Candidate]):
    """The plans of the kinds and shape the weighed candidates find fastest, where that is :data:`TIE` faster than
    ``planned`` (the flat and node-shaped stages, and their ranks): the flat and shaped stage plans, the ranks, those
    left out and why; None where ``planned`` stands."""
    results, shaped, ranks = planned
    beat = _best_speed({**results, **{-1 - s: sp for s, sp in shaped.items()}})
    top = candidates[0] if candidates else None
    if top is None or top.samples_per_s <= beat * (1 + TIE):
        return None
    mine, flat = kind_ranks(profile, top.kinds), top.name == "flat"
    # at scale, the stages without their bound, the chosen one's its floor (plan_stage: the bound's cost)
    bounded = profile.world_size <= EXHAUSTIVE_RANKS
    if mine != ranks:
        results = _beside(profile, {s: plan_stage(profile, s, global_batch, mine, ideal=bounded) for s in stages},
                          whole)
        shaped = ({s: plan_stage(profile, s, global_batch, mine, shaped=True, ideal=bounded) for s in stages}
                  if node_shape(profile, mine) is not None else {})
    if not flat:
        shape = shapes_of(profile, mine, top.stage)[top.name]
        shaped = {**shaped, top.stage: plan_stage(profile, top.stage, global_batch, mine, shape=shape, ideal=bounded,
                                                  shape_name="" if shape == node_shape(profile, mine) else top.name)}
    chosen = (results if flat else shaped)[top.stage]
    if not chosen.excluded and not chosen.ideal_samples_per_s:
        chosen.ideal_samples_per_s = max(top.floor_samples_per_s, chosen.poplar.predicted.samples_per_s)
    out = [r for r in range(profile.world_size) if r not in set(mine)]
    return results, shaped, mine, out, _why_without(candidates, top) if out else ""


def _why_without(candidates: list[Candidate], top: Candidate) -> str:
    """Why the kinds ``top`` leaves out sit out, each in a few words: the fastest plan weighed of ``top``'s kinds
    and it (or that no stage and shape of them holds the model), beside ``top``'s."""
    every = dict.fromkeys(k for c in candidates for k in c.kinds)
    said = []
    for kind in (k for k in every if k not in top.kinds):
        mine = {*top.kinds, kind}
        with_it = [c for c in candidates if set(c.kinds) == mine and c.floor_samples_per_s]
        best = max(with_it, key=lambda c: (c.samples_per_s, c.floor_samples_per_s), default=None)
        said.append(f"with {kind} " + ("no stage or shape holds the model" if best is None else
                                       f"{best.samples_per_s:,.0f} samples/s ({best.label})" if best.samples_per_s
                                       else f"at most {best.floor_samples_per_s:,.0f} samples/s"))
    return (f"sit out, {top.samples_per_s:,.0f} samples/s predicted without them ({top.label}); {'; '.join(said)} "
            f"({len(candidates)} subsets of the kinds, stages and shapes weighed)")


def _leaving_out(profile: Profile, stages: list[int], global_batch: int,
                 results: dict[int, StagePlan]) -> tuple[dict[int, StagePlan], list[int], str]:
    """The stages planned without some ranks where that is faster: those whose devices hold the model in no stage
    at an even share (where nothing else runs, or where they run only with uneven shares), and a kind whose step
    of one sample takes longer than the others' whole step (it holds every rank back). The plans, the ranks left
    out and why ("" where none)."""
    every = list(range(profile.world_size))
    with_them = _best_speed(results)
    never = [r for r in every if all(sp.max_micro_batch == 0 for s, sp in
                                     profile.devices[profile.ranks[r]].stages.items() if s in stages)]
    tries = []
    if never:
        how = (f"{'holds' if len(never) == 1 else 'hold'} the model only with uneven shares, {with_them:.3g} "
               "samples/s predicted with them" if with_them else "cannot hold the model and a sample in any stage "
               "profiled, even with no share of the states")
        tries.append((never, how, 0.0))
    if with_them and len(set(profile.ranks)) > 1:
        step = global_batch / with_them
        for kind in dict.fromkeys(profile.ranks):
            sps = [sp for s, sp in profile.devices[kind].stages.items() if s in stages and sp.points]
            one = min((sp.time(1) for sp in sps), default=0.0)
            if one >= SLOW_SHARE * step:    # worth a try: its least step is much of the whole plan's
                out = sorted({*never, *(r for r in every if profile.ranks[r] == kind)})
                tries.append((out, f"takes {1000 * one:.2f} ms for a step of one sample, "
                                   f"{one / step:.0%} of the plan's step with it ({1000 * step:.2f} ms)", TIE))
    best = (results, [], "")
    for out, how, margin in tries:
        rest = [r for r in every if r not in out]
        if not rest or global_batch < len(rest):
            continue
        without = {s: plan_stage(profile, s, global_batch, rest) for s in stages}
        if _best_speed(without) > _best_speed(best[0]) * (1 + margin):
            best = (without, out, how + f", {_best_speed(without) / with_them:.2f}x as fast without"
                    if with_them else how)
    plans, out, why = best
    return (_beside(profile, plans, results) if out else plans), out, why


def _beside(profile: Profile, plans: dict[int, StagePlan], whole: dict[int, StagePlan]) -> dict[int, StagePlan]:
    """``plans`` (some ranks left out) each beside the whole cluster's baselines in its stage, or where the whole
    cluster cannot run it, in the stage it runs fastest."""
    running = [sp for sp in whole.values() if not sp.excluded]
    fastest = max(running, key=lambda sp: sp.poplar.predicted.samples_per_s, default=None)
    return {s: _beside_the_whole_cluster(sp, whole[s] if s in whole and not whole[s].excluded else fastest)
            for s, sp in plans.items()}


def _beside_the_whole_cluster(without: StagePlan, whole: StagePlan | None) -> StagePlan:
    """Poplar's plan without some ranks, beside the baselines of the whole cluster: what a user would run on it
    otherwise (DeepSpeed's uniform split over every card), in this stage or, where the whole cluster cannot run
    it, in the stage it runs fastest; the bound, the higher of the two."""
    if whole is None or without.excluded:
        return without
    allocations = {"poplar": without.poplar, **{n: a for n, a in whole.allocations.items() if n != "poplar"}}
    bound = max(without.ideal_samples_per_s, whole.ideal_samples_per_s) if without.ideal_samples_per_s else 0.0
    return replace(without, allocations=allocations, ideal_samples_per_s=bound)   # (0: not bounded, plan_stage)


def _best_speed(results: dict[int, StagePlan]) -> float:
    """The most samples a second any stage's Poplar plan is predicted (0: none runs)."""
    return max((r.poplar.predicted.samples_per_s for r in results.values() if not r.excluded), default=0.0)


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
