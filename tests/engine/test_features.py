"""Mixed precision, unused parameters, ZeRO-3 evaluation, state dicts, and launch modes."""

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from poplar.processes.spawn import spawn
from tests.engine.workers import feature_scenarios
from tests.helpers.models import make_batches, make_model, reference_train

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


@functools.cache
def outcomes():
    return spawn(feature_scenarios, 2, timeout_s=180)


def test_bf16_trains_close_to_fp32_and_stages_agree():
    out = outcomes()[0]
    ref_state, ref_losses = reference_train(make_batches(3, 8))
    assert out["bf16-stage0"]["losses"] == pytest.approx(ref_losses, abs=3e-2)
    # the same bf16 arithmetic on the same micro-batches: stages differ only in fp32 reductions
    for key, value in out["bf16-stage0"]["state"].items():
        torch.testing.assert_close(out["bf16-stage3"]["state"][key], value, atol=1e-4, rtol=0)
        assert out["bf16-stage3"]["state"][key].dtype == torch.float32     # fp32 masters come back
        torch.testing.assert_close(value, ref_state[key], atol=5e-3, rtol=0)


def test_unused_parameters_do_not_hang_and_stay_put():
    no_decay = functools.partial(torch.optim.AdamW, lr=1e-3, weight_decay=0.0)
    ref_state, _ = reference_train(make_batches(3, 6), optimizer=no_decay, model_kw={"unused": True})
    got = outcomes()[0]["unused"]
    for key, value in ref_state.items():
        torch.testing.assert_close(got[key], value, atol=1e-5, rtol=0)
    torch.testing.assert_close(got["unused.weight"], make_model(unused=True).unused.weight.detach())


@pytest.mark.parametrize("mode", ["early_stop", "full", "reentrant"])
def test_zero3_with_activation_checkpointing_matches_single_device(mode):
    ref_state, _ = reference_train(make_batches(3, 6))
    for key, value in ref_state.items():
        torch.testing.assert_close(outcomes()[0][f"checkpoint-{mode}"][key], value, atol=1e-5, rtol=0)


def test_zero3_eval_forward_gathers_then_frees():
    for out in outcomes():
        model = make_model()
        model.load_state_dict(out["trained_state"])
        with torch.no_grad():
            expected = model(make_batches(1, 4, seed=7)[0][0])
        torch.testing.assert_close(out["eval_logits"], expected, atol=1e-5, rtol=1e-5)
        assert out["eval_param_bytes"] == out["shard_bytes"]


def test_full_state_dict_moves_between_stages_and_plans():
    for out in outcomes():
        for key, value in out["trained_state"].items():
            torch.testing.assert_close(out["reloaded_state"][key], value, atol=0, rtol=0)


SINGLE = """
import functools, torch, poplar
from tests.helpers.models import make_model, make_batches, lm_loss, reference_train
plan = poplar.Plan(0, [2], [3])
engine = poplar.initialize(make_model(), functools.partial(torch.optim.AdamW, lr=1e-3, eps=1e-6), plan)
batches = make_batches(3, 6)
for b in batches:
    engine.train_batch(b, lm_loss)
ref, _ = reference_train(batches, optimizer=functools.partial(torch.optim.AdamW, lr=1e-3, eps=1e-6))
err = max((engine.full_state_dict()[k] - v).abs().max().item() for k, v in ref.items())
assert engine.world_size == 1 and err < 1e-5, err
print("single-process ok", err)
poplar.engine.dist.shutdown()
"""


def test_plain_python_without_a_launcher_is_one_rank():
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    run = subprocess.run([sys.executable, "-c", SINGLE], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "single-process ok" in run.stdout


def test_torchrun_launch_of_the_example():
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
                          "examples/hetero_train.py", "--steps", "3", "--zero-stage", "1"],
                         cwd=ROOT, capture_output=True, text=True, timeout=180,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert "matches single-device training" in run.stdout, (run.stdout[-2000:], run.stderr[-3000:])
    if run.returncode != 0:
        # Known upstream gloo issue: rarely (seen ~1 in 40 runs on a loaded 2-core machine)
        # a rank aborts in process teardown after destroy_process_group, with the work
        # done and verified above. Anything else is a failure.
        teardown_abort = "terminate called without an active exception" in run.stderr and \
            "Signal 6 (SIGABRT)" in run.stderr
        assert teardown_abort, run.stderr[-3000:]
