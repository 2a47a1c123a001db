"""The cost model's arithmetic, on profiles whose answers are known."""

import pytest

from poplar.plan import Plan
from poplar.planner import CostModel
from poplar.profile.profile import CommProfile
from tests.planner.profiles import make_profile

KINDS = {"fast": (1, 0.010, 0.001, 8), "slow": (2, 0.020, 0.004, 4)}


def test_busy_time_of_near_equal_micro_batches_and_the_optimizer_once():
    cost = CostModel(make_profile(KINDS, per_step=0.005), 0)
    # fast: 11 samples in 2 micro-batches (6 + 5): 2 * 0.010 + 11 * 0.001, plus the update once
    # slow: 7 samples in 2 micro-batches (4 + 3): 2 * 0.020 + 7 * 0.004, plus the update once
    plan = Plan.from_local_batches(0, [11, 7, 7], [2, 2, 2])
    pred = cost.predict(plan)
    assert pred.busy_s == pytest.approx([0.031 + 0.005, 0.068 + 0.005, 0.068 + 0.005])
    assert pred.step_s == pytest.approx(0.073)          # no collectives profiled: nothing exposed
    assert pred.idle_s == pytest.approx([0.037, 0.0, 0.0])
    assert pred.samples_per_s == pytest.approx(25 / 0.073)
    assert pred.tokens_per_s == pytest.approx(16 * 25 / 0.073)


def test_a_measured_dip_does_not_make_a_larger_micro_batch_cheaper():
    prof = make_profile({"a": (1, 0.01, 0.001, 8)})
    prof.devices["a"].stages[0].points = [(1, 0.011), (4, 0.020), (6, 0.016), (8, 0.022)]
    g = CostModel(prof, 0).kinds["a"].g
    assert all(g[i + 1] >= g[i] for i in range(1, 8))


def test_plans_over_the_memory_limit_or_for_another_stage_are_refused():
    cost = CostModel(make_profile(KINDS), 1)
    with pytest.raises(ValueError, match="micro-batch 5 is over its stage-1 limit 4"):
        cost.predict(Plan(1, [1, 5, 1], 1))
    with pytest.raises(ValueError, match="plan is for stage 0"):
        cost.predict(Plan(0, [1, 1, 1], 1))


COMM = CommProfile(numel=1000, all_reduce_s=0.010, reduce_scatter_s=0.006, all_gather_s=0.004)


@pytest.mark.parametrize("stage, accum, expected", [
    (0, 3, 0.4 * 0.010),                          # the root's all-reduce (400 of 1,000 parameters)
    (1, 3, 0.4 * 0.006 + 0.004),                  # its reduce-scatter, then the full parameter all-gather
    (2, 3, 3 * 0.4 * 0.006 + 0.004),              # a reduce-scatter per micro-step, then the all-gather
    (3, 3, 3 * 0.4 * (0.004 + 0.006)),            # gather and reduce-scatter the root per micro-step
])
def test_exposed_communication_per_stage(stage, accum, expected):
    cost = CostModel(make_profile(KINDS, comm=COMM), stage)
    assert cost.comm_s(accum) == pytest.approx(expected)


def test_an_untimed_zero0_step_is_no_update_for_a_share_of_the_states():
    """A kind that holds no sample in ZeRO-0 has no ZeRO-0 step timed (its per_step_s there is 0, no points): it is
    no measure of the whole model's update. With a sixth of the states instead of half, such a card's update stays
    its even share's (it grew to 5 ms, on the line towards that 0, and an A100 beside a T4 was predicted 8.7% slow);
    a kind whose ZeRO-0 step was timed still moves along the line to it."""
    from poplar.profile.profile import StageProfile

    prof = make_profile({"big": (1, 0.010, 0.001, 8), "small": (1, 0.010, 0.001, 8)}, per_step=0.003)
    prof.devices["small"].stages[0] = StageProfile(max_micro_batch=0, state_bytes=0, note="does not fit")
    prof.devices["big"].stages[0] = prof.devices["big"].stages[0].model_copy(update={"per_step_s": 0.006})
    cost = CostModel(prof, 1, shares=[5.0, 1.0])
    assert cost.kinds["small"].per_step_s == pytest.approx(0.003)
    assert cost.kinds["big"].per_step_s == pytest.approx(0.003 + 0.003 * (5 / 6 - 1 / 2) / (1 / 2))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_rank_planned_alone_moves_nothing(stage):
    """A plan for one rank of a profiled cluster (the others left out): its collectives are over a world of one, so
    its step is its busy time, not that plus the profile's collectives over the whole cluster."""
    cost = CostModel(make_profile({"big": (1, 0.01, 0.001, 16), "small": (1, 0.02, 0.004, 8)}, comm=COMM), stage, [0])
    pred = cost.predict(Plan.from_local_batches(stage, [16], [2]))
    assert pred.step_s == pred.busy_s[0] and pred.comm_s == 0.0 and cost.comm_s(4) == 0.0
