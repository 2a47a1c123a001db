"""`poplar train` without a cluster file: the real CUDA devices where there are some, a clear error where not."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import poplar
from poplar.train.config import load_config
from poplar.train.planning import get_plan
from poplar.train.run import run_training
from poplar.models.workload import Workload

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the errors of a machine without CUDA")
def test_without_a_cluster_file_or_cuda_it_says_what_to_give(tmp_path):
    cfg = load_config(None, {"cluster": "none", "out": str(tmp_path / "run")})
    with pytest.raises(ValueError, match=r"no CUDA device to discover.*--cluster FILE\|PRESET.*--nproc with --plan"):
        run_training(cfg)
    assert not (tmp_path / "run").exists()
    # plain CPU ranks (--nproc) are not profiled: they train with a given plan
    with pytest.raises(ValueError, match=r"plain CPU ranks: give --plan, or --cluster FILE\|PRESET"):
        get_plan(cfg, Workload(model="llama-tiny", seq_len=32, vocab_size=512), 2, None, None)


@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_trains_on_the_gpu_here_with_its_own_profile(tmp_path):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "0", "POPLAR_CACHE_DIR": str(tmp_path / "cache"),
           "POPLAR_DATA_CACHE": str(tmp_path / "data"), "COLUMNS": "200"}
    run = subprocess.run([sys.executable, "-m", "poplar.cli.main", "train", "--cluster", "none", "--model",
                          "llama-tiny", "--global-batch", "16", "--steps", "3", "--set", "stages=[0]", "--set",
                          "seq_len=32", "--set", "vocab_size=512", "--out", str(tmp_path / "run")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    assert all(0 < r["busy_s"][0] <= r["step_s"] for r in records)    # the GPU's own time, within the step's
    plan = poplar.Plan.load(tmp_path / "run" / "plan.json")
    assert plan.zero_stage == 0 and plan.global_batch_size == 16
