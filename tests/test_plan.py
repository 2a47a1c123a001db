import json

import numpy as np
import pytest

from poplar import Plan


def test_global_batch_and_sample_ranges_are_consecutive():
    plan = Plan(zero_stage=1, micro_batch_sizes=[1, 2, 3], accum_steps=[3, 2, 1])
    assert plan.global_batch_size == 3 + 4 + 3
    assert [plan.sample_range(r) for r in range(3)] == [(0, 3), (3, 7), (7, 10)]
    assert plan.local_batch_sizes == (3, 4, 3)


def test_single_accum_count_applies_to_every_rank():
    plan = Plan(3, [5, 1], 4)
    assert plan.accum_steps == (4, 4)
    assert plan.global_batch_size == 24


def test_json_round_trip_and_file(tmp_path):
    plan = Plan(2, [4, 2, 1], [2, 2, 2])
    assert Plan.from_json(plan.to_json()) == plan
    assert json.loads(plan.to_json()) == {"zero_stage": 2, "micro_batch_sizes": [4, 2, 1], "accum_steps": [2, 2, 2],
                                          "local_batch_sizes": [8, 4, 2]}
    # a plan written without local_batch_sizes (micro-batches all full) still loads
    assert Plan.from_json('{"zero_stage": 2, "micro_batch_sizes": [4, 2, 1], "accum_steps": [2, 2, 2]}') == plan
    plan.save(tmp_path / "plan.json")
    assert Plan.load(tmp_path / "plan.json") == plan


@pytest.mark.parametrize("kwargs, words", [
    (dict(zero_stage=4, micro_batch_sizes=[1], accum_steps=[1]), "choose one of 0, 1, 2, 3"),
    (dict(zero_stage=True, micro_batch_sizes=[1], accum_steps=[1]), "choose one of 0, 1, 2, 3"),
    (dict(zero_stage=0, micro_batch_sizes=[2, 0], accum_steps=[1, 1]), "micro_batch_sizes[1] = 0"),
    (dict(zero_stage=0, micro_batch_sizes=[2, -1], accum_steps=[1, 1]), "micro_batch_sizes[1] = -1"),
    (dict(zero_stage=0, micro_batch_sizes=[2, 1.5], accum_steps=[1, 1]), "positive integer"),
    (dict(zero_stage=0, micro_batch_sizes=[2, True], accum_steps=[1, 1]), "micro_batch_sizes[1] = True"),
    (dict(zero_stage=0, micro_batch_sizes=[2, 2], accum_steps=[np.int64(1), 1]), "accum_steps[0] = np.int64(1)"),
    (dict(zero_stage=0, micro_batch_sizes=[], accum_steps=[]), "empty"),
    (dict(zero_stage=0, micro_batch_sizes=[1, 1], accum_steps=[0, 1]), "accum_steps[0] = 0"),
    (dict(zero_stage=0, micro_batch_sizes=[1, 1], accum_steps=[1, 1, 1]), "exactly one of each per rank"),
    (dict(zero_stage=2, micro_batch_sizes=[1, 1], accum_steps=[1, 2]), "same number of accumulation steps"),
    (dict(zero_stage=3, micro_batch_sizes=[1, 1], accum_steps=[2, 1]), "use zero_stage 0 or 1"),
    (dict(zero_stage=0, micro_batch_sizes="12", accum_steps=[1]), "list of positive integers"),
    (dict(zero_stage=1, micro_batch_sizes=[1, 1, 1], shard_groups=[[0, 1]]), "each rank in exactly one"),
    (dict(zero_stage=1, micro_batch_sizes=[1, 1, 1], shard_groups=[[0, 1], [1, 2]]), "each rank in exactly one"),
    (dict(zero_stage=1, micro_batch_sizes=[1, 1, 1], shard_groups=[[0, 1, 2], []]), "non-empty groups"),
    (dict(zero_stage=1, micro_batch_sizes=[1, 1], shard_groups=[[0], [5]]), "ranks 0..1"),
    (dict(zero_stage=1, micro_batch_sizes=[1, 1], shard_groups=[[0], ["x"]]), "ranks 0..1"),
    (dict(zero_stage=1, micro_batch_sizes=[1, 1], shard_groups=[[0], [1.5]]), "ranks 0..1"),
    (dict(zero_stage=1, micro_batch_sizes=[1, 1], shard_groups=3), "ranks 0..1"),
    (dict(zero_stage=0, micro_batch_sizes=[1, 1], shard_shares=[2, 1]), "stage 0 shards nothing"),
    (dict(zero_stage=1, micro_batch_sizes=[1, 1], shard_shares=[2]), "list of 2 numbers"),
    (dict(zero_stage=1, micro_batch_sizes=[1, 1], shard_shares=[2, -1]), "shard_shares[1] = -1"),
    (dict(zero_stage=2, micro_batch_sizes=[1, 1], shard_shares=[1, float("inf")]), "shard_shares[1] = inf"),
    (dict(zero_stage=3, micro_batch_sizes=[1, 1], shard_shares=[True, 1]), "shard_shares[0] = True"),
    (dict(zero_stage=3, micro_batch_sizes=[1, 1], shard_shares="21"), "one per rank"),
    (dict(zero_stage=1, micro_batch_sizes=[1, 1], shard_shares=[0, 0]), "give at least one of them a share"),
    (dict(zero_stage=1, micro_batch_sizes=[1, 1, 1], shard_groups=[[0], [1, 2]], shard_shares=[1, 0, 0]),
     "ranks [1, 2] hold one copy"),
])
def test_invalid_plans_say_what_to_change(kwargs, words):
    with pytest.raises(ValueError, match=None) as e:
        Plan(**kwargs)
    assert words in str(e.value)


def test_shard_groups_shape_the_plan_and_survive_json_and_replanning():
    plan = Plan.from_local_batches(2, [5, 3, 2], 2, shard_groups=[[2, 1], [0]])
    assert plan.shard_groups == ((0,), (1, 2)) and plan.shape == "hybrid [0][1,2]"
    assert Plan.from_json(plan.to_json()) == plan and "hybrid" in str(plan)
    assert plan.lower_micro_batch(0, 2).shard_groups == plan.shard_groups
    assert Plan(0, [1, 1], shard_groups=[[0], [1]]).shape == "two-level [0][1]"
    assert Plan(1, [1, 1], shard_groups=[[0, 1]]).shard_groups is None      # one group of every rank: flat
    assert "shard_groups" not in Plan(1, [1, 1]).to_dict()


def test_shard_shares_survive_json_and_replanning_and_equal_ones_are_the_even_layout():
    plan = Plan.from_local_batches(3, [6, 2], 2, shard_shares=[3, 1])
    assert plan.shard_shares == (3.0, 1.0) and plan.share_fractions == (0.75, 0.25)
    assert Plan.from_json(plan.to_json()) == plan and "shares 3:1" in str(plan) and "uneven shares" in plan.summary()
    assert plan.lower_micro_batch(0, 2).shard_shares == plan.shard_shares
    assert plan.with_shard_shares(None).shard_shares is None and "shard_shares" not in plan.with_shard_shares(None).to_dict()
    assert Plan(1, [1, 1], shard_shares=[0.5, 0.5]).shard_shares is None               # equal: the even layout
    assert Plan(1, [1, 1, 1], shard_groups=[[0], [1, 2]], shard_shares=[1, 2, 2]).shard_shares is None
    assert Plan(1, [1, 1, 1], shard_groups=[[0], [1, 2]], shard_shares=[1, 0, 2]).share_fractions == (1.0, 0.0, 1.0)
    assert Plan(1, [1, 1], shard_shares=[np.float64(2), 1]).shard_shares == (2.0, 1.0)


def test_near_equal_micro_batches_meet_any_local_batch():
    plan = Plan.from_local_batches(1, [37, 5, 1], [2, 1, 1])
    assert plan.micro_batch_sizes == (19, 5, 1)
    assert plan.micro_batches(0) == [19, 18] and plan.micro_batches(1) == [5]
    assert plan.global_batch_size == 43 and plan.sample_range(1) == (37, 42)
    assert not plan.is_exact and Plan(1, [2], [3]).is_exact
    assert Plan.from_json(plan.to_json()) == plan
    assert "r0:37<=19x2" in str(plan)
    assert Plan.from_local_batches(3, [7, 9, 3], 3).micro_batches(1) == [3, 3, 3]


@pytest.mark.parametrize("args, words", [
    ((1, [4, 2], [2, 1], [9, 2]), "set micro_batch_sizes[0] = 5"),
    ((1, [4, 2], [2, 1], [6, 2]), "set micro_batch_sizes[0] = 3"),
    ((1, [1, 2], [3, 1], [2, 2]), "give at least 3 samples"),
    ((1, [1, 2], [3, 1], [3]), "give exactly one of each per rank"),
    ((1, [1, 2], [3, 1], [3, 0]), "local_batch_sizes[1] = 0"),
])
def test_inconsistent_local_batches_say_what_to_change(args, words):
    with pytest.raises(ValueError) as e:
        Plan(*args)
    assert words in str(e.value)


def test_unequal_accumulation_is_allowed_where_the_stage_syncs_once():
    for stage in (0, 1):
        assert Plan(stage, [1, 2], [4, 1]).accum_steps == (4, 1)


def test_world_size_check_and_bad_json():
    plan = Plan(0, [1, 1, 1], 1)
    with pytest.raises(ValueError, match="plan is for 3 ranks .* but 2 were launched"):
        plan.check_world_size(2)
    with pytest.raises(ValueError, match="not valid JSON"):
        Plan.from_json("{zero_stage: 1")
    with pytest.raises(ValueError, match="missing \\['accum_steps'\\]"):
        Plan.from_json('{"zero_stage": 1, "micro_batch_sizes": [1]}')
    with pytest.raises(ValueError, match="rank 3 is outside"):
        plan.sample_range(3)


@pytest.mark.parametrize("given, stages", [("0,1,2,3", [0, 1, 2, 3]), ("3, 0,1", [0, 1, 3]), ([2, 2, 0], [0, 2]),
                                           ((1,), [1])])
def test_a_stage_list_is_read_once_for_every_command(given, stages):
    from poplar.stages import parse_stages

    assert parse_stages(given) == stages


@pytest.mark.parametrize("given", ["0,7", "", "1.5", "one", [], [True], [0, -1], None])
def test_a_stage_list_naming_no_stage_or_an_unknown_one_is_refused(given):
    from poplar.stages import parse_stages

    with pytest.raises(ValueError) as e:
        parse_stages(given)
    assert str(e.value) == f"choose stages from 0, 1, 2, 3, e.g. 0,1,2,3 (got {given!r})"


def test_the_stage_module_examples_run():
    import doctest

    import poplar.stages

    failed, tried = doctest.testmod(poplar.stages)
    assert tried > 0 and failed == 0
