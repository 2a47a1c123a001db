"""Checkpoints: resharded onto another world size, plan, stage and shares; damage detected; never NaN."""

import json
import shutil

import pytest
import torch

import poplar
from poplar.processes.spawn import spawn
from poplar.runtime.checkpoint import find_resumable, verify
from tests.train.checkpoint_workers import fp16_span, save_nonfinite, train_span

THREE = poplar.Plan.from_local_batches(2, [6, 4, 2], [2, 2, 2])     # 12 samples, ZeRO-2


def _close(a, b, tol=1e-6):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=tol, atol=tol, msg=k)


@pytest.fixture(scope="module")
def uninterrupted(starts_processes, tmp_path_factory):
    """Three ranks, six steps, checkpoints after steps 3 and 6: the final state, and the checkpoints."""
    root = tmp_path_factory.mktemp("whole")
    return spawn(train_span, 3, THREE.to_dict(), str(root), 0, 6, 3, timeout_s=180)[0], root


@pytest.mark.parametrize("plan", [poplar.Plan.from_local_batches(1, [9, 3], [3, 1]),            # 2 ranks, ZeRO-1
                                  poplar.Plan.from_local_batches(3, [3, 3, 4, 2], [1, 1, 1, 1]),   # 4 ranks, ZeRO-3
                                  poplar.Plan.from_local_batches(0, [5, 7], [1, 7]),               # 2 ranks, ZeRO-0
                                  poplar.Plan.from_local_batches(3, [3, 3, 4, 2], [1, 1, 1, 1],    # hybrid, unlike
                                                                 shard_groups=[[0, 1, 2], [3]])],  # groups
                         ids=["2-ranks-stage1", "4-ranks-stage3", "2-ranks-stage0", "4-ranks-stage3-hybrid"])
def test_a_checkpoint_resumes_on_another_world_plan_and_stage(tmp_path, uninterrupted, plan):
    final, root = uninterrupted
    shutil.copytree(root / "step-00000003", tmp_path / "step-00000003")
    resumed = spawn(train_span, plan.world_size, plan.to_dict(), str(tmp_path), 3, 6, 0, timeout_s=180)[0]
    _close(resumed, final)


def test_a_hybrid_checkpoint_resumes_flat_and_trains_as_the_flat_run(tmp_path, uninterrupted):
    """Written by shard groups of one and two ranks (each holding a copy), read back by a flat world of two."""
    hybrid = poplar.Plan.from_local_batches(2, [6, 4, 2], [2, 2, 2], shard_groups=[[0], [1, 2]])
    final = spawn(train_span, 3, hybrid.to_dict(), str(tmp_path / "hybrid"), 0, 6, 3, timeout_s=180)[0]
    _close(final, uninterrupted[0], tol=1e-5)
    flat = poplar.Plan.from_local_batches(1, [9, 3], [3, 1])
    shutil.copytree(tmp_path / "hybrid" / "step-00000003", tmp_path / "flat" / "step-00000003")
    resumed = spawn(train_span, 2, flat.to_dict(), str(tmp_path / "flat"), 3, 6, 0, timeout_s=180)[0]
    _close(resumed, final, tol=1e-5)


def test_uneven_shares_resume_on_any_layout_and_back(tmp_path, uninterrupted):
    """Even (the uninterrupted run's step 3) -> uneven shares on two ranks in ZeRO-3 -> three ranks in ZeRO-1, one
    holding none -> even again: each span continues the uninterrupted run."""
    final, root = uninterrupted
    shutil.copytree(root / "step-00000003", tmp_path / "step-00000003")
    chain = [(poplar.Plan.from_local_batches(3, [5, 7], [1, 1], shard_shares=[1, 3]), 3, 4),
             (poplar.Plan.from_local_batches(1, [6, 4, 2], [2, 1, 1], shard_shares=[2, 0, 1]), 4, 5),
             (THREE, 5, 6)]
    for plan, first, last in chain:
        resumed = spawn(train_span, plan.world_size, plan.to_dict(), str(tmp_path), first, last, 1, timeout_s=180)[0]
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000005", "step-00000006"]
    _close(resumed, final)


@pytest.mark.slow
def test_the_newest_two_are_kept_and_damage_falls_back_to_the_previous(tmp_path):
    spawn(train_span, 2, poplar.Plan.from_local_batches(2, [8, 4], [2, 2]).to_dict(), str(tmp_path), 0, 6, 2,
          timeout_s=180)
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000004", "step-00000006"]
    step4, step6 = tmp_path / "step-00000004", tmp_path / "step-00000006"
    assert verify(step4) is None and verify(step6) is None
    assert (tmp_path / "latest").read_text() == "step-00000006"
    meta = json.loads((step6 / "poplar.json").read_text())
    assert meta["step"] == 6 and meta["optimizer"][0]["lr"] == 1e-3 and len(meta["layout"]) >= 2
    shard = sorted(step6.glob("*.distcp"))[-1]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01                       # one bit flipped
    shard.write_bytes(bytes(data))
    said = []
    assert find_resumable(tmp_path, report=said.append) == step4
    assert "does not match its checksum" in said[0] and "step-00000006" in said[0]
    shard.write_bytes(bytes(data[: len(data) // 2]))   # truncated
    assert "bytes" in verify(step6)
    shard.unlink()                                     # a missing shard
    assert "missing" in verify(step6)
    (step4 / "manifest.json").unlink()                 # a checkpoint never finished: not even a candidate
    assert find_resumable(tmp_path, report=said.append) is None


@pytest.mark.slow
def test_parameters_holding_nan_are_never_written(tmp_path):
    said = spawn(save_nonfinite, 2, str(tmp_path), timeout_s=120)
    assert all("NaN" in s and "no checkpoint was written" in s for s in said)
    assert not list(tmp_path.glob("step-*"))


def test_a_failure_inside_torch_checkpoint_reads_as_one_line(tmp_path):
    # DCP raises a BaseException holding every rank's traceback: it becomes one CheckpointError line
    import torch.distributed.checkpoint as dcp

    from poplar.runtime.checkpoint import CheckpointError, dcp_errors

    dcp.save({"a": torch.ones(4)}, checkpoint_id=str(tmp_path))
    for shard in tmp_path.glob("*.distcp"):
        shard.unlink()
    with pytest.raises(CheckpointError) as caught:
        with dcp_errors("read", tmp_path, "it is damaged"):
            dcp.load({"a": torch.zeros(4)}, checkpoint_id=str(tmp_path))
    line = str(caught.value)
    assert "\n" not in line and line.startswith(f"checkpoint {tmp_path} could not be read (rank 0: FileNotFoundError")
    assert line.endswith("it is damaged")


@pytest.mark.slow
def test_fp16_resumes_on_another_world_with_its_loss_scale(tmp_path):
    """Three ranks save after step 4 (an overflow there: the scale lowered to 2^15); two resume, with the same
    micro-batches (so fp16 rounds the same partial sums): the scale goes on where it was, the parameters too."""
    three = poplar.Plan(1, [4, 4, 4], [1, 1, 1])
    two = poplar.Plan(1, [4, 4], [2, 1])
    final, scales = spawn(fp16_span, 3, three.to_dict(), str(tmp_path / "whole"), 0, 6, 4, timeout_s=180)[0]
    assert scales == [2 ** 16, 2 ** 15, 2 ** 15, 2 ** 16, 2 ** 15, 2 ** 15]
    shutil.copytree(tmp_path / "whole" / "step-00000004", tmp_path / "resumed" / "step-00000004")
    resumed, after = spawn(fp16_span, 2, two.to_dict(), str(tmp_path / "resumed"), 4, 6, 0, timeout_s=180)[0]
    assert after == [2 ** 15, 2 ** 15]   # a fresh scale (2^16) would overflow at step 5 instead
    _close(resumed, final, tol=1e-5)


@pytest.mark.slow
def test_a_checkpoint_written_in_fp32_resumes_in_fp16_with_a_fresh_loss_scale(tmp_path):
    plan = poplar.Plan(0, [6, 6], 1).to_dict()
    spawn(train_span, 2, plan, str(tmp_path), 0, 2, 2, timeout_s=120)
    state, scales = spawn(fp16_span, 2, plan, str(tmp_path), 2, 4, 0,
                          timeout_s=120)[0]
    assert scales == [2 ** 16, 2 ** 15] and all(torch.isfinite(v).all() for v in state.values())
