"""The emulated device's clock: work calibrated once, alone, on a fixed scale, then run at that time."""

import multiprocessing as mp
import time

import pytest
import torch

from poplar.emulate import EmulatedDevice, parse_cluster
from poplar.emulate import calibration as cal
from poplar.emulate.calibration import Calibration, HostLock
from tests.emulate.workers import hold_exclusively

A = torch.randn(160, 160)


def work(n: int) -> None:
    for _ in range(n):
        torch.mm(A, A)


def device(table, speed=0.5):
    return EmulatedDevice(parse_cluster({"devices": [{"kind": "d", "speed": speed, "memory_gb": 1.0}]}).device(0),
                          table=table)


def run_step(dev, n: int, key="work") -> None:
    with dev.step("rest"):
        with dev.span(key):
            work(n)


def test_calibrated_work_keeps_its_time_when_the_host_slows_down(tmp_path):
    table = Calibration(tmp_path)
    # speed 0.2: the device's time is 5x the host's, so a host that now takes twice the
    # CPU time for the work, and is loaded by other work besides, still keeps up
    dev, raw = device(table, speed=0.2), device(False, speed=0.2)
    for _ in range(cal.OBSERVATIONS):
        run_step(dev, 40)
    assert table.cost("work") is not None and table.cost("rest") is not None
    calibrated = dev.target_s
    # the same work now costs the host twice the CPU time (as on a host twice as slow)
    walls, raw_walls = [], []
    for _ in range(3):
        run_step(dev, 80)
        walls.append(dev.compute_wall_s)
        run_step(raw, 80)
        raw_walls.append(raw.compute_wall_s)
    assert min(walls) == pytest.approx(calibrated, rel=0.1), (walls, calibrated)
    # without the table the device slows down with the host (2x, less what the host's
    # speed drifted by since the calibration: a third at most here)
    assert min(raw_walls) > 1.5 * calibrated, (raw_walls, calibrated)
    assert dev.micro_s[0] == pytest.approx(table.cost("work") / dev.speed)


def test_a_step_says_whether_it_calibrated_work(tmp_path):
    dev = device(Calibration(tmp_path))
    flags = []
    for _ in range(cal.OBSERVATIONS + 2):
        run_step(dev, 4)
        flags.append(dev.calibrating)
    assert flags == [True] * cal.OBSERVATIONS + [False, False]
    run_step(dev, 4, key="new work")
    assert dev.calibrating


def test_a_calibration_is_kept_for_every_process_and_launch(tmp_path):
    first = Calibration(tmp_path)
    dev = device(first)
    for _ in range(cal.OBSERVATIONS):
        run_step(dev, 10, key="k")
    again = Calibration(tmp_path)          # another process, or a later launch
    assert again.cost("k") == first.cost("k") and again.id == first.id
    assert Calibration(tmp_path / "other").cost("k") is None


def test_a_cost_is_the_best_of_its_first_runs(tmp_path):
    table = Calibration(tmp_path)
    runs = [0.9, 0.7, 1.3, 0.8, 1.1][:cal.OBSERVATIONS]
    costs = [table.observe("k", t) for t in runs]
    assert costs[:-1] == runs[:-1]            # while calibrating: as measured
    assert costs[-1] == table.cost("k") == min(runs)
    assert table.observe("k", 0.1) == min(runs)   # fixed from then on


def test_a_failed_step_calibrates_nothing(tmp_path):
    table = Calibration(tmp_path)
    dev = device(table)
    for _ in range(cal.OBSERVATIONS):
        with pytest.raises(RuntimeError):
            with dev.step("rest"):
                with dev.span("work"):
                    work(2)
                    raise RuntimeError("out of memory, say")
    assert table.cost("work") is None and table.cost("rest") is None
    assert table.lock.mode is None   # and no lock is left held


def test_calibrating_waits_until_nobody_else_computes(tmp_path):
    # another process calibrating holds the lock exclusively: computing here waits for it
    path = tmp_path / "host.lock"
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    other = ctx.Process(target=hold_exclusively, args=(str(path), 1.0, ready))
    other.start()
    try:
        assert ready.wait(60)
        lock = HostLock(path)
        start = time.perf_counter()
        lock.hold(exclusive=False)
        waited = time.perf_counter() - start
        lock.release()
    finally:
        other.join(30)
    assert 0.5 < waited < cal.LOCK_TIMEOUT_S, waited
    assert lock.timeouts == 0


def test_a_size_between_calibrated_sizes_is_interpolated_and_fixed(tmp_path):
    table = Calibration(tmp_path)
    for m, cost in ((2, 0.020), (6, 0.060), (10, 0.090)):
        for _ in range(cal.OBSERVATIONS):
            table.observe(f"fam@{m}", cost)
    assert table.cost("fam@4") == pytest.approx(0.040)          # halfway between 2 and 6
    assert table.cost("fam@9") == pytest.approx(0.0825)
    assert table.cost("fam@1") is None and table.cost("fam@11") is None   # never extrapolated: calibrated
    assert table.cost("other@4") is None                         # another family has no calibrated sizes
    again = Calibration(tmp_path)                                # fixed for every process, as written
    assert again.cost("fam@4") == table.cost("fam@4") and again.cost("fam@9") == table.cost("fam@9")
    # an interpolated size is no anchor: 5 lies between the calibrated 2 and 6, not between 4 and 6
    for _ in range(cal.OBSERVATIONS):
        table.observe("fam@3", 0.045)                            # a new calibrated size below
    assert table.cost("fam@5") == pytest.approx(0.045 + (5 - 3) / (6 - 3) * (0.060 - 0.045))
    assert table.cost("fam@4") == pytest.approx(0.040)           # once fixed, it keeps its cost


def spin(cpu_s: float) -> None:
    """Work of exactly ``cpu_s`` CPU seconds in this thread, whatever else the host runs."""
    end = time.thread_time() + cpu_s
    while time.thread_time() < end:
        pass


def test_a_sleep_before_a_collective_never_runs_past_the_span_in_progress(tmp_path):
    # a micro-step's gradients are sent at its end: the device pays its debt right before
    # (boundary), while the span's cost is not yet settled. Its work now costs the host
    # twice its calibrated CPU time (as on a host twice as slow): at speed 0.25 the device
    # has the time to do it, and must still take its calibrated time, no more.
    dev = device(Calibration(tmp_path), speed=0.25)

    def step(cpu_s):
        with dev.step("rest"):
            with dev.span("work"):
                spin(cpu_s)
                dev.boundary()

    for _ in range(cal.OBSERVATIONS + 1):
        step(0.010)
    calibrated = dev.target_s
    lags = []
    for _ in range(3):
        step(0.020)
        lags.append(dev.compute_wall_s / dev.target_s)
    assert dev.target_s == pytest.approx(calibrated)
    assert max(lags) < 1.15, lags      # not up to 2x: the sleep stopped at the span's cost
