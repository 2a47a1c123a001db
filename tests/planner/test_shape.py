"""Planning the shape: flat or hybrid (two-level in stage 0) over the nodes, by predicted step time."""

import pytest

from poplar.plan import Plan
from poplar.planner import make_plan
from poplar.planner.cost import CostModel
from poplar.profile.profile import CommProfile, ShapedComm
from tests.planner.profiles import make_profile

KINDS = {"big": (2, 0.008, 0.0015, 64), "small": (2, 0.025, 0.005, 16)}   # node 0: the bigs, node 1: the smalls
INSIDE = CommProfile(numel=1000, all_reduce_s=0.010, reduce_scatter_s=0.006, all_gather_s=0.004)


def _comm(flat_s: float, across_s: float) -> CommProfile:
    """Flat collectives ``flat_s`` times the inside ones; the sum across the nodes ``across_s``."""
    shaped = ShapedComm(groups=[[0, 1], [2, 3]], numel=1000, inside=[INSIDE, INSIDE], reduce_across_s=across_s)
    return CommProfile(numel=1000, all_reduce_s=0.010 * flat_s, reduce_scatter_s=0.006 * flat_s,
                       all_gather_s=0.004 * flat_s, shaped=shaped)


def test_a_shaped_step_follows_the_hybrid_schedule():
    """ZeRO-1 hybrid with no compute to speak of: the group's reduce-scatters back to back, each unit's sum across
    nodes once its own is waited for (one after another on the slow link), then the group's parameter gathers."""
    prof = make_profile({"k": (4, 0.0, 1e-9, 8)}, comm=_comm(1.0, 0.010))
    cost = CostModel(prof, 1, shaped=True)
    assert cost.shard_groups == [[0, 1], [2, 3]]
    step = cost.predict(Plan(1, [1, 1, 1, 1], 1)).step_s
    # reduce-scatters 1.8, 1.8, 2.4 ms (units of 300, 300, 400); sums 3, 3, 4 ms issued at 1.8, 3.6, 6.0 ms
    # hold the link from 1.8 to 11.8 ms; then the gathers, 4 ms. Before them, the batch check's all-reduce
    # (10 us: one element of the world's all-reduce), and after them the loss's and the norm's (waited for)
    assert step == pytest.approx(0.0158 + 3 * 10e-6, abs=1e-6)
    # the parts added once they are across (2.5 ms at the model's size: 0.75, 0.75 and 1 ms): each runs while the
    # next sum is on the link, all but the last
    comm = _comm(1.0, 0.010)
    comm.shaped.sum_s = 0.0025
    summed = CostModel(make_profile({"k": (4, 0.0, 1e-9, 8)}, comm=comm), 1, shaped=True)
    assert summed.predict(Plan(1, [1, 1, 1, 1], 1)).step_s == pytest.approx(step + 0.001, abs=1e-9)


def test_over_a_slow_link_the_planner_shapes_the_collectives_and_says_why():
    result = make_plan(make_profile(KINDS, comm=_comm(flat_s=50.0, across_s=0.002)), 96)
    assert result.plan.shard_groups == ((0, 1), (2, 3)) and result.chosen.shaped
    assert result.predicted.step_s == result.chosen.poplar.predicted.step_s
    flat = result.stages[result.stage].poplar.predicted
    assert result.predicted.step_s < flat.step_s
    assert "would expose" in result.reason and f"stage {result.stage} flat" in result.reason
    assert set(result.to_dict()["meta"]["shaped_stages"]) == {0, 1, 2, 3}


def test_over_a_fast_link_the_planner_keeps_them_flat():
    result = make_plan(make_profile(KINDS, comm=_comm(flat_s=1.0, across_s=0.5)), 96)
    assert result.plan.shard_groups is None and not result.chosen.shaped
    shaped = result.shaped[result.stage].poplar.predicted
    assert shaped.step_s > result.predicted.step_s and "would expose" in result.reason


def test_without_zero0_profiled_the_plan_says_its_hybrid_update_is_a_coarse_estimate():
    note = "ZeRO-0 not timed"
    assert note not in make_plan(make_profile(KINDS, comm=_comm(50.0, 0.002)), 96).reason
    result = make_plan(make_profile(KINDS, stages=(1, 3), comm=_comm(50.0, 0.002)), 96, stages=(1, 3))
    assert note in result.reason and "profile stage 0 too" in result.reason
    flat_only = make_plan(make_profile(KINDS, stages=(1,), comm=INSIDE), 96, stages=(1,))   # one node: no hybrid
    assert note not in flat_only.reason


def test_a_shaped_plan_holds_more_states_so_it_fits_fewer_samples():
    prof = make_profile(KINDS, comm=_comm(1.0, 0.01))
    prof.model.n_params = 2**26
    for kind in prof.devices.values():   # states a quarter of the 1 GiB flat, activations the rest at the limit
        for sp in kind.stages.values():
            sp.state_bytes = 2**28
    flat, shaped = CostModel(prof, 3), CostModel(prof, 3, shaped=True)
    # ZeRO-3 in fp32 shards 16 bytes a parameter: a half instead of a quarter of them is 256 MiB more, so
    # 512 MiB are left where 768 MiB held 64 (big) and 16 (small) samples
    assert {k: c.max_micro_batch for k, c in flat.kinds.items()} == {"big": 64, "small": 16}
    assert {k: c.max_micro_batch for k, c in shaped.kinds.items()} == {"big": 42, "small": 10}
    single = make_profile(KINDS, comm=INSIDE)
    with pytest.raises(ValueError, match="several nodes"):
        CostModel(single, 3, shaped=True)


@pytest.mark.parametrize("flat_s,across_s", [(50.0, 0.002), (1.0, 0.5), (5.0, 0.05)])
def test_the_ideal_bound_is_above_every_allocation_of_every_stage_and_shape(flat_s, across_s):
    result = make_plan(make_profile(KINDS, comm=_comm(flat_s, across_s), per_step=0.004), 96)
    for sp in [*result.stages.values(), *result.shaped.values()]:
        for alloc in sp.allocations.values():
            assert alloc.predicted.samples_per_s <= sp.ideal_samples_per_s * (1 + 1e-9), (sp.label, alloc.name)
    assert result.ideal_samples_per_s == max(sp.ideal_samples_per_s for sp in [*result.stages.values(),
                                                                               *result.shaped.values()])


def test_the_ideal_bound_charges_the_communication_a_slow_link_cannot_hide():
    """Over a link slower than all the compute, every allocation waits for the whole gradient's all-reduce:
    so does the bound (it used to charge only the root unit's), and Poplar's plan comes close to it."""
    result = make_plan(make_profile(KINDS, comm=_comm(flat_s=100.0, across_s=0.002)), 96, stages=(0,))
    flat = result.stages[0]
    whole_all_reduce_s = 100 * 0.010          # the model's 1000 parameters, in three units
    assert 96 / flat.ideal_samples_per_s > whole_all_reduce_s
    assert flat.poplar.predicted.samples_per_s >= 0.95 * flat.ideal_samples_per_s


def test_over_three_nodes_the_ideal_bound_weighs_each_node_s_links():
    kinds = {"big": (2, 0.008, 0.0015, 64), "mid": (2, 0.012, 0.003, 32), "small": (1, 0.025, 0.005, 16)}
    slow = CommProfile(numel=1000, all_reduce_s=0.05, reduce_scatter_s=0.03, all_gather_s=0.02)
    shaped = ShapedComm(groups=[[0, 1], [2, 3], [4]], numel=1000, inside=[INSIDE, slow, INSIDE],
                        reduce_across_s=0.004)
    comm = CommProfile(numel=1000, all_reduce_s=0.5, reduce_scatter_s=0.3, all_gather_s=0.2, shaped=shaped)
    result = make_plan(make_profile(kinds, comm=comm, per_step=0.002), 160)
    assert result.chosen.shaped and len(result.plan.shard_groups) == 3
    for sp in [*result.stages.values(), *result.shaped.values()]:
        for alloc in sp.allocations.values():
            assert alloc.predicted.samples_per_s <= sp.ideal_samples_per_s * (1 + 1e-9), (sp.label, alloc.name)


def test_the_ideal_bound_lets_a_node_with_slack_on_its_links_take_more():
    """Two nodes of one kind; the second's links are ten times slower, so its ZeRO-3 gathers stall it: a split
    that gives the first node more samples steps faster than the even one, and the bound is above both."""
    slow = CommProfile(numel=1000, all_reduce_s=0.10, reduce_scatter_s=0.06, all_gather_s=0.04)
    shaped = ShapedComm(groups=[[0, 1], [2, 3]], numel=1000, inside=[INSIDE, slow], reduce_across_s=0.002)
    comm = CommProfile(numel=1000, all_reduce_s=0.5, reduce_scatter_s=0.3, all_gather_s=0.2, shaped=shaped)
    prof = make_profile({"k": (4, 0.002, 0.001, 64)}, comm=comm)
    cost = CostModel(prof, 3, shaped=True)
    even = cost.predict(Plan.from_local_batches(3, [24, 24, 24, 24], [1] * 4).with_shard_groups(cost.shard_groups))
    leaning = cost.predict(Plan.from_local_batches(3, [40, 40, 8, 8], [1] * 4).with_shard_groups(cost.shard_groups))
    assert leaning.step_s < even.step_s
    from poplar.planner import ideal_samples_per_s
    assert ideal_samples_per_s(cost, 96) >= leaning.samples_per_s


def test_the_bound_s_tables_stop_where_no_rank_reaches_and_lose_nothing(monkeypatch):
    """The bound's tables go as far as any rank computes in its search, not to the whole batch: on three nodes
    of unlike kinds and links, the bound is the same as with tables over the whole batch."""
    from poplar.planner import bound
    kinds = {"big": (2, 0.008, 0.0015, 64), "mid": (2, 0.012, 0.003, 32), "small": (1, 0.025, 0.005, 16)}
    slow = CommProfile(numel=1000, all_reduce_s=0.05, reduce_scatter_s=0.03, all_gather_s=0.02)
    shaped = ShapedComm(groups=[[0, 1], [2, 3], [4]], numel=1000, inside=[INSIDE, slow, INSIDE],
                        reduce_across_s=0.004)
    comm = CommProfile(numel=1000, all_reduce_s=0.5, reduce_scatter_s=0.3, all_gather_s=0.2, shaped=shaped)
    prof = make_profile(kinds, comm=comm, per_step=0.002)
    capped = {}
    for stage in (0, 3):
        cost = CostModel(prof, stage, shaped=True)
        capped[stage] = bound.ideal_samples_per_s(cost, 4000)
        assert all(bound.most_within(kc, 1.0, 4000) < 4000 for kc in cost.kinds.values())   # capped here
    monkeypatch.setattr(bound, "most_within", lambda kc, seconds, global_batch: global_batch)
    for stage in (0, 3):
        assert bound.ideal_samples_per_s(CostModel(prof, stage, shaped=True), 4000) == pytest.approx(capped[stage],
                                                                                                    rel=1e-12)
