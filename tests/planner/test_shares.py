"""Uneven shares of the states in the planner: a kind's largest micro-batch at its share, and shares planned where
they let a small card take larger micro-batches."""

import pytest

from poplar.planner import make_plan
from poplar.planner.planner import EVEN_SHARES, MEMORY_SHARES
from poplar.planner.shares import gather_scale, room_shares, stage_at_share, weights
from poplar.profile.profile import StageProfile
from poplar.stages import stage as zero_stage
from tests.planner.profiles import make_profile, memory_skewed

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


@pytest.mark.parametrize("times, slope", [((0.25, 0.27), 0.3), ((0.27, 0.25), 0.0)])
def test_with_unlike_shares_the_update_is_on_the_line_timed_at_unlike_shares(times, slope):
    """Where the ranks' shares differ, the once-per-step part is read off the steps timed so (a falling line is
    noise: flat); where they are alike (some ranks left out), off the line to ZeRO-0's as before."""
    sp = StageProfile(max_micro_batch=2, state_bytes=STATE, per_step_s=0.1, points=[(1, 1.1), (2, 1.2)],
                      memory_points=[(STATE - COPY // 2, 8), (STATE, 2)],
                      share_steps=[(0.6, times[0]), (2 / 3, times[1])])
    full = StageProfile(max_micro_batch=1, state_bytes=STATE, per_step_s=0.3, points=[(1, 1.3)])

    def at(fraction: float, uneven: bool) -> StageProfile:
        return stage_at_share(sp, stage=2, precision="fp32", n_params=N_PARAMS, world=2, fraction=fraction,
                              capacity=10 * STATE, full=full, uneven=uneven)
    mean = (sum(times) / 2, (0.6 + 2 / 3) / 2)
    for fraction in (0.25, 0.6, 0.9):
        assert at(fraction, True).per_step_s == pytest.approx(mean[0] + slope * (fraction - mean[1]))
    assert at(0.25, True).time(1) == pytest.approx(1.1 + at(0.25, True).per_step_s - 0.1)   # the compute unchanged
    assert at(0.75, False).per_step_s == pytest.approx(0.1 + 0.2 * 0.5)


def test_with_unlike_shares_the_gathers_own_work_is_on_the_line_measured_at_unlike_shares():
    """The parameter gathers' own work after the update (the slices cast and padded, copied out) at a share: on the
    lines through the figures measured at unlike shares; at alike shares, the even share's anatomy as measured."""
    from poplar.profile.profile import StepAnatomy

    anatomy = StepAnatomy(micro_batch=1, forward=[0.5], backward=[0.5], root_middle=0.0, before_loss_s=0.0,
                          before_norm_s=0.0, gather_issue_s=0.01, gather_copy_s=0.0)
    sp = StageProfile(max_micro_batch=2, state_bytes=STATE, per_step_s=0.1, points=[(1, 1.1), (2, 1.2)],
                      memory_points=[(STATE - COPY // 2, 8), (STATE, 2)], anatomy=[anatomy],
                      share_steps=[(0.6, 0.25), (2 / 3, 0.27)], share_gathers=[(0.6, 0.012, 0.02), (2 / 3, 0.014, 0.02)])

    def at(fraction: float, uneven: bool) -> StepAnatomy:
        shared = stage_at_share(sp, stage=2, precision="fp32", n_params=N_PARAMS, world=2, fraction=fraction,
                                capacity=10 * STATE, uneven=uneven)
        return shared.anatomy_at(1)
    got = at(0.25, True)
    assert (got.gather_issue_s, got.gather_copy_s) == pytest.approx((0.012 + 0.03 * (0.25 - 0.6), 0.02))
    assert (at(0.25, False).gather_issue_s, at(0.25, False).gather_copy_s) == (0.01, 0.0)


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


def _fits_only_with_less(n_small: int, big_free: int = 9):
    """Stage 2 where a small card holds a sample only beside at most 5% of the sharded states (so no power of
    memory fits it: memory^3 gives it 1/9), two with none; the big one 8 at an even share, ``big_free`` with none."""
    prof = make_profile({"big": (1, 0.01, 0.0005, 8), "small": (n_small, 0.01, 0.0005, 8)}, stages=(2,))
    prof.model.n_params = N_PARAMS
    world = 1 + n_small
    base = STATE - COPY // world     # the states held at a share of 0
    points = {"big": [(base, big_free), (STATE, 8)], "small": [(base, 2), (base + COPY // 20, 1)]}
    for (name, device), gb in zip(prof.devices.items(), (2.0, 1.0)):
        device.memory_gb = gb
        device.stages[2] = device.stages[2].model_copy(update={
            "state_bytes": STATE, "max_micro_batch": 8 if name == "big" else 0, "memory_points": points[name]})
    return prof


def test_room_shares_fit_every_kind_where_no_even_share_or_power_of_memory_does():
    prof = _fits_only_with_less(3)
    kinds = prof.ranks
    assert [_limits(prof, weights({"big": 2.0, "small": 1.0}, kinds, p))[1] for p in (1, 2, 3)] == [0, 0, 0]
    room = room_shares(prof, 2, kinds)
    assert list(room) == [1, 2]    # two with (almost) none of the states, not four with any
    assert _limits(prof, room[1]) == (5, 1) and room[1][0] > 20 * room[1][1] * 0.9
    assert _limits(prof, room[2]) == (5, 2)      # the big card holds all of them


def _limits(prof, shares):
    from poplar.planner.planner import limits_at
    return limits_at(prof, 2, prof.ranks, shares)


def test_a_stage_that_fits_only_with_uneven_shares_is_planned_with_them_where_they_are_faster():
    # 54 samples: the big card alone (8 a micro-step) takes 7 micro-steps; with three small cards beside it, at
    # room for two each, 11 a micro-step, 5 shorter micro-steps
    result = make_plan(_fits_only_with_less(3), 54, [2])
    assert result.excluded_ranks == [] and result.plan.world_size == 4
    assert result.plan.shard_shares is not None and min(result.plan.micro_batch_sizes) >= 1
    assert result.plan.share_fractions[1] < 0.05
    allocations = result.allocations()
    assert allocations[EVEN_SHARES].plan is None and "cannot hold" in allocations[EVEN_SHARES].why_not
    assert allocations["uniform"].plan is None and allocations[MEMORY_SHARES].plan is None
    assert result.chosen.ideal_samples_per_s >= result.predicted.samples_per_s


def test_cards_that_fit_only_with_uneven_shares_are_left_out_where_that_is_faster():
    # the big card alone holds the whole of the states (not its even share of them) and 8 samples beside them:
    # 6 micro-steps; the small card would add a sample or two a micro-step at ten times the big card's cost
    prof = _fits_only_with_less(1, big_free=16)
    big, small = prof.devices["big"].stages[2], prof.devices["small"].stages[2]
    prof.devices["big"].stages[2] = big.model_copy(update={"memory_points": [big.memory_points[0], (STATE, 12)],
                                                           "max_micro_batch": 12})
    prof.devices["small"].stages[2] = small.model_copy(update={"points": [(m, 10 * t) for m, t in small.points]})
    result = make_plan(prof, 48, [2])
    assert result.plan.micro_batch_sizes == (8,)
    assert result.excluded_ranks == [1] and result.plan.world_size == 1 and result.plan.shard_shares is None
    assert "holds the model only with uneven shares" in result.reason


def test_on_the_memory_skewed_preset_the_states_are_shared_unevenly():
    """The preset's small card is capped by its share of the states (simulated, as the profiler measures): the
    planner gives it less of them, and a larger micro-batch, for a step predicted well ahead of even shares."""
    prof = memory_skewed()
    result = make_plan(prof, 64, [2])
    chosen, even = result.allocations()["poplar"], result.allocations()[EVEN_SHARES]
    assert chosen.plan.share_fractions[1] < 0.5 and even.plan.shard_shares is None
    assert chosen.plan.micro_batch_sizes[1] > even.plan.micro_batch_sizes[1]
    assert chosen.predicted.samples_per_s > 1.05 * even.predicted.samples_per_s


def test_zero3_counts_the_buffers_of_gathers_of_unlike_slices():
    from poplar.planner.shares import gather_buffer_bytes

    # (n + 1) slices of the largest unit's largest share, for the unit computing and the one prefetched
    assert gather_buffer_bytes([0.75, 0.25], 3, [100, 400], "fp32") == 2 * 3 * 0.75 * 400 * 4
    assert gather_buffer_bytes([0.75, 0.25], 3, [100, 400], "bf16") == 2 * 3 * 0.75 * 400 * 2
    assert gather_buffer_bytes([0.5, 0.5], 3, [100, 400], "fp32") == 0 == gather_buffer_bytes([0.75, 0.25], 2, [400],
                                                                                              "fp32")
    sp = StageProfile(max_micro_batch=4, state_bytes=STATE, points=[(1, 1.0), (4, 2.0)],
                      memory_points=[(STATE - 1000, 8), (STATE, 4)])
    at = [stage_at_share(sp, stage=3, precision="fp32", n_params=N_PARAMS, world=2, fraction=0.5, capacity=10 * STATE,
                         buffers=b).max_micro_batch for b in (0, 250, 1000)]
    assert at == [4, 3, 0]     # 250 bytes a sample
