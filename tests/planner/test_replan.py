"""Planning again on the profile rescaled by what each rank measures (:mod:`poplar.planner.replan`)."""

import random

import pytest

from poplar.planner.cost import CostModel
from poplar.planner.planner import plan_stage
from poplar.planner.replan import PlanBasis, rescaled
from tests.planner.profiles import COMM, make_profile, memory_skewed


def _cluster(rng: random.Random):
    """2-3 kinds of 1-2 ranks each: unlike speeds, fixed costs and memory limits."""
    kinds = {f"k{i}": (rng.randint(1, 2), rng.uniform(1e-4, 2e-3), rng.uniform(2e-4, 4e-3), rng.choice([6, 12, 32]))
             for i in range(rng.randint(2, 3))}
    return make_profile(kinds, per_step=rng.uniform(0, 5e-4), comm=COMM if rng.random() < 0.5 else None)


def test_at_its_own_speeds_the_profile_is_itself():
    profile = make_profile({"a": (1, 1e-3, 1e-3, 16), "b": (2, 1e-3, 3e-3, 8)}, comm=COMM)
    assert rescaled(profile, [0, 1, 2], [1.0, 1.0, 1.0]) == profile
    plan = plan_stage(profile, 2, 24).poplar.plan
    assert PlanBasis(profile, [0, 1, 2]).predict(plan) == CostModel(profile, 2).predict(plan)


def test_ranks_of_a_kind_measured_apart_become_kinds_of_their_own():
    profile = make_profile({"a": (1, 1e-3, 1e-3, 16), "b": (3, 1e-3, 3e-3, 8)})
    out = rescaled(profile, [0, 1, 2, 3], [1.0, 1.5, 1.004, 1.5])
    assert out.ranks == ["a", "b x1.50", "b", "b x1.50"]      # 1.004: within a step of the profile, as profiled
    assert out.stage("b x1.50", 1).time(4) == pytest.approx(1.5 * profile.stage("b", 1).time(4))
    assert out.stage("b x1.50", 1).max_micro_batch == 8       # its memory as it was


@pytest.mark.parametrize("seed", range(24))
def test_a_slowed_rank_is_planned_as_a_fresh_plan_of_the_slowed_cluster_would_be(seed):
    """Seeded clusters x stages x a rank slowed (or sped up): the re-plan keeps the stage, shape and global batch,
    gives the rank no more samples than it had (no fewer if it sped up), is never predicted slower than the
    plan it replaces, and is as fast as the planner's own plan of the rescaled cluster (within its tie)."""
    rng = random.Random(seed)
    profile = _cluster(rng)
    world, stage = profile.world_size, rng.choice([0, 1, 2, 3])
    global_batch = rng.randint(2 * world, 8 * world)
    plan = plan_stage(profile, stage, global_batch).poplar.plan
    if plan is None:
        pytest.skip("no plan of this cluster at this stage")
    rank, factor = rng.randrange(world), rng.choice([1 / 0.6, 1 / 0.8, 2.0, 0.7])
    speeds = [factor if r == rank else 1.0 for r in range(world)]
    basis = PlanBasis(profile, list(range(world)))
    new, predicted = basis.replan(plan, speeds)
    assert (new.zero_stage, new.global_batch_size, new.shard_groups, new.shard_shares) == (
        plan.zero_stage, plan.global_batch_size, plan.shard_groups, plan.shard_shares)
    assert predicted.step_s <= basis.predict(plan, speeds).step_s
    assert predicted == basis.predict(new, speeds)
    mine, before = new.local_batch_size(rank), plan.local_batch_size(rank)
    assert (mine <= before) if factor > 1 else (mine >= before)
    fresh = plan_stage(rescaled(profile, list(range(world)), speeds), stage, global_batch).poplar
    assert predicted.step_s <= fresh.predicted.step_s * 1.011


def test_a_plan_with_shares_keeps_them_where_no_others_pay():
    profile = make_profile({"a": (2, 1e-3, 1e-3, 16), "b": (2, 1e-3, 3e-3, 8)}, comm=COMM)
    plan = plan_stage(profile, 2, 24).poplar.plan.with_shard_shares([1.0, 1.0, 1.0, 1.0])
    new, _ = PlanBasis(profile, [0, 1, 2, 3]).replan(plan, [1.0, 2.0, 1.0, 1.0])
    assert new.shard_shares == plan.shard_shares and new.local_batch_size(1) < plan.local_batch_size(1)


def test_a_replan_cuts_the_states_anew_where_other_shares_pay():
    """memory-skewed's small card takes a larger micro-batch with less of the states (simulated, as the profiler
    measures): from even shares, the re-plan takes the planner's uneven ones."""
    from poplar.planner import make_plan
    from poplar.planner.planner import EVEN_SHARES

    prof = memory_skewed()
    result = make_plan(prof, 64, [2])
    chosen, even = result.allocations()["poplar"], result.allocations()[EVEN_SHARES]
    new, predicted = PlanBasis(prof, result.ranks).replan(even.plan, [1.0] * even.plan.world_size)
    assert even.plan.shard_shares is None and new.shard_shares == chosen.plan.shard_shares
    assert predicted.step_s == pytest.approx(chosen.predicted.step_s)
