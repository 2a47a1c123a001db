"""Per-rank bytes of parameters, gradients and optimizer states follow ZeRO's accounting.

The figures come from the tensors the engine really holds (their storages, shared
views counted once), at rest after a step and at their peak during it.
"""

import functools

import pytest

from poplar.engine.layout import ShardLayout
from poplar.processes.spawn import spawn
from tests.engine.workers import run_cases

pytestmark = pytest.mark.slow

WORLD = 3
MODEL = {"layers": 8, "d": 32}
SHARES = [4, 1, 0]   # uneven: one rank four times another's share, one holding none
CASES = {  # name: (plan, config)
    "stage0": ({"zero_stage": 0, "micro_batch_sizes": [1, 2, 3], "accum_steps": [2, 1, 1]}, {}),
    "stage1": ({"zero_stage": 1, "micro_batch_sizes": [1, 2, 3], "accum_steps": [2, 1, 1]}, {}),
    "stage2": ({"zero_stage": 2, "micro_batch_sizes": [1, 2, 3], "accum_steps": [2, 2, 2]}, {}),
    "stage3": ({"zero_stage": 3, "micro_batch_sizes": [1, 2, 3], "accum_steps": [2, 2, 2]}, {}),
    "stage1-bf16": ({"zero_stage": 1, "micro_batch_sizes": [1, 2, 3], "accum_steps": [1, 1, 1]},
                    {"mixed_precision": "bf16"}),
    "stage3-bf16": ({"zero_stage": 3, "micro_batch_sizes": [1, 2, 3], "accum_steps": [1, 1, 1]},
                    {"mixed_precision": "bf16"}),
    "stage2-shares": ({"zero_stage": 2, "micro_batch_sizes": [1, 2, 3], "accum_steps": [2, 2, 2],
                       "shard_shares": SHARES}, {}),
    "stage3-shares": ({"zero_stage": 3, "micro_batch_sizes": [1, 2, 3], "accum_steps": [2, 2, 2],
                       "shard_shares": SHARES}, {}),
}


@functools.cache
def measured():
    cases = [(plan, config, MODEL) for plan, config in CASES.values()]
    ranks = spawn(run_cases, WORLD, cases, 2, track_peak=True, timeout_s=240)
    return {name: [r[i] for r in ranks] for i, name in enumerate(CASES)}


def sizes():
    numels = measured()["stage0"][0]["unit_numels"]
    full = sum(numels)
    return full, full // WORLD, max(numels[1:]), numels[0]


@pytest.mark.parametrize("rank", range(WORLD))
def test_at_rest_each_stage_holds_what_zero_says(rank):
    P, S, _, _ = sizes()   # padded parameter count, and one rank's shard of it
    m = {name: runs[rank]["memory"] for name, runs in measured().items()}
    # stage 0: everything replicated; Adam keeps two fp32 states per parameter
    assert (m["stage0"]["parameters"], m["stage0"]["gradients"], m["stage0"]["optimizer"]) == (4 * P, 4 * P, 8 * P)
    # stage 1: optimizer states sharded; the fp32 master is a view of the parameters (no copy)
    assert (m["stage1"]["parameters"], m["stage1"]["master"], m["stage1"]["optimizer"]) == (4 * P, 0, 8 * S)
    # stage 2: + gradients sharded
    assert (m["stage2"]["parameters"], m["stage2"]["gradients"], m["stage2"]["optimizer"]) == (4 * P, 4 * S, 8 * S)
    # stage 3: + parameters sharded: about 1/N of each
    assert (m["stage3"]["parameters"], m["stage3"]["gradients"], m["stage3"]["optimizer"]) == (4 * S, 4 * S, 8 * S)
    assert m["stage3"]["total"] == m["stage0"]["total"] // WORLD
    # bf16 mixed precision: 2-byte model parameters, a separate fp32 master shard
    assert (m["stage1-bf16"]["parameters"], m["stage1-bf16"]["master"]) == (2 * P, 4 * S)
    assert (m["stage3-bf16"]["parameters"], m["stage3-bf16"]["master"], m["stage3-bf16"]["optimizer"]) == (2 * S, 4 * S, 8 * S)


def test_peak_gradient_and_parameter_bytes_during_a_step():
    P, S, biggest_unit, root = sizes()
    runs = measured()
    for rank in range(WORLD):
        # stage 1 accumulates full gradients over the micro-steps, then reduce-scatters once
        assert runs["stage1"][rank]["peak"]["gradients"] == 4 * P + 4 * S
        # stage 2 keeps only a few full-size gradient buckets alive next to its shard
        stage2 = runs["stage2"][rank]["peak"]["gradients"]
        assert stage2 <= 4 * S + 4 * (2 + 2) * biggest_unit < 4 * P, (stage2, 4 * P)
        # stage 3 gathers a unit (and the next, prefetched) just in time, never the whole model
        stage3 = runs["stage3"][rank]["peak"]["parameters"]
        assert 4 * S + 4 * biggest_unit <= stage3 <= 4 * S + 4 * (root + 3 * biggest_unit) < 4 * P, (stage3, 4 * P)


def test_sharded_states_add_up_to_one_replica_across_ranks():
    runs = measured()
    for name in ("stage1", "stage2", "stage3"):
        assert sum(r["memory"]["optimizer"] for r in runs[name]) == runs["stage0"][0]["memory"]["optimizer"]


def test_uneven_shares_hold_each_ranks_own_slices_and_one_replica_in_all():
    runs = measured()
    numels = runs["stage0"][0]["unit_numels"]
    for name in ("stage2-shares", "stage3-shares"):
        for rank, run in enumerate(runs[name]):
            held = sum(ShardLayout(WORLD, None, rank, SHARES).slice_sizes(n)[rank] for n in numels)
            m = run["memory"]
            assert (m["optimizer"], m["gradients"]) == (8 * held, 4 * held), (name, rank)
            if name == "stage3-shares":
                assert m["parameters"] == 4 * held, rank
        assert sum(r["memory"]["optimizer"] for r in runs[name]) == runs["stage0"][0]["memory"]["optimizer"]
    zero, big, small = (runs["stage3-shares"][r]["memory"]["total"] for r in (2, 0, 1))
    assert zero == 0 and big > 3 * small      # ZeRO-3: a rank with no share holds no state at rest
