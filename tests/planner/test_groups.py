"""Shard groups of several nodes: which the planner weighs, their collectives, and the update of a larger shard."""

import itertools

import pytest

from poplar.cluster.spec import parse_cluster
from poplar.models.workload import Workload
from poplar.planner.cost import CostModel
from poplar.planner.groups import group_sizes, groups_shape, kind_shapes, sized_shape, spanning_comm
from poplar.planner.events import Issue
from poplar.planner.replan import PlanBasis
from poplar.planner.search import allocate
from poplar.planner.shape import node_shape, shaped_stage
from poplar.planner.shares import UPDATE_PASSES
from poplar.profile.options import ProfileOptions
from poplar.profile.profile import CommProfile, StageProfile
from poplar.simulate import simulate_profile
from poplar.stages import stage as zero_stage

LAB = {"memory_scale": 0.003,
       "network": {"intra_node": {"bandwidth_gbs": 100, "latency_us": 3},
                   "inter_node": {"bandwidth_gbs": 12.5, "latency_us": 5}},
       "devices": [{"kind": "a100-80gb", "gpu": "A100-80GB", "count": 4, "gpus_per_node": 2},
                   {"kind": "v100-16gb", "gpu": "V100-16GB", "count": 8, "gpus_per_node": 2}]}


@pytest.fixture(scope="module")
def lab():
    wl = Workload(model="llama-small", seq_len=64, vocab_size=1024)
    return simulate_profile(wl, parse_cluster(LAB), ProfileOptions(stages=(1, 3), max_micro_batch=64, n_points=3))


def test_a_kind_whose_node_cannot_hold_the_states_gets_groups_of_several_nodes(lab):
    """On one node a group the V100s hold no sample; the shapes weighed give them two nodes (or more) a group, the
    A100s one node where sized to each kind, and every group is whole nodes of one kind."""
    every = list(range(lab.world_size))
    nodes = CostModel(lab, 3, every, shaped=True)
    assert not nodes.kinds["v100-16gb"].fits() and nodes.kinds["a100-80gb"].fits()
    shapes = kind_shapes(lab, every, 3)
    assert "2 nodes a group" in shapes and "1-2 nodes a group" in shapes
    node_of = {r: j for j, g in enumerate(lab.comm.shaped.groups) for r in g}
    for label, shape in shapes.items():
        cost = CostModel(lab, 3, every, shape=shape)
        assert all(kc.fits() for kc in cost.kinds.values()), label
        for g in shape.groups:
            assert len({lab.ranks[r] for r in g}) == 1 and len(g) == 2 * len({node_of[r] for r in g})
    sized = shapes["1-2 nodes a group"].groups
    assert sorted(map(len, sized)) == [2, 2, 4, 4]


@pytest.mark.parametrize("stage", [1, 3])
def test_a_plans_groups_alone_give_its_shape_back_and_a_run_replans_it(lab, stage):
    """A run keeps only its plan: the groups of every shape weighed are priced again from the plan's groups (the
    same collectives, the same prediction), and the re-planner predicts and re-splits such a plan in its shape (it
    priced every hybrid plan by node, and refused one of several nodes a group). A group that splits a node has none."""
    every = list(range(lab.world_size))
    for label, shape in kind_shapes(lab, every, stage).items():
        cost = CostModel(lab, stage, every, shape=shape)
        plan = allocate(cost, 96).with_shard_groups(cost.shard_groups)
        again = groups_shape(lab, every, plan.shard_groups)
        assert again == shape, label
        basis = PlanBasis(lab, every)
        assert basis.predict(plan).step_s == pytest.approx(cost.predict(plan).step_s, rel=1e-12), label
        found, predicted = basis.replan(plan, [2.0] + [1.0] * (lab.world_size - 1))
        assert found.shard_groups == plan.shard_groups and predicted.step_s <= basis.predict(plan, [2.0] + [1.0] * (
            lab.world_size - 1)).step_s, label
    assert groups_shape(lab, every, [[0], [1, 2, 3], list(range(4, lab.world_size))]) is None


def test_sized_groups_are_whole_nodes_a_remainder_joining_the_last_group(lab):
    every = list(range(lab.world_size))
    shape = sized_shape(lab, every, {"a100-80gb": 1, "v100-16gb": 3})    # four V100 nodes: one group of 3+1
    assert sorted(map(len, shape.groups)) == [2, 2, 8]
    assert [list(g) for g in shape.groups] == sorted(shape.groups, key=lambda g: g[0])


@pytest.mark.parametrize("need, nodes", [({"a": 1, "b": 2}, {"a": 2, "b": 4}), ({"a": 3}, {"a": 4}),
                                         ({"a": 1, "b": 1}, {"a": 3, "b": 3}), ({"a": 2, "b": 5}, {"a": 9, "b": 5})])
def test_the_group_sizes_weighed(need, nodes):
    sizes = group_sizes(need, nodes)
    if max(need.values()) == 1:
        assert sizes == {}
        return
    for per_kind in sizes.values():
        assert all(need[k] <= n <= nodes[k] for k, n in per_kind.items())    # each holds a copy, within its nodes
        assert sum(max(nodes[k] // n, 1) for k, n in per_kind.items()) >= 2  # never one group of them all
    alike = {k: min(max(need.values()), nodes[k]) for k in need}
    if sum(max(nodes[k] // n, 1) for k, n in alike.items()) >= 2:    # (else one group of them all: flat)
        assert alike in sizes.values()
    assert len(set(map(str, sizes.values()))) == len(sizes)


def test_a_group_of_several_nodes_collectives_cross_the_slow_link_over_fewer_ranks():
    flat = CommProfile(numel=1000, all_reduce_s=2.0, reduce_scatter_s=1.0, all_gather_s=1.0,
                       latency_s={"all_reduce": 0.2, "reduce_scatter": 0.1, "all_gather": 0.1},
                       between_s={"all_gather": [(100, 0.3)]})
    for g in (2, 4, 16, 64):
        out = spanning_comm(flat, g, 64)
        ring = ((g - 1) / g) / (63 / 64)
        assert out.all_gather_s == pytest.approx(0.1 * (g - 1) / 63 + 0.9 * ring)
        assert out.latency_s["all_reduce"] == pytest.approx(0.2 * (g - 1) / 63)
        assert out.between_s["all_gather"][0][0] == 100
    assert spanning_comm(flat, 64, 64) is flat


@pytest.mark.parametrize("stage_n, group, world", itertools.product((1, 2, 3), (8, 16), (64, 4096)))
def test_a_larger_shard_s_update_reads_and_writes_its_bytes_at_the_memory_bandwidth(stage_n, group, world):
    """Without ZeRO-0 profiled, the update of a group's shard is the flat one's plus the larger shard's bytes twice
    at the card's bandwidth (no longer N/n times the flat update, mostly fixed costs at thousands of ranks)."""
    sp = StageProfile(max_micro_batch=8, state_bytes=10**9, points=[(1, 1.0), (8, 4.0)], per_step_s=0.05)
    n_params = 10**9
    out = shaped_stage(sp, stage=stage_n, n_params=n_params, world=world, group=group, capacity=80 * 2**30,
                       precision="fp16", bandwidth_gbs=2000.0)
    more = zero_stage(stage_n).sharded_bytes_per_param("fp16") * n_params * (1 / group - 1 / world)
    assert out.per_step_s == pytest.approx(0.05 + UPDATE_PASSES * more / 2000e9)
    unknown = shaped_stage(sp, stage=stage_n, n_params=n_params, world=world, group=group, capacity=80 * 2**30,
                           precision="fp16")
    assert unknown.per_step_s == pytest.approx(0.05 * world / group)


def test_the_profile_knows_each_kind_s_memory_bandwidth(lab):
    assert lab.devices["a100-80gb"].memory_bandwidth_gbs == 2039 and lab.devices["v100-16gb"].memory_bandwidth_gbs == 900
    assert node_shape(lab, list(range(lab.world_size))) is not None


def test_groups_in_their_own_stages_are_priced_each_in_its_own(lab):
    """Each kind's groups in their own stage (the A100s' in ZeRO-1 beside the V100s' in ZeRO-3): a rank gathers the
    parameters for every micro-step only in a ZeRO-3 group, after the update only in a ZeRO-1 group, every rank joins
    the norm's all-reduce (the engine's, where the stages differ), each kind is priced at its own stage, and the plan
    carries the groups' stages through a re-plan. Alike stages are the plain hybrid plan, to the bit."""
    every = list(range(lab.world_size))
    shape = kind_shapes(lab, every, 3)["1-2 nodes a group"]
    kinds = [lab.ranks[g[0]] for g in shape.groups]
    stages = [1 if k == "a100-80gb" else 3 for k in kinds]
    mixed = CostModel(lab, 3, every, shape=shape, group_stages=stages)
    alike = CostModel(lab, 3, every, shape=shape)
    assert all(kc.fits() for kc in mixed.kinds.values())
    plan = mixed.shaped_plan(allocate(mixed, 96))
    assert list(plan.group_stages) == stages and plan.zero_stage == 3
    one = CostModel(lab, 1, every, shape=shape)
    assert mixed.kinds["a100-80gb@z1"].max_micro_batch == one.kinds["a100-80gb"].max_micro_batch
    assert mixed.kinds["v100-16gb@z3"].max_micro_batch == alike.kinds["v100-16gb"].max_micro_batch
    for j, g in enumerate(shape.groups):
        kc = mixed.kinds[mixed.rank_kinds[g[0]]]
        keys = [e.key for e in mixed.schedule.rank_events([(2, float(kc.g[2]))] * 2, kc, j) if isinstance(e, Issue)]
        assert any(".g" in k for k in keys) == (stages[j] == 3)             # gathered for each micro-step
        assert any(".p" in k for k in keys) == (stages[j] == 1)             # gathered after the update
        assert "norm" in keys
    basis = PlanBasis(lab, every)
    assert basis.predict(plan).step_s == pytest.approx(mixed.predict(plan).step_s, rel=1e-12)
    found, _ = basis.replan(plan, [2.0] + [1.0] * (lab.world_size - 1))
    assert found.group_stages == plan.group_stages
    same = CostModel(lab, 3, every, shape=shape, group_stages=[3] * len(shape.groups))
    flat_plan = allocate(alike, 96).with_shard_groups(shape.groups)
    assert same.group_stages is None and same.predict(flat_plan).step_s == alike.predict(flat_plan).step_s
    with pytest.raises(ValueError, match="one a shard group, the highest"):
        CostModel(lab, 3, every, shape=shape, group_stages=[1] * len(shape.groups))
