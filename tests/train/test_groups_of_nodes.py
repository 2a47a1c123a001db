"""The planner's shard groups of several nodes, trained on the emulated lab-sized miniature (two nodes of one
A100-80GB, four of one V100-16GB, at a memory scale where a V100 alone holds no copy of the states): groups of
unlike sizes spanning nodes, in ZeRO-1, equal single-device training to 1e-5 (every partition of up to five
ranks, in every stage, is walked in tests/engine/test_shapes.py; this is the planner's own shape, through
``poplar train`` on the emulated devices and network)."""

import pytest
import torch

import poplar
from poplar.cluster.spec import load_cluster
from poplar.planner.groups import kind_shapes
from poplar.train.config import load_config
from poplar.train.dataset import prepare_data, workload_of
from poplar.train.run import run_training
from poplar.simulate import simulate_profile
from poplar.profile.options import ProfileOptions

pytestmark = pytest.mark.slow

CLUSTER = "bench/clusters/lab-miniature.yaml"
FIELDS = dict(model="llama-tiny", seq_len=64, vocab_size=1024, global_batch=24, lr=3e-3, stages=[1])
STEPS = 3


def test_the_planners_groups_of_several_nodes_train_as_one_device(tmp_path, monkeypatch):
    monkeypatch.setenv("POPLAR_DATA_CACHE", str(tmp_path / "data"))
    monkeypatch.setenv("POPLAR_DILATION", "150")
    cfg = load_config(None, {**FIELDS, "out": str(tmp_path / "unused")})
    wl = workload_of(cfg.model_data, prepare_data(cfg.model_data))
    profile = simulate_profile(wl, load_cluster(CLUSTER), ProfileOptions(stages=(1,), max_micro_batch=8, n_points=2))
    every = list(range(profile.world_size))
    shape = kind_shapes(profile, every, 1)["1-2 nodes a group"]     # each A100 a group, the V100s two by two
    assert sorted(map(len, shape.groups)) == [1, 1, 2, 2]
    plan = poplar.Plan.from_local_batches(1, [8, 6, 2, 2, 3, 3], [2, 1, 2, 2, 3, 3], shard_groups=shape.groups)
    plan.save(tmp_path / "plan.json")
    poplar.Plan(0, [FIELDS["global_batch"]], 1).save(tmp_path / "one.json")
    one = run_training(load_config(None, {**FIELDS, "cluster": "none", "plan": str(tmp_path / "one.json"),
                                          "steps": STEPS, "out": str(tmp_path / "one")}), return_state=True, nproc=1)
    mine = run_training(load_config(None, {**FIELDS, "cluster": CLUSTER, "plan": str(tmp_path / "plan.json"),
                                           "steps": STEPS, "out": str(tmp_path / "groups")}), return_state=True)
    assert mine["plan"] == plan
    for key, value in one["state"].items():
        torch.testing.assert_close(mine["state"][key], value, atol=1e-5, rtol=0)
