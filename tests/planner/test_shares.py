"""Uneven shares of the states in the planner: a kind's largest micro-batch at its share, and shares planned where
they let a small card take larger micro-batches."""

import pytest

from poplar.planner import make_plan
from poplar.planner.planner import EVEN_SHARES, MEMORY_SHARES
from poplar.planner.shares import gather_scale, stage_at_share, weights
from poplar.profile.profile import StageProfile
from poplar.stages import stage as zero_stage
from tests.planner.profiles import make_profile

N_PARAMS, STATE = 1000, 20_000
COPY = zero_stage(2).sharded_bytes_per_param("fp32") * N_PARAMS   # one whole copy of ZeRO-2's sharded states


def test_the_largest_micro_batch_follows_the_memory_points():
    sp = StageProfile(max_micro_batch=4, state_bytes=1000, memory_points=[(600, 12), (1000, 4)])
    assert [sp.max_micro_batch_at(s, 2000) for s in (500, 600, 700, 1000, 1050, 1200)] == [12, 12, 10, 4, 3, 0]
    flat = StageProfile(max_micro_batch=4, state_bytes=1000, memory_points=[(600, 4), (1000, 4)])
    assert [flat.max_micro_batch_at(s, 2000) for s in (600, 1000, 1250, 1500)] == [4, 4, 3, 2]   # as if all free
    assert StageProfile(max_micro_batch=4, state_bytes=1000).max_micro_batch_at(900, 2000) == 4


def test_a_share_moves_the_states_the_micro_batch_and_the_update():
    sp = StageProfile(max_micro_batch=2, state_bytes=STATE, per_step_s=0.1, points=[(1, 1.1), (2, 1.2)],
                      memory_points=[(STATE - COPY // 2, 8), (STATE, 2)])
    full = StageProfile(max_micro_batch=1, state_bytes=STATE, per_step_s=0.3, points=[(1, 1.3)])
    none = stage_at_share(sp, stage=2, precision="fp32", n_params=N_PARAMS, world=2, fraction=0.0,
                          capacity=10 * STATE, full=full)
    assert none.state_bytes == STATE - COPY // 2 and none.max_micro_batch == 8
    assert none.per_step_s == 0.0                        # the update's line through even and ZeRO-0's, at 0
    assert none.time(8) == pytest.approx(1.8 - 0.1)     # on the measured line, beyond the points, without the update
    whole = stage_at_share(sp, stage=2, precision="fp32", n_params=N_PARAMS, world=2, fraction=1.0,
                           capacity=10 * STATE, full=full)
    assert whole.per_step_s == pytest.approx(0.3) and whole.max_micro_batch == 0     # 6,000 more bytes: no sample
    assert weights({"big": 80.0, "small": 40.0}, ["big", "small"], 2) == [4.0, 1.0]
    assert gather_scale([0.75, 0.25]) == 1.5


def _profile(memory_points: bool = True, memory=(2.0, 1.0)):
    """Stage 2 (every rank the same micro-steps) on a big card and a small one that holds one sample at an even
    share and eight holding none, each timed up to eight samples; large fixed costs a micro-step, so fewer
    micro-steps go faster."""
    prof = make_profile({"big": (1, 0.01, 0.0005, 8), "small": (1, 0.01, 0.0005, 8)}, stages=(2,))
    prof.model.n_params = N_PARAMS
    points = {"big": [(STATE - COPY // 2, 10), (STATE, 8)], "small": [(STATE - COPY // 2, 8), (STATE, 1)]}
    for (name, device), gb in zip(prof.devices.items(), memory):
        device.memory_gb = gb
        device.stages[2] = device.stages[2].model_copy(update={
            "state_bytes": STATE, "max_micro_batch": points[name][1][1],
            "memory_points": points[name] if memory_points else []})
    return prof


def test_shares_are_planned_where_they_let_the_small_card_take_larger_micro_batches():
    result = make_plan(_profile(), 48, [2])
    chosen, even = result.allocations()["poplar"], result.allocations()[EVEN_SHARES]
    assert chosen.plan.shard_shares is not None and chosen.plan.share_fractions[1] < 0.5
    assert chosen.plan.micro_batch_sizes[1] > 1 == even.plan.micro_batch_sizes[1]
    assert chosen.predicted.step_s * 1.01 < even.predicted.step_s
    assert result.allocations()[MEMORY_SHARES].plan.shard_shares == (2.0, 1.0)
    assert result.chosen.ideal_samples_per_s >= chosen.predicted.samples_per_s


@pytest.mark.parametrize("profile", [_profile(memory_points=False), _profile(memory=(1.0, 1.0))],
                         ids=["no-memory-points", "alike-memory"])
def test_no_shares_without_memory_points_or_where_every_card_holds_as_much(profile):
    result = make_plan(profile, 48, [2])
    assert result.plan.shard_shares is None and EVEN_SHARES not in result.allocations()
