"""A run survives real signals: SIGKILL of a rank at several points, torchrun's restarts, SIGTERM.

Faults are injected with ``POPLAR_FAULT`` (:mod:`poplar.train.faults`): the rank sends
the signal to itself at the named point, so the death is real and exactly placed.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import poplar
from poplar.processes.spawn import RankFailed
from poplar.runtime.checkpoint import latest_checkpoint, verify
from poplar.train.config import load_config
from poplar.train.run import run_training

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = str(ROOT / "examples" / "cluster-3.yaml")
PLAN = poplar.Plan.from_local_batches(2, [4, 8, 4], 1)      # ZeRO-2, 16 samples on 3 ranks (rank 1 a T4)
STEPS = 4
SHRINK_TO = 0.06


@pytest.fixture(autouse=True)
def caches(tmp_path_factory, monkeypatch):
    shared = tmp_path_factory.getbasetemp() / "fault-caches"
    monkeypatch.setenv("POPLAR_DATA_CACHE", str(shared / "data"))
    monkeypatch.setenv("POPLAR_CACHE_DIR", str(shared / "profiles"))
    monkeypatch.setenv("POPLAR_DILATION", "3")
    monkeypatch.delenv("POPLAR_FAULT", raising=False)


def _fields(tmp_path, name, **kw):
    PLAN.save(tmp_path / "plan.json")
    return {**dict(model="llama-tiny", seq_len=32, vocab_size=512, global_batch=16, steps=STEPS, lr=3e-3,
                   cluster=CLUSTER, plan=str(tmp_path / "plan.json"), out=str(tmp_path / name), checkpoint_every=2),
            **kw}


def _cli(tmp_path, name, *extra, env=None):
    f = _fields(tmp_path, name)
    args = ["train", "--cluster", f["cluster"], "--plan", f["plan"], "--steps", str(STEPS), "--global-batch", "16",
            "--out", f["out"], "--set", "seq_len=32", "--set", "vocab_size=512", "--set", "lr=3e-3",
            "--set", "checkpoint_every=2", *extra]
    return args, {**os.environ, "COLUMNS": "200", "OMP_NUM_THREADS": "1", **(env or {})}


@pytest.fixture(scope="module")
def reference(starts_processes, tmp_path_factory):
    """The uninterrupted run's final parameters (its run directory beside them, under ``.out``)."""
    tmp = tmp_path_factory.mktemp("reference")
    env = {"POPLAR_DATA_CACHE": str(tmp_path_factory.getbasetemp() / "fault-caches" / "data"),
           "POPLAR_DILATION": "3"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        state = run_training(load_config(None, _fields(tmp, "whole")), return_state=True)["state"]
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    return _Reference(state, out=tmp / "whole")


class _Reference(dict):
    def __init__(self, state: dict, out: Path):
        super().__init__(state)
        self.out = out


def _masters(run_dir: Path, tmp: Path) -> dict:
    """The final checkpoint's fp32 masters as whole tensors, read in this process (no ranks)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp / f"{run_dir.name}.pt"
    dcp_to_torch_save(latest_checkpoint(run_dir / "checkpoints"), out)
    return {k: v for k, v in torch.load(out, weights_only=True).items() if k.endswith(".master")}


def _same(state, reference):
    for key, value in reference.items():
        torch.testing.assert_close(state[key], value, atol=1e-6, rtol=0, msg=key)


def test_a_rank_killed_anywhere_stops_the_run_and_resume_matches(tmp_path, monkeypatch, reference):
    """One run killed four times, at four points: each time every rank is gone, the last checkpoint whole.

    A checkpoint every step; each resume must start after the previous kill's last
    complete checkpoint, and the run that finishes must equal the uninterrupted one.
    """
    cfg = load_config(None, _fields(tmp_path, "run", checkpoint_every=1))
    ckpts = tmp_path / "run" / "checkpoints"
    for i, (where, rank, step) in enumerate([("forward", 0, 1), ("backward", 1, 2), ("collective", 2, 3),
                                             ("save", 1, 4)]):
        monkeypatch.setenv("POPLAR_FAULT", f"kill@{where}:rank={rank}:step={step}")
        start = time.monotonic()
        with pytest.raises(RankFailed) as failed:
            run_training(cfg.model_copy(update={"resume": i > 0}))
        assert time.monotonic() - start < 120
        assert failed.value.line == f"rank {rank} was killed by SIGKILL before returning", where
        last = latest_checkpoint(ckpts)
        assert (last.name if last else None) == (f"step-{step - 1:08d}" if step > 1 else None), where
        assert last is None or verify(last) is None
        assert (list(ckpts.glob("*.tmp")) != []) == (where == "save")   # a partial one is never taken for whole
    monkeypatch.delenv("POPLAR_FAULT")
    result = run_training(cfg.model_copy(update={"resume": True}), return_state=True)
    assert result["start"] == STEPS - 1
    _same(result["state"], reference)
    records = [json.loads(x) for x in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(STEPS))      # each step logged once


def test_under_torchrun_a_killed_rank_is_survived_without_a_command(tmp_path, reference):
    args, env = _cli(tmp_path, "elastic", env={"POPLAR_FAULT": "kill@backward:rank=1:step=3"})
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
                          "--max-restarts", "1", "--monitor-interval", "0.2", "-m", "poplar.cli.main", *args],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert "resuming after step 2" in run.stdout
    records = [json.loads(x) for x in (tmp_path / "elastic" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(STEPS))
    assert latest_checkpoint(tmp_path / "elastic" / "checkpoints").name == f"step-{STEPS:08d}"
    ours, theirs = _masters(tmp_path / "elastic", tmp_path), _masters(reference.out, tmp_path)
    assert ours.keys() == theirs.keys() and len(ours) >= 2
    for key, value in theirs.items():
        torch.testing.assert_close(ours[key], value, atol=1e-6, rtol=0, msg=key)


def test_sigterm_checkpoints_and_exits_0_and_a_second_stops_at_once(tmp_path, reference):
    args, env = _cli(tmp_path, "pre", env={"POPLAR_DILATION": "10"})   # slow steps: the signals land mid-run
    log = tmp_path / "pre" / "log.jsonl"

    def run_until_signalled(times: int, after_lines: int):
        proc = subprocess.Popen([sys.executable, "-m", "poplar.cli.main", *args], cwd=ROOT, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and (not log.exists() or len(log.read_text().splitlines()) < after_lines):
            time.sleep(0.02)
        for _ in range(times):
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.05)
        out, _ = proc.communicate(timeout=120)
        return proc.returncode, out

    code, out = run_until_signalled(1, 1)
    assert code == 0, out[-3000:]
    stopped = latest_checkpoint(tmp_path / "pre" / "checkpoints")
    assert stopped.name in ("step-00000001", "step-00000002") and verify(stopped) is None
    assert f"preempted: stopped after step {int(stopped.name[5:])} with a checkpoint" in out
    assert f"poplar train --resume --out {tmp_path / 'pre'}" in out
    args.append("--resume")
    code, out = run_until_signalled(2, int(stopped.name[5:]) + 1)
    assert code != 0 and "a second SIGTERM: stopping now" in out, out[-3000:]
    assert latest_checkpoint(tmp_path / "pre" / "checkpoints") == stopped and verify(stopped) is None
    resumed = run_training(load_config(None, {**_fields(tmp_path, "pre"), "resume": True}), return_state=True)
    assert resumed["start"] == int(stopped.name[5:])
    _same(resumed["state"], reference)


def test_a_device_whose_memory_shrinks_mid_run_is_replanned_and_loses_no_step(tmp_path, monkeypatch, reference):
    # from step 2 on, rank 1's memory (a T4's) holds its state and a few samples' activations, not eight
    monkeypatch.setenv("POPLAR_FAULT", f"shrink@step:rank=1:step=2:to={SHRINK_TO}")
    shrunk = run_training(load_config(None, _fields(tmp_path, "shrunk")), return_state=True)
    assert len(shrunk["losses"]) == STEPS
    _same(shrunk["state"], reference)
    lowered = shrunk["plan"]
    assert lowered.micro_batch_sizes[1] < 8 and lowered.global_batch_size == PLAN.global_batch_size
    assert poplar.Plan.load(tmp_path / "shrunk" / "plan.json") == lowered     # what --resume reads
    assert poplar.Plan.load(tmp_path / "shrunk" / "plan.1.json") == PLAN      # the plan it started with, kept


def test_a_slow_fault_is_written_as_its_grammar_says():
    from poplar.train.faults import Fault

    assert Fault.parse("slow@step:rank=1:step=5:to=0.6:until=9") == Fault("slow", "step", 1, 5, 0.6, 9)
    for bad in ("slow@backward:rank=1:step=5:to=0.6", "slow@step:rank=1:step=5:to=0.6:until=5",
                "kill@backward:rank=1:step=5:until=9", "slow@step:rank=1:step=5:to=1.5"):
        with pytest.raises(ValueError, match="POPLAR_FAULT="):
            Fault.parse(bad)
