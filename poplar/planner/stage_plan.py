"""One stage's plans: Poplar's allocation, the baselines and the ideal bound for some ranks in one ZeRO stage and
shape (:func:`plan_stage`), with uneven shares of the states where they may pay; :mod:`poplar.planner.planner`
weighs the stages, shapes and kinds."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from poplar.plan import Plan
from poplar.planner.bound import ideal_samples_per_s
from poplar.planner.cost import CostModel
from poplar.planner.result import BASELINES, EVEN_SHARES, MEMORY_SHARES, Allocation, StagePlan
from poplar.planner.schedule import Shape
from poplar.planner.search import Infeasible, allocate, measured_proportional, proportional, uniform
from poplar.planner.shares import (POWERS, PROPORTIONAL, fractions, gather_buffer_bytes, room_shares, stage_at_share,
                                    weights)
from poplar.profile.profile import Profile

ALLOCATIONS = {"poplar": allocate, "uniform": uniform, "proportional": proportional,
               "measured-peak": measured_proportional}
TIE = 0.01   # predicted gains below this are not worth a split other than a baseline's (see plan_stage)


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


def ranks_said(ranks: list[int]) -> str:
    """``rank 0-3, 8`` for a few ranks, ``512 ranks`` for many.

    >>> ranks_said([1, 2]), ranks_said(list(range(4096)))
    ('rank 1, 2', '4,096 ranks')
    """
    return f"rank {_rank_list(ranks)}" if len(ranks) <= NAMED else f"{len(ranks):,} ranks"


def _unfit_message(kinds: list[str], ranks: list[int], label: str) -> str:
    return f"{', '.join(kinds)} ({ranks_said(ranks)}) cannot hold the model and one sample in {label}"


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
               ideal: bool = True, group_stages: list[int] | None = None) -> StagePlan:
    """Poplar's allocation, the baselines and the ideal bound for one stage (``shaped``: over the nodes; ``shape``:
    over other shard groups, named ``shape_name``, :mod:`poplar.planner.groups`; ``ideal``: False, no bound, 0: it
    is the costly part at thousands of ranks, and a stage not chosen need not show one; ``group_stages``: each of
    ``shape``'s groups in its own stage, ``stage`` the highest)."""
    ranks = ranks if ranks is not None else list(range(profile.world_size))
    shaped = shaped or shape is not None
    out = StagePlan(stage=stage, ranks=ranks, shaped=shaped, shape_name=shape_name if shape is not None else "")
    out.excluded = _not_profiled_to_plan(profile, stage, ranks, out.label)
    if out.excluded:
        if not shaped and _fits_with_less(profile, stage, ranks):   # only some uneven shares may hold it
            out.allocations = {n: Allocation(n, None, None, why_not=out.excluded) for n in ALLOCATIONS}
            _plan_shares(out, profile, global_batch)
        return out
    cost = CostModel(profile, stage, ranks, shaped, shape=shape, group_stages=group_stages)
    # a shape may not fit where the flat profile did: hybrid states, sharded over fewer ranks, are larger
    unfit = [r for r, k in zip(ranks, cost.rank_kinds) if not cost.kinds[k].fits()]
    if unfit:
        out.excluded = _unfit_message(sorted({profile.ranks[r] for r in unfit}), unfit, out.label)
        return out
    for name, fn in ALLOCATIONS.items():
        try:
            plan = cost.shaped_plan(fn(cost, global_batch))
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
