"""A rank that gloo aborts in a mismatched collective is reported in one line: which rank, which collective,
how its peers sized it, and the plan (the flight record, poplar.engine.flight)."""

import pytest

from poplar.engine import flight
from poplar.processes.spawn import RankFailed, spawn
from tests.engine.flight_workers import mismatched_broadcast


@pytest.mark.slow
def test_a_rank_aborted_in_a_mismatched_collective_is_named_with_its_collective_and_plan():
    plan = {"zero_stage": 1, "micro_batch_sizes": [2, 1, 1], "accum_steps": [1, 1, 1], "shard_groups": [[0, 1], [2]]}
    with pytest.raises(RankFailed) as failed:
        spawn(mismatched_broadcast, 3, plan, timeout_s=60)
    line = failed.value.line
    assert failed.value.rank == 2 and "SIGABRT" in line, line
    assert "a collective mismatch" in line, line
    assert "broadcast of 40 bytes over the world" in line and "rank 0's" in line, line
    assert "broadcast of 48 bytes over the world" in line, line
    assert "plan: Plan(stage 1, hybrid [0,1][2]" in line, line


def test_the_record_keeps_the_plan_and_the_last_collectives(tmp_path):
    record = flight.FlightRecord(tmp_path, 0)
    record.note("plan: P")
    for i in range(10):
        record.record("all_reduce", i, (0, 1))
    note, issued = flight.read(tmp_path, 0)
    assert note == "plan: P"
    assert issued == [f"#{i + 1} all_reduce of {i} bytes over ranks [0, 1]" for i in range(10 - flight.KEPT, 10)]
    assert flight.read(tmp_path, 1) is None
    assert flight.mismatch_line(tmp_path, 1, 2) is None
    # a peer at the same collective with the same size: not called a mismatch
    other = flight.FlightRecord(tmp_path, 1)
    other.record("all_reduce", 9, (0, 1))
    assert flight.mismatch_line(tmp_path, 1, 2) == "rank 1 died in a collective: its #1 all_reduce of 9 bytes over ranks [0, 1]"
