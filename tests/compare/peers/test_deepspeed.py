"""DeepSpeed as a measured peer: it runs under the emulated devices (time and memory) and in `poplar bench`.

The tests that run DeepSpeed skip where it is not installed; the others check what the
benchmark does without it, or when a peer fails, and run everywhere.
"""

import importlib.util
import json
import statistics

import pytest

import poplar.compare.bench
from poplar.compare.measure import measure_plans
from poplar.compare.peers import PeerFailed
from poplar.compare.peers.deepspeed import INSTALL_HINT
from poplar.processes.spawn import spawn
from tests.compare.peers.workers import BrokenSetup, deepspeed_time_and_memory
from tests.helpers.comparisons import WORKLOAD, profiled_at_once

# the same memory (20 and 4 GB), different compute: by the data sheets the T4 has 8.1 fp32 TFLOP/s
# and 320 GB/s beside the A100's 19.5 and 2,039
A100_T4 = {"memory_scale": 0.25, "devices": [{"kind": "a100", "gpu": "A100-80GB"}, {"kind": "t4", "gpu": "T4-16GB"}]}
DILATION = 40    # the pace: every figure is in the declared devices' seconds whatever it is


@pytest.fixture(autouse=True)
def caches(tmp_path, monkeypatch):
    monkeypatch.setenv("POPLAR_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("POPLAR_DILATION", str(DILATION))


@pytest.fixture(scope="module")
def zero3_ranks(starts_processes, tmp_path_factory):
    pytest.importorskip("deepspeed")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("POPLAR_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        return spawn(deepspeed_time_and_memory, 2, A100_T4, 3, 6, DILATION, timeout_s=240)


@pytest.mark.paced
def test_deepspeed_computes_at_the_pace_of_the_declared_gpus(zero3_ranks):
    a100, t4 = zero3_ranks
    assert (a100["kind"], t4["kind"]) == ("a100", "t4")
    steps = {r["kind"]: r["times"][1:] for r in zero3_ranks}    # the first step creates the optimizer states
    busy = {kind: statistics.median(s["compute"] for s in times) for kind, times in steps.items()}
    # the same work every step takes the same declared time, whatever the host did meanwhile
    for kind, times in steps.items():
        assert all(s["compute"] == pytest.approx(busy[kind], rel=0.03) for s in times), times
    # slower on the T4, by as much as the same operators take longer on it than on the A100
    assert busy["t4"] > busy["a100"]
    declared = {kind: statistics.median(s["declared"]["t4"] / s["declared"]["a100"] for s in times)
                for kind, times in steps.items()}
    assert declared["a100"] > 1
    assert busy["t4"] / busy["a100"] == pytest.approx(declared["a100"], rel=0.02), (busy, declared)
    # ZeRO-3 gathers parameters asynchronously and reduce-scatters gradients: if any of
    # DeepSpeed's waits escaped the device, the A100's waiting for the T4 would count as its compute
    fast = steps["a100"]
    assert statistics.median(s["wait"] for s in fast) > 0.5 * statistics.median(s["compute"] for s in fast)


@pytest.mark.paced
def test_deepspeed_runs_out_of_the_emulated_memory(zero3_ranks):
    for rank in zero3_ranks:
        assert rank["oom"] is not None and "out of memory" in rank["oom"], rank["oom"]
        # its model state fitted: what overflowed were the activations its forward saved
        assert 0 < rank["peak_state_bytes"] == rank["state_bytes"] < rank["capacity"]


@pytest.mark.slow
def test_bench_measures_deepspeed_beside_poplar(tmp_path, monkeypatch):
    pytest.importorskip("deepspeed")
    from typer.testing import CliRunner

    from poplar.cli.main import app

    profiled_at_once(monkeypatch)
    monkeypatch.setenv("COLUMNS", "200")
    out = tmp_path / "bench.json"
    run = CliRunner().invoke(app, ["bench", "--cluster", "both-differ", "--model", "llama-tiny", "--seq-len", "32",
                                   "--vocab-size", "512", "--global-batch", "16", "--steps", "3", "--json", str(out)])
    assert run.exit_code == 0, run.output
    (result,) = json.loads(out.read_text())
    ds = result["peers"]["deepspeed"]
    uniform = result["allocations"]["uniform"]["plan"]
    assert ds["config"]["zero_optimization"]["stage"] == result["zero_stage"]
    assert ds["config"]["train_micro_batch_size_per_gpu"] == max(uniform["micro_batch_sizes"])
    assert ds["config"]["gradient_accumulation_steps"] == uniform["accum_steps"][0]
    assert ds["global_batch"] == 16 and ds["samples_per_s"] > 0
    assert isinstance(ds["overruns"], int) and ds["overruns"] >= 0     # reported beside the figure, as for Poplar's
    assert ds["tokens_per_s"] == pytest.approx(32 * ds["samples_per_s"])
    poplar_speed = result["allocations"]["poplar"]["samples_per_s"]
    assert result["poplar_vs_deepspeed"] == pytest.approx(poplar_speed / ds["samples_per_s"])
    assert "vs deepspeed" in run.output      # and its row in the table, beside Poplar's
    assert any("both-differ" in line and " deepspeed " in line for line in run.output.splitlines())


@pytest.mark.slow
def test_a_peer_that_cannot_start_fails_the_launch_with_its_reason():
    with pytest.raises(PeerFailed, match=r"broken \(ZeRO-1, micro-batch 4 x 1\) failed on rank \d: "
                                         r"RuntimeError: this peer does not start"):
        measure_plans(WORKLOAD, A100_T4, [], peers=[BrokenSetup()], timeout_s=60)


def fake_measure(calls):
    """measure_plans without processes: every plan and peer at 100 samples/s.

    A peer that is not DeepSpeed fails; DeepSpeed runs out of memory above micro-batch 4.
    """
    def measure(workload, cluster, plans, steps=12, rounds=3, peers=(), config=None, timeout_s=900):
        calls.append([f"{p.name}:{p.micro_batch_size}" for p in peers])
        if any(p.name != "deepspeed" for p in peers):
            raise PeerFailed("broken: it failed")
        if any(p.micro_batch_size > 4 for p in peers):
            raise PeerFailed("deepspeed (...) failed on rank 1: OutOfMemoryError: emulated v100s-32gb (rank 1) ...")
        return [{"step_s": w.global_batch_size / 100, "busy_s": [0.1, 0.1], "samples_per_s": 100.0, "steps": 3,
                 "overruns": 0} for w in [*plans, *peers]]
    return measure


@pytest.fixture
def no_processes(monkeypatch):
    calls = []
    profiled_at_once(monkeypatch)
    monkeypatch.setattr(poplar.compare.bench, "measure_plans", fake_measure(calls))
    return calls


def test_without_deepspeed_the_row_is_absent_and_the_output_says_why(no_processes, monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else find_spec(name, *a))
    result = poplar.compare.bench.bench_cluster("both-differ", WORKLOAD, 16, steps=3).to_dict()
    assert result["peers"] == {"deepspeed": INSTALL_HINT} and result["poplar_vs_deepspeed"] is None
    assert set(result["allocations"]) == {"poplar", "uniform", "proportional", "measured-peak"} and no_processes == [[]]
    # and without peers asked for, none is tried and nothing is said
    result = poplar.compare.bench.bench_cluster("both-differ", WORKLOAD, 16, steps=3, peers=False)
    assert result.peers == {} and no_processes == [[], []]


def test_a_failing_peer_is_reported_and_poplar_measured_without_it(no_processes, monkeypatch):
    monkeypatch.setattr(poplar.compare.bench, "deepspeed_setup", lambda result, workload: (BrokenSetup(), None))
    result = poplar.compare.bench.bench_cluster("both-differ", WORKLOAD, 16, steps=3)
    assert result.peers == {"broken": "broken: it failed"} and result.to_dict()["poplar_vs_deepspeed"] is None
    assert no_processes == [["broken:4"], []]
    assert all(a.samples_per_s == 100.0 for a in result.allocations)


def test_deepspeed_out_of_memory_gets_the_next_smaller_micro_batch(no_processes, monkeypatch):
    pytest.importorskip("deepspeed")
    from poplar.compare.peers.deepspeed import DeepSpeedSetup

    setup = DeepSpeedSetup(zero_stage=0, micro_batch_size=8, accum_steps=1, world_size=2, hidden_size=64)
    monkeypatch.setattr(poplar.compare.bench, "deepspeed_setup", lambda result, workload: (setup, None))
    result = poplar.compare.bench.bench_cluster("both-differ", WORKLOAD, 16, steps=3).to_dict()
    ds = result["peers"]["deepspeed"]
    # 8 samples per rank: 8 x 1 did not fit, 4 x 2 did (7, 6 and 5 do not divide 8)
    assert no_processes == [["deepspeed:8"], ["deepspeed:4"]]
    assert (ds["micro_batch_size"], ds["accum_steps"], ds["config"]["gradient_accumulation_steps"]) == (4, 2, 2)
    assert len(ds["failed_before"]) == 1 and "OutOfMemoryError" in ds["failed_before"][0]
    assert result["poplar_vs_deepspeed"] == pytest.approx(1.0)
