"""The engine's update equals single-process training on the whole global batch.

Real processes over gloo; uneven micro-batches, unequal accumulation where the stage
allows it. Parameters must match the single-device run to 1e-5 after several AdamW
steps, for every ZeRO stage, with and without exact global-norm clipping; flat, and
hybrid over shard groups of unlike sizes (stage 0: the two-level all-reduce), where
every group's copy must also be bit for bit the same; and with uneven shares of the
states (a very small share, and none), flat and hybrid.
"""

import functools

import pytest
import torch

from poplar.processes.spawn import spawn
from tests.engine.workers import run_cases
from tests.helpers.models import ORDER_TOLERANT_OPTIMIZER as OPTIMIZER, make_batches, reference_train

pytestmark = pytest.mark.slow

N_STEPS = 4
# (stage, micro_batch_sizes, accum_steps[, local_batch_sizes]): the last form splits a
# rank's samples into near-equal micro-batches (7 samples in 2 = 4 + 3).
PLANS = {
    2: [(0, [5, 1], [1, 3]), (1, [2, 3], [3, 1]), (2, [5, 1], [2, 2]), (3, [1, 3], [2, 2]),
        (0, [4, 1], [2, 3], [7, 3]), (2, [3, 2], [3, 3], [7, 5])],
    3: [(0, [1, 2, 3], [3, 2, 1]), (1, [1, 2, 3], [1, 1, 2]), (2, [1, 2, 3], [2, 2, 2]), (3, [3, 1, 2], [1, 1, 1]),
        (1, [3, 1, 2], [2, 1, 3], [5, 1, 4]), (3, [2, 3, 1], [2, 2, 2], [3, 5, 2])],
    # (..., local_batch_sizes or None, shard_groups): groups of three and one rank, and of two and two
    4: [(0, [1, 2, 3, 1], [3, 2, 1, 2], None, [[0, 1, 2], [3]]), (1, [2, 1, 3, 2], [1, 3, 1, 2], None, [[0, 1, 2], [3]]),
        (2, [2, 1, 3, 2], [2, 2, 2, 2], None, [[0, 1, 2], [3]]), (3, [3, 1, 2, 2], [2, 2, 2, 2], None, [[0, 1, 2], [3]]),
        (0, [4, 1, 2, 1], [2, 3, 1, 1], [7, 3, 2, 1], [[0, 3], [1, 2]]), (3, [1, 2, 3, 1], [1, 1, 1, 1], None, [[0, 1], [2, 3]]),
        (1, [1, 2, 3, 1], [1, 1, 1, 1], None, [[0, 1], [2, 3]]),
        (3, [3, 1, 2, 2], [2, 2, 2, 2], None, [[0, 1, 2], [3]], [1, 2, 0, 1]),
        (2, [1, 2, 3, 1], [1, 1, 1, 1], None, [[0, 1], [2, 3]], [3, 1, 1, 0.02])],
}
# (..., shard_shares): uneven shares of the states, a very small one and none at all among them
SHARES = {
    2: [(1, [2, 3], [3, 1], None, None, [3, 1]), (2, [5, 1], [2, 2], None, None, [1, 0.01]),
        (3, [1, 3], [2, 2], None, None, [0, 1]), (3, [4, 2], [1, 1], None, None, [5, 2])],
    3: [(1, [3, 1, 2], [2, 1, 3], [5, 1, 4], None, [1, 2, 0]), (2, [1, 2, 3], [2, 2, 2], None, None, [3, 1, 0.01]),
        (3, [2, 3, 1], [2, 2, 2], [3, 5, 2], None, [1, 4, 2]), (1, [2, 2, 2], [1, 1, 1], None, None, [7, 1, 1])],
}
for _w, _extra in SHARES.items():
    PLANS[_w] = PLANS[_w] + _extra
CLIPS = [None, 0.05]   # 0.05 is below every step's gradient norm here, so clipping really acts


def _plan(stage, mbs, acc, local=None, groups=None, shares=None):
    return {"zero_stage": stage, "micro_batch_sizes": mbs, "accum_steps": acc, "local_batch_sizes": local,
            "shard_groups": groups, "shard_shares": shares}


@functools.cache
def results(world_size):
    cases = [(_plan(*p), {"clip_grad_norm": clip}, None) for clip in CLIPS for p in PLANS[world_size]]
    return spawn(run_cases, world_size, cases, N_STEPS, OPTIMIZER, timeout_s=300)


CASES = [(w, i, clip, p) for w in PLANS for i, (clip, p) in enumerate((c, p) for c in CLIPS for p in PLANS[w])]


@pytest.mark.parametrize("world_size, index, clip, plan", CASES,
                         ids=[f"w{w}-stage{p[0]}-mbs{p[1]}-acc{p[2]}{'-local' + str(p[3]) if len(p) > 3 and p[3] else ''}"
                              f"{'-groups' + str(p[4]) if len(p) > 4 and p[4] else ''}"
                              f"{'-shares' + str(p[5]) if len(p) > 5 else ''}-clip{c}"
                              for w, _, c, p in CASES])
def test_matches_single_device_training(world_size, index, clip, plan):
    ranks = results(world_size)
    global_batch = sum(plan[3]) if len(plan) > 3 and plan[3] else sum(m * a for m, a in zip(plan[1], plan[2]))
    ref_state, ref_losses = reference_train(make_batches(N_STEPS, global_batch), clip=clip, optimizer=OPTIMIZER)
    got = ranks[0][index]
    for key, ref in ref_state.items():
        torch.testing.assert_close(got["state"][key], ref, atol=1e-5, rtol=0, msg=lambda m, key=key: f"{key}: {m}")
    for key, value in ranks[-1][index]["state"].items():   # another group's copy (hybrid): the very same bits
        assert torch.equal(value, got["state"][key]), key
    for r in ranks:   # the returned loss is the global mean, the same on every rank
        assert r[index]["losses"] == pytest.approx(ref_losses, abs=1e-5)
    if clip is not None:
        assert all(n > clip for n in got["norms"]), "clipping must have acted in every step"
