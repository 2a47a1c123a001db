"""Ranks for tests/peers (importable by spawned processes)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from poplar.emulate import EmulatedDevice, parse_cluster
from poplar.workload import Workload

WORKLOAD = Workload(model="llama-tiny", seq_len=32, vocab_size=512)


def deepspeed_speed_and_memory(rank: int, world_size: int, cluster: dict, stage: int, steps: int,
                               slowdown: float) -> dict:
    """DeepSpeed under this rank's emulated device: its step times; then a device too small for a micro-step."""
    from poplar.peers.deepspeed import DeepSpeedSetup

    spec = parse_cluster(cluster)
    device = EmulatedDevice(spec.device(rank), rank, slowdown)
    batch = WORKLOAD.random_batch(16, seed=rank)
    peer = DeepSpeedSetup(stage, micro_batch_size=8, accum_steps=2, world_size=world_size, hidden_size=64).start(
        WORKLOAD, device)
    times = []
    for _ in range(steps):
        peer.train_batch(batch)
        times.append({"compute": device.step_wall_s - device.wait_s, "wait": device.wait_s})
    peer.close()

    # Room for ZeRO-1's model state and 1 KiB more: the first activation saved overflows.
    # (ZeRO-1's forward launches no collective, so every rank fails at the same place.)
    zero1 = DeepSpeedSetup(1, micro_batch_size=8, accum_steps=2, world_size=world_size, hidden_size=64)
    probe = zero1.start(WORKLOAD, device)
    state, _ = probe.held_state()
    probe.close()
    small = EmulatedDevice(parse_cluster({"devices": [{"kind": "small", "speed": 1.0,
                                                       "memory_gb": (state + 1024) / 2**30}]}).device(0), rank)
    peer = zero1.start(WORKLOAD, small)
    error = None
    try:
        peer.train_batch(batch)
    except torch.OutOfMemoryError as e:
        error = str(e)
    return {"times": times, "state_bytes": state, "capacity": small.capacity,
            "peak_state_bytes": small.peak_state_bytes, "oom": error}


@dataclass(frozen=True)
class BrokenSetup:
    """A peer that cannot start (as a DeepSpeed with a wrong config would fail)."""

    name: str = "broken"
    zero_stage: int = 1
    micro_batch_size: int = 4
    accum_steps: int = 1
    global_batch_size: int = 8

    def local_batch_size(self, rank: int) -> int:
        return 4

    def start(self, workload, device):
        raise RuntimeError("this peer does not start")
