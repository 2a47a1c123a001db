"""Choosing the stage, leaving out what cannot run, saying why; `poplar plan` on the command line."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from poplar.plan import Plan
from poplar.planner import PlanningError, make_plan
from poplar.profile.profile import CommProfile
from tests.planner.profiles import make_profile

ROOT = Path(__file__).resolve().parents[2]
KINDS = {"big": (1, 0.008, 0.0015, 64), "small": (2, 0.025, 0.005, 16)}


def test_chooses_the_stage_with_the_most_predicted_throughput_and_says_why():
    # stage 0 gets the most memory headroom in this profile... but its all-reduce is slow
    comm = CommProfile(numel=1000, all_reduce_s=0.5, reduce_scatter_s=0.001, all_gather_s=0.001)
    prof = make_profile(KINDS, comm=comm, max_by_stage={"small": {0: 8, 1: 16, 2: 16, 3: 16}})
    result = make_plan(prof, 120)
    best = max((s for s, sp in result.stages.items()), key=lambda s: result.stages[s].poplar.predicted.samples_per_s)
    assert result.stage == best != 0
    assert result.plan.zero_stage == best and result.plan.global_batch_size == 120
    assert f"stage {best}:" in result.reason and "above stage" in result.reason
    assert result.predicted.step_s == result.stages[best].poplar.predicted.step_s


def test_plan_json_holds_the_plan_and_what_it_predicts(tmp_path):
    result = make_plan(make_profile(KINDS), 100)
    result.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json") == result.plan      # the engine can read it back
    data = json.loads((tmp_path / "plan.json").read_text())
    assert data["predicted"]["samples_per_s"] == pytest.approx(result.predicted.samples_per_s)
    assert set(data["meta"]["stages"]["0"]) == {"ideal_samples_per_s", "poplar", "uniform", "proportional",
                                               "measured-peak"}
    assert data["meta"]["device_kinds"] == ["big", "small", "small"]


def test_ideal_bound_is_above_every_allocation():
    result = make_plan(make_profile(KINDS, per_step=0.01), 200)
    for sp in result.stages.values():
        for alloc in sp.allocations.values():
            assert alloc.predicted.samples_per_s <= sp.ideal_samples_per_s * (1 + 1e-9)


def test_a_global_batch_smaller_than_the_cluster_says_what_to_do():
    with pytest.raises(PlanningError, match="cannot give each of the 3 ranks a sample: raise it to at least 3"):
        make_plan(make_profile(KINDS), 2)
    with pytest.raises(PlanningError, match="positive whole number"):
        make_plan(make_profile(KINDS), 0)


def test_a_stage_a_device_cannot_hold_is_left_out_and_said_so():
    prof = make_profile(KINDS, max_by_stage={"small": {0: 0, 1: 0}})
    result = make_plan(prof, 64)
    assert result.stage in (2, 3)
    assert "stage 0 left out: small (rank 1, 2) cannot hold the model" in result.reason
    assert result.stages[1].excluded and not result.stages[2].excluded


def test_a_device_that_fits_no_stage_is_left_out_of_the_plan():
    prof = make_profile(KINDS, max_by_stage={"small": {0: 0, 1: 0, 2: 0, 3: 0}})
    result = make_plan(prof, 64)
    assert result.excluded_ranks == [1, 2] and result.ranks == [0]
    assert result.plan.world_size == 1 and result.plan.global_batch_size == 64
    # no stage runs on the whole cluster: the baselines are for the card that runs, as Poplar's plan
    assert all(a.plan.world_size == 1 for a in result.allocations().values())
    assert ("rank 1, 2 (small) cannot hold the model and a sample in any stage profiled, even with no share of the "
            "states: this plan is for rank 0" in result.reason.lower())


def test_a_reason_at_hundreds_of_ranks_counts_them_and_names_a_few():
    prof = make_profile({"big": (8, 5e-4, 1e-3, 32), "small": (688, 5e-4, 3e-3, 16)},
                        max_by_stage={"small": {s: 0 for s in range(4)}})
    result = make_plan(prof, 2048, [0])
    assert result.excluded_ranks == list(range(8, 696))
    assert "688 ranks (small) cannot hold the model" in result.reason.lower()
    assert "this plan is for rank 0-7" in result.reason and len(result.reason) < 600


def test_no_stage_and_no_device_can_run():
    prof = make_profile({"x": (2, 0.01, 0.001, 0)})
    for s, gib in zip(range(4), (4.0, 2.5, 2.0, 1.5)):   # the states shrink with the stage, ZeRO-3's the least
        prof.devices["x"].stages[s].state_bytes = int(gib * 2**30)
    with pytest.raises(PlanningError, match="no stage can run this job") as e:
        make_plan(prof, 8)
    assert "The least it needs is ZeRO-3's model states, 1.50 GiB a device, plus a sample's activations (the " \
           "largest device here has 1.00 GiB)" in str(e.value)


@pytest.mark.slow
def test_cli_writes_a_plan_and_rejects_bad_input(tmp_path):
    profile = tmp_path / "profile.json"
    make_profile(KINDS, per_step=0.004).save(profile)
    env = {**os.environ, "COLUMNS": "200"}
    cmd = [sys.executable, "-m", "poplar.cli.main", "plan", "--profile", str(profile)]
    run = subprocess.run(cmd + ["--global-batch", "101", "--out", str(tmp_path / "plan.json")], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    plan = Plan.load(tmp_path / "plan.json")
    assert plan.global_batch_size == 101
    for word in ("poplar", "uniform", "proportional", "ideal", "samples/s", "tokens/s", "busy ms", "idle ms",
                 "chosen:"):
        assert word in run.stdout, word
    bad = subprocess.run(cmd + ["--global-batch", "2"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and "raise it to at least 3" in bad.stdout
    missing = subprocess.run([sys.executable, "-m", "poplar.cli.main", "plan", "--profile", str(tmp_path / "no.json"),
                              "--global-batch", "8"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "poplar profile" in missing.stdout
    stages = subprocess.run(cmd + ["--global-batch", "8", "--stages", "0,5"], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=120)
    assert stages.returncode == 2 and "--stages" in stages.stdout


@pytest.mark.parametrize("stage", [0, 2])
def test_a_gain_within_the_cost_models_error_keeps_the_simpler_split(stage, monkeypatch):
    import poplar.planner.stage_plan as planner
    from tests.planner.profiles import make_profile

    def plans(slower: float):
        prof = make_profile({"a": (1, 0.010, 0.002, 64), "b": (1, 0.010 * slower, 0.002 * slower, 64)},
                            per_step=0.005)
        return planner.plan_stage(prof, stage, 96).allocations

    # 2% slower: one sample moved to the faster card would gain 0.1%, below TIE: uniform's split
    monkeypatch.setattr(planner, "TIE", 0.0)
    own = plans(1.02)
    assert list(own["poplar"].plan.local_batch_sizes) == [49, 47]
    assert own["uniform"].predicted.step_s / own["poplar"].predicted.step_s - 1 < 0.01
    monkeypatch.setattr(planner, "TIE", 0.01)
    kept = plans(1.02)
    assert kept["poplar"].plan == kept["uniform"].plan
    assert kept["poplar"].predicted.step_s == kept["uniform"].predicted.step_s
    # 5% slower: the same move gains 1.8%, and Poplar keeps its own split
    assert list(plans(1.05)["poplar"].plan.local_batch_sizes) == [49, 47]


@pytest.mark.parametrize("old_fixed_ms, left_out", [(9.0, True), (4.0, False), (1.0, False)])
def test_a_kind_whose_one_sample_holds_every_rank_back_is_planned_without(old_fixed_ms, left_out):
    """Two fast cards (1 ms a step, 0.05 ms a sample) and an old one with a large fixed cost a step: where its one
    sample takes most of the step the fast ones need for the whole batch, the plan is theirs alone (the bound
    with it), said in the reason; where it still helps, it stays."""
    from tests.planner.profiles import make_profile

    profile = make_profile({"fast": (2, 0.001, 0.00005, 128), "old": (1, old_fixed_ms / 1000, 0.0002, 64)},
                           stages=(0,))
    result = make_plan(profile, 128, [0])
    if left_out:
        assert result.excluded_ranks == [2] and result.ranks == [0, 1]
        assert "Rank 2 (old) takes 9.20 ms for a step of one sample" in result.reason
        assert "as fast without: this plan is for rank 0, 1" in result.reason
        assert result.predicted.samples_per_s >= 0.99 * result.ideal_samples_per_s
        # the baselines are the whole cluster's (what a user would run on it otherwise), slower than Poplar's
        for name, alloc in result.allocations().items():
            assert alloc.plan.world_size == (2 if name == "poplar" else 3), name
            assert name == "poplar" or alloc.predicted.samples_per_s < result.predicted.samples_per_s
    else:
        assert result.excluded_ranks == [] and result.ranks == [0, 1, 2]


def test_poplars_split_is_never_predicted_slower_than_any_baselines():
    """Seeded walk of kinds, counts, links and batches, every stage: whichever split Poplar keeps (its own, or a
    baseline's within the cost model's error), none of the baselines is predicted faster in that stage."""
    import random

    import poplar.planner.planner as planner

    rng = random.Random(11)
    for _ in range(60):
        kinds = {f"k{i}": (rng.randint(1, 3), rng.uniform(0.002, 0.02), rng.uniform(2e-4, 5e-3), rng.randint(2, 40))
                 for i in range(rng.randint(2, 3))}
        comm = CommProfile(numel=1000, all_reduce_s=rng.uniform(0, 0.02), reduce_scatter_s=rng.uniform(0, 0.01),
                           all_gather_s=rng.uniform(0, 0.01))
        rated = {k: rng.uniform(10, 300) for k in kinds}    # proportional's split: by rating, not as measured
        prof = make_profile(kinds, comm=comm, per_step=rng.uniform(0, 0.01), rated_tflops=rated)
        global_batch = rng.randint(len(prof.ranks) * 2, 300)
        for stage in range(4):
            allocations = planner.plan_stage(prof, stage, global_batch).allocations
            if "poplar" not in allocations or allocations["poplar"].plan is None:
                continue
            mine = allocations["poplar"].predicted.step_s
            for name in ("uniform", "proportional", "measured-peak"):
                other = allocations.get(name)
                assert other is None or other.plan is None or mine <= other.predicted.step_s, (kinds, stage, name)


@pytest.mark.parametrize("enabled", [True, False])
def test_planning_pauses_the_cycle_collector_and_leaves_it_as_it_was(enabled):
    import gc

    from poplar.planner import planner

    seen = []
    original = planner.plan_stage

    def watched(*args, **kwargs):
        seen.append(gc.isenabled())
        return original(*args, **kwargs)

    (gc.enable if enabled else gc.disable)()
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(planner, "plan_stage", watched)
            make_plan(make_profile(KINDS), 64, [0, 3])
        assert seen and not any(seen) and gc.isenabled() == enabled
    finally:
        gc.enable()
