"""Batch allocation against a brute-force optimum, validity, and the paper's heterogeneity cases."""

import itertools
import random

import pytest

from poplar.cluster.catalogue import peak_tflops
from poplar.plan import Plan
from poplar.planner import CostModel, allocate, measured_proportional, proportional, uniform
from poplar.profile.profile import CommProfile
from tests.planner.profiles import make_profile


def brute_force(cost: CostModel, global_batch: int) -> float:
    """The least predicted step time over every valid plan (every split, every accumulation count)."""
    limits = [cost.kinds[k].max_micro_batch for k in cost.rank_kinds]
    n = len(limits)

    def options(limit):      # (samples, accum) a rank can run
        return [(b, a) for b in range(1, global_batch + 1) for a in range(1, b + 1) if -(-b // a) <= limit]

    best = float("inf")
    for combo in itertools.product(*(options(m) for m in limits)):
        if sum(b for b, _ in combo) != global_batch:
            continue
        accum = [a for _, a in combo]
        if cost.stage >= 2 and len(set(accum)) > 1:
            continue
        plan = Plan.from_local_batches(cost.stage, [b for b, _ in combo], accum)
        best = min(best, cost.predict(plan).step_s)
    assert n >= 1 and best < float("inf")
    return best


def check_valid(plan: Plan, cost: CostModel, global_batch: int) -> None:
    assert plan.global_batch_size == global_batch
    assert plan.world_size == len(cost.ranks)
    for i, k in enumerate(cost.rank_kinds):
        assert 1 <= plan.micro_batch_sizes[i] <= cost.kinds[k].max_micro_batch
        assert plan.local_batch_sizes[i] >= plan.accum_steps[i]
    if plan.zero_stage >= 2:
        assert len(set(plan.accum_steps)) == 1


# (kinds, global batches): counts, alpha (s per micro-step), beta (s per sample), memory limit
SMALL_CASES = [
    ({"fast": (1, 0.010, 0.001, 4), "slow": (1, 0.020, 0.0025, 4)}, [2, 5, 9, 13]),       # compute differs
    ({"big": (1, 0.010, 0.001, 5), "small": (1, 0.010, 0.001, 2)}, [3, 7, 11]),             # memory differs
    ({"a": (1, 0.005, 0.002, 3), "b": (1, 0.012, 0.001, 6), "c": (1, 0.008, 0.004, 2)}, [3, 8, 10]),
    ({"big": (1, 0.004, 0.001, 6), "small": (2, 0.010, 0.003, 2)}, [4, 9]),                  # unequal quantities
]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("case", range(len(SMALL_CASES)))
def test_matches_brute_force_on_small_cases(stage, case):
    kinds, batches = SMALL_CASES[case]
    cost = CostModel(make_profile(kinds, per_step=0.003), stage)
    for global_batch in batches:
        try:
            plan = allocate(cost, global_batch)
        except ValueError:
            # stage 2/3 infeasibility must be real: no equal-accumulation plan exists at all
            assert stage >= 2
            with pytest.raises(AssertionError):
                brute_force(cost, global_batch)
            continue
        check_valid(plan, cost, global_batch)
        assert cost.predict(plan).step_s == pytest.approx(brute_force(cost, global_batch), rel=1e-9), \
            (stage, global_batch, str(plan))


def test_matches_brute_force_with_communication():
    # the collectives' times add per micro-step in ZeRO-2/3: fewer micro-steps matter more
    comm = CommProfile(numel=1000, all_reduce_s=0.004, reduce_scatter_s=0.003, all_gather_s=0.002)
    kinds = {"fast": (1, 0.010, 0.001, 3), "slow": (1, 0.020, 0.003, 5)}
    for stage in (0, 1, 2, 3):
        cost = CostModel(make_profile(kinds, comm=comm), stage)
        for global_batch in (4, 9):
            plan = allocate(cost, global_batch)
            assert cost.predict(plan).step_s == pytest.approx(brute_force(cost, global_batch), rel=1e-9)


def test_random_profiles_give_valid_plans_never_worse_than_the_baselines():
    rng = random.Random(7)
    for _ in range(60):
        kinds = {f"k{i}": (rng.randint(1, 4), rng.uniform(0.001, 0.02), rng.uniform(1e-4, 5e-3), rng.randint(1, 40))
                 for i in range(rng.randint(1, 4))}
        world = sum(k[0] for k in kinds.values())
        global_batch = rng.randint(world, 400)
        stage = rng.randint(0, 3)
        cost = CostModel(make_profile(kinds, per_step=rng.uniform(0, 0.01)), stage)
        try:
            plan = allocate(cost, global_batch)
        except ValueError as e:
            assert stage >= 2 and "same number of micro-steps" in str(e)
            continue
        check_valid(plan, cost, global_batch)
        mine = cost.predict(plan).step_s
        for baseline in (uniform, proportional):
            try:
                other = baseline(cost, global_batch)
            except ValueError:
                continue
            check_valid(other, cost, global_batch)
            assert mine <= cost.predict(other).step_s * (1 + 1e-9), (kinds, global_batch, stage, plan, other)


# The paper's cluster shapes (in seconds per micro-step and per sample; limits in samples)
PAPER_CASES = {
    "memory differs": {"a100-80": (1, 0.010, 0.002, 64), "a100-40": (1, 0.010, 0.002, 24)},
    "compute differs": {"v100": (1, 0.010, 0.002, 32), "t4": (1, 0.025, 0.005, 32)},
    "both differ": {"a800": (1, 0.008, 0.0015, 64), "v100s": (1, 0.020, 0.004, 20)},
    "unequal quantities": {"big": (1, 0.008, 0.0015, 64), "small": (3, 0.025, 0.005, 16)},
}


@pytest.mark.parametrize("name", list(PAPER_CASES))
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_paper_cases_beat_both_baselines(name, stage):
    cost = CostModel(make_profile(PAPER_CASES[name], per_step=0.005), stage)
    for global_batch in (96, 250):
        mine = cost.predict(allocate(cost, global_batch)).step_s
        for baseline in (uniform, proportional, measured_proportional):
            # never worse; proportional can be as good where the speed ratio alone splits the batch well
            assert mine <= cost.predict(baseline(cost, global_batch)).step_s * (1 + 1e-9)
        # uniform waits for the slowest card: clearly worse where compute differs; where only
        # memory does, it pays one more micro-step's fixed cost on the big card (ZeRO-0/1; in
        # ZeRO-2/3 every card runs as many micro-steps, so an even split is already the best)
        theirs = cost.predict(uniform(cost, global_batch)).step_s
        if name != "memory differs":
            assert mine < 0.9 * theirs
        elif stage <= 1:
            assert mine < 0.99 * theirs


def test_memory_only_difference_gives_the_big_card_more():
    cost = CostModel(make_profile(PAPER_CASES["memory differs"], per_step=0.005), 0)
    plan = allocate(cost, 100)
    assert plan.local_batch_sizes[0] > plan.local_batch_sizes[1]
    assert plan.accum_steps[0] <= plan.accum_steps[1]


def test_faster_devices_get_more_and_nobody_idles_much():
    cost = CostModel(make_profile(PAPER_CASES["unequal quantities"], per_step=0.005), 1)
    plan = allocate(cost, 250)
    pred = cost.predict(plan)
    assert plan.local_batch_sizes[0] > max(plan.local_batch_sizes[1:])
    assert max(pred.idle_s) < 0.05 * pred.step_s
    assert plan.local_batch_sizes[1:] == tuple(sorted(plan.local_batch_sizes[1:], reverse=True))


def test_fewest_accumulation_steps_memory_allows_on_straight_curves():
    cost = CostModel(make_profile({"a": (1, 0.01, 0.001, 10), "b": (1, 0.01, 0.001, 10)}), 0)
    plan = allocate(cost, 38)
    assert plan.accum_steps == (2, 2) and plan.micro_batch_sizes == (10, 10)
    assert sorted(plan.local_batch_sizes) == [19, 19]


def test_a_curve_bending_upwards_takes_more_smaller_micro_batches():
    # time grows faster than the micro-batch above 8 samples: 4 micro-batches of 8 beat 2 of 16
    prof = make_profile({"a": (1, 0.01, 0.001, 16)})
    sp = prof.devices["a"].stages[0]
    sp.points = [(1, 0.011), (4, 0.014), (8, 0.018), (12, 0.040), (16, 0.080)]
    cost = CostModel(prof, 0)
    plan = allocate(cost, 32)
    assert plan.accum_steps[0] > 2
    assert cost.predict(plan).step_s < cost.predict(Plan(0, [16], [2])).step_s


def test_baselines_that_cannot_split_the_batch_say_so():
    # devices that hold one sample each: 5 samples need 3 micro-steps on one rank, and ZeRO-2
    # wants as many on the other, which has only 2 samples; no split works, and none hangs
    cost = CostModel(make_profile({"a": (2, 0.01, 0.001, 1)}), 2)
    for fn in (proportional, uniform, allocate):
        with pytest.raises(ValueError, match="micro-steps"):
            fn(cost, 5)
    assert allocate(cost, 6).accum_steps == (3, 3)


def test_odd_global_batch_is_met_exactly():
    cost = CostModel(make_profile({"x": (3, 0.01, 0.002, 8)}), 2)
    plan = allocate(cost, 101)
    assert plan.global_batch_size == 101
    assert max(plan.local_batch_sizes) - min(plan.local_batch_sizes) == 1


def test_planning_a_thousand_ranks_of_six_kinds():
    kinds = {f"gpu{i}": (1024 // 6 + (1 if i < 1024 % 6 else 0), 0.005 * (1 + i), 0.001 * (1 + i / 2), 16 + 8 * i)
             for i in range(6)}
    prof = make_profile(kinds, per_step=0.01)
    assert prof.world_size == 1024
    for stage in (0, 3):
        cost = CostModel(prof, stage)
        plan = allocate(cost, 16384)
        check_valid(plan, cost, 16384)
        pred = cost.predict(plan)
        for i, k in enumerate(cost.rank_kinds):   # every rank is busy, or as full as its memory allows
            full = plan.local_batch_sizes[i] == plan.accum_steps[i] * cost.kinds[k].max_micro_batch
            assert full or pred.idle_s[i] < 0.15 * pred.step_s, (i, k, pred.idle_s[i], pred.step_s)


def test_whale_style_splits_by_rated_tflops_and_misses_what_memory_costs():
    # the V100S is rated at 0.4 of the A800 but holds only 20 samples a micro-batch: Whale's
    # split gives it 0.4 / 1.4 of the batch whatever its curve says; the measured-peak split
    # sees its throughput at the micro-batches it can hold
    prof = make_profile(PAPER_CASES["both differ"], per_step=0.005, rated_tflops={"a800": 50.0, "v100s": 20.0})
    cost = CostModel(prof, 1)
    whale = proportional(cost, 254)
    assert whale.local_batch_sizes == (181, 73)              # 1 + 252 / 1.4 and 1 + 252 * 0.4 / 1.4
    measured = measured_proportional(cost, 254)
    assert measured.local_batch_sizes != whale.local_batch_sizes
    mine = cost.predict(allocate(cost, 254)).step_s
    assert mine <= cost.predict(measured).step_s * (1 + 1e-9)
    assert mine < 0.95 * cost.predict(whale).step_s


def test_whale_style_follows_the_data_sheet_and_else_measures():
    # the profiler stores a real GPU's data-sheet peak in its profile's dtype as its rating
    h100, a100 = "NVIDIA H100 80GB HBM3 (79.1 GiB, sm_90)", "NVIDIA A100-SXM4-40GB (39.4 GiB, sm_80)"
    rated = {h100: peak_tflops("NVIDIA H100 80GB HBM3", "bf16"), a100: peak_tflops("NVIDIA A100-SXM4-40GB", "bf16")}
    assert rated == {h100: 989.0, a100: 312.0}
    prof = make_profile({h100: (1, 0.004, 0.001, 64), a100: (1, 0.008, 0.002, 32)}, dtype="bf16", rated_tflops=rated)
    plan = proportional(CostModel(prof, 0), 1303)
    assert plan.local_batch_sizes == (990, 313)                    # 1 + 1301 * 989 / 1301 and 1 + 1301 * 312 / 1301
    # in fp32 the same GPUs are rated 67 : 19.5, and the split follows
    rated = {h100: peak_tflops("NVIDIA H100 80GB HBM3", "fp32"), a100: peak_tflops("NVIDIA A100-SXM4-40GB", "fp32")}
    prof = make_profile({h100: (1, 0.004, 0.001, 64), a100: (1, 0.008, 0.002, 32)}, rated_tflops=rated)
    plan = proportional(CostModel(prof, 0), 867)
    assert plan.local_batch_sizes == (671, 196)                    # 1 + 865 * 67 / 86.5 and 1 + 865 * 19.5 / 86.5
    # a GPU without a known rating (None): every device's measured peak instead (units must not mix)
    future = "Some Future GPU (96.0 GiB, sm_100)"
    assert peak_tflops(future, "bf16") is None
    prof = make_profile({h100: (1, 0.004, 0.001, 64), future: (1, 0.008, 0.002, 32)}, dtype="bf16",
                        rated_tflops={h100: 989.0, future: None})
    cost = CostModel(prof, 0)
    assert proportional(cost, 300) == measured_proportional(cost, 300)


def _shaped_comm(rng: random.Random, world: int, scale: float = 1.0) -> CommProfile:
    """Random flat collectives, and where the ranks make two nodes or more, random nodes' links beside them."""
    from poplar.profile.profile import ShapedComm

    def comm(s: float, **extra) -> CommProfile:
        s *= scale
        return CommProfile(numel=1000, all_reduce_s=s * rng.uniform(1, 2), reduce_scatter_s=s * rng.uniform(0.5, 1),
                           all_gather_s=s * rng.uniform(0.5, 1), **extra)
    cut = sorted(rng.sample(range(1, world), rng.randint(1, min(3, world - 1)))) if world > 1 else []
    bounds = [0, *cut, world]
    groups = [list(range(a, b)) for a, b in zip(bounds, bounds[1:])]
    shaped = ShapedComm(groups=groups, numel=1000, inside=[comm(rng.uniform(1e-4, 3e-3)) for _ in groups],
                        reduce_across_s=scale * rng.uniform(1e-4, 5e-3)) if len(groups) > 1 else None
    return comm(rng.uniform(1e-4, 1e-2), shaped=shaped)


def _random_costs(seed: int, n: int, comm_scale: float = 1.0):
    """``n`` seeded cost models of ZeRO-2/3 (one count for all ranks: the counts searched), flat and shaped, with
    their global batches (``comm_scale``: the collectives' times scaled)."""
    rng = random.Random(seed)
    for _ in range(n):
        kinds = {f"k{i}": (rng.randint(1, 3), rng.uniform(0.001, 0.02), rng.uniform(1e-4, 5e-3), rng.randint(1, 24))
                 for i in range(rng.randint(1, 3))}
        world = sum(k[0] for k in kinds.values())
        prof = make_profile(kinds, per_step=rng.uniform(0, 0.01), comm=_shaped_comm(rng, world, comm_scale))
        shaped = prof.comm.shaped is not None and rng.random() < 0.5
        yield CostModel(prof, rng.choice((2, 3)), shaped=shaped), rng.randint(world, 300)


def test_no_plan_is_faster_than_its_busiest_rank_or_link():
    """The floor the search leaves counts out by (the busiest rank's compute, the busiest link's collectives):
    every stage, flat and shaped, random plans."""
    rng, checked, links = random.Random(11), 0, 0
    for cost, global_batch in (*_random_costs(5, 40), *_random_costs(6, 40, comm_scale=30.0)):
        for stage in (0, 1, cost.stage):
            c = CostModel(cost.profile, stage, shaped=cost.shape is not None)
            for _ in range(5):
                limits = [c.kinds[k].max_micro_batch for k in c.rank_kinds]
                if min(limits) < 1:      # (a shaped stage holds more states: a kind may hold no sample)
                    break
                accum = [rng.randint(1, 4)] * len(limits)
                samples = [a * rng.randint(1, m) for a, m in zip(accum, limits)]
                plan = Plan.from_local_batches(stage, samples, accum)
                if c.shard_groups:
                    plan = plan.with_shard_groups(c.shard_groups)
                pred = c.predict(plan)
                assert pred.step_s >= c.floor_s(plan) * (1 - 1e-12) and pred.busy_s == c.busy_s(plan)
                checked += 1
                links += c.floor_s(plan) > max(c.busy_s(plan))
    assert checked >= 800 and links >= 100      # the links' part of the floor is held, not only the ranks'



def test_the_busiest_link_is_every_rank_s_collectives_on_it():
    """The links' part of the floor, drawn once a group, against every rank's step written out in full: each
    link's collectives (every issuer's, each counted once at its least seconds) summed, the most of the links;
    every stage, flat and shaped, ranks of unlike micro-batches and (ZeRO-0/1) accumulations up to 6."""
    from poplar.split import near_equal
    from poplar.planner.events import Issue

    rng, checked = random.Random(12), 0
    for cost, _ in (*_random_costs(7, 30), *_random_costs(8, 30, comm_scale=30.0)):
        for stage in (0, 1, 2, 3):
            c = CostModel(cost.profile, stage, shaped=cost.shape is not None)
            limits = [c.kinds[k].max_micro_batch for k in c.rank_kinds]
            if min(limits) < 1:
                continue
            one = rng.randint(1, 6)
            accum = [one if stage >= 2 else rng.randint(1, 6) for _ in limits]
            plan = Plan.from_local_batches(stage, [a * rng.randint(1, m) for a, m in zip(accum, limits)], accum)
            groups = c.shape.rank_groups if c.shape else [0] * len(limits)
            least: dict = {}
            for r, kind in enumerate(c.rank_kinds):
                kc = c.kinds[kind]
                micro = [(m, float(kc.g[m])) for m in near_equal(plan.local_batch_sizes[r], accum[r])]
                for e in c.schedule.rank_events(micro, kc, groups[r]):
                    if isinstance(e, Issue):
                        on = least.setdefault(e.link, {})
                        on[e.key] = min(on.get(e.key, e.seconds), e.seconds)
            whole = max(sum(on.values()) for on in least.values())
            if c.shard_groups:
                plan = plan.with_shard_groups(c.shard_groups)
            assert c.schedule.link_s(plan, c.rank_kinds, c.kinds) == pytest.approx(whole, rel=1e-12)
            checked += 1
    assert checked >= 150


def test_counts_left_unfollowed_change_no_plan(monkeypatch):
    """The counts whose floor is above the fastest step found are not followed through the schedule: the plans
    are those found following every count, and some counts are left so."""
    from poplar.planner import search
    cases = [*_random_costs(3, 40), *_random_costs(4, 40, comm_scale=30.0)]
    found, followed = [], [0]
    real = CostModel.predict

    def counted(self, plan):
        followed[0] += 1
        return real(self, plan)
    monkeypatch.setattr(CostModel, "predict", counted)
    for cost, global_batch in cases:
        try:
            found.append(allocate(cost, global_batch))
        except ValueError:
            found.append(None)
    pruned = followed[0]
    monkeypatch.setattr(search, "lower_bound", lambda cost, plan: 0.0)
    for (cost, global_batch), plan in zip(cases, found):
        try:
            assert allocate(cost, global_batch) == plan
        except ValueError:
            assert plan is None
    assert sum(p is not None for p in found) >= 60 and pruned < followed[0] - pruned
