"""The engine's schedule followed unit by unit: hand-computed timelines."""

import pytest

from poplar.planner.events import Compute, Issue, Wait, run_ranks
from poplar.planner.schedule import UnitTimes, micro_step_events


def _units(n_layers: int, *, fwd=1.0, bwd=2.0, gather=0.0, reduce=0.0, root_fwd=0.0, root_bwd=0.0):
    root = UnitTimes(forward_s=root_fwd, backward_s=root_bwd, gather_s=gather, reduce_s=reduce)
    return [root] + [UnitTimes(fwd, bwd, gather, reduce) for _ in range(n_layers)]


def test_reductions_hide_behind_the_backward_still_to_come_and_the_root_is_exposed():
    # backward: l2 ends at 4 (reduce 4-5), l1 at 6 (reduce 6-7), the root's reduce queues behind: 7-8
    events = micro_step_events(_units(2, reduce=1.0), gathers=False, reduces=True)
    assert run_ranks([events]) == (8.0, [6.0])


def test_a_slow_link_queues_the_reductions_behind_each_other():
    # each reduce takes 5: l2's 4-9, l1's 9-14, the root's 14-19; compute ended at 6
    events = micro_step_events(_units(2, reduce=5.0), gathers=False, reduces=True)
    end, busy = run_ranks([events])
    assert (end, busy) == (19.0, [6.0])


def test_an_accumulating_micro_step_communicates_nothing():
    events = micro_step_events(_units(3, reduce=5.0), gathers=False, reduces=False)
    assert not any(isinstance(e, (Issue, Wait)) for e in events)
    assert run_ranks([events]) == (9.0, [9.0])


def test_a_collective_starts_when_the_last_rank_issues_it():
    fast = micro_step_events(_units(1, bwd=1.0, reduce=1.0), gathers=False, reduces=True)
    slow = micro_step_events(_units(1, bwd=3.0, reduce=1.0), gathers=False, reduces=True)
    # the slow rank issues both reductions at 4: 4-5 and 5-6; the fast one waits for them
    assert run_ranks([fast, slow]) == (6.0, [2.0, 4.0])


def test_more_reductions_in_flight_than_allowed_stall_the_backward():
    units = _units(3, bwd=1.0, fwd=0.0, reduce=10.0)
    free = run_ranks([micro_step_events(units, gathers=False, reduces=True)])
    bound = run_ranks([micro_step_events(units, gathers=False, reduces=True, max_inflight=1)])
    # unbounded: l3 at 1 (1-11), l2 at 2 (11-21), l1 at 3 (21-31), root (31-41)
    assert free == (41.0, [3.0])
    # one in flight: issuing l2's waits for l3's (11), l1 is computed 11-12 and waits for l2's (21)
    assert bound == (41.0, [3.0])
    events = micro_step_events(units, gathers=False, reduces=True, max_inflight=1)
    waits = [i for i, e in enumerate(events) if isinstance(e, Wait)]
    computes = [i for i, e in enumerate(events) if isinstance(e, Compute)]
    assert waits[0] < computes[-1]      # the first wait comes before the last layer's backward


def test_zero3_gathers_the_root_and_prefetches_the_next_unit():
    # gathers of 1 each; forward 1 a layer. g0 0-1 (waited), g1 prefetched 1-2, waited: layer 1 runs 2-3,
    # g2 issued at 2 runs 2-3, layer 2 runs 3-4; backward: g2b at 4 (4-5) waited, g1b prefetched 5-6,
    # layer 2 backward 5-7, layer 1 backward 7-9
    events = micro_step_events(_units(2, gather=1.0), gathers=True, reduces=False)
    assert run_ranks([events]) == (9.0, [6.0])
    no_prefetch = micro_step_events(_units(2, gather=1.0), gathers=True, reduces=False, prefetch=False)
    assert run_ranks([no_prefetch]) == (11.0, [6.0])   # every gather exposed: 5 gathers + 6 of compute


def test_the_root_s_own_work_falls_before_between_and_after_the_layers():
    # forward: root 1 (0-1), layers 1-3; the head and loss 3-4; backward: l2 4-6 (r2 6-7), l1 6-8 (r1 8-9),
    # the embeddings' gradient 8-9, so the root's reduction is issued at 9 and queues behind none: 9-10
    units = _units(2, reduce=1.0, root_fwd=1.0, root_bwd=1.0)
    units[0] = UnitTimes(forward_s=1.0, backward_s=1.0, reduce_s=1.0, middle_s=1.0)
    assert run_ranks([micro_step_events(units, gathers=False, reduces=True)]) == (10.0, [9.0])


def _step_with(stage: int, **anatomy) -> float:
    """The predicted step of two ranks of one kind, 8 samples each in one micro-step, 1 ms before the loss's
    all-reduce and 5 ms once a step, where the step's anatomy places the work as ``anatomy`` says. Collectives:
    all-reduce 10 ms, reduce-scatter 6 ms, all-gather 4 ms for the model's 1,000 parameters (units of 400, 300,
    300), latencies 1-2 ms."""
    from poplar.plan import Plan
    from poplar.planner.cost import CostModel
    from poplar.profile.profile import CommProfile, StepAnatomy
    from tests.planner.profiles import make_profile

    comm = CommProfile(numel=1000, all_reduce_s=0.010, reduce_scatter_s=0.006, all_gather_s=0.004,
                       latency_s={"all_reduce": 0.002, "reduce_scatter": 0.001, "all_gather": 0.001})
    prof = make_profile({"k": (2, 0.01, 0.001, 16)}, comm=comm, per_step=0.005)
    for sp in prof.devices["k"].stages.values():
        sp.anatomy = [StepAnatomy(micro_batch=8, forward=[0.1, 0.1, 0.1], backward=[0.1, 0.3, 0.3], root_middle=0.0,
                                  **{"before_loss_s": 0.001, "before_norm_s": 0.0, **anatomy})]
    return CostModel(prof, stage).predict(Plan(stage, [8, 8], 1)).step_s


def test_the_step_s_own_work_before_the_norm_overlaps_the_loss_s_all_reduce():
    """Stage 1: the loss's all-reduce, then the norm's queued behind it; work the step does between them (the
    norm's own kernels) runs while the loss's is in flight, so it comes off the step as long as it is shorter."""
    assert _step_with(1) - _step_with(1, before_norm_s=0.0015) == pytest.approx(0.0015, abs=1e-9)


@pytest.mark.parametrize("stage", [1, 2])
def test_the_gathers_own_work_after_the_update_overlaps_the_gathers_in_flight(stage):
    """ZeRO-1/2 gather the parameters unit by unit after the update: each later unit's slice is made ready (cast,
    padded) while the gathers before it are in flight, and each unit's copied out once its own is done, while the
    later ones are. With gathers longer than each part, only the last unit's copy (its 300 of 1,000 parameters)
    stays exposed: the step is that much shorter than with the same work all before the first gather."""
    issue, copy = 0.001, 0.001
    placed = _step_with(stage, gather_issue_s=issue, gather_copy_s=copy)
    assert _step_with(stage) - placed == pytest.approx(issue + copy * (1 - 0.3), abs=1e-9)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_each_reduced_gradient_s_own_work_overlaps_the_reductions_still_in_flight(stage):
    """After the root's gradient collective the engine waits for each unit's in turn and finishes it (its shard
    copied, scaled) while the later ones are on the link: of the step's work before the loss's all-reduce, what
    runs between those waits (0.6 ms, each part shorter than the reduction after it) hides behind them whole, and
    only the rest follows the last."""
    assert _step_with(stage) - _step_with(stage, between_waits_s=0.0006) == pytest.approx(0.0006, abs=1e-9)


def test_ranks_that_issue_other_collectives_are_refused():
    a = micro_step_events(_units(1, reduce=1.0), gathers=False, reduces=True)
    b = micro_step_events(_units(2, reduce=1.0), gathers=False, reduces=True)
    with pytest.raises(ValueError, match="rank 1 issues other collectives"):
        run_ranks([a, b])


def test_the_module_examples_hold():
    import doctest

    import poplar.planner.schedule

    failed, tried = doctest.testmod(poplar.planner.schedule)
    assert tried > 0 and failed == 0


def _two_kinds_unlike_updates():
    """Two kinds busy alike (21 ms), the second in one micro-step beside a long update: an older card's optimizer
    kernels cost several times as much (its update 9 ms against 1 ms). Collectives: 1 ms for the model's 1,000
    parameters (the root's 400: 0.4 ms, each layer's 300: 0.3 ms), 1 us for one number."""
    from poplar.profile.profile import CommProfile, DeviceProfile, ModelInfo, Profile
    from tests.planner.profiles import affine_stage

    comm = CommProfile(numel=1000, all_reduce_s=0.001, reduce_scatter_s=0.001, all_gather_s=0.001)
    devices = {"new": DeviceProfile(kind="new", memory_gb=1.0, stages={s: affine_stage(0.010, 0.0, 8, per_step=0.001)
                                                                       for s in (0, 1, 2, 3)}),
               "old": DeviceProfile(kind="old", memory_gb=1.0, stages={s: affine_stage(0.012, 0.0, 8, per_step=0.009)
                                                                       for s in (0, 1, 2, 3)})}
    return Profile(model=ModelInfo(name="synthetic", n_params=1000, seq_len=16, unit_numels=[400, 300, 300]),
                   ranks=["new", "old"], devices=devices, comm=comm)


def test_zero0_a_rank_s_update_overlaps_the_others_next_step():
    """ZeRO-0: nothing after the gradients' all-reduces waits for the other rank, so in a run of steps the old card's
    long update overlaps the new card's next step (its first, accumulating micro-step): the step is the busiest
    rank's 21 ms plus the all-reduces left after its backward (layer 1's 0.3 ms, the root's 0.4 ms), not the new
    card's 20 ms to its last all-reduce plus the old card's 9 ms update (29.7 ms, as one step from a common start)."""
    from poplar.plan import Plan
    from poplar.planner.cost import CostModel

    cost = CostModel(_two_kinds_unlike_updates(), 0)
    pred = cost.predict(Plan.from_local_batches(0, [16, 8], [2, 1]))
    assert pred.busy_s == pytest.approx([0.021, 0.021])
    assert pred.step_s == pytest.approx(0.021 + 0.0003 + 0.0004, abs=3e-6)   # the batch check's 1 us aside


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_where_every_rank_waits_at_a_step_s_start_or_end_one_step_is_the_steady_one(stage):
    from poplar.plan import Plan
    from poplar.planner.cost import CostModel
    from poplar.planner.events import follow_ranks, repeated
    from poplar.planner.schedule import STEADY_STEPS

    cost = CostModel(_two_kinds_unlike_updates(), stage)
    plan = Plan.from_local_batches(stage, [16, 8], [2, 1] if stage == 1 else [2, 2])
    sched = cost.schedule
    assert sched.ranks_start_together
    events = [sched.rank_events([(m, float(cost.kinds[k].g[m])) for m in plan.micro_batches(r)], cost.kinds[k])
              for r, k in enumerate(cost.rank_kinds)]
    _, _, ends = follow_ranks([repeated(e, STEADY_STEPS + 1) for e in events])
    assert cost.predict(plan).step_s == pytest.approx(max(e[-1] - e[-2] for e in ends), rel=1e-12)


@pytest.mark.parametrize("global_batch", [24, 50, 97])
def test_zero0_the_ideal_bound_balances_the_update_too(global_batch):
    """The old card's update overlaps the new card's next step, so the bound balances busy times, update included;
    no allocation is predicted above it, and Poplar's reaches it within whole samples."""
    from poplar.planner import make_plan

    result = make_plan(_two_kinds_unlike_updates(), global_batch, [0])
    stage = result.stages[0]
    for a in stage.allocations.values():
        if a.plan is not None:
            assert a.predicted.samples_per_s <= stage.ideal_samples_per_s * (1 + 1e-9)
    assert result.predicted.samples_per_s >= 0.9 * stage.ideal_samples_per_s


def test_the_schedule_follows_the_engine_options_the_profile_was_measured_with():
    """With one reduction in flight a layer's backward waits for the one before's (ZeRO-2), with four none does;
    ZeRO-3 without prefetch waits for every gather where it would have had it gathered already."""
    from poplar.plan import Plan
    from poplar.planner.cost import CostModel
    from poplar.planner.events import Issue, Wait
    from poplar.profile.profile import EngineOptions

    base = _two_kinds_unlike_updates()

    def events(stage: int, **options) -> list:
        cost = CostModel(base.model_copy(update={"engine": EngineOptions(**options)}), stage)
        return cost.schedule.rank_events([(8, float(cost.kinds["new"].g[8]))], cost.kinds["new"])

    def waited_before_root_issued(**options) -> bool:     # the last layer's reduction, before the root's issued
        keys = [(type(e).__name__, e.key) for e in events(2, **options) if isinstance(e, (Wait, Issue))]
        return keys.index(("Wait", ".0.r2")) < keys.index(("Issue", ".0.r0"))

    assert waited_before_root_issued(max_inflight_reduces=1) and not waited_before_root_issued(max_inflight_reduces=4)
    assert events(3, prefetch=False) != events(3, prefetch=True)
    slow = base.comm.model_copy(update={"all_gather_s": 0.05})
    steps = [CostModel(base.model_copy(update={"comm": slow, "engine": EngineOptions(prefetch=p)}), 3).predict(
        Plan.from_local_batches(3, [16, 8], [2, 2])).step_s for p in (False, True)]
    assert steps[0] > steps[1]                                           # without prefetch none overlaps compute


def test_a_profile_records_the_engine_options_it_was_measured_with():
    from poplar.engine.config import EngineConfig
    from poplar.profile.options import ProfileOptions
    from poplar.simulate import simulate_profile

    cluster = {"devices": [{"kind": "a", "gpu": "A100-40GB"}, {"kind": "b", "gpu": "T4-16GB"}], "memory_scale": 0.001}
    options = ProfileOptions(stages=(0,), n_points=2, max_micro_batch=4)
    assert simulate_profile("tiny", cluster, options).engine.max_inflight_reduces == 2
    config = EngineConfig(max_inflight_reduces=3, prefetch=False)
    recorded = simulate_profile("tiny", cluster, options, config).engine
    assert (recorded.max_inflight_reduces, recorded.prefetch) == (3, False)
