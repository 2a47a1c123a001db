"""Measuring several plans in one launch keeps every figure it can: a plan that cannot run is named with its reason."""

import pytest

import poplar
from poplar.cluster.spec import load_cluster
from poplar.compare.measure import measure_plans
from poplar.models.workload import Workload

pytestmark = pytest.mark.slow     # the plans' ranks

WORKLOAD = Workload(model="llama-tiny", seq_len=64, vocab_size=1024)   # the demo's


def test_a_plan_out_of_memory_is_reported_and_the_others_are_measured(monkeypatch):
    monkeypatch.setenv("POPLAR_DILATION", "3")     # what is checked is memory, not times: a fast pace
    cluster = load_cluster("memory-bound").model_dump()   # the T4 holds one sample a micro-step in ZeRO-1
    fits = poplar.Plan(1, [4, 1], [1, 2])
    too_large = poplar.Plan(1, [4, 6], [1, 1])
    out = measure_plans(WORKLOAD, cluster, [fits, too_large, poplar.Plan(1, [2, 1], [1, 1])], steps=2, warmup=1,
                        rounds=1, timeout_s=240)
    assert len(out) == 3
    assert out[0]["samples_per_s"] > 0 and out[2]["samples_per_s"] > 0
    assert "OutOfMemoryError" in out[1]["failed"] and "rank 1" in out[1]["failed"], out[1]
