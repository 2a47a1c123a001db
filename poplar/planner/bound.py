"""The ideal bound: the most throughput any allocation of a stage and shape could reach, on the cost model.

Every device finishes its compute at the same moment, with samples split into
fractions, and the engine's schedule is followed on that balanced step at its most
favourable; see :func:`ideal_samples_per_s`.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
from scipy.optimize import minimize, minimize_scalar

from poplar.planner.cost import CostModel
from poplar.planner.search import even_split_busy_s, fastest_accum_table


def ideal_samples_per_s(cost: CostModel, global_batch: int) -> float:
    """The bound: the global batch shared so that every device finishes its compute at the same moment.

    Samples may be split into fractions (a device's time is interpolated between whole
    sample counts), every device takes its fastest accumulation count for its share and
    nobody waits for another's compute. (A device's throughput rises with its batch on a
    GPU, so "every device at its own best" would count each at a batch it cannot have
    while the others have theirs.) The communication is what the engine's schedule
    leaves exposed in that balanced step (:func:`_balanced_step_s`), taken at its most
    favourable: over a slow link the gradient collectives, the step's small all-reduces
    and the sum across nodes are a real share of a step that no allocation avoids.
    Without collectives to follow, the busy times (update included) are what is balanced.
    """
    scheduled = cost.profile.comm is not None and len(cost.ranks) > 1
    # where the ranks start every step together, the update follows the step's last collective on every rank:
    # the compute is balanced, the update after it; elsewhere (ZeRO-0) a rank's update overlaps the others'
    # next step, and what is balanced is the busy time, update included, as without collectives
    together = scheduled and cost.schedule.ranks_start_together
    # the balanced limit is within an even split's longest busy time (every rank computing longer would take
    # more than the whole batch)
    longest = even_split_busy_s(cost, global_batch)
    span = OFFSET_SPAN * longest
    reach = longest + 2 * span    # the most any rank computes in the search (see most_within)
    times = {}
    for k, kc in cost.kinds.items():
        b = np.arange(0, most_within(kc, reach, global_batch) + 1)
        t, _ = fastest_accum_table(kc, np.maximum(b, 1))
        if together:
            t = t - kc.per_step_s
        times[k] = np.maximum.accumulate(np.where(b == 0, 0.0, t))   # more samples never take less time
    if not scheduled:
        alike = Counter((k, 0.0) for k in cost.rank_kinds)
        return global_batch / (_balanced_limit(times, alike, global_batch) + cost.comm_s(1))
    return global_batch / _balanced_step_s(cost, global_batch, times, span, with_update=not together)


# Groups of ranks may compute up to this many times an even split's longest busy time longer or shorter than the
# first (the bound's search over offsets, :func:`_balanced_step_s`).
OFFSET_SPAN = 2.0
GRID_HALVINGS = 6    # the grid of offsets tried along each axis before refining (see _balanced_step_s)
REFINE_EVALS = 12    # steps the refinement may take for each offset (it gains ~1e-5 of the step at scale)


def most_within(kc, seconds: float, global_batch: int) -> int:
    """More samples than ``kc`` computes within ``seconds`` (each sample takes at least its cheapest time), at most
    the whole batch: the bound's tables stop there. The least rank computes within an even split's time and no
    offset is wider than ``span``, so no rank computes longer than that time plus twice ``span``."""
    return int(min(global_batch, seconds / kc.cheapest_sample_s + 2))


def _balanced_limit(times: dict[str, np.ndarray], alike: Counter, global_batch: int) -> float:
    """The least time within which the ranks (``times[kind][b]``: ``b`` samples' time) take the whole batch,
    a rank's samples interpolated between whole counts; ``alike[(kind, extra)]``: how many ranks of ``kind``
    may go on ``extra`` seconds longer (ranks of one kind and offset take the same share)."""
    offsets = [extra for _, extra in alike]

    def samples_within(limit: float) -> float:
        total = 0.0
        for (k, extra), count in alike.items():
            t = times[k]
            whole = int(np.searchsorted(t, limit + extra, side="right")) - 1     # most whole samples within
            if whole >= len(t) - 1:     # the table's end: the whole batch, or more than the search reaches
                total += count * (len(t) - 1)
                continue
            if whole < 0:
                continue
            step = t[whole + 1] - t[whole]
            total += count * (whole + (min(1.0, (limit + extra - t[whole]) / step) if step > 0 else 1.0))
        return total

    lo, hi = -max(map(abs, offsets)), float(max(t[-1] for t in times.values())) + max(map(abs, offsets))
    return _least_reaching(lambda x: samples_within(x) - global_batch, lo, hi)


def _least_reaching(f, lo: float, hi: float, rel: float = 1e-13) -> float:
    """The least ``x`` in ``(lo, hi]`` with ``f(x) >= 0``, ``f`` non-decreasing and piecewise linear (``f(lo) < 0 <=
    f(hi)``), to within ``rel`` of it: regula falsi on the bracket, the stale end's value halved when one end
    keeps moving (the Illinois rule), a bisection where the secant would leave the bracket."""
    f_lo, f_hi, moved = f(lo), f(hi), 0
    while hi - lo > rel * max(1.0, abs(hi)):
        mid = hi - f_hi * (hi - lo) / (f_hi - f_lo) if f_hi > f_lo else (lo + hi) / 2
        if not lo < mid < hi:
            mid = (lo + hi) / 2
        value = f(mid)
        if value < 0:
            lo, f_lo = mid, value
            f_hi, moved = (f_hi / 2 if moved < 0 else f_hi), -1
        else:
            hi, f_hi = mid, value
            f_lo, moved = (f_lo / 2 if moved > 0 else f_lo), 1
    return hi


def _balanced_step_s(cost: CostModel, global_batch: int, compute: dict[str, np.ndarray], span: float,
                     with_update: bool = False) -> float:
    """The least step of the schedule over fractional allocations (see :func:`_step_at`); ``with_update``: the
    times balanced (``compute[kind][b]``) hold the update too.

    Flat, every rank computes equally long. Over shard groups, a group whose own links
    leave it slack may compute longer than another: one offset per sort of group (its
    kinds and its links) but the first, within ``span`` seconds of it, chosen for the least
    step (two sorts: over a grid, then refined; more: from the best of the grid's axes, by
    Nelder-Mead).
    """
    sorts = _group_sorts(cost)
    groups = max(sorts) + 1
    rank_groups = cost.shape.rank_groups if cost.shape else [0] * len(cost.rank_kinds)
    # groups of one sort run alike (the same kinds on the same links, the same offset): the first stands for
    # them all, and its ranks of one kind for each other
    reps = Counter((sorts[g], k) for g, k in zip(rank_groups, cost.rank_kinds))
    firsts = [sorts.index(j) for j in range(groups)]
    at = lambda d: _step_at(cost, global_batch, compute, [0.0, *d], reps, firsts, with_update)   # noqa: E731
    if groups == 1:
        return at([])
    # finer near no offset, where the best are found: 0 and +-span halved GRID_HALVINGS times
    halved = span * 0.5 ** np.arange(GRID_HALVINGS + 1)
    grid = np.sort(np.concatenate([-halved, [0.0], halved]))
    best = np.zeros(groups - 1)
    for axis in range(groups - 1):
        trials = [best + x * np.eye(groups - 1)[axis] for x in grid]
        best = min(trials, key=at)
    # the grid's spacing around the best point: the refinement's first step
    i = int(np.searchsorted(grid, best[0]))
    step = max(grid[min(i + 1, len(grid) - 1)] - grid[i], grid[i] - grid[max(i - 1, 0)])
    if groups == 2:
        found = minimize_scalar(lambda x: at([x]), bounds=(best[0] - step, best[0] + step), method="bounded",
                                options={"xatol": span * 1e-7})
        return min(float(found.fun), at(best))
    step = min(step, span * 0.5 ** GRID_HALVINGS)
    simplex = np.vstack([best, best + step * np.eye(groups - 1)])
    found = minimize(at, best, method="Nelder-Mead",
                     options={"xatol": span * 1e-5, "fatol": span * 1e-7, "initial_simplex": simplex,
                              "maxfev": REFINE_EVALS * (groups - 1)})
    return min(float(found.fun), at(best))


def _group_sorts(cost: CostModel) -> list[int]:
    """For each shard group, the index of its sort: groups of the same kinds on equal links are alike."""
    if not cost.shape:
        return [0]
    keys = [(sorted(cost.rank_kinds[i] for i in g), comm) for g, comm in zip(cost.shape.groups, cost.shape.inside)]
    firsts: list = []
    for key in keys:
        if key not in firsts:
            firsts.append(key)
    return [firsts.index(key) for key in keys]


def _step_at(cost: CostModel, global_batch: int, compute: dict[str, np.ndarray], offsets: list[float],
             reps: Counter, firsts: list[int], with_update: bool = False) -> float:
    """The schedule's step when the ranks of groups of sort ``j`` compute until a common limit plus
    ``offsets[j]`` (less if the whole batch takes less), the limit at which the ranks take the whole batch;
    ``reps[(j, kind)]``: how many ranks of ``kind`` groups of sort ``j`` hold, ``firsts[j]``: the group that is
    scheduled for its sort; ``with_update``: the times in ``compute`` hold the update (the schedule adds it).

    Each rank runs the fewest micro-steps memory allows (in ZeRO-2/3 the fewest the
    cluster's memory allows for the whole batch), of equal length: the longest last
    micro-step, under which the most communication hides.
    """
    alike = Counter()
    for (j, k), count in reps.items():
        alike[k, offsets[j]] += count
    limit = _balanced_limit(compute, alike, global_batch)
    if cost.stage >= 2:
        capacity = sum(count * cost.kinds[k].max_micro_batch for (_, k), count in reps.items())
        common = -(-global_batch // capacity)
    ranks = []
    for j, k in reps:
        kc, t = cost.kinds[k], compute[k]
        mine = max(0.0, limit + offsets[j])
        whole = max(1, min(global_batch, int(np.searchsorted(t, mine, side="right")) - 1))
        accum = common if cost.stage >= 2 else -(-whole // kc.max_micro_batch)
        seconds = min(mine, float(t[-1]))
        if with_update:   # less than a sample's time: no compute (no plan gives a rank less than a sample)
            seconds = max(0.0, seconds - kc.per_step_s)
        ranks.append((firsts[j], [(whole / accum, seconds / accum)] * accum, kc))
    return cost.schedule.run(ranks)
