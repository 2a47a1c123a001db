"""The engine's step as a state: every call out of order refused, saying what to call, before any collective."""

import pytest

from poplar.engine.phase import StepPhase


@pytest.mark.parametrize("micro_steps", [1, 2, 3])
def test_a_step_runs_its_micro_steps_in_order_and_only_those(micro_steps):
    phase = StepPhase(micro_steps)
    with pytest.raises(RuntimeError, match="begin the step"):
        phase.begin_micro_step()
    for _ in range(2):       # two steps, one after the other
        phase.begin_step()
        with pytest.raises(RuntimeError, match=f"ran 0 of its {micro_steps}"):
            phase.end_step()
        lasts = []
        for _ in range(micro_steps):
            lasts.append(phase.begin_micro_step())
            phase.end_micro_step()
        assert lasts == [False] * (micro_steps - 1) + [True]
        with pytest.raises(RuntimeError, match=f"run its {micro_steps} micro-batches"):
            phase.begin_micro_step()
        phase.end_step()
        assert phase.idle


def test_a_step_given_up_part_way_begins_again():
    phase = StepPhase(3)
    phase.begin_step()
    phase.begin_micro_step()
    phase.end_micro_step()
    phase.begin_step()           # after abandon_step: the step's micro-steps again from the first
    assert phase.done == 0 and not phase.begin_micro_step()
