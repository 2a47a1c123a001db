"""Bad input fails on every rank with an error that says what to change, and never hangs."""

import functools

import pytest

from poplar.processes.spawn import spawn
from tests.engine.workers import bad_input_scenarios, stalled_rank

pytestmark = pytest.mark.slow


@functools.cache
def outcomes():
    return spawn(bad_input_scenarios, 2, timeout_s=120)


@pytest.mark.parametrize("scenario, error, words", [
    ("world_size", "ValueError", "plan is for 3 ranks"),
    ("different_plans", "ValueError", "ranks hold different plans"),
    ("different_models", "ValueError", "ranks hold different models"),
    ("optimizer_instance", "TypeError", "not an optimizer instance"),
    ("short_batch", "ValueError", "rank 1 got 1 samples, its plan slice is 2"),
    ("ragged_batch", "ValueError", "disagree on the number of samples"),
    ("vector_loss", "ValueError", "scalar tensor"),
])
def test_every_rank_gets_a_clear_error(scenario, error, words):
    for rank, out in enumerate(outcomes()):
        assert out[scenario] is not None, f"rank {rank} raised nothing for {scenario}"
        kind, message = out[scenario]
        assert kind == error and words in message, (rank, kind, message)


def test_engine_still_trains_after_rejected_input():
    losses = [out["still_trains"] for out in outcomes()]
    assert losses[0] == losses[1] > 0


@pytest.mark.paced
def test_a_stalled_rank_gives_a_timeout_not_a_hang():
    (err0, waited0), _ = spawn(stalled_rank, 2, 8.0, timeout_s=60, collective_timeout_s=3)
    assert err0 is not None, "rank 0 should have timed out waiting for rank 1"
    assert waited0 < 8.0, f"rank 0 waited {waited0:.1f} s, longer than rank 1's stall"
