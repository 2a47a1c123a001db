"""`poplar simulate`: a plan from a simulated profile; bad input refused in one line before anything is simulated."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _simulate(*args, cwd=ROOT):
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "poplar.cli.main", "simulate", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_it_plans_a_preset_and_writes_the_plan_and_the_profile(tmp_path):
    run = _simulate("--cluster", "memory-differs", "--model", "tiny", "--global-batch", "64", "--stages", "0",
                    "--points", "2", "--out", str(tmp_path / "plan.json"), "--profile-out", str(tmp_path / "p.json"))
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "chosen: stage" in run.stdout and "simulated 120,064 parameters on 2 ranks" in run.stdout
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["zero_stage"] == 0 and sum(
        m * a for m, a in zip(plan["micro_batch_sizes"], plan["accum_steps"])) == 64
    assert set(json.loads((tmp_path / "p.json").read_text())["devices"]) == {"a100-80gb", "a100-40gb"}


@pytest.mark.parametrize("args, says", [
    (["--cluster", "memory-differs", "--model", "gpt-5", "--global-batch", "64"], "model 'gpt-5': choose one of"),
    (["--cluster", "no-such-cluster", "--model", "tiny", "--global-batch", "64"], "no cluster file"),
    (["--cluster", "memory-differs", "--model", "tiny", "--global-batch", "1"], "smaller than the 2 ranks"),
    (["--cluster", "memory-differs", "--model", "tiny", "--global-batch", str(10**12)], "at most 4,194,304"),
    (["--cluster", "memory-differs", "--model", "tiny", "--global-batch", "64", "--stages", "5"], "--stages"),
])
def test_bad_input_is_one_line_and_exit_2(args, says):
    run = _simulate(*args)
    assert run.returncode == 2, run.stdout[-2000:] + run.stderr[-2000:]
    assert says in run.stdout and run.stdout.count("error:") == 1 and "Traceback" not in run.stdout + run.stderr


def test_a_cluster_file_of_an_unknown_gpu_or_no_devices_is_refused(tmp_path):
    for text, says in (("devices:\n  - {kind: x, gpu: A100-81GB}\n", "A100-81GB"), ("devices: []\n", "devices")):
        path = tmp_path / "c.yaml"
        path.write_text(text)
        run = _simulate("--cluster", str(path), "--model", "tiny", "--global-batch", "64")
        assert run.returncode == 2 and says in run.stdout and "Traceback" not in run.stdout + run.stderr, run.stdout


def test_a_model_that_fits_no_device_in_any_stage_names_what_it_needs(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("memory_scale: 0.00001\ndevices:\n  - {kind: t4, gpu: T4-16GB, count: 2}\n")
    run = _simulate("--cluster", str(path), "--model", "tiny", "--global-batch", "8", "--points", "2")
    assert run.returncode == 2, run.stdout[-2000:] + run.stderr[-2000:]
    assert "no stage can run this job" in run.stdout and "The least it needs is ZeRO-" in run.stdout
    assert "MiB a device, plus a sample's activations (the largest device here has 0.2 MiB)" in run.stdout
