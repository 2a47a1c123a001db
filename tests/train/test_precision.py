"""`poplar train` in fp16: the precision each cluster can run, left to Poplar or asked for, and a model that
overflows fp16 at every scale stopped in one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import poplar
from poplar.cli.main import app
from poplar.train.config import load_config
from poplar.train.run import run_training

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
CLUSTER3 = str(ROOT / "examples" / "cluster-3.yaml")     # an A100-80GB beside two T4-16GB: no bf16 on the T4s
PLAN = poplar.Plan.from_local_batches(1, [6, 4, 2], 1)


@pytest.fixture(autouse=True)
def caches(tmp_path_factory, monkeypatch):
    shared = tmp_path_factory.getbasetemp() / "precision-caches"
    monkeypatch.setenv("POPLAR_DATA_CACHE", str(shared / "data"))
    monkeypatch.setenv("POPLAR_DILATION", "3")


def _fields(tmp_path: Path, name: str, **kw) -> dict:
    PLAN.save(tmp_path / "plan.json")
    return {"model": "llama-tiny", "seq_len": 32, "vocab_size": 512, "global_batch": 12, "steps": 3, "lr": 3e-3,
            "cluster": CLUSTER3, "plan": str(tmp_path / "plan.json"), "out": str(tmp_path / name), **kw}


def test_auto_trains_a_cluster_of_t4s_in_fp16_says_so_and_is_fp16_asked_for(tmp_path, capsys):
    auto = run_training(load_config(None, _fields(tmp_path, "auto", mixed_precision="auto")), return_state=True)
    said = capsys.readouterr().out
    assert "poplar: mixed precision auto: fp16 (t4-16gb: no bf16 hardware)" in said
    asked = run_training(load_config(None, _fields(tmp_path, "fp16", mixed_precision="fp16")), return_state=True)
    assert auto["losses"] == asked["losses"] and all(map(torch.isfinite, map(torch.tensor, auto["losses"])))
    for key, value in asked["state"].items():
        assert torch.equal(auto["state"][key], value), key
    log = (tmp_path / "auto" / "log.jsonl").read_text()
    assert '"loss_scale": 65536.0' in log


def test_a_model_that_overflows_fp16_at_every_scale_stops_in_one_line_naming_the_step(tmp_path):
    f = _fields(tmp_path, "overflow")
    args = ["train", "--cluster", f["cluster"], "--plan", f["plan"], "--global-batch", "12", "--steps", "6",
            "--set", "seq_len=32", "--set", "vocab_size=512", "--set", "mixed_precision=fp16",
            "--set", "lr=1e30", "--set", "clip_grad_norm=null", "--set", "engine.loss_scale.init_scale=4",
            "--out", f["out"]]
    result = CliRunner().invoke(app, args, env={"COLUMNS": "400"})
    assert result.exit_code == 1
    error = [line for line in result.output.splitlines() if line.startswith("error:")]
    # step 1 sends the weights past fp16's range (lr 1e30): 4 -> 2 -> 1, and at the minimum it stops
    assert len(error) == 1 and "NonFiniteError: step 4: the loss is non-finite on ranks 0, 1, 2 at the minimum " \
                               "fp16 loss scale (1)" in error[0], result.output
