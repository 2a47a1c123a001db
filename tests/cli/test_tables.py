"""The commands' tables, drawn from the plain rows the modules below return: a plan's, a profile's."""

import doctest
import io

from rich.console import Console

import poplar.cli.tables
from poplar.cli.tables import allocations_table, profile_table, stage_table
from poplar.planner import make_plan
from poplar.planner.report import allocation_rows, rank_rows
from poplar.profile.report import profile_rows
from tests.planner.profiles import make_profile

# two fast cards and a slow one that holds no sample in stage 0
PROFILE = make_profile({"fast": (2, 0.01, 0.002, 16), "slow": (1, 0.02, 0.004, 8)}, stages=(0, 1),
                       max_by_stage={"slow": {0: 0}})


def _drawn(table) -> str:
    out = io.StringIO()
    Console(file=out, width=250).print(table)
    return out.getvalue()


def test_a_plan_s_rows_are_values_and_its_tables_show_them():
    result = make_plan(PROFILE, 40, (0, 1))
    ranks = rank_rows(result, result.chosen)    # ranks of one kind and the same work together: "0-1"
    assert sum(r.samples * r.count for r in ranks) == 40 and {r.kind for r in ranks} <= {"fast", "slow"}
    rows = allocation_rows(result)
    chosen = [r for r in rows if r.chosen]
    assert len(chosen) == 1 and chosen[0].name == "poplar" and chosen[0].samples_per_s == result.predicted.samples_per_s
    assert all(r.of_ideal == 1.0 for r in rows if r.name == "ideal")
    drawn = _drawn(allocations_table(result))
    assert f"{chosen[0].stage}*" in drawn and "predicted throughput, global batch 40" in drawn
    assert "(chosen): Poplar's plan" in _drawn(stage_table(result, result.chosen))


def test_a_profile_s_rows_say_where_each_came_from():
    rows = profile_rows(PROFILE, {"from_cache": [("fast", 0)]})
    assert [(r.kind, r.stage, r.note.split(":")[0]) for r in rows][:2] == [("fast", 0, "cache"), ("fast", 1, "measured")]
    slow0 = next(r for r in rows if (r.kind, r.stage) == ("slow", 0))
    assert slow0.max_micro_batch == 0
    drawn = _drawn(profile_table(rows, "the profile"))
    assert "the profile" in drawn and "cache" in drawn and "measured" in drawn


def test_the_module_s_examples():
    failed, tried = doctest.testmod(poplar.cli.tables)
    assert tried and not failed


def test_ranks_listed_kinds_in_turn_read_as_the_same_rows_as_ranks_listed_kind_by_kind():
    """One entry a node with the kinds in turn, or one entry a kind: the same rows (one a kind and work), only
    the ranks named otherwise."""
    blocked = make_profile({"fast": (8, 0.01, 0.002, 16), "slow": (8, 0.02, 0.004, 8)}, stages=(1,))
    in_turn = blocked.model_copy(update={"ranks": [("fast", "slow")[(r // 2) % 2] for r in range(16)]})
    rows = {}
    for name, profile in (("blocked", blocked), ("in turn", in_turn)):
        result = make_plan(profile, 96, (1,))
        rows[name] = rank_rows(result, result.chosen)
        assert sum(r.samples * r.count for r in rows[name]) == 96
    assert [r[1:] for r in rows["blocked"]] == [r[1:] for r in rows["in turn"]]
    assert [r.label for r in rows["blocked"]] == ["0-7", "8-15"]
    assert [r.label for r in rows["in turn"]] == ["0-1, 4-5, ..., 12-13 (8 ranks in 4 runs)",
                                                  "2-3, 6-7, ..., 14-15 (8 ranks in 4 runs)"]

