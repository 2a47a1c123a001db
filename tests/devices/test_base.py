"""The host device: a step's time, and the waits for collectives told apart from compute over real gloo ranks."""

import time

import pytest

from poplar.devices import Device
from poplar.engine.collectives import ObservedComm
from poplar.processes.spawn import spawn
from tests.devices.workers import LATE_S, wait_for_a_late_rank


def test_a_step_lasts_as_long_as_its_work_and_without_collectives_it_is_all_compute():
    device = Device()
    with device:
        assert isinstance(device.comm, ObservedComm) and device.comm.observer is device   # its collectives' seam
        with device.step():
            time.sleep(0.2)
        assert device.step_s >= 0.2
        assert device.wait_s == 0.0 and device.compute_s == device.step_s
        with device.step():                           # each step is timed afresh
            pass
        assert device.step_s < 0.1
    assert device.capacity is None and device.dilation == 1.0 and device.overruns == 0


@pytest.mark.slow
def test_a_wait_for_a_late_rank_is_waiting_not_compute():
    early, late = spawn(wait_for_a_late_rank, 2, timeout_s=120)
    assert early["sync"]["sum"] == late["sync"]["sum"] == [3.0] * 4    # the collective did its work
    # rank 0 computed nothing: its step is the wait for rank 1
    assert early["sync"]["wait_s"] >= LATE_S - 0.05
    assert early["sync"]["compute_s"] < 0.1
    assert early["sync"]["step_s"] == pytest.approx(early["sync"]["wait_s"] + early["sync"]["compute_s"])
    # rank 1 computed, then found rank 0 already there
    assert late["sync"]["compute_s"] >= LATE_S
    assert late["sync"]["wait_s"] < 0.1
    # a collective that finished while both ranks computed beside it costs no wait
    for rank in (early, late):
        assert rank["overlapped"]["step_s"] >= LATE_S
        assert rank["overlapped"]["wait_s"] < 0.1
        # the device sees only what goes through its comm: nothing process-global
        assert rank["plain_comm"]["wait_s"] == 0.0
