"""Batch allocation: every rank's samples and accumulation steps for the least step time.

For a stage and a global batch ``B``, each rank ``r`` takes ``b_r >= 1`` samples in
``a_r`` near-equal micro-batches no larger than its memory limit, ``sum b_r = B``,
and the step lasts ``max_r busy_r(b_r, a_r)`` plus the stage's exposed communication.

The search works on time thresholds. For a threshold ``t`` every rank can take any
number of samples from its floor (1, or ``a`` in ZeRO-2/3) up to ``cap_r(t)``, the most
it finishes within ``t``: a rank's busy time never falls when it takes more samples,
so what it can take under ``t`` is an interval. ``B`` is reachable within ``t`` exactly
when the floors and caps bracket it, so the least feasible ``t`` is found by bisection
over the finitely many busy times the ranks can have, and no allocation finishes
sooner. Then every rank gets what it can take under the next lower threshold and the
few samples left go to the ranks that reach ``t``: the fast devices get more, every
rank is as close to the slowest as whole samples allow.

Ranks of one kind share their tables, so planning 1,024 ranks of 6 kinds costs about
as much as planning 6.

- ZeRO-0/1 synchronise once per step: every rank has its own accumulation count, the
  fewest its memory allows for its samples, unless more is predicted at least 15% faster
  (one or two more, or counts that bring its micro-batches to a spread of sizes).
- ZeRO-2/3 synchronise on every micro-step: one count for all ranks, the one predicted
  fastest among the fewest that lets the cluster's memory hold the batch and others (a
  larger shared count also lets a memory-bound fast device take more). A count whose
  busiest rank computes, or whose busiest link communicates, longer than the fastest
  step found cannot beat it and is not followed through the step's schedule
  (docs/simulate.md, docs/plan.md: what that saves at 512 ranks).
"""

from __future__ import annotations

import numpy as np

from poplar.plan import Plan
from poplar.split import apportion
from poplar.planner.cost import CostModel, KindCost

EXTRA_ACCUM = 2        # accumulation counts tried above the fewest memory allows
# More micro-steps than memory requires only where predicted at least this much faster.
# Measured here: profile points carry ~5% noise, and ranks that all run their largest
# sizes at once (as the profiler's rounds do) slow each other on a shared host, so a
# curve can seem to bend upwards by ~10% at its top; a plan that split micro-batches on
# that evidence measured no faster than the fewest steps.
MORE_STEPS_GAIN = 0.15


class Infeasible(ValueError):
    """No plan of this kind exists; the message says why and what to change."""


def _require_feasible(cost: CostModel, global_batch: int) -> int:
    """Every rank needs a sample and a device that holds one: the number of ranks, or Infeasible."""
    n = len(cost.ranks)
    too_small = [k for k, kc in cost.kinds.items() if not kc.fits()]
    if too_small:
        raise Infeasible(f"{', '.join(too_small)} cannot hold micro-batch 1 in stage {cost.stage}")
    if global_batch < n:
        raise Infeasible(f"a global batch of {global_batch} cannot give each of the {n} ranks a sample")
    return n


def even_split_busy_s(cost: CostModel, global_batch: int) -> float:
    """The longest busy time of the batch split evenly over the ranks, each in the fewest micro-steps it holds."""
    even = -(-global_batch // len(cost.ranks))
    return max(float(kc.busy(even, -(-even // kc.max_micro_batch))) for kc in cost.kinds.values())


def _target_sizes(kc: KindCost, n: int = 12) -> np.ndarray:
    """Micro-batch sizes worth aiming at: spread over 1..max, and the most efficient one."""
    m = kc.max_micro_batch
    grid = np.concatenate([np.geomspace(1, m, n), np.linspace(1, m, n), [kc.best_micro_batch]])
    return np.unique(np.clip(np.round(grid).astype(int), 1, m))


def fastest_accum_table(kc: KindCost, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Busy time and accumulation count for each number of samples in ``b``, choosing the count.

    Counts tried: the fewest memory allows and a couple more, and those that cut the
    samples into micro-batches of about each of a spread of sizes. A count above the
    fewest is taken only where it is predicted ``MORE_STEPS_GAIN`` faster; ties go to the
    fewer micro-steps.
    """
    a_min = -(-b // kc.max_micro_batch)
    best_t = kc.busy(b, a_min)
    best_a = a_min.copy()
    fewest_t = best_t.copy()
    tries = [a_min + extra for extra in range(1, EXTRA_ACCUM + 1)] + [-(-b // m) for m in _target_sizes(kc)]
    for a in tries:
        ok = a <= b
        t = np.where(ok, kc.busy(b, np.minimum(a, b)), np.inf)
        better = (t < best_t * (1 - 1e-9)) | ((t <= best_t * (1 + 1e-9)) & (a < best_a))
        better &= t < fewest_t * (1 - MORE_STEPS_GAIN)
        best_t, best_a = np.where(better, t, best_t), np.where(better, a, best_a)
    return best_t, best_a


def _level(tables: dict[str, tuple[int, np.ndarray]], counts: dict[str, int], total: int) -> dict[str, tuple[int, int]]:
    """Per kind ``(floor, top)`` samples such that floors <= total <= tops summed over ranks, at the least time.

    ``tables[kind] = (first, times)``: ``times[i]`` is the busy time at ``first + i``
    samples, non-decreasing.
    """
    candidates = np.unique(np.concatenate([t for _, t in tables.values()]))

    def caps(threshold: float) -> dict[str, int]:
        return {k: first + int(np.searchsorted(t, threshold, side="right")) - 1 for k, (first, t) in tables.items()}

    def reach(c: dict[str, int]) -> int:
        return sum(counts[k] * max(tables[k][0], v) for k, v in c.items())

    lo, hi = 0, len(candidates) - 1            # reach(candidates[hi]) >= total is checked by the caller
    while lo < hi:
        mid = (lo + hi) // 2
        if reach(caps(candidates[mid])) >= total:
            hi = mid
        else:
            lo = mid + 1
    top = caps(candidates[lo])
    below = caps(candidates[lo - 1]) if lo > 0 else {k: tables[k][0] for k in tables}
    return {k: (max(tables[k][0], below[k]), max(tables[k][0], top[k])) for k in tables}


def _spread(rank_kinds: list[str], level: dict[str, tuple[int, int]], total: int) -> list[int]:
    """Floors for every rank, then the remainder one sample at a time over ranks with room, round-robin."""
    samples = [level[k][0] for k in rank_kinds]
    left = total - sum(samples)
    while left > 0:
        moved = False
        for i, k in enumerate(rank_kinds):
            if left and samples[i] < level[k][1]:
                samples[i] += 1
                left -= 1
                moved = True
        if not moved:
            raise AssertionError("the level search guarantees room for the whole batch")
    return samples


def allocate(cost: CostModel, global_batch: int) -> Plan:
    """The plan with the least predicted step time for ``cost``'s stage and ranks."""
    n = _require_feasible(cost, global_batch)
    counts = {k: cost.rank_kinds.count(k) for k in cost.kinds}
    if cost.stage <= 1:
        # Tables need not go beyond what a rank could take within the time of an even split
        # (a feasible plan): its busy time is at least its per-step part plus its samples at
        # its cheapest per-sample cost.
        even, bound = -(-global_batch // n), even_split_busy_s(cost, global_batch)
        most = {k: int(min(global_batch - (n - 1), max(even, (bound - kc.per_step_s) / kc.cheapest_sample_s + 1)))
                for k, kc in cost.kinds.items()}
        free = {k: fastest_accum_table(kc, np.arange(1, most[k] + 1)) for k, kc in cost.kinds.items()}
        # np.maximum.accumulate: a busy time that dips after a jump in accumulation counts as
        # the higher one, so each rank's feasible samples under a threshold stay an interval
        tables = {k: (1, np.maximum.accumulate(t)) for k, (t, _) in free.items()}
        samples = _spread(cost.rank_kinds, _level(tables, counts, global_batch), global_batch)
        accum = [int(free[k][1][b - 1]) for k, b in zip(cost.rank_kinds, samples)]
        return Plan.from_local_batches(cost.stage, samples, accum)
    capacity = sum(counts[k] * kc.max_micro_batch for k, kc in cost.kinds.items())
    a_lo, a_hi = -(-global_batch // capacity), global_batch // n
    if a_lo > a_hi:
        raise Infeasible(f"stage {cost.stage} runs the same number of micro-steps on every rank; no count fits "
                         f"{global_batch} samples on {n} ranks within memory (it needs at least {a_lo} micro-steps "
                         f"for memory, and at most {a_hi} leave every rank a sample each)")
    # counts that fill the devices' micro-batches to a spread of fractions of their limits,
    # then the neighbours of the best of those
    fill = np.geomspace(1.0, 1.0 / max(kc.max_micro_batch for kc in cost.kinds.values()), 32)
    tries = {int(x) for x in np.ceil(global_batch / (fill * capacity))} | set(range(a_lo, a_lo + EXTRA_ACCUM + 1))
    found: dict[int, tuple[float, Plan]] = {}

    def attempt(a: int) -> None:
        if a_lo <= a <= a_hi and a not in found:
            tables = {k: (a, kc.busy(np.arange(a, a * kc.max_micro_batch + 1), a)) for k, kc in cost.kinds.items()}
            samples = _spread(cost.rank_kinds, _level(tables, counts, global_batch), global_batch)
            plan = Plan.from_local_batches(cost.stage, samples, a)
            # a count whose plan cannot beat the fastest step found is not followed through the schedule: its
            # floor stands for it (above the fastest, never the least)
            floor = lower_bound(cost, plan)
            fastest = min((s for s, _ in found.values()), default=float("inf"))
            found[a] = (floor, plan) if floor > fastest * (1 + 1e-9) else (cost.predict(plan).step_s, plan)

    def best() -> int:             # the fastest; among equals, the fewest micro-steps
        return min(found, key=lambda a: (round(found[a][0], 12), a))

    for a in sorted(tries):
        attempt(a)
    for a in range(best() - 3, best() + 4):
        attempt(a)
    return found[best()][1]


def lower_bound(cost: CostModel, plan: Plan) -> float:
    """No step of ``plan`` is shorter (:meth:`CostModel.floor_s`)."""
    return cost.floor_s(plan)


# ---------------------------------------------------------------------------- baselines
def uniform(cost: CostModel, global_batch: int) -> Plan:
    """DeepSpeed-style: the same micro-batch and accumulation everywhere, sized for the smallest device.

    Every rank takes ``B / N`` samples (one more on the first ``B mod N`` ranks, where
    ``N`` does not divide ``B``) in the fewest micro-steps the smallest device's memory allows.
    """
    n = _require_feasible(cost, global_batch)
    smallest = min(kc.max_micro_batch for kc in cost.kinds.values())
    q, r = divmod(global_batch, n)
    samples = [q + 1] * r + [q] * (n - r)
    accum = -(-max(samples) // smallest)
    if accum > q:
        raise Infeasible(f"{global_batch} samples over {n} ranks need {accum} micro-steps of at most {smallest}, "
                         "more than the ranks with fewer samples can run")
    return Plan.from_local_batches(cost.stage, samples, accum)


def peak_throughput(kc: KindCost) -> float:
    """A device's peak samples/s over one micro-batch of each profiled size (its measured speed)."""
    m = np.arange(1, kc.max_micro_batch + 1)
    return float(np.max(m / kc.busy(m, 1)))


def rated_speeds(cost: CostModel) -> dict[str, float] | None:
    """Each kind's rated speed, as Whale reads it: its peak dense TFLOP/s in the profile's dtype (the data
    sheet's, or a cluster file's declared figure; the profile holds it). None where some kind has none."""
    speeds = {}
    for k in cost.kinds:
        device = cost.profile.devices[cost.device_kind(k)]
        speeds[k] = device.rated_tflops
        if not speeds[k]:
            return None
    return speeds


def proportional(cost: CostModel, global_batch: int) -> Plan:
    """Whale-style: samples in proportion to each device's rated speed, memory met by accumulation only.

    The rated speed (:func:`rated_speeds`) is what a device is sold as: it ignores the
    device's measured curve, so it misses what memory does to a device's throughput (a
    card that holds only small micro-batches runs below its rating). Where some device
    has no rating (a GPU this module does not know), each device's measured peak is used,
    as :func:`measured_proportional` does.
    """
    speed = rated_speeds(cost)
    return measured_proportional(cost, global_batch) if speed is None else _split_by_speed(cost, global_batch, speed)


def measured_proportional(cost: CostModel, global_batch: int) -> Plan:
    """Samples in proportion to each device's measured peak samples/s (the best point of its profiled curve).

    A stronger heuristic than Whale's: it sees how memory limits a device's throughput,
    though not how the devices' times move with the micro-batch each is given.
    """
    return _split_by_speed(cost, global_batch, {k: peak_throughput(kc) for k, kc in cost.kinds.items()})


def _split_by_speed(cost: CostModel, global_batch: int, peak: dict[str, float]) -> Plan:
    """Samples in proportion to ``peak`` (per kind), memory met by accumulation only.

    Each device's memory limit only clips its micro-batch: a rank whose share does not fit
    in one micro-batch accumulates (in ZeRO-2/3 every rank then runs the most micro-steps
    any rank needs). Ties (kinds of the same speed, a remainder) go by kind, in the order the kinds first appear,
    then by rank: the split is the same however a cluster file lists its nodes.
    """
    n = _require_feasible(cost, global_batch)
    first = {k: i for i, k in reversed(list(enumerate(dict.fromkeys(cost.rank_kinds))))}
    order = sorted(range(n), key=lambda r: (first[cost.rank_kinds[r]], r))   # by kind, then by rank
    kinds = [cost.rank_kinds[r] for r in order]
    samples = 1 + np.array(apportion(global_batch - n, [peak[k] for k in kinds]))    # at least one sample each
    limits = np.array([cost.kinds[k].max_micro_batch for k in kinds])
    accum = [int(a) for a in -(-samples // limits)]
    if cost.stage >= 2:
        a = max(accum)
        for _ in range(global_batch):     # a rank needs a sample for every micro-step: move the surplus
            if samples.min() >= a:
                break
            i, j = int(np.argmin(samples)), int(np.argmax(samples))
            samples[i] += 1
            samples[j] -= 1
            a = int(np.max(-(-samples // limits)))
        if samples.min() < a:
            raise Infeasible(f"no proportional split of {global_batch} samples gives every rank the {a} "
                             f"micro-steps stage {cost.stage} needs")
        accum = [a] * n
    mine, steps = [0] * n, [0] * n
    for at, r in enumerate(order):
        mine[r], steps[r] = int(samples[at]), int(accum[at])
    return Plan.from_local_batches(cost.stage, mine, steps)
