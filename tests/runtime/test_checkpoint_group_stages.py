"""A checkpoint of a plan whose shard groups run different ZeRO stages (a sharding group before a replicating one:
only the first group's copy is written) resumes exactly, on the same plan and on a flat one."""

import shutil

import torch

import poplar
from poplar.processes.spawn import spawn
from tests.train.checkpoint_workers import train_span

# ranks 0-1 shard everything (ZeRO-3, two micro-steps each), rank 2 replicates (ZeRO-0, one): 12 samples a step
MIXED = poplar.Plan.from_local_batches(3, [6, 4, 2], [2, 2, 1], shard_groups=[[0, 1], [2]], group_stages=[3, 0])


def _close(a: dict, b: dict, tol: float) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=tol, atol=tol, msg=k)


def test_a_mixed_stage_run_resumes_on_its_plan_and_on_a_flat_one(starts_processes, tmp_path):
    whole = spawn(train_span, 3, MIXED.to_dict(), str(tmp_path / "whole"), 0, 6, 3, timeout_s=180)[0]
    for name, plan, tol in [("same", MIXED, 1e-6), ("flat", poplar.Plan.from_local_batches(1, [9, 3], [3, 1]), 1e-5)]:
        shutil.copytree(tmp_path / "whole" / "step-00000003", tmp_path / name / "step-00000003")
        resumed = spawn(train_span, plan.world_size, plan.to_dict(), str(tmp_path / name), 3, 6, 0, timeout_s=180)[0]
        _close(resumed, whole, tol)
