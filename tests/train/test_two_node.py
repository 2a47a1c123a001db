"""The two-node preset as two torchrun agents on this host (--nnodes 2, c10d rendezvous), as on two machines."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import poplar
from poplar.engine.dist import free_port

pytestmark = [pytest.mark.slow, pytest.mark.paced]

ROOT = Path(__file__).resolve().parents[2]


def test_two_torchrun_agents_train_the_two_node_preset_as_one_process_per_node_does(tmp_path):
    plan = poplar.Plan.from_local_batches(1, [6, 2], 1)
    plan.save(tmp_path / "plan.json")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"}   # the pace chosen from the host: step times compared
    common = ["train", "--plan", str(tmp_path / "plan.json"), "--steps", "3", "--global-batch", "8",
              "--cluster", "two-node", "--set", "seq_len=32", "--set", "vocab_size=512"]
    port = free_port()
    agents = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "two-node",
                                "-m", "poplar.cli.main", *common, "--out", str(tmp_path / "agents")],
                               cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for _ in range(2)]
    outputs = []
    try:
        for agent in agents:
            outputs.append(agent.communicate(timeout=300))
    finally:
        for agent in agents:
            agent.kill()
    for agent, (out, err) in zip(agents, outputs):
        teardown_abort = "terminate called without an active exception" in err
        assert agent.returncode == 0 or teardown_abort, out[-2000:] + err[-3000:]
    spawned = subprocess.run([sys.executable, "-m", "poplar.cli.main", *common, "--out", str(tmp_path / "spawned")],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert spawned.returncode == 0, spawned.stdout[-2000:] + spawned.stderr[-3000:]
    logs = {name: [json.loads(line) for line in (tmp_path / name / "log.jsonl").read_text().splitlines()]
            for name in ("agents", "spawned")}
    assert [r["loss"] for r in logs["agents"]] == pytest.approx([r["loss"] for r in logs["spawned"]], abs=1e-6)
    # the same declared devices and link: the same step time, whoever launched the ranks
    for a, s in zip(logs["agents"][1:], logs["spawned"][1:]):
        assert a["step_s"] == pytest.approx(s["step_s"], rel=0.03)
