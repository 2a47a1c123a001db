"""`poplar bench`'s bookkeeping, without processes: which plans are measured, how rows are filled."""

import dataclasses
import re

import pytest

import poplar.compare.bench
import poplar.planner
from poplar.compare.comparison import Comparison, Contender
from tests.helpers.comparisons import WORKLOAD, profiled_at_once


@pytest.fixture
def measured(monkeypatch):
    """Plans handed to the measurement; each is measured at a speed of its own (100, 200, ... samples/s),
    with overruns of its own (0, 1, ...)."""
    seen = []

    def measure(workload, cluster, plans, steps=12, rounds=3, peers=(), config=None, timeout_s=900):
        seen.append([p.to_dict() for p in plans])
        return [{"step_s": p.global_batch_size / (100.0 * (i + 1)), "busy_s": [0.1] * p.world_size,
                 "samples_per_s": 100.0 * (i + 1), "steps": steps, "overruns": i} for i, p in enumerate(plans)]

    profiled_at_once(monkeypatch)
    monkeypatch.setattr(poplar.compare.bench, "measure_plans", measure)
    return seen


def test_every_distinct_plan_is_measured(measured):
    result = poplar.compare.bench.bench_cluster("both-differ", WORKLOAD, 16, steps=3, peers=False)
    assert [a.name for a in result.allocations] == ["poplar", "uniform", "proportional", "measured-peak"]
    firsts = {}
    for a in result.allocations:   # a plan seen before is that allocation's measurement
        first = firsts.setdefault(repr(a.plan.to_dict()), a.name)
        assert a.same_plan_as == ("" if first == a.name else first)
    assert len(measured) == 1 and [repr(p) for p in measured[0]] == list(firsts)


def test_an_allocation_with_another_ones_plan_is_measured_once_and_says_so(measured, monkeypatch):
    make_plan = poplar.planner.make_plan

    def poplar_keeps_proportional(profile, global_batch, stages=(0, 1, 2, 3), **how):
        result = make_plan(profile, global_batch, stages, **how)
        allocs = result.stages[result.stage].allocations
        allocs["poplar"] = dataclasses.replace(allocs["poplar"], plan=allocs["proportional"].plan)
        return result

    monkeypatch.setattr(poplar.planner, "make_plan", poplar_keeps_proportional)
    result = poplar.compare.bench.bench_cluster("both-differ", WORKLOAD, 16, steps=3, peers=False).to_dict()
    rows = result["allocations"]
    assert rows["poplar"]["plan"] == rows["proportional"]["plan"] != rows["uniform"]["plan"]
    # two plans measured, poplar's first; proportional's row is that measurement
    assert [len(m) for m in measured] == [2] and measured[0][0] == rows["poplar"]["plan"]
    assert rows["proportional"]["same_plan_as"] == "poplar" and "same_plan_as" not in rows["poplar"]
    assert rows["proportional"]["samples_per_s"] == rows["poplar"]["samples_per_s"] == 100.0
    assert rows["uniform"]["samples_per_s"] == 200.0
    assert (rows["poplar"]["overruns"], rows["proportional"]["overruns"], rows["uniform"]["overruns"]) == (0, 0, 1)
    assert result["poplar_vs_proportional"] == 1.0 and result["poplar_vs_uniform"] == 0.5
    assert result["overruns"] == 1      # each plan's run counted once


def test_the_table_and_a_missing_peers_hint_read_whole_in_a_log(measured, monkeypatch):
    from typer.testing import CliRunner

    from poplar.cli.main import app
    from poplar.compare.peers.deepspeed import INSTALL_HINT

    monkeypatch.delenv("COLUMNS", raising=False)
    monkeypatch.setattr(poplar.compare.peers.deepspeed, "unavailable", lambda: INSTALL_HINT)
    run = CliRunner().invoke(app, ["bench", "--cluster", "uneven-quantity,both-differ", "--global-batch", "16",
                                   "--steps", "3"])
    assert run.exit_code == 0, run.output
    header = next(line for line in run.output.splitlines() if "cluster" in line and "allocation" in line)
    assert all(col in header for col in ("vs proportional", "vs measured-peak", "vs deepspeed", "overruns")), header
    assert "uneven-quantity" in run.output and "\u2026" not in run.output
    assert "both-differ: deepspeed: not installed: pip install 'poplar-zero[bench]'" in run.output.splitlines()
    assert re.search(r"^uneven-quantity: measuring \d plans in ZeRO-\d, 3 rounds of 3 steps$", run.output, re.M)


def test_a_cluster_that_fails_is_one_line_and_the_others_figures_are_kept(measured, monkeypatch, tmp_path):
    import json

    from typer.testing import CliRunner

    from poplar.cli.main import app
    from poplar.processes.spawn import RankFailed

    out, seen_before = tmp_path / "bench.json", []
    original = poplar.compare.bench.bench_cluster

    def first_one_fails(name, *args, **kwargs):
        if name == "uneven-quantity":
            raise RankFailed("rank 2 failed:\nTraceback (most recent call last):\n  ...\ntorch.OutOfMemoryError: x",
                             rank=2, line="rank 2: OutOfMemoryError: emulated t4 out of memory")
        seen_before.append(json.loads(out.read_text()))   # what was written before this cluster began
        return original(name, *args, **kwargs)

    monkeypatch.setattr(poplar.compare.bench, "bench_cluster", first_one_fails)
    monkeypatch.setenv("COLUMNS", "250")
    run = CliRunner().invoke(app, ["bench", "--cluster", "uneven-quantity,both-differ", "--global-batch", "16",
                                   "--steps", "3", "--no-peers", "--json", str(out)])
    assert run.exit_code == 1, run.output
    assert "error: uneven-quantity: failed: RankFailed: rank 2: OutOfMemoryError: emulated t4 out of memory" \
        in run.output.splitlines()
    assert "both-differ" in run.output and "Traceback" not in run.output
    assert seen_before == [[{"cluster": "uneven-quantity", "failed": "RankFailed: rank 2: OutOfMemoryError: "
                                                                      "emulated t4 out of memory"}]]
    written = json.loads(out.read_text())
    assert [r["cluster"] for r in written] == ["both-differ", "uneven-quantity"]
    assert written[0]["allocations"]["poplar"]["samples_per_s"] > 0 and "failed" in written[1]


def test_a_plan_that_leaves_cards_out_is_measured_on_the_cards_it_names(monkeypatch):
    """A kind that fits no stage is left out by the planner: every allocation is measured on the other ranks'
    cluster, and a plan that fails is reported beside the others with its reason."""
    import json

    from poplar.cli.tables import bench_table
    from poplar.cluster.spec import parse_cluster
    from poplar.profile.profile import DOES_NOT_FIT
    from tests.planner.profiles import make_profile

    prof = make_profile({"big": (1, 0.01, 0.001, 8), "small": (2, 0.01, 0.001, 0)})
    for s in range(4):
        prof.devices["small"].stages[s] = prof.devices["small"].stages[s].model_copy(
            update={"points": [], "note": DOES_NOT_FIT})
    clusters = []

    def measure(workload, cluster, plans, steps=12, rounds=3, peers=(), config=None, timeout_s=900):
        clusters.append(cluster)
        return [{"failed": "rank 0: OutOfMemoryError: emulated"} if i else
                {"step_s": 0.1, "busy_s": [0.1], "samples_per_s": 80.0, "steps": steps, "overruns": 0}
                for i, _ in enumerate(plans)]

    profiled_at_once(monkeypatch, prof)
    monkeypatch.setattr(poplar.compare.bench, "measure_plans", measure)
    spec = {"devices": [{"kind": "big", "gpu": "A100-80GB"}, {"kind": "small", "gpu": "T4-16GB", "count": 2}]}
    monkeypatch.setattr(poplar.compare.bench, "load_cluster", lambda name: parse_cluster(spec))
    result = poplar.compare.bench.bench_cluster("x", WORKLOAD, 8, steps=3, peers=False)
    assert [(d["kind"], d.get("count", 1)) for d in clusters[0]["devices"]] == [("big", 1)]
    assert result.poplar.samples_per_s == 80.0
    # a plan that could not run is a row of its own, its reason under the table, the others' ratios unharmed
    failed = Contender("uniform", result.poplar.plan, failed="rank 0: OutOfMemoryError: emulated")
    assert failed.samples_per_s is None and failed.measured is None
    shown = dataclasses.replace(result, allocations=(result.poplar, failed))
    table, notes = bench_table([shown], "t")
    assert "x: uniform could not run: rank 0: OutOfMemoryError: emulated" in notes and table.row_count == 3
    # and in the JSON: its reason where the figures would be, the ratio to it None; read back whole
    saved = shown.to_dict()
    assert saved["allocations"]["uniform"]["failed"] == failed.failed and saved["poplar_vs_uniform"] is None
    assert Comparison.from_dict(json.loads(json.dumps(saved))) == shown
