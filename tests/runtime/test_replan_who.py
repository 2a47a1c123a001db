"""Re-planning decides who takes part (:mod:`poplar.runtime.replanner`, ``who``): a card that sat out is weighed
again when the others slow, one that became a drag may sit out, through the planner's own search over the whole
profile (:meth:`poplar.planner.replan.PlanBasis.regroup`). The decisions are walked on figures a cost model gives
(seeded noise); the runs that re-launch on real ranks are in tests/train/test_replan_relaunch.py."""

import random

import pytest

from poplar.planner import make_plan
from poplar.planner.replan import PlanBasis, rescaled
from poplar.runtime.replanner import Replanner, ReplanConfig, replanner_for
from poplar.runtime.step_figures import StepFigures
from tests.planner.profiles import COMM, make_profile

# a fast card and an old one whose step of one sample is longer than the fast card's whole step: it sits out
SITS_OUT = make_profile({"fast": (1, 5e-4, 1e-4, 64), "old": (1, 3.5e-3, 3e-4, 32)}, stages=(0, 1), comm=COMM)
# a fast card and a slower one that takes part
BOTH = make_profile({"fast": (1, 5e-4, 1e-4, 64), "t4": (1, 5e-4, 2.5e-4, 32)}, stages=(0, 1), comm=COMM)
BATCH = 32


def _start(profile):
    result = make_plan(profile, BATCH, [0, 1])
    return PlanBasis(profile, list(result.ranks)), result.plan


def _run(replanner: Replanner, steps: int, speeds_at, seed: int = 0, noise: float = 0.02):
    """Steps 1..``steps`` with profile rank speeds ``speeds_at(step)`` (a dict; others 1.0); the re-plans, the run
    stopping at one that changes who takes part (as the trainer does)."""
    rng, changes, basis = random.Random(seed), [], replanner.basis
    for step in range(1, steps + 1):
        speeds = [speeds_at(step).get(r, 1.0) for r in basis.ranks]
        p = basis.predict(replanner.plan, speeds)
        jitter = lambda x: x * (1 + rng.uniform(-noise, noise))   # noqa: E731
        figures = StepFigures(step_s=jitter(p.step_s), busy_s=[jitter(b) for b in p.busy_s], overruns=0,
                              peaks=[0.0] * len(speeds), grad_norm=None)
        change = replanner.observe(step, figures)
        if change is not None:
            changes.append(change)
            if change.ranks is not None:
                break
    return changes


def test_a_card_that_sat_out_is_brought_in_when_the_other_slows_as_a_fresh_plan_would():
    basis, plan = _start(SITS_OUT)
    assert basis.ranks == [0] and plan.world_size == 1
    replanner = replanner_for(ReplanConfig(), basis, plan, 1, restage=True, who="relaunch")
    (change,) = _run(replanner, 30, lambda s: {0: 2.0} if s >= 5 else {})
    assert change.step == 7 and change.ranks_before == [0] and change.ranks == [0, 1]
    assert change.speeds == pytest.approx([2.0], rel=0.03) and change.after_speeds[1] == 1.0
    fresh = make_plan(rescaled(SITS_OUT, [0, 1], [2.0, 1.0]), BATCH, [0, 1])   # the slowed cluster, planned anew
    assert change.after.world_size == 2
    assert change.predicted_step_s == pytest.approx(fresh.predicted.step_s, rel=0.02)
    assert change.predicted_step_s * 1.1 < change.kept_step_s
    record = change.record()
    assert record["ranks"] == {"before": [0], "after": [0, 1]} and "re-launched on profile rank 0, 1" in change.line()


def test_a_card_that_becomes_a_drag_sits_out():
    basis, plan = _start(BOTH)
    assert basis.ranks == [0, 1]
    replanner = Replanner(ReplanConfig(), basis, plan, restage=True, who="relaunch")
    (change,) = _run(replanner, 30, lambda s: {1: 6.0} if s >= 5 else {})
    assert change.ranks == [0] and change.after.world_size == 1
    assert change.after_speeds == pytest.approx([1.0], abs=0.03)


def test_where_nothing_can_start_other_ranks_it_is_said_once_and_the_ranks_kept():
    basis, plan = _start(SITS_OUT)
    replanner = replanner_for(ReplanConfig(), basis, plan, 1, restage=True, who="said")
    assert _run(replanner, 40, lambda s: {0: 2.0} if s >= 5 else {}) == []
    said = replanner.notice()
    assert "profile rank 0, 1" in said and "needs the launcher" in said and "\n" not in said
    assert replanner.notice() is None
    assert replanner_for(ReplanConfig(), basis, plan, 1, who="kept") is None    # a rank alone, others not weighed


@pytest.mark.parametrize("profile", [SITS_OUT, BOTH])
@pytest.mark.parametrize("seed", range(3))
def test_a_steady_cluster_never_changes_who_takes_part(profile, seed):
    basis, plan = _start(profile)
    replanner = Replanner(ReplanConfig(), basis, plan, restage=True, who="relaunch")
    assert _run(replanner, 50, lambda s: {}, seed=seed, noise=0.04) == []


def test_a_run_started_again_plans_on_from_the_speeds_it_measured():
    basis, plan = _start(SITS_OUT)
    (change,) = _run(Replanner(ReplanConfig(), basis, plan, who="relaunch"), 30, lambda s: {0: 2.0} if s >= 5 else {})
    moved = PlanBasis.from_dict(PlanBasis(SITS_OUT, change.ranks, change.after_speeds).to_dict())   # basis.json
    assert moved.ranks == [0, 1] and moved.speeds == change.after_speeds
    again = Replanner(ReplanConfig(), moved, change.after, restage=True, who="relaunch")
    assert again.expected.step_s == pytest.approx(change.predicted_step_s)
    assert _run(again, 40, lambda s: {0: 2.0}) == []                     # held to what it measured: steady
    (back,) = _run(again, 40, lambda s: {})        # the fast card recovers: the old one kept, a little (under the
    assert back.ranks is None and back.after.local_batch_size(1) < change.after.local_batch_size(1)   # threshold)
