"""`poplar simulate`: a plan from a simulated profile; bad input refused in one line before anything is simulated."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def _simulate(*args, cwd=ROOT):
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "poplar.cli.main", "simulate", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_it_plans_a_preset_and_writes_the_plan_and_the_profile(tmp_path):
    run = _simulate("--cluster", "memory-differs", "--model", "tiny", "--global-batch", "64", "--stages", "0",
                    "--points", "2", "--no-alone", "--out", str(tmp_path / "plan.json"),
                    "--profile-out", str(tmp_path / "p.json"))
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert "chosen: stage" in run.stdout and "simulated 120,064 parameters on 2 ranks" in run.stdout
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["zero_stage"] == 0 and sum(
        m * a for m, a in zip(plan["micro_batch_sizes"], plan["accum_steps"])) == 64
    assert set(json.loads((tmp_path / "p.json").read_text())["devices"]) == {"a100-80gb", "a100-40gb"}


# (what is refused before torch is imported, the batch's options among it: tests/cli/test_before_torch.py)
@pytest.mark.parametrize("args, says", [
    (["--cluster", "memory-differs", "--model", "gpt-5", "--global-batch", "64"], "model 'gpt-5': choose one of"),
    (["--cluster", "no-such-cluster", "--model", "tiny", "--global-batch", "64"], "no cluster file"),
    (["--cluster", "memory-differs", "--model", "tiny", "--global-batch-tokens", "32"],
     "fewer tokens than one sample of 64"),
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
    # 1 MiB a card: together they hold ZeRO-3's states (1.83 MiB), neither holds a share and a sample beside it
    path.write_text("memory_scale: 0.000061\ndevices:\n  - {kind: t4, gpu: T4-16GB, count: 2}\n")
    run = _simulate("--cluster", str(path), "--model", "tiny", "--global-batch", "8", "--points", "2")
    assert run.returncode == 2, run.stdout[-2000:] + run.stderr[-2000:]
    assert "no stage can run this job" in run.stdout and "The least it needs is ZeRO-" in run.stdout
    assert "MiB a device, plus a sample's activations (the largest device here has 1.0 MiB)" in run.stdout


def test_a_model_whose_states_the_whole_cluster_cannot_hold_is_refused_before_it_is_simulated(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("memory_scale: 0.00001\ndevices:\n  - {kind: t4, gpu: T4-16GB, count: 2}\n")
    run = _simulate("--cluster", str(path), "--model", "tiny", "--global-batch", "8", "--points", "2")
    assert run.returncode == 2, run.stdout[-2000:] + run.stderr[-2000:]
    assert ("tiny has 120,064 parameters: its model states take at least 1.83 MiB in ZeRO-3" in run.stdout
            and "more than the 2 devices of this cluster hold together (0.33 MiB)" in run.stdout)


def test_a_token_batch_the_baselines_each_kind_alone_and_the_figures_as_json(tmp_path):
    """2k tokens of 64-token samples: 32 samples; Poplar beside uniform, proportional and each kind alone."""
    out = tmp_path / "e.json"
    run = _simulate("--cluster", "memory-differs", "--model", "tiny", "--global-batch-tokens", "2k", "--stages", "0",
                    "--points", "2", "--out", str(tmp_path / "plan.json"), "--json", str(out),
                    "--plot", str(tmp_path / "e.png"))
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    ev = json.loads(out.read_text())
    assert ev["global_batch"] == 32 and ev["seq_len"] == 64 and ev["tokens_per_s"] == ev["samples_per_s"] * 64
    assert set(ev["baselines"]) == {"uniform", "proportional", "measured-peak"}
    assert ev["samples_per_s"] >= max(v for v in ev["baselines"].values() if v) * (1 - 1e-9)
    assert ev["samples_per_s"] <= ev["ideal_samples_per_s"] * (1 + 1e-9)
    assert [(a["kind"], a["ranks"]) for a in ev["alone"]] == [("a100-80gb", 1), ("a100-40gb", 1)]
    assert all(a["samples_per_s"] > 0 for a in ev["alone"])
    assert {k["kind"] for k in ev["kinds"]} == {"a100-80gb", "a100-40gb"}
    assert sum(k["ranks"] * k["samples"] for k in ev["kinds"]) == 32
    for k in ev["kinds"]:    # the model's FLOPs a device computes, below its peak
        assert 0 < k["mfu"] < 1 and k["tflops"] > 0
    assert (tmp_path / "e.png").stat().st_size > 0 and "Poplar's speedup" in run.stdout
