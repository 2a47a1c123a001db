"""The README's main job and the benchmark, as a user runs them (real processes, real text)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from poplar.train.report import read_log

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def _number(match) -> float:
    return float(match.group(1).replace(",", ""))


def test_demo_then_bench_on_an_emulated_cluster(tmp_path):
    # a global batch of 24 caps every micro-batch the profiler tries at 24: a shorter profile
    # the pace does not matter here (what does is tested in tests/devices/test_emulated.py): a small dilation runs it fast
    # piped, as into a log: no COLUMNS set, so nothing but the console's own choice decides the width
    env = {**{k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")},
           "POPLAR_CACHE_DIR": str(tmp_path / "profiles"), "POPLAR_DATA_CACHE": str(tmp_path / "data"),
           "POPLAR_DILATION": "3"}
    out = tmp_path / "demo"
    # the closing table's real model simulated as llama-1b's is, a smaller one (the same procedure, fewer operators)
    run = subprocess.run([sys.executable, "-m", "poplar.cli.main", "demo", "--steps", "3", "--global-batch", "24",
                          "--real-model", "llama-tiny", "--out", str(out)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for word in ("poplar", "uniform", "proportional", "ideal", "samples/s", "predicted", "comparison.png"):
        assert word in run.stdout, word
    assert (out / "comparison.png").stat().st_size > 20_000
    # the demo's cluster is memory-bound: its small card holds a sample beside an even share of the states only
    # in ZeRO-1 (at the demo's pace, ZeRO-1 is planned), and in ZeRO-2 beside a smaller share (timed so: at this
    # test's fast pace, whose overruns blur the times, either may win); never in ZeRO-0
    said = " ".join(run.stdout.split())     # however the console wrapped it
    assert re.search(r"llama-tiny on memory-bound: ZeRO-[12]", said) and "stage 0 left out" in said, \
        run.stdout[-3000:]
    # empty caches: the profiling reports every stage as it starts and ends, a line each in a log
    for stage in range(4):
        assert re.search(rf"^memory-bound: (\S+ )?stage {stage}: memory$", run.stdout, re.M), run.stdout[:3000]
        assert re.search(rf"^memory-bound: (\S+ )?stage {stage}: done \(\d+ s\)$", run.stdout, re.M), run.stdout[:3000]
    assert "\u2026" not in run.stdout and "vs uniform" in run.stdout      # the table whole, no column cut
    # and what the same two GPUs do at full memory with a real model, simulated: Poplar against each card alone
    assert "llama-tiny (256-token samples, checkpointed)" in said and "at full memory: simulated" in said \
        and "model TFLOP/s" in said, run.stdout[-3000:]
    real = re.search(r"Poplar \(stage \d[^)]*\) │ +([\d,.]+) │ +([\d,.]+) │ +(\d+)% │", run.stdout)
    alone = re.search(r"a100-80gb alone │ +([\d,.]+) │", run.stdout)
    assert real and alone and _number(real) > _number(alone) > 0, run.stdout[-3000:]
    logs = {name: read_log(out / name / "log.jsonl") for name in ("poplar", "uniform", "proportional")}
    # however the batch is spread, the update is the same: so are the losses
    for name in ("uniform", "proportional"):
        for a, b in zip(logs["poplar"], logs[name]):
            assert abs(a["loss"] - b["loss"]) < 1e-4, (name, a["loss"], b["loss"])
    # the benchmark reuses the demo's profile (same workload) and measures all three
    # DeepSpeed beside Poplar in the bench: tests/peers/test_deepspeed.py; its column is there either way
    bench = subprocess.run([sys.executable, "-m", "poplar.cli.main", "bench", "--cluster", "memory-bound",
                            "--global-batch", "24", "--steps", "3", "--no-peers", "--json", str(tmp_path / "bench.json")],
                           cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=600)
    assert bench.returncode == 0, bench.stdout[-3000:] + bench.stderr[-3000:]
    (result,) = json.loads((tmp_path / "bench.json").read_text())
    header = next(line for line in bench.stdout.splitlines() if "allocation" in line and "cluster" in line)
    for column in ("samples/s", "vs uniform", "vs proportional", "vs measured-peak", "vs deepspeed", "of ideal",
                   "predicted", "overruns"):
        assert column in header, header                                   # whole, in the 80 columns of no terminal
    assert "\u2026" not in bench.stdout and "memory-bound: measuring" in bench.stdout, bench.stdout
    # and Poplar's split with even and with memory-proportional shares of the states (the kinds' memory differs)
    assert set(result["allocations"]) == {"poplar", "uniform", "proportional", "measured-peak", "even-shares",
                                          "memory-shares"}
    assert result["zero_stage"] in (1, 2)                                # as the demo: either may win at this pace
    assert all(a["samples_per_s"] > 0 for a in result["allocations"].values())
    assert result["ideal_samples_per_s"] > 0 and result["poplar_of_ideal"] > 0
