"""The emulated device runs at its declared speed and within its declared memory, for real."""

import statistics

import pytest

from poplar.emulate.calibration import OBSERVATIONS
from poplar.launch import spawn
from tests.emulate.workers import largest_fitting_micro_batch, micro_step_times, timed_steps

HALF_SPEED = {"devices": [{"kind": "fast", "speed": 1.0, "memory_gb": 4.0},
                          {"kind": "half", "speed": 0.5, "memory_gb": 4.0}]}


def test_half_speed_device_takes_twice_the_time_at_the_same_micro_batch():
    # micro-batch 16: steps of ~100 ms, so the scheduler's jitter is small beside them
    plan = {"zero_stage": 0, "micro_batch_sizes": [16, 16], "accum_steps": [1, 1]}
    fast, half = spawn(timed_steps, 2, HALF_SPEED, plan, 10, timeout_s=180)
    # the same work is calibrated once for both ranks (the two vCPUs of this VM do not
    # always run equally fast: the same work took up to ~17% more CPU time on one)
    after = slice(OBSERVATIONS, None)   # the first steps calibrate the work
    ratio = statistics.median(h["compute"] / f["compute"] for f, h in zip(fast[after], half[after]))
    assert ratio == pytest.approx(2.0, rel=0.1), ratio
    # the fast device really waits for the slow one at the gradient all-reduce
    assert statistics.median(s["wait"] for s in fast[after]) > 0.5 * statistics.median(s["compute"] for s in fast[after])


def test_speed_holds_when_ranks_share_cores():
    # 4 ranks on this 2-core host: every device, the fast one too, takes the time its
    # work was calibrated at (measured alone) divided by its declared speed (times the
    # cluster's common slowdown), although sharing the cores inflates its CPU time
    cluster = {"devices": [{"kind": "big", "speed": 1.0, "memory_gb": 4.0},
                           {"kind": "small", "count": 3, "speed": 0.35, "memory_gb": 4.0}]}
    plan = {"zero_stage": 1, "micro_batch_sizes": [4, 2, 2, 2], "accum_steps": [1, 1, 1, 1]}
    ranks = spawn(timed_steps, 4, cluster, plan, 9, timeout_s=240)
    assert ranks[0][0]["slowdown"] > 1.0
    after = slice(OBSERVATIONS, None)
    for rank in ranks:
        achieved = statistics.median(s["compute"] / s["target"] for s in rank[after])
        assert achieved == pytest.approx(1.0, rel=0.1), [round(s["compute"] / s["target"], 2) for s in rank]
    # the small devices do the same work: one calibrated time, the same to the last digit
    targets = {round(s["target"], 9) for rank in ranks[1:] for s in rank[after]}
    assert len(targets) == 1, targets
    # the big one does more work (micro-batch 4 against 2; at most twice the time on one
    # device) at 1/0.35 of the speed
    assert 0.35 < ranks[0][-1]["target"] / ranks[1][-1]["target"] <= 2 * 0.35


@pytest.fixture(scope="module")
def fits():
    def run(memory_gb, stage=0):
        return spawn(largest_fitting_micro_batch, 1, memory_gb, stage, timeout_s=120)[0]
    return run


def test_running_above_capacity_raises_out_of_memory(fits):
    small = fits(0.03)
    assert 0 < small["best"] < 64
    assert small["error"] is not None and "out of memory" in small["error"] and "capacity" in small["error"]


def test_largest_micro_batch_grows_with_memory_and_activations_grow_with_it(fits):
    small, large = fits(0.03), fits(0.12)
    assert large["best"] > small["best"]
    peaks = [large["peaks"][m] for m in sorted(large["peaks"])]
    assert peaks == sorted(peaks) and peaks[-1] > peaks[0]


def test_a_higher_zero_stage_fits_a_larger_micro_batch_only_with_more_ranks(fits):
    # one rank: nothing to shard, so stage 3 fits no more than stage 0
    assert fits(0.03, stage=3)["best"] <= fits(0.03, stage=0)["best"]


def test_a_micro_step_costs_by_its_size_alone_and_sizes_between_are_interpolated(tmp_path, monkeypatch):
    monkeypatch.setenv("POPLAR_CACHE_DIR", str(tmp_path))    # a table of its own: no size calibrated before
    # sizes 2 and 6 calibrated; then 3 + 3 + 3 (every place in the step at one cost) and
    # 4 + 4 (between the calibrated sizes: interpolated, so its time follows the curve)
    plans = [{"zero_stage": 0, "micro_batch_sizes": [m], "accum_steps": [a]} for m, a in ((2, 1), (6, 1), (3, 3), (4, 2))]
    two, six, threes, fours = spawn(micro_step_times, 1, plans, OBSERVATIONS + 1, timeout_s=180)[0]
    assert len(set(threes)) == 1, threes              # first, middle and last: the same work, the same time
    assert fours == [pytest.approx((two[0] + six[0]) / 2)] * 2, (two, six, fours)
