"""bench/bench_engine.py: its report and flags without processes; one tiny run end to end with real ranks."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "bench_engine.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_engine", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # its dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


def _ran(ms):
    return {"median_ms": ms, "round_wall_ms": [ms], "losses": [5.0, 4.0], "error": None}


def test_report_divides_poplar_by_the_fastest_peer_of_its_group(bench):
    results = {"ddp": _ran(100.0), "poplar0": _ran(95.0), "zero_redundancy": _ran(120.0), "ds1": _ran(110.0),
               "poplar1": _ran(99.0), "ds2": {"median_ms": None, "error": "not installed: pip install x"},
               "poplar2": _ran(50.0)}
    lines = bench.report(results, list(results))
    assert "poplar stage 0: 0.95x the fastest peer (torch DDP)" in lines
    assert "poplar stage 1: 0.90x the fastest peer (DeepSpeed ZeRO-1)" in lines
    assert "poplar stage 2: 50.0 ms/step (no peer ran in this group)" in lines
    assert results["poplar1"]["ratio_to_fastest_peer"] == pytest.approx(0.9)
    assert results["zero_redundancy"]["ratio_to_fastest_peer"] == pytest.approx(120 / 110)
    ds2 = next(line for line in lines if "DeepSpeed ZeRO-2" in line)
    assert ds2.endswith("unavailable: not installed: pip install x")
    # one block per group, the group named on its first row only
    assert sum(line.startswith("stage ") for line in lines) == 3


def test_without_deepspeed_its_rows_say_so_and_nothing_is_launched_for_them(bench, monkeypatch):
    monkeypatch.setattr(bench.deepspeed, "unavailable", lambda: "not installed: pip install 'poplar-zero[bench]'")
    monkeypatch.setattr(bench, "run_system", lambda *a, **k: pytest.fail("a launch for a missing peer"))
    args = bench.parse_args(["--systems", "ds1,ds3", "--rounds", "2"])
    results, interrupted = bench.run_rounds(args, None, "unused")
    assert not interrupted
    assert {k: (r["median_ms"], r["error"]) for k, r in results.items()} == {
        "ds1": (None, "not installed: pip install 'poplar-zero[bench]'"),
        "ds3": (None, "not installed: pip install 'poplar-zero[bench]'")}
    lines = bench.report(results, args.system_keys)
    assert lines[2].endswith("unavailable: not installed: pip install 'poplar-zero[bench]'")


@pytest.mark.parametrize("argv, message", [
    (["--model", "smal"], "--model/--seq-len/--vocab: model 'smal': choose one of"),
    (["--model", "small", "--seq-len", "64"], "the built-in 'small' model has 128"),
    (["--poplar-config", '{"unit_numel": 0}'], "--poplar-config: unit_numel: Input should be greater than 0"),
    (["--poplar-config", "[1]"], "--poplar-config: write a JSON object"),
    (["--systems", "ddp,fsdp3"], "unknown system(s) ['fsdp3']"),
    (["--steps", "0"], "--steps must be >= 1"),
])
def test_bad_flags_are_refused_in_one_line(bench, capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_tiny_run_gives_every_system_a_step_time_and_the_same_losses(tmp_path):
    systems = ["fsdp2_full", "poplar3"]   # a peer and Poplar: two launches, ~20 s on a quiet machine
    out = tmp_path / "bench.json"
    run = subprocess.run([sys.executable, str(SCRIPT), "--model", "tiny", "--systems", ",".join(systems),
                          "--rounds", "1", "--steps", "2", "--warmup", "1", "--json", str(out)],
                         capture_output=True, text=True, timeout=170)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())["systems"]
    assert list(result) == systems
    for key, r in result.items():
        assert r["error"] is None and r["median_ms"] > 0 and len(r["step_s"]) == 2, (key, r.get("error"))
        assert len(r["losses"]) == 3   # warm-up and timed steps
    # the same weights and batches: every system starts on the same loss and takes the same steps
    assert result["poplar3"]["losses"] == pytest.approx(result["fsdp2_full"]["losses"], abs=1e-5)
    assert result["poplar3"]["fastest_peer"] == "FSDP2 reshard_after_forward=True"
    ratio = result["poplar3"]["median_ms"] / result["fsdp2_full"]["median_ms"]
    assert f"poplar stage 3: {ratio:.2f}x the fastest peer (FSDP2 reshard_after_forward=True)" in run.stdout
