"""Runs whose re-plan changes who takes part, on real ranks (gloo) of an emulated cluster: the ranks stop after a
step's checkpoint, ``poplar train`` starts the run again on the re-plan's devices, and the result is exactly
single-device training's; the log reads as one run and says what changed; the run's files say where it now is.

The runs plan from the simulator's profile of the cluster (tests/helpers/replan_profiles.py); the decisions
themselves are walked in tests/runtime/test_replan_who.py.
"""

import json

import pytest
import torch
import yaml

import poplar
from poplar.train.config import load_config
from poplar.train.dataset import prepare_data, workload_of
from poplar.train.report import read_log
from poplar.train.run import run_training
from tests.helpers.replan_profiles import seed_profiles

pytestmark = pytest.mark.slow

OLDER = "bench/clusters/older-card-1.yaml"   # an A100-40GB and an older card: at these sizes the A100 alone
DRAG = "compute-differs"                     # a V100 and a T4: both take part
CASES = {  # cluster: (fields, the fault, the ranks before and after)
    "sits-out": (dict(model="llama-tiny", seq_len=256, vocab_size=1024, global_batch=32, cluster=OLDER),
                 "slow@step:rank=0:step=2:to=0.5", [0], [0, 1]),
    "drag": (dict(model="llama-tiny", seq_len=128, vocab_size=512, global_batch=16, cluster=DRAG),
             "slow@step:rank=1:step=2:to=0.15", [0, 1], [0]),
}
STEPS = 8


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    """The case's caches (data, the simulated profile) and single-device training on its global batches."""
    fields, fault, before, after = CASES[request.param]
    fields = {**fields, "lr": 3e-3, "stages": [0]}
    root = tmp_path_factory.mktemp(f"relaunch-{request.param}")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("POPLAR_DATA_CACHE", str(root / "data"))
        cfg = load_config(None, {**fields, "out": str(root / "unused")})
        wl = workload_of(cfg.model_data, prepare_data(cfg.model_data))
        seed_profiles(root / "profiles", wl, fields["cluster"], fields["global_batch"], cfg.engine, stages=(0,))
        poplar.Plan.from_local_batches(0, [fields["global_batch"]], 1).save(root / "one.json")
        one = run_training(load_config(None, {**fields, "cluster": "none", "plan": str(root / "one.json"),
                                              "steps": STEPS, "out": str(root / "one")}), return_state=True, nproc=1)
    return root, fields, fault, before, after, one["state"]


def test_a_replan_that_changes_who_takes_part_relaunches_and_ends_as_single_device_training(case, tmp_path,
                                                                                          monkeypatch):
    root, fields, fault, before, after, one_device = case
    monkeypatch.setenv("POPLAR_DATA_CACHE", str(root / "data"))
    monkeypatch.setenv("POPLAR_CACHE_DIR", str(root / "profiles"))
    monkeypatch.setenv("POPLAR_DILATION", "150")
    monkeypatch.setenv("POPLAR_FAULT", fault)
    out = tmp_path / "run"
    result = run_training(load_config(None, {**fields, "steps": STEPS, "out": str(out)}), return_state=True)
    for key, value in one_device.items():
        torch.testing.assert_close(result["state"][key], value, atol=1e-5, rtol=0)
    assert result["planning"].ranks == before and len(result["losses"]) == STEPS and result["start"] == 0
    log = read_log(out / "log.jsonl")
    assert [r["step"] for r in log] == list(range(STEPS))                      # one run's log, each step once
    (change,) = [r["replan"] for r in log if "replan" in r]
    assert change["ranks"] == {"before": before, "after": after} and 2 <= change["after_step"] < STEPS
    moved = poplar.Plan.from_dict(change["after"])
    assert result["plan"] == moved == poplar.Plan.load(out / "plan.json") and moved.world_size == len(after)
    basis = json.loads((out / "basis.json").read_text())
    assert basis["ranks"] == after and len(basis["speeds"]) == len(after)
    record = yaml.safe_load((out / "config.yaml").read_text())
    assert record["resume"] is True
    assert record["cluster"] == (fields["cluster"] if len(after) == 2 else str(out / "cluster.yaml"))
    assert json.loads((out / "cluster.json").read_text())["world_size"] == len(after)
