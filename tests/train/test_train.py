"""`poplar train`: a tiny Llama on real text over 3 emulated ranks; exact resume; config errors."""

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

import poplar
from poplar.profile.units import step_flops_per_sample
from poplar.train.config import load_config
from poplar.train.report import summarize
from poplar.train.run import run_training
from poplar.models.workload import Workload

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = str(ROOT / "examples" / "cluster-3.yaml")      # an A100-80GB beside two T4-16GB
PEAK_TFLOPS = 19.5 + 2 * 8.1                              # their data sheets' fp32 peaks


@pytest.fixture(autouse=True)
def caches(tmp_path, monkeypatch):
    monkeypatch.setenv("POPLAR_DATA_CACHE", str(tmp_path / "data-cache"))
    monkeypatch.setenv("POPLAR_CACHE_DIR", str(tmp_path / "profile-cache"))
    monkeypatch.setenv("POPLAR_DILATION", "3")     # the emulated devices' pace: their figures do not depend on it


def config(tmp_path, name, plan: poplar.Plan, **kw):
    plan.save(tmp_path / f"{name}-plan.json")
    fields = dict(model="llama-tiny", seq_len=32, vocab_size=512, global_batch=plan.global_batch_size, steps=8,
                  lr=3e-3, cluster=CLUSTER, plan=str(tmp_path / f"{name}-plan.json"), out=str(tmp_path / name))
    return load_config(None, {**fields, **kw})


@pytest.mark.slow
def test_tiny_llama_on_three_uneven_ranks_learns(tmp_path, monkeypatch):
    plan = poplar.Plan.from_local_batches(1, [10, 4, 3], [2, 1, 1])      # 17 samples, near-equal micro-batches
    cfg = config(tmp_path, "run", plan)
    reads, read_text = Counter(), Path.read_text

    def counted(path, *args, **kwargs):
        reads[Path(path).resolve()] += 1
        return read_text(path, *args, **kwargs)
    monkeypatch.setattr(Path, "read_text", counted)
    result = run_training(cfg)
    # the cluster file and the plan are read once, at the launch, and handed on (the ranks read neither)
    assert reads[Path(CLUSTER).resolve()] == 1 and reads[(tmp_path / "run-plan.json").resolve()] == 1, reads
    losses = result["losses"]
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.3, losses
    records = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(8))
    step_flops = step_flops_per_sample(Workload(model="llama-tiny", seq_len=32, vocab_size=512))
    for r in records:
        assert len(r["busy_s"]) == len(r["idle_s"]) == 3
        assert r["samples_per_s"] > 0 and r["tokens_per_s"] == pytest.approx(r["samples_per_s"] * 32)
        # the model FLOPs of a step: the profile's and the simulator's count (three times the forward's)
        assert r["tflops"] == pytest.approx(r["samples_per_s"] * step_flops / 1e12)
        assert r["mfu"] == pytest.approx(r["tflops"] / PEAK_TFLOPS)    # over the emulated GPUs' declared peaks
        # spans where an emulated device's real work ran past its declared time, summed over the ranks
        assert isinstance(r["overruns"], int) and r["overruns"] >= 0
        assert "calibrating" not in r
    assert summarize(records)["steady_steps"] == list(range(1, 8))     # only the first step is left out
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text() == "step-00000008"


def test_the_summary_leaves_out_only_the_first_step():
    records = [{"step": i, "loss": 5.0 - i, "step_s": s, "samples_per_s": 10 / s, "tokens_per_s": 320 / s,
                "tflops": 1.0, "busy_s": [s, s / 2], "idle_s": [0.0, s / 2], "overruns": int(i == 1)}
               for i, s in enumerate([9.0, 8.0, 7.0, 1.0, 2.0, 3.0])]
    s = summarize(records)
    assert s["steady_steps"] == [1, 2, 3, 4, 5] and s["step_s"] == 3.0 and s["busy_s"] == [3.0, 1.5]
    assert s["idle_s"] == [0.0, 1.5] and s["samples_per_s"] == pytest.approx(10 / 3)
    assert (s["first_loss"], s["last_loss"], s["steps"]) == (5.0, 0.0, 6)
    assert summarize(records, skip=3)["steady_steps"] == [3, 4, 5]
    assert summarize(records[:1])["steady_steps"] == [0]      # a run of one step: that step, rather than nothing
    assert "mfu" not in summarize(records)
    for r, mfu in zip(records, [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]):   # real GPUs: the log's MFU, summarised too
        r["mfu"] = mfu
    assert summarize(records)["mfu"] == 0.4


@pytest.mark.slow
def test_resume_continues_exactly_on_another_cluster(tmp_path):
    plan = poplar.Plan.from_local_batches(2, [7, 5, 4], 2)                # 16 samples, ZeRO-2 on 3 ranks
    whole = run_training(config(tmp_path, "whole", plan, steps=5), return_state=True)
    run_training(config(tmp_path, "split", plan, steps=5, stop_at=2))   # as if the job ended there
    # the last three steps on two ranks of other kinds, ZeRO-1 and another plan
    two = poplar.Plan.from_local_batches(1, [11, 5], [3, 1])
    moved = run_training(config(tmp_path, "split", two, steps=5, resume=True, cluster="compute-differs"),
                         return_state=True)
    assert moved["start"] == 2 and moved["losses"] == pytest.approx(whole["losses"][2:], abs=1e-6)
    for key, value in whole["state"].items():
        torch.testing.assert_close(moved["state"][key], value, atol=1e-6, rtol=0)
    records = [json.loads(line) for line in (tmp_path / "split" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(5))
    assert (tmp_path / "split" / "config.1.yaml").exists()      # the earlier run's settings are kept
    with pytest.raises(ValueError, match="resume with the same global_batch"):   # refused before it starts
        run_training(config(tmp_path, "split", poplar.Plan.from_local_batches(1, [9, 9], 1), steps=8,
                            resume=True, cluster="compute-differs"))


@pytest.mark.slow
def test_config_errors_name_the_field_and_nothing_is_overwritten(tmp_path):
    with pytest.raises(ValueError, match="lr: Input should be greater than 0"):
        load_config(None, {"lr": 0})
    with pytest.raises(ValueError, match="colour: unknown field"):
        load_config(None, {"colour": "red"})
    bad = tmp_path / "bad.yaml"
    bad.write_text("stages: [0, 7]\n")
    with pytest.raises(ValueError, match="stages: Value error, choose stages from 0, 1, 2, 3"):
        load_config(bad)
    good = tmp_path / "good.yaml"
    good.write_text("model: bert-tiny\nsteps: 3\n")
    assert load_config(good, {"steps": 5}).steps == 5 and load_config(good).model == "bert-tiny"
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "log.jsonl").write_text("{}\n")
    with pytest.raises(ValueError, match="already holds a run"):
        run_training(load_config(None, {"out": str(tmp_path / "old")}))
    env = {**os.environ, "COLUMNS": "200"}
    run = subprocess.run([sys.executable, "-m", "poplar.cli.main", "train", "--set", "warmup_steps=-1",
                          "--out", str(tmp_path / "cli")], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 2 and "warmup_steps" in run.stdout, run.stdout + run.stderr


@pytest.mark.slow
def test_under_torchrun_and_with_plain_ranks_the_run_is_the_same(tmp_path):
    plan = poplar.Plan.from_local_batches(2, [5, 3], 1)
    plan.save(tmp_path / "plan.json")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    common = ["train", "--plan", str(tmp_path / "plan.json"), "--steps", "3", "--global-batch", "8",
              "--set", "seq_len=32", "--set", "vocab_size=512"]
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "-m", "poplar.cli.main", *common, "--cluster", "compute-differs",
                          "--out", str(tmp_path / "torchrun")], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    # as in tests/engine/test_features.py: gloo may rarely abort in teardown after the work is done
    teardown_abort = "terminate called without an active exception" in run.stderr
    assert run.returncode == 0 or teardown_abort, run.stdout[-2000:] + run.stderr[-3000:]
    plain = subprocess.run([sys.executable, "-m", "poplar.cli.main", *common, "--cluster", "none", "--nproc", "2",
                            "--out", str(tmp_path / "plain")], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=300)
    assert plain.returncode == 0, plain.stdout[-2000:] + plain.stderr[-3000:]
    losses = {name: [json.loads(line)["loss"] for line in (tmp_path / name / "log.jsonl").read_text().splitlines()]
              for name in ("torchrun", "plain")}
    assert len(losses["torchrun"]) == 3
    assert losses["torchrun"] == pytest.approx(losses["plain"], abs=1e-6)
    missing = subprocess.run([sys.executable, "-m", "poplar.cli.main", "train", "--cluster", "none",
                              "--out", str(tmp_path / "x")], cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=120)
    assert missing.returncode == 2 and "--nproc with --plan" in missing.stdout


@pytest.mark.parametrize("allocation", ["poplar", "uniform", "proportional"])
def test_the_run_keeps_the_plan_it_trains_with(tmp_path, allocation):
    # plan.json holds the plan trained (--resume reads it back), and the planner's figures
    from poplar.planner import make_plan
    from poplar.train.run_dir import write_plan
    from tests.planner.profiles import make_profile

    result = make_plan(make_profile({"big": (1, 0.01, 0.002, 16), "small": (1, 0.02, 0.004, 8)}, seq_len=32), 48)
    alloc = result.stages[result.stage].allocations[allocation]
    write_plan(tmp_path, alloc.plan, result, allocation)
    saved = json.loads((tmp_path / "plan.json").read_text())
    assert poplar.Plan.load(tmp_path / "plan.json") == alloc.plan
    assert saved["predicted"]["samples_per_s"] == pytest.approx(alloc.predicted.samples_per_s)
    assert saved["meta"]["allocation"] == allocation and saved["meta"]["reason"] == result.reason


@pytest.mark.slow
def test_cards_that_fit_nowhere_sit_out_and_the_plan_trains_on_the_others(tmp_path):
    """Two T4s that hold no sample beside the model (2 MiB each at this scale), an A100 that does: the plan is for
    the A100, and `poplar train` runs it on that rank alone (the run's cluster.yaml), the T4s sitting out."""
    import yaml

    cluster = tmp_path / "big-and-two-small.yaml"
    cluster.write_text(yaml.safe_dump({"memory_scale": 0.00012, "devices": [
        {"kind": "a100-80gb", "gpu": "A100-80GB"}, {"kind": "t4-16gb", "gpu": "T4-16GB", "count": 2}]}))
    cfg = load_config(None, dict(model="llama-tiny", seq_len=32, vocab_size=512, global_batch=8, steps=3, lr=3e-3,
                                 cluster=str(cluster), stages=[0], out=str(tmp_path / "run")))
    result = run_training(cfg)
    assert result["plan"].world_size == 1 and result["planning"].excluded_ranks == [1, 2]
    assert "cannot hold the model and a sample in any stage profiled" in result["planning"].reason
    ran = yaml.safe_load((tmp_path / "run" / "cluster.yaml").read_text())
    assert [(d["kind"], d.get("count", 1)) for d in ran["devices"]] == [("a100-80gb", 1)]
    records = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2] and all(len(r["busy_s"]) == 1 for r in records)
