"""Re-planning while training (:mod:`poplar.runtime.replanner`): when it happens, what it plans, and that it does not
when nothing changed. The decisions are walked here on figures a cost model gives (seeded noise); the runs that
re-plan on real ranks are in tests/train/test_replan_runs.py."""

import random

import pytest

from poplar.planner.planner import plan_stage
from poplar.planner.replan import PlanBasis, rescaled
from poplar.runtime.replanner import LATE_SHARE, Replanner, ReplanConfig, replanner_for
from poplar.runtime.step_figures import StepFigures
from poplar.train.config import load_config
from tests.planner.profiles import COMM, make_profile

PROFILE = make_profile({"fast": (1, 5e-4, 1e-3, 32), "slow": (2, 5e-4, 3e-3, 16)}, per_step=2e-4, comm=COMM)
BASIS = PlanBasis(PROFILE, [0, 1, 2])


def _plan(stage: int):
    return plan_stage(PROFILE, stage, 36).poplar.plan


def _figures(plan, speeds, rng: random.Random, noise: float, late: float = 0.0) -> StepFigures:
    """A step of ``plan`` on ranks computing ``speeds`` times as long as profiled, each time off by up to ``noise``;
    ``late``: the share of the step an overrun added (0: none)."""
    p = BASIS.predict(plan, speeds)
    jitter = lambda x: x * (1 + rng.uniform(-noise, noise))   # noqa: E731
    step_s = jitter(p.step_s)
    return StepFigures(step_s=step_s, busy_s=[jitter(b) for b in p.busy_s], overruns=int(late > 0),
                       peaks=[0.0] * len(speeds), grad_norm=None, late_s=late * step_s)


def _run(replanner: Replanner, steps: int, speeds_at, seed: int = 0, noise: float = 0.02, late_at=None):
    """Steps 1..``steps``, rank speeds ``speeds_at(step)``, the host late by ``late_at(step)`` of the step; each
    re-plan (taken at once, as the trainer does)."""
    rng, changes = random.Random(seed), []
    for step in range(1, steps + 1):
        fig = _figures(replanner.plan, speeds_at(step), rng, noise, (late_at or (lambda s: 0.0))(step))
        before = replanner.plan
        change = replanner.observe(step, fig)
        if change is not None:
            assert change.before == before and replanner.plan == change.after and change.step == step
            changes.append(change)
    return changes


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("restage", [False, True])
def test_a_steady_cluster_is_never_replanned(stage, seed, restage):
    replanner = Replanner(ReplanConfig(), BASIS, _plan(stage), restage=restage)
    assert _run(replanner, 50, lambda s: [1.0, 1.0, 1.0], seed=seed, noise=0.04) == []


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("rank,factor", [(1, 0.6), (0, 0.6), (2, 0.5)])
def test_a_rank_that_slows_is_planned_around_after_patience_and_planned_back_when_it_recovers(stage, rank, factor):
    plan = _plan(stage)
    slowed = [1 / factor if r == rank else 1.0 for r in range(3)]
    speeds_at = lambda s: slowed if 5 <= s < 25 else [1.0, 1.0, 1.0]   # noqa: E731
    changes = _run(Replanner(ReplanConfig(patience=3, every=10), BASIS, plan), 45, speeds_at)
    assert [c.step for c in changes] == [7, 27]        # the third step off in a row, each time
    away, back = changes
    assert away.speeds[rank] == pytest.approx(1 / factor, rel=0.05)
    assert away.after.local_batch_size(rank) < plan.local_batch_size(rank)
    best = BASIS.replan(plan, slowed)[1].step_s
    assert away.predicted_step_s == pytest.approx(best, rel=0.05)
    assert back.speeds == pytest.approx([1.0, 1.0, 1.0], abs=0.05)
    assert BASIS.predict(back.after).step_s <= BASIS.predict(plan).step_s * 1.02    # as good as the first plan
    assert back.record()["before"] == away.after.to_dict() and "re-planned after step 27" in back.line()


def test_a_change_under_the_threshold_steps_the_host_ran_late_and_a_change_too_soon_are_not_replanned():
    plan = _plan(2)
    slight = lambda s: [1.0, 1.05, 1.0] if s >= 5 else [1.0, 1.0, 1.0]   # noqa: E731
    assert _run(Replanner(ReplanConfig(), BASIS, plan), 40, slight, noise=0.0) == []
    slowed = lambda s: [1.0, 2.0, 1.0] if s >= 5 else [1.0, 1.0, 1.0]   # noqa: E731
    assert _run(Replanner(ReplanConfig(), BASIS, plan), 40, slowed, late_at=lambda s: 0.5 * (s >= 5)) == []
    late = lambda s: 0.5 * (s % 2)                                      # noqa: E731  (skipped, not counted)
    assert [c.step for c in _run(Replanner(ReplanConfig(), BASIS, plan), 40, slowed, late_at=late)] == [10]
    twice = lambda s: [1.0, 2.0, 1.0] if 5 <= s < 12 else [1.0, 1.0, 1.0]   # noqa: E731
    changes = _run(Replanner(ReplanConfig(every=20), BASIS, plan), 40, twice)
    assert [c.step for c in changes] == [7, 27]        # back only once 20 steps have passed


@pytest.mark.parametrize("threshold", [0.05, 0.1, 0.3])
@pytest.mark.parametrize("share", [0.0, 0.001, 0.5, 0.99, 1.01, 2.0])
def test_a_host_late_on_every_step_by_a_little_still_replans(threshold, share):
    """Lateness under LATE_SHARE of the threshold of a step is counted as a step (a host persistently a little late
    must not freeze re-planning); more is not counted."""
    plan = _plan(2)
    slowed = lambda s: [1.0, 2.0, 1.0] if s >= 5 else [1.0, 1.0, 1.0]   # noqa: E731
    late = share * LATE_SHARE * threshold
    on_time = _run(Replanner(ReplanConfig(threshold=threshold), BASIS, plan), 30, slowed)
    late_run = _run(Replanner(ReplanConfig(threshold=threshold), BASIS, plan), 30, slowed, late_at=lambda s: late)
    assert len(on_time) == 1
    assert [c.step for c in late_run] == ([c.step for c in on_time] if share < 1 else [])


def test_a_cost_model_a_little_off_on_this_cluster_is_held_to_what_it_measures_not_replanned_over_and_over():
    plan = _plan(1)
    replanner = Replanner(ReplanConfig(), BASIS, plan)
    rng, changes = random.Random(1), []
    for step in range(1, 60):
        fig = _figures(replanner.plan, [1.0, 1.0, 1.0], rng, 0.01)
        fig = StepFigures(fig.step_s * 1.2, fig.busy_s, 0, fig.peaks, None)    # exposed communication mispredicted
        changes += [c for c in [replanner.observe(step, fig)] if c is not None]
    assert changes == [] and replanner.residual == pytest.approx(1.2, rel=0.03)


def test_who_replans():
    plan = _plan(0)
    cfg = load_config(None, {})
    assert isinstance(replanner_for(cfg.replan, BASIS, plan, 3), Replanner)
    assert replanner_for(load_config(None, {"replan": "off"}).replan, BASIS, plan, 3) is None
    assert replanner_for(load_config(None, {"replan": False}).replan, BASIS, plan, 3) is None
    assert replanner_for(cfg.replan, BASIS, plan, 3, baseline="uniform") is None
    assert replanner_for(cfg.replan, None, plan, 3) is None                 # a plan given: no profile to plan from
    with pytest.raises(ValueError, match="replan.mode: Input should be 'auto' or 'off'"):
        load_config(None, {"replan": "sometimes"})
    with pytest.raises(ValueError, match="replan.threshold"):
        load_config(None, {"replan": {"threshold": 1.5}})


def test_a_plan_that_cannot_be_searched_stops_replanning_not_the_run(monkeypatch):
    plan = _plan(2)
    replanner = Replanner(ReplanConfig(), BASIS, plan)

    def broken(*_):
        raise ValueError("rank 1 (slow x2.00): micro-batch 9 is over its stage-2 limit 8")

    monkeypatch.setattr(PlanBasis, "replan", broken)
    slowed = lambda s: [1.0, 2.0, 1.0] if s >= 5 else [1.0, 1.0, 1.0]   # noqa: E731
    assert _run(replanner, 20, slowed) == []
    assert replanner.stopped == ("re-planning stops after step 7, the plan kept: rank 1 (slow x2.00): micro-batch 9 "
                                 "is over its stage-2 limit 8") and replanner.plan == plan


# stage 0 holds 4 samples of the fast kind (its states take the memory), stages 1-3 hold 32; a micro-step costs 3 ms
STAGED = make_profile({"fast": (1, 5e-4, 1e-3, 32), "slow": (2, 5e-4, 3e-3, 16)}, per_step=3e-3, comm=COMM,
                      max_by_stage={"fast": {0: 4}})


@pytest.mark.parametrize("restage", [False, True])
@pytest.mark.parametrize("factor, seed", [(4, 0), (4, 1), (6, 2)])
def test_another_stage_is_taken_only_where_the_loop_can_change_stage_and_it_is_clearly_faster(restage, factor, seed):
    """Planned in stage 1 (the best while every rank computes as profiled); the slow kind then computes ``factor``
    times as long, and stage 0 (accumulating on the fast card) becomes the fastest by far more than the threshold."""
    basis, start = PlanBasis(STAGED, [0, 1, 2]), plan_stage(STAGED, 1, 36).poplar.plan
    replanner, rng, changes = Replanner(ReplanConfig(), basis, start, restage=restage), random.Random(seed), []
    slowed = [1.0, factor, factor]
    for step in range(1, 15):
        p = basis.predict(replanner.plan, slowed if step >= 5 else [1.0] * 3)
        jitter = lambda x: x * (1 + rng.uniform(-0.02, 0.02))   # noqa: E731
        fig = StepFigures(jitter(p.step_s), [jitter(b) for b in p.busy_s], 0, [0.0] * 3, None)
        changes += [c for c in [replanner.observe(step, fig)] if c is not None]
    (change,) = changes
    same, _ = basis.replan(start, change.speeds)
    if not restage:
        assert change.after == same and change.after.zero_stage == 1
        return
    other = plan_stage(rescaled(STAGED, [0, 1, 2], change.speeds), 0, 36).poplar
    assert change.after == other.plan and change.predicted_step_s == pytest.approx(other.predicted.step_s)
    assert change.predicted_step_s * 1.1 < basis.predict(same, change.speeds).step_s      # clearly faster
