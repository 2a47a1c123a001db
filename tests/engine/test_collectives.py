"""Which collectives a step issues, in what order, on how many bytes: every stage, with and without accumulation.

A counting Comm (:class:`tests.engine.workers.CountingComm`) records every collective the
engine issues over real gloo ranks, and each micro-step's start (its ``loss_fn`` call).
The expected sequences (:func:`tests.helpers.collectives.expected_step`) are written from the
units' padded sizes and the schedule each stage promises, so a collective added, dropped,
resized or moved fails the test:

- every step: the local batch sizes all-reduced (8 bytes a rank), then per stage; after
  the micro-steps the loss all-reduced, and where gradients are sharded the squared norm;
- gradient buckets are fp32 and reduced in reverse unit order (as backward finishes them);
- stage 0: an all-reduce per unit in a rank's last micro-step only;
- stage 1: a reduce-scatter per unit in the last micro-step, the parameters all-gathered after the update;
- stage 2: a reduce-scatter per unit every micro-step, the parameters all-gathered after the update;
- stage 3: the root gathered before each micro-step; each other unit gathered for its forward
  and again for its backward (the next one prefetched), a reduce-scatter per unit every micro-step.

Hybrid plans (shard groups of three ranks and one) issue the same schedule inside the
group, every unit padded to the group's size; in the step's last micro-step each unit's
shard is then summed across the groups (``reduce_across``, its unpadded bytes) as soon as
its reduce-scatter is waited for (stages 2-3: when a third bucket is in flight; stages 0-1:
at the end), and stage 0 gathers the summed shards back into the full gradient.
"""

import functools

import pytest
import torch

from poplar.engine.layout import ShardLayout
from poplar.processes.spawn import spawn
from tests.engine.workers import collectives_and_states, count_collectives
from tests.helpers.collectives import MODEL, WORLD, expected_step, unit_numels

CASES = {  # name: (plan, config); uneven micro-batches everywhere, ranks' accumulation differing where allowed
    "stage0-accum": ({"zero_stage": 0, "micro_batch_sizes": [1, 2], "accum_steps": [3, 2]}, {}),
    "stage0": ({"zero_stage": 0, "micro_batch_sizes": [3, 1], "accum_steps": [1, 1]}, {}),
    "stage1-accum": ({"zero_stage": 1, "micro_batch_sizes": [1, 2], "accum_steps": [3, 2]}, {}),
    "stage1": ({"zero_stage": 1, "micro_batch_sizes": [3, 1], "accum_steps": [1, 1]}, {}),
    "stage1-bf16": ({"zero_stage": 1, "micro_batch_sizes": [3, 1], "accum_steps": [1, 1]}, {"mixed_precision": "bf16"}),
    "stage2-accum": ({"zero_stage": 2, "micro_batch_sizes": [1, 2], "accum_steps": [2, 2]}, {}),
    "stage2": ({"zero_stage": 2, "micro_batch_sizes": [3, 1], "accum_steps": [1, 1]}, {}),
    "stage3-accum": ({"zero_stage": 3, "micro_batch_sizes": [1, 2], "accum_steps": [3, 3]}, {}),
    "stage3": ({"zero_stage": 3, "micro_batch_sizes": [3, 1], "accum_steps": [1, 1]}, {}),
    "stage3-bf16": ({"zero_stage": 3, "micro_batch_sizes": [1, 2], "accum_steps": [2, 2]}, {"mixed_precision": "bf16"}),
}


@functools.cache
def launched():
    return spawn(collectives_and_states, WORLD, list(CASES.values()), MODEL, timeout_s=180)


def counted():
    return {name: [r["counts"][i] for r in launched()] for i, name in enumerate(CASES)}


def padded_numels(ranks: int = WORLD) -> list[int]:
    return [-(-n // ranks) * ranks for n in unit_numels()]


HYBRID_WORLD, HYBRID_GROUPS = 4, [[0, 1, 2], [3]]
HYBRID = {  # name: plan
    f"hybrid-stage{st}": {"zero_stage": st, "micro_batch_sizes": [1, 2, 1, 3], "accum_steps": acc,
                          "shard_groups": HYBRID_GROUPS}
    for st, acc in ((0, [3, 2, 1, 2]), (1, [2, 1, 3, 1]), (2, [2, 2, 2, 2]), (3, [2, 2, 2, 2]))}


@functools.cache
def hybrid_counted():
    runs = spawn(count_collectives, HYBRID_WORLD, [(p, {}) for p in HYBRID.values()], MODEL, timeout_s=180)
    return {name: [r[i] for r in runs] for i, name in enumerate(HYBRID)}


@pytest.mark.slow
@pytest.mark.parametrize("name", HYBRID)
def test_a_hybrid_step_issues_the_stages_collectives_in_its_group_and_one_sum_across(name):
    plan = HYBRID[name]
    for rank, run in enumerate(hybrid_counted()[name]):
        layout = ShardLayout(HYBRID_WORLD, HYBRID_GROUPS, rank)
        expected = expected_step(plan["zero_stage"], plan["accum_steps"][rank], 4, layout)
        for step in run["steps"]:
            assert [tuple(c) for c in step] == expected, (name, rank)


@pytest.mark.slow
def test_the_units_are_the_models_blocks_and_root():
    for runs in counted().values():
        assert [r["padded_numels"] for r in runs] == [padded_numels()] * WORLD


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
def test_each_step_issues_exactly_the_stages_collectives(name):
    plan, config = CASES[name]
    itemsize = torch.finfo(torch.bfloat16 if config.get("mixed_precision") == "bf16" else torch.float32).bits // 8
    for rank, run in enumerate(counted()[name]):
        expected = expected_step(plan["zero_stage"], plan["accum_steps"][rank], itemsize)
        for step in run["steps"]:   # the first step (forward order not yet known) and a later one alike
            assert [tuple(c) for c in step] == expected, (name, rank)


@pytest.mark.slow
def test_ranks_issue_the_same_collectives_whatever_their_accumulation():
    for name, runs in counted().items():
        ops = [[tuple(c) for c in step if c[0] != "micro_step"] for run in runs for step in run["steps"]]
        assert all(o == ops[0] for o in ops), name


@pytest.mark.slow
def test_a_zero3_units_states_follow_its_backward():
    """(parameters, gradient) of units 0-3 as each unit's backward finishes: the one done is READY and still
    gathered; the one before it is being prefetched; at most two reduce-scatters stay in flight."""
    G, S, U = "gathering", "sharded", "unsharded"
    acc, ready, reducing, reduced = "accumulating", "ready", "reducing", "reduced"
    micro_step = [
        [(U, acc), (S, acc), (G, acc), (U, ready)],
        [(U, acc), (G, acc), (U, ready), (S, reducing)],
        [(U, acc), (U, ready), (S, reducing), (S, reducing)],
        [(U, ready), (S, reducing), (S, reducing), (S, reduced)],
    ]
    for rank in launched():
        states = rank["states"]
        assert [[tuple(u) for u in done] for done in states["unit_done"]] == micro_step * 2
        assert [tuple(u) for u in states["after_step"]] == [(S, reduced)] * 4


@pytest.mark.slow
def test_abandoning_a_gather_hands_its_work_over_and_stays_gathering_until_reset():
    for rank in launched():
        assert tuple(rank["states"]["abandoned"]) == ("gathering", 1)
        assert tuple(rank["states"]["reset"]) == ("sharded", "idle")


UNEVEN = {  # name: plan; a rank holding three quarters of the states, and one holding none
    f"uneven-stage{st}-{shares}": {"zero_stage": st, "micro_batch_sizes": [1, 2], "accum_steps": acc,
                                   "shard_shares": shares}
    for st, acc, shares in ((1, [3, 2], [3, 1]), (2, [2, 2], [3, 1]), (3, [2, 2], [3, 1]), (3, [1, 1], [0, 1]))}


@functools.cache
def uneven_counted():
    runs = spawn(count_collectives, WORLD, [(p, {}) for p in UNEVEN.values()], MODEL, timeout_s=180)
    return {name: [r[i] for r in runs] for i, name in enumerate(UNEVEN)}


@pytest.mark.slow
@pytest.mark.parametrize("name", UNEVEN)
def test_uneven_shares_issue_the_same_collectives_the_gathers_padded_to_the_largest_slice(name):
    plan = UNEVEN[name]
    for rank, run in enumerate(uneven_counted()[name]):
        layout = ShardLayout(WORLD, None, rank, plan["shard_shares"])
        expected = expected_step(plan["zero_stage"], plan["accum_steps"][rank], 4, layout)
        for step in run["steps"]:
            assert [tuple(c) for c in step] == expected, (name, rank)


@pytest.mark.parametrize("groups, shares, expected", [
    ([[0, 1], [2, 3], [4, 5]], None, [[0, 2, 4], [1, 3, 5]] * 3),
    ([[0, 1], [2, 3]], None, [None] * 4),                            # two groups: the exchange (one hop)
    ([[0, 1, 2], [3, 4, 5], [6, 7, 8]], None, [[0, 3, 6], [1, 4, 7], [2, 5, 8]] * 3),
    ([[0], [1], [2]], None, [[0, 1, 2]] * 3),
    ([[3, 1], [0, 2], [5, 4]], None, [[3, 0, 5], [1, 2, 4], [1, 2, 4], [3, 0, 5], [1, 2, 4], [3, 0, 5]]),
    ([[0, 1, 2], [3]], None, [None] * 4),                            # unlike groups: the exchange
    ([[0, 1], [2, 3], [4, 5]], [2, 1, 2, 1, 2, 1], [None] * 6),      # shares cut the slices unalike
    (None, None, [None] * 4),                                        # flat: nothing to sum across
])
def test_the_ranks_that_hold_a_slice_in_every_group(groups, shares, expected):
    world = len(expected)
    got = []
    for rank in range(world):
        layout = ShardLayout(world, groups, rank, shares)
        got.append(layout.counterparts)
        if layout.counterparts is not None:    # they hold the same range of the unit: the same slice
            assert len({ShardLayout(world, groups, r).shard_range(1000) for r in layout.counterparts}) == 1
    assert got == expected
