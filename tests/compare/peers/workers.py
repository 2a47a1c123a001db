"""Ranks for tests/compare/peers (importable by spawned processes)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from poplar.cluster.spec import parse_cluster
from poplar.devices.emulated import EmulatedDevice
from poplar.emulate import GpuModel, WorkCounter
from tests.helpers.comparisons import WORKLOAD


def deepspeed_time_and_memory(rank: int, world_size: int, cluster: dict, stage: int, steps: int,
                              dilation: float) -> dict:
    """DeepSpeed under this rank's emulated device: its step times; then a device too small for a micro-step.

    Each step also counts what the same operators take on every kind of the cluster
    (``declared``), so a rank's busy time can be held against the work it ran.
    """
    from poplar.compare.peers.deepspeed import DeepSpeedSetup

    spec = parse_cluster(cluster)
    gpus = {d.kind: GpuModel.of(d) for d in spec.devices}
    batch = WORKLOAD.random_batch(16, seed=rank)
    times = []
    with EmulatedDevice(spec, rank, dilation=dilation) as device:
        peer = DeepSpeedSetup(stage, micro_batch_size=8, accum_steps=2, world_size=world_size,
                              hidden_size=64).start(WORKLOAD, device.comm)
        for _ in range(steps):
            with device.step(peer.held_state), contextlib.ExitStack() as counting:
                counters = {kind: counting.enter_context(WorkCounter(gpu)) for kind, gpu in gpus.items()}
                peer.train_batch(batch)
            times.append({"compute": device.compute_s, "wait": device.wait_s,
                          "declared": {kind: c.seconds for kind, c in counters.items()}})
        peer.close()
        overruns = device.overruns

    # Room for ZeRO-1's model state and 1 KiB more: the first activation saved overflows.
    # (ZeRO-1's forward launches no collective, so every rank fails at the same place.)
    zero1 = DeepSpeedSetup(1, micro_batch_size=8, accum_steps=2, world_size=world_size, hidden_size=64)
    probe = zero1.start(WORKLOAD)
    state, _ = probe.held_state()
    probe.close()
    small = {"devices": [{"kind": "small", "count": world_size, "memory_gb": (state + 1024) / 2**30,
                          "tflops": 10.0, "memory_bandwidth_gbs": 500.0}]}
    error = None
    with EmulatedDevice(parse_cluster(small), rank, dilation=dilation) as device:
        peer = zero1.start(WORKLOAD, device.comm)
        try:
            with device.step(peer.held_state):
                peer.train_batch(batch)
        except torch.OutOfMemoryError as e:
            error = str(e)
    return {"kind": spec.device(rank).kind, "times": times, "overruns": overruns, "state_bytes": state,
            "capacity": device.capacity, "peak_state_bytes": device.peak_state_bytes, "oom": error}


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

    def start(self, workload, comm=None):
        raise RuntimeError("this peer does not start")
