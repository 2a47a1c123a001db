import time

import pytest

from poplar.processes.spawn import RankFailed, spawn
from tests.processes.spawn_workers import abort_at_exit, fail_on_rank_1, hang_on_rank_0, rank_sum

pytestmark = pytest.mark.slow


def test_results_come_back_in_rank_order():
    assert spawn(rank_sum, 3) == [(0, 6.0), (1, 6.0), (2, 6.0)]


def test_a_failing_rank_reports_its_own_traceback():
    with pytest.raises(RankFailed, match="rank 1 failed") as e:
        spawn(fail_on_rank_1, 2, timeout_s=60)
    assert "KeyError" in str(e.value) and "rank one is broken" in str(e.value)


@pytest.mark.paced
def test_a_hanging_rank_is_stopped_at_the_deadline():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="did not finish within 8 s"):
        spawn(hang_on_rank_0, 2, timeout_s=8)
    assert time.monotonic() - start < 30


def test_a_rank_dying_after_it_returned_is_not_a_failure():
    assert spawn(abort_at_exit, 2, timeout_s=60) == [0, 2]
