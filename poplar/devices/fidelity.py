"""Rank functions that measure how faithfully an emulated cluster keeps its declared pace.

Used by ``bench/bench_emulation.py`` (the figures in docs/devices.md) and by
``tests/devices/test_emulated.py``: each compares a wall-clock measurement over the dilation with the
declared time of the same work. Run them on every rank (``poplar.processes.spawn.spawn``).
"""

from __future__ import annotations

import functools
import statistics
import time

import torch

import poplar
from poplar.cluster.spec import parse_cluster
from poplar.devices.emulated import EmulatedDevice
from poplar.emulate.model import WorkCounter
from poplar.engine import initialize
from poplar.models.workload import as_workload

_OPTIMIZER = functools.partial(torch.optim.AdamW, lr=1e-4)


def micro_steps(rank: int, world_size: int, cluster: dict, sizes: list[int], steps: int = 2) -> dict:
    """Per size, a ZeRO-0 step of one micro-batch of ``tiny``: its declared compute and its measured one.

    Measured: the step's wall time over the dilation, less its waits for the other ranks.
    Declared: the same step's operators counted by the device model (after a first step
    that creates the optimizer's states).
    """
    spec = parse_cluster(cluster)
    wl = as_workload("tiny")
    model = wl.build()
    with EmulatedDevice(spec, rank, probe=lambda m: wl.loss(model, wl.random_batch(m)).backward()) as device:
        rows = []
        for m in sizes:
            engine = initialize(wl.build(), _OPTIMIZER, poplar.Plan(0, [m] * world_size, 1), comm=device.comm)
            batch = wl.random_batch(m, seed=rank)
            engine.train_batch(batch, wl.loss)
            with WorkCounter(device.gpu) as counter:      # not paced: no device step
                engine.train_batch(batch, wl.loss)
            measured = []
            for _ in range(steps):
                device.comm.barrier()
                start = time.perf_counter()
                with device.step(engine.held_state):
                    engine.train_batch(batch, wl.loss)
                measured.append((time.perf_counter() - start) / device.dilation - device.wait_s)
            rows.append({"m": m, "declared": counter.seconds, "measured": statistics.median(measured)})
            engine.close()
        return {"kind": device.kind.kind, "sizes": rows, "overruns": device.overruns, "dilation": device.dilation}


def collective_times(rank: int, world_size: int, cluster: dict, sizes: list[int], repeats: int = 2) -> dict:
    """Per size (bytes), an all-reduce from launch to completion on the wall clock over the dilation, and declared."""
    spec = parse_cluster(cluster)
    with EmulatedDevice(spec, rank) as device:
        rows = []
        for nbytes in sizes:
            t = torch.zeros(nbytes // 4)
            runs = []
            for _ in range(repeats):
                with device.step():
                    device.comm.barrier()                   # both ranks launch at the same device time
                    start = device.origin + device.dilation * device.T    # that time, on the wall clock
                    device.comm.all_reduce(t)
                    runs.append((time.time() - start) / device.dilation)
            rows.append({"bytes": nbytes, "measured": min(runs),
                         "declared": device.network.seconds("all_reduce", nbytes)})
        return {"sizes": rows, "overruns": device.overruns}


def overlapped_collective(rank: int, world_size: int, cluster: dict, nbytes: int) -> dict:
    """A step that launches an all-reduce, computes for longer than it takes, then waits for it."""
    spec = parse_cluster(cluster)
    a = torch.randn(256, 256)

    def compute():
        b = a
        for _ in range(400):
            b = torch.tanh(b @ b)

    with EmulatedDevice(spec, rank, probe=lambda m: [torch.tanh(a @ a) for _ in range(m)]) as device:
        t = torch.zeros(nbytes // 4)
        with WorkCounter(device.gpu) as counter:
            compute()
        with device.step():
            device.comm.barrier()
            work = device.comm.all_reduce(t, async_op=True)
            compute()
            before_wait = device.T
            work.wait()
        return {"step": device.step_s, "wait": device.wait_s, "compute": counter.seconds,
                "network": device.network.seconds("all_reduce", nbytes), "overruns": device.overruns,
                "waited_for": device.T - before_wait}


def queued_collectives(rank: int, world_size: int, cluster: dict, nbytes: int) -> dict:
    """A step that launches two all-reduces at once and waits for both: they share the link, one after the other."""
    spec = parse_cluster(cluster)
    with EmulatedDevice(spec, rank, dilation=100.0) as device:   # slow enough that gloo's real work fits
        a, b = torch.zeros(nbytes // 4), torch.zeros(nbytes // 4)
        with device.step():
            device.comm.barrier()
            before = device.T
            first, second = device.comm.all_reduce(a, async_op=True), device.comm.all_reduce(b, async_op=True)
            first.wait()
            after_first = device.T
            second.wait()
        return {"first": after_first - before, "both": device.T - before,
                "network": device.network.seconds("all_reduce", nbytes)}


def shaped_collectives(rank: int, world_size: int, cluster: dict, nbytes: int) -> dict:
    """Hybrid over the cluster's nodes: an all-gather inside the node, then the sum of a shard across the nodes.

    Each takes the time of the links it crosses: the node's all-gather its intra-node
    link's, the sum across nodes the inter-node link's (see :mod:`poplar.emulate.network`).
    """
    from poplar.engine.layout import ShardLayout

    spec = parse_cluster(cluster)
    groups = spec.node_groups()
    with EmulatedDevice(spec, rank, dilation=1000.0) as device:
        layout = ShardLayout.build(device.comm, groups)
        numel = nbytes // 4
        full = torch.zeros(layout.padded(numel))
        shard = torch.ones(full.numel() // layout.shard_size)
        members = groups[layout.group_index]
        with device.step():
            device.comm.barrier()
            before = device.T
            layout.shard_comm.all_gather(full, shard)
            gathered = device.T
            layout.reduce_across(shard, numel)
            summed = device.T
        return {"gather": gathered - before, "across": summed - gathered, "sum": shard[0].item(),
                "gather_declared": device.network.seconds("all_gather", full.numel() * 4, members),
                "across_declared": device.network.seconds("reduce_across", nbytes, None, len(groups))}
