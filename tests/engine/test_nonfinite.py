"""A NaN loss on one rank: every rank stops naming the step and the rank, or the step is skipped exactly."""

import pytest
import torch

import poplar
from poplar.processes.spawn import spawn
from tests.engine.workers import nonfinite_step, skip_and_leave_out

pytestmark = pytest.mark.slow

PLANS = [poplar.Plan.from_local_batches(1, [5, 3], [2, 1]), poplar.Plan.from_local_batches(3, [4, 4], 2)]


def test_a_nan_loss_stops_every_rank_naming_the_step_and_rank():
    ranks = spawn(nonfinite_step, 2, PLANS[1].to_dict(), "raise", 1, 2, 4, timeout_s=120)
    for r in ranks:
        message, step, culprits = r["raised"]
        assert (step, culprits, r["steps"]) == (3, [1], 2)      # steps 1 and 2 applied, the third not
        assert message.startswith("step 3: the loss is non-finite on rank 1;") and "on_nonfinite" in message
    assert all(torch.isfinite(v).all() for v in ranks[0]["state"].values())


@pytest.mark.parametrize("plan", PLANS, ids=["stage1", "stage3"])
def test_a_skipped_step_leaves_the_parameters_as_if_it_never_was(plan):
    skipped, without = spawn(skip_and_leave_out, 2, plan.to_dict(), timeout_s=120)[0]
    assert (skipped["skipped"], skipped["steps"], skipped["raised"]) == (1, 2, None)
    assert (without["skipped"], without["steps"]) == (0, 2)
    for key, value in without["state"].items():
        torch.testing.assert_close(skipped["state"][key], value, atol=1e-7, rtol=0, msg=key)
