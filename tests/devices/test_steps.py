"""The one step loop (:class:`poplar.devices.steps.TimedSteps`): each step in the device's step, its figures kept in
order, a warm-up's and a failed step's forgotten, what a step holds handed to the device."""

import doctest
import time

import pytest

import poplar.devices.steps
from poplar.devices import Device
from poplar.devices.steps import TimedSteps


def test_the_module_examples_run():
    failed, tried = doctest.testmod(poplar.devices.steps)
    assert tried > 0 and failed == 0


def test_each_kept_step_is_timed_on_the_device_and_a_warm_up_or_a_failed_step_is_forgotten():
    held = []

    class Holding(Device):
        def _step_context(self, h):
            held.append(h)
            return super()._step_context(h)

    def state():
        return 0, set()

    with Holding() as device:
        steps = TimedSteps(device, state)
        steps.run(lambda: time.sleep(0.05), keep=False)
        assert steps.run(lambda: time.sleep(0.1) or "done") == "done"
        with steps.step() as inside:
            assert inside is device
        with pytest.raises(ZeroDivisionError), steps.step():
            _ = 1 / 0
    assert held == [state] * 4                                  # every step, kept or not, holds what it was given
    assert len(steps.step_s) == len(steps.busy_s) == len(steps.wait_s) == len(steps.walls) == 2
    assert steps.step_s[0] >= 0.1 > steps.step_s[1] and steps.busy_s == steps.step_s and steps.wait_s == [0.0, 0.0]
    (a0, a1), (b0, b1) = steps.walls
    assert a0 < a1 <= b0 < b1 and a1 - a0 >= steps.step_s[0]    # the host's wall time around the device's
    assert steps.overruns == 0
