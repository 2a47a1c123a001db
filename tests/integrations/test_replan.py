"""Re-planning in every front end (Lightning, the HF Trainer, DeepSpeed's loop): real ranks (gloo) of an emulated
cluster whose first card computes at half the speed its profile says. Each front end re-plans around it from the
steps it measures, its data cut with each step's plan, and ends exactly where the same run with re-planning off
ends (which trains the very global batches of one device: tests/integrations/test_*.py); the DeepSpeed form's
run, saved after its re-plan and resumed in a new run, continues with the re-planned plan and ends as the whole.

The profile is the simulator's of the full-speed cluster, put where the ranks' profiling reads its cache
(tests/helpers/replan_profiles.py).
"""

import pytest
import torch

import poplar
from poplar.cluster.spec import load_cluster
from poplar.engine.config import EngineConfig
from poplar.processes.spawn import spawn
from tests.integrations import replan_workers as W
from tests.helpers.replan_profiles import seed_profiles

pytestmark = pytest.mark.slow

CLUSTER = "compute-differs"      # a V100 and a T4


@pytest.fixture(scope="module")
def slowed(tmp_path_factory):
    """The cluster file with the V100 at half its speed, and the profile cache holding the full-speed profile."""
    root = tmp_path_factory.mktemp("replan-integrations")
    seed_profiles(root / "profiles", W.workload(), CLUSTER, W.GLOBAL_BATCH, EngineConfig(), stages=(1, 2, 3))
    path = root / "slowed.yaml"
    path.write_text(load_cluster(CLUSTER).slowed(0, 0.5).to_yaml())
    return root, str(path)


@pytest.fixture
def on_slowed(slowed, monkeypatch):
    root, cluster = slowed
    monkeypatch.setenv("POPLAR_CACHE_DIR", str(root / "profiles"))
    monkeypatch.setenv("POPLAR_DILATION", "150")    # the real work inside every span: the times are the declared ones
    return cluster


@pytest.mark.parametrize("front, stage", [("deepspeed", 2), ("lightning", 1), ("hf", 3)])
def test_every_front_end_replans_around_a_slow_card_and_ends_as_the_run_that_does_not(on_slowed, tmp_path, front,
                                                                                     stage):
    replanned, kept = spawn(W.both, 2, front, on_slowed, stage, str(tmp_path), timeout_s=280)[0]
    assert kept["replans"] == [] and replanned["steps"] == kept["steps"] == W.STEPS
    change = replanned["replans"][0]
    before, after = poplar.Plan.from_dict(change["before"]), poplar.Plan.from_dict(change["after"])
    assert before == poplar.Plan.from_dict(kept["plan"]) and before.zero_stage == after.zero_stage == stage
    assert change["speeds"][0] == pytest.approx(2.0, rel=0.05)
    assert after.local_batch_size(0) < before.local_batch_size(0)     # the slow V100 takes fewer samples
    assert poplar.Plan.from_dict(replanned["plan"]) == after
    for key, value in kept["state"].items():
        torch.testing.assert_close(replanned["state"][key], value, atol=1e-5, rtol=0)
    if front == "deepspeed":   # saved after step 5, resumed in a new run: the checkpoint's plan, not the profile's
        resumed = replanned["resumed"]
        assert change["after_step"] < 5 and replanned["loaded"] == change["after"]
        assert resumed["steps"] == W.STEPS and resumed["replans"] == []
        for key, value in replanned["state"].items():
            torch.testing.assert_close(resumed["state"][key], value, atol=1e-5, rtol=0)
