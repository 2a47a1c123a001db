"""Who takes part: the plans of the whole cluster without the ranks that hold it back (:func:`leaving_out`: those
that hold the model in no stage, a kind far slower than the rest), and the kinds, stage and shape the weighed
candidates find fastest (:func:`taking_part`, :mod:`poplar.planner.subsets`), each beside the whole cluster's
baselines (what a user would run otherwise)."""

from __future__ import annotations

from dataclasses import replace

from poplar.planner.result import StagePlan
from poplar.planner.shape import node_shape
from poplar.planner.stage_plan import TIE, plan_stage
from poplar.planner.subsets import Candidate, kind_ranks, shapes_of
from poplar.profile.profile import Profile

SLOW_SHARE = 0.5   # a kind whose step of one sample is this much of the plan's step: planned without it too
# A plan of other ranks is taken where it is predicted this much faster than the best of the ranks planned: a
# measured profile's points carry about 5% of noise (search.MORE_STEPS_GAIN), and a card left out on its noise
# is a card lost (its figures sit out; a re-plan weighs it again only when the others slow)
OTHER_RANKS_GAIN = 0.05
EXHAUSTIVE_RANKS = 256   # up to this many ranks every candidate above the fastest found is predicted (else at most
                         # MOST_PREDICTED of them, the likeliest first: poplar.planner.subsets)


def taking_part(profile: Profile, stages: list[int], global_batch: int, whole: dict[int, StagePlan],
                 planned: tuple[dict, dict, list[int]], candidates: list[Candidate]):
    """The plans of the kinds and shape the weighed candidates find fastest, where that is :data:`TIE` faster than
    ``planned`` (the flat and node-shaped stages, and their ranks), and where it changes who takes part,
    :data:`OTHER_RANKS_GAIN` faster than every plan of ``planned``'s ranks: the flat and shaped stage plans, the
    ranks, those left out and why; None where ``planned`` stands."""
    results, shaped, ranks = planned
    beat = best_speed({**results, **{-1 - s: sp for s, sp in shaped.items()}})
    kinds = {profile.ranks[r] for r in ranks}    # the candidates of these ranks: those of every rank of their kinds
    complete = len(kind_ranks(profile, kinds)) == len(ranks)
    same = [c for c in candidates if complete and set(c.kinds) == kinds]
    kept = max([beat, *(c.samples_per_s for c in same)])
    others = [c for c in candidates if c not in same and c.samples_per_s > kept * (1 + OTHER_RANKS_GAIN)]
    top = max(others or same, key=lambda c: c.samples_per_s, default=None)
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
        named = ", ".join(filter(None, ["" if shape == node_shape(profile, mine) else top.name, top.own_said]))
        shaped = {**shaped, top.stage: plan_stage(profile, top.stage, global_batch, mine, shape=shape, ideal=bounded,
                                                  shape_name=named,
                                                  group_stages=top.group_stages(profile, mine, shape))}
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


def leaving_out(profile: Profile, stages: list[int], global_batch: int,
                 results: dict[int, StagePlan]) -> tuple[dict[int, StagePlan], list[int], str]:
    """The stages planned without some ranks where that is faster: those whose devices hold the model in no stage
    at an even share (where nothing else runs, or where they run only with uneven shares), and a kind whose step
    of one sample takes longer than the others' whole step (it holds every rank back). The plans, the ranks left
    out and why ("" where none)."""
    every = list(range(profile.world_size))
    with_them = best_speed(results)
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
        if best_speed(without) > best_speed(best[0]) * (1 + margin):
            best = (without, out, how + f", {best_speed(without) / with_them:.2f}x as fast without"
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


def best_speed(results: dict[int, StagePlan]) -> float:
    """The most samples a second any stage's Poplar plan is predicted (0: none runs)."""
    return max((r.poplar.predicted.samples_per_s for r in results.values() if not r.excluded), default=0.0)
