"""fp16 with dynamic loss scaling: the update one device computes with ``torch.amp.GradScaler``, skipped steps too.

Real processes over gloo; every ZeRO stage, uneven micro-batches, accumulation, shares
and shard groups. The loss scale starts at 2^16 and grows after every two good steps,
and a step run at 2^16 is made to overflow: the scale goes 2^16 (skipped), 2^15, 2^15,
2^16 (skipped)... so every case skips, backs off and grows several times.

The reference is one device with GradScaler on the whole global batch, run as the
plan's micro-batches (each rank's summed, then the ranks' sums): fp16 rounds each
backward's weight gradient once (to 11 significant bits), so a device that ran the
batch in one backward rounds other partial sums, and its larger sums overflow at scales
where the micro-batches' do not. The parameters must match that device to 1e-5 and
the scale step for step.
"""

import functools

import pytest
import torch

from poplar import Plan
from poplar.processes.spawn import spawn
from tests.engine.workers import fp16_cases
from tests.helpers.models import ORDER_TOLERANT_OPTIMIZER as OPTIMIZER, make_batches, reference_train_fp16

pytestmark = pytest.mark.slow

N_STEPS = 7
SCALER = {"init_scale": 2.0 ** 16, "growth_interval": 2}
OVERFLOW_FROM = 2.0 ** 16


def _plan(stage, mbs, acc, groups=None, shares=None):
    return {"zero_stage": stage, "micro_batch_sizes": mbs, "accum_steps": acc, "shard_groups": groups,
            "shard_shares": shares}


# (plan, clip): every stage on 2 and 3 ranks, uneven micro-batches and accumulation, shares, clipping
CASES = {
    2: [(_plan(0, [5, 1], [1, 3]), None), (_plan(1, [2, 3], [3, 1], shares=[3, 1]), 0.05),
        (_plan(2, [5, 1], [2, 2]), None), (_plan(3, [1, 3], [2, 2], shares=[0, 1]), 0.05)],
    3: [(_plan(0, [1, 2, 3], [3, 2, 1]), 0.05), (_plan(1, [1, 2, 3], [1, 1, 2], shares=[1, 2, 0]), None),
        (_plan(2, [1, 2, 3], [2, 2, 2]), 0.05), (_plan(3, [3, 1, 2], [1, 1, 1], shares=[1, 4, 2]), None)],
    4: [(_plan(0, [1, 2, 3, 1], [3, 2, 1, 2], groups=[[0, 1, 2], [3]]), None),
        (_plan(3, [3, 1, 2, 2], [2, 2, 2, 2], groups=[[0, 1, 2], [3]]), 0.05)],
}


# after them (2 ranks): a model that overflows at every scale, from 8 down to the minimum, 1 (hysteresis 2)
EVERY_SCALE = (_plan(1, [3, 1], [1, 2]), {"loss_scale": {"init_scale": 8.0, "hysteresis": 2}}, 0.0)


@functools.cache
def results(world_size):
    cases = [(plan, {"clip_grad_norm": clip, "loss_scale": SCALER}, OVERFLOW_FROM) for plan, clip in CASES[world_size]]
    return spawn(fp16_cases, world_size, cases + [EVERY_SCALE] * (world_size == 2), N_STEPS, OPTIMIZER,
                 timeout_s=300)


@pytest.mark.parametrize("world_size, index", [(w, i) for w in CASES for i in range(len(CASES[w]))],
                         ids=[f"w{w}-stage{p['zero_stage']}-mbs{p['micro_batch_sizes']}-acc{p['accum_steps']}"
                              f"{'-shares' + str(p['shard_shares']) if p['shard_shares'] else ''}"
                              f"{'-groups' if p['shard_groups'] else ''}-clip{c}"
                              for w in CASES for p, c in CASES[w]])
def test_fp16_matches_one_device_with_grad_scaler(world_size, index):
    plan, clip = CASES[world_size][index]
    micro = [Plan.from_dict(plan).micro_batches(r) for r in range(len(plan["accum_steps"]))]
    batches = make_batches(N_STEPS, sum(map(sum, micro)))
    ref_state, ref_losses, ref_scales = reference_train_fp16(
        batches, clip=clip, optimizer=OPTIMIZER, scaler_kw=SCALER, overflow_from=OVERFLOW_FROM, micro_batches=micro)
    assert ref_scales == [2 ** 16, 2 ** 15, 2 ** 15, 2 ** 16, 2 ** 15, 2 ** 15, 2 ** 16]   # the case is what we say
    for got in (r[index] for r in results(world_size)):
        assert got["scales"] == ref_scales
        assert got["skipped"] == 3
        assert got["losses"] == pytest.approx(ref_losses, rel=1e-3)
    got = results(world_size)[0][index]
    for key, ref in ref_state.items():
        torch.testing.assert_close(got["state"][key], ref, atol=1e-5, rtol=0, msg=lambda m, key=key: f"{key}: {m}")


def test_a_model_that_overflows_at_every_scale_stops_at_the_minimum_naming_the_step():
    for rank in results(2):
        got = rank[len(CASES[2])]
        # 8 twice (hysteresis 2: the first overflow only spends it; restored only when the scale grows, as
        # DeepSpeed's), 4, 2, 1, whose overflow stops the run
        assert got["scales"] == [8.0, 8.0, 4.0, 2.0, 1.0]
        assert got["step"] == 5
        assert got["error"].startswith("step 5: the loss is non-finite on ranks 0, 1 at the minimum fp16 loss "
                                       "scale (1)"), got["error"]
        assert "\n" not in got["error"]
