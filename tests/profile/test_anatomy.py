"""The step anatomy: where a step's compute falls between its collectives, measured on the device's clock."""

import warnings

import pytest

from poplar.processes.spawn import spawn
from poplar.profile.anatomy import Marks
from poplar.profile.profile import StageProfile, StepAnatomy
from tests.profile.workers import anatomy_at

CLUSTER = {"devices": [{"kind": "a100", "gpu": "A100-80GB"}, {"kind": "t4", "gpu": "T4-16GB"}]}
SLOW = 40   # a pace (declared time x this) at which this host keeps up with these steps when quiet


@pytest.mark.slow
@pytest.mark.paced     # the shares are read from the emulated pace: a host late beside another test reads as its own
@pytest.mark.parametrize("stage", [0, 1, 3])
def test_a_step_s_compute_is_placed_unit_by_unit(stage):
    for dilation in (None, 2 * SLOW, 4 * SLOW):   # a run the host made late (overruns) measures the host: again,
        results = spawn(anatomy_at, 2, CLUSTER, stage, [8, 4], dilation, timeout_s=240)   # at a slower pace
        if all(r["overruns"] == 0 for r in results):
            break
    else:   # a host late at every pace (a span's real start-up past 2 ms, whatever the pace): the shares still hold
        warnings.warn(f"the host ran late at every pace tried ({[r['overruns'] for r in results]} overruns)")
    ranks = [StepAnatomy.model_validate(r["anatomy"]) for r in results]
    for a, m in zip(ranks, (8, 4)):
        assert a.micro_batch == m
        assert sum(a.forward) + sum(a.backward) + a.root_middle == pytest.approx(1.0, abs=0.02)
        layers = range(1, len(a.forward))
        assert len(layers) >= 2 and all(a.backward[i] > a.forward[i] > 0 for i in layers)
        # the root: its embeddings before the layers, the head and loss between, the embeddings' gradient after
        assert a.forward[0] > 0 and a.root_middle > 0 and a.backward[0] > 0
        assert a.before_loss_s > 0
        # the gradient norm's all-reduce comes only where the gradients are sharded
        assert (a.before_norm_s > 0) == (stage > 0)
        # only ZeRO-1/2 gather the parameters after the update, each later unit's slice cast before its launch
        assert (a.gather_issue_s > 0) == (stage == 1) and a.gather_copy_s >= 0
        # after the root's gradient collective, each reduction is waited for and finished in turn: a reduce-scatter's
        # shard copied out (an all-reduce sums in place: nothing to finish)
        assert (a.between_waits_s > 0) == (stage > 0) and a.before_waits_s + a.between_waits_s <= a.before_loss_s
    # the T4 is the slower device: the same work takes it longer, in seconds
    assert ranks[1].before_loss_s > ranks[0].before_loss_s


def test_shares_between_the_measured_sizes_are_interpolated():
    def anatomy(m, middle):
        return StepAnatomy(micro_batch=m, forward=[0.1, 0.2], backward=[0.1, 0.6 - middle], root_middle=middle,
                           before_loss_s=m * 1e-6, before_norm_s=0.0)
    sp = StageProfile(max_micro_batch=64, state_bytes=0, points=[(1, 1.0)], anatomy=[anatomy(4, 0.2), anatomy(64, 0.1)])
    mid = sp.anatomy_at(34)
    assert mid.root_middle == pytest.approx(0.15) and mid.before_loss_s == pytest.approx(34e-6)
    assert sp.anatomy_at(1).root_middle == pytest.approx(0.2) and sp.anatomy_at(200).root_middle == pytest.approx(0.1)
    assert StageProfile(max_micro_batch=1, state_bytes=0).anatomy_at(1) is None


def _marks(launch_before_inputs: float) -> Marks:
    """Marks of a step of two layers (1 then 2), each layer's gradient collective issued ``launch_before_inputs``
    seconds before its inputs' gradient is in (its parameters' gradients come first)."""
    marks = Marks(None)
    marks.at = {("forward", 1): 1.0, ("forward_end", 1): 2.0, ("forward", 2): 2.0, ("forward_end", 2): 3.0,
                ("backward", 2): 4.0, ("backward_end", 2): 6.0, ("backward", 1): 6.0, ("backward_end", 1): 8.0}
    marks.launches = [("all_reduce", 16, 0.0),                          # the batch check, as the step starts
                      ("reduce_scatter", 4096, 6.0 - launch_before_inputs),
                      ("reduce_scatter", 4096, 8.0 - launch_before_inputs),
                      ("reduce_scatter", 2048, 9.0),                    # the root's, after its own backward
                      ("all_reduce", 4, 9.5), ("all_reduce", 4, 9.75),   # the loss, the norm
                      ("all_gather", 4096, 10.0), ("all_gather", 4096, 10.25), ("all_gather", 2048, 10.75)]
    marks.at[("end", 0)] = 11.5
    marks.waits = [3.5, 9.1, 9.2, 9.4]    # one during the backward; then the three reductions' after the root's
    return marks


@pytest.mark.parametrize("early", [0.0, 0.5, 1.5])
def test_a_unit_s_backward_ends_where_its_gradient_collective_is_issued(early):
    a = _marks(early).anatomy(3, 4)
    seconds = [s * 9.0 for s in a.backward]   # shares of the micro-step, up to the root's collective at 9
    # the last layer from its backward's start to its collective, the first from there to its own; the root the rest
    assert seconds == pytest.approx([1.0 + early, 2.0, 2.0 - early])
    assert sum(a.forward) + sum(a.backward) + a.root_middle == pytest.approx(1.0)
    assert (a.before_loss_s, a.before_norm_s) == pytest.approx((0.5, 0.25))
    # of the 0.5 before the loss's all-reduce: 0.1 before the first wait, 0.3 between the first and the last
    assert (a.before_waits_s, a.between_waits_s) == pytest.approx((0.1, 0.3))


def test_the_parameter_gathers_own_work_is_read_between_their_launches_and_after_the_last():
    marks = _marks(0.0)
    assert marks.gather_phase() == pytest.approx((0.75, 0.75))   # the gathers launched 10-10.75, the end at 11.5
    a = marks.anatomy(3, 4)
    assert (a.gather_issue_s, a.gather_copy_s) == pytest.approx((0.75, 0.75))
    del marks.at[("end", 0)]       # a step whose end was not marked: nothing read
    assert marks.gather_phase() == (0.0, 0.0)
    marks = _marks(0.0)
    marks.launches = [op for op in marks.launches if op[0] != "all_gather"]   # ZeRO-0/3: no gathers after the norm
    assert marks.gather_phase() == (0.0, 0.0)
