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
