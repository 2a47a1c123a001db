"""A stage per shard group (``Plan.group_stages``): what it accepts, what it refuses and why, how it reads and
round-trips, and that a plan without it is unchanged."""

import json

import pytest

from poplar.plan import Plan

GROUPS = [[0, 1], [2, 3, 4]]


def mixed(**kw) -> Plan:
    args = {"zero_stage": 3, "micro_batch_sizes": [2, 1, 3, 3, 3], "accum_steps": [1, 3, 2, 2, 2],
            "shard_groups": GROUPS, "group_stages": [0, 3], **kw}
    return Plan(**args)


def test_each_group_runs_its_own_stage_and_the_plan_says_so():
    plan = mixed()
    assert plan.group_stages == (0, 3) and [plan.stage_of(r) for r in range(5)] == [0, 0, 3, 3, 3]
    assert plan.shape == "hybrid [0,1]z0 [2,3,4]z3"
    assert str(plan) == ("Plan(stage 3, hybrid [0,1]z0 [2,3,4]z3, global batch 23: "
                         "r0:2x1, r1:1x3, r2:3x2, r3:3x2, r4:3x2)")
    assert plan.summary() == ("stage 3 hybrid over 2 groups in stages 0,3, global batch 23 on 5 ranks: "
                              "micro-batch 1-3, accumulation 1-3")


def test_stages_follow_their_groups_in_the_plans_order():
    plan = Plan(2, [1, 1, 1], 1, shard_groups=[[2, 1], [0]], group_stages=[2, 1])
    assert plan.shard_groups == ((0,), (1, 2)) and plan.group_stages == (1, 2)
    assert [plan.stage_of(r) for r in range(3)] == [1, 2, 2]


def test_alike_stages_are_a_plain_plan():
    plain = Plan(1, [1, 1, 1], 1, shard_groups=[[0], [1, 2]])
    same = Plan(1, [1, 1, 1], 1, shard_groups=[[0], [1, 2]], group_stages=[1, 1])
    assert same == plain and same.group_stages is None and "group_stages" not in same.to_dict()
    assert same.shape == "hybrid [0][1,2]" and same.same_shape(plain)
    assert not mixed().same_shape(mixed(group_stages=[1, 3])) and mixed().same_shape(mixed(accum_steps=2))


@pytest.mark.parametrize("kw, says", [
    ({"shard_groups": None}, "give shard_groups too"),
    ({"group_stages": [0, 3, 3]}, "one ZeRO stage per shard group (2 of them)"),
    ({"group_stages": "03"}, "one ZeRO stage per shard group"),
    ({"group_stages": [0, 4], "zero_stage": 3}, "group_stages[1] = 4: choose one of 0, 1, 2, 3"),
    ({"group_stages": [True, 3]}, "group_stages[0] = True"),
    ({"group_stages": [0, 2]}, "set zero_stage to 2"),
    ({"group_stages": [1, 1], "zero_stage": 3}, "set zero_stage to 1"),
    ({"accum_steps": [1, 3, 2, 1, 2]}, "shard group [2, 3, 4] is in ZeRO stage 3"),
    ({"shard_shares": [1, 2, 1, 1, 1]}, "shard group [0, 1] is in ZeRO stage 0, which shards nothing"),
])
def test_refusals_say_what_to_change(kw, says):
    with pytest.raises(ValueError, match=".*") as e:
        mixed(**kw)
    assert says in str(e.value) and "\n" not in str(e.value)


def test_equal_accumulation_only_inside_a_group_that_needs_it():
    assert mixed(group_stages=[2, 1], zero_stage=2, accum_steps=[2, 2, 1, 3, 2]).accum_steps == (2, 2, 1, 3, 2)
    with pytest.raises(ValueError, match=r"shard group \[0, 1\] is in ZeRO stage 2"):
        mixed(group_stages=[2, 1], zero_stage=2, accum_steps=[1, 2, 1, 1, 1])
    # a plan of one stage keeps its rule for every rank, as it always had
    with pytest.raises(ValueError, match="every rank must run the same number"):
        mixed(group_stages=None, accum_steps=[1, 1, 2, 2, 2])


def test_shares_beside_a_replicating_group():
    plan = mixed(shard_shares=[1, 1, 3, 1, 0])
    assert plan.shard_shares == (1, 1, 3, 1, 0) and plan.with_shard_shares(None).group_stages == (0, 3)


def test_round_trip_and_copies_keep_it(tmp_path):
    plan = mixed()
    assert Plan.from_json(plan.to_json()) == plan and plan.to_dict()["group_stages"] == [0, 3]
    plan.save(tmp_path / "p.json")
    assert Plan.load(tmp_path / "p.json") == plan
    lowered = plan.lower_micro_batch(2, 2)
    assert lowered.group_stages == (0, 3) and lowered.accum_steps[2:] == (3, 3, 3)
    assert lowered.accum_steps[:2] == (1, 3) and lowered.global_batch_size == plan.global_batch_size
    even = mixed(accum_steps=2)   # other groups: the stages are the plan's unless given again
    assert even.with_shard_groups([[0], [1, 2, 3, 4]]).group_stages is None
    assert even.with_shard_groups(GROUPS, [1, 3]).group_stages == (1, 3)


def test_an_old_plan_file_loads_unchanged(tmp_path):
    old = {"zero_stage": 2, "micro_batch_sizes": [2, 1], "accum_steps": [1, 1], "local_batch_sizes": [2, 1],
           "shard_groups": [[0], [1]]}
    (tmp_path / "old.json").write_text(json.dumps(old))
    plan = Plan.load(tmp_path / "old.json")
    assert plan.group_stages is None and plan.to_dict() == old and [plan.stage_of(r) for r in (0, 1)] == [2, 2]
