"""Rank functions for the emulated cluster's tests (module level: spawned processes import them).

The pace's own measurements are in :mod:`poplar.devices.fidelity` (the benchmark uses them too).
"""

from __future__ import annotations

import functools

import torch

import poplar
from poplar.cluster.spec import parse_cluster
from poplar.devices.emulated import EmulatedDevice
from poplar.models.workload import as_workload

OPTIMIZER = functools.partial(torch.optim.AdamW, lr=1e-4)


def fits(rank, world_size, cluster: dict, micro_batches: list[int]):
    """Does a forward and backward of each micro-batch fit the device (engine states held beside it)?"""
    spec = parse_cluster(cluster)
    wl = as_workload("tiny")
    device = EmulatedDevice(spec, rank, dilation=1.0)
    engine = poplar.initialize(wl.build(), OPTIMIZER, poplar.Plan(0, [1], 1))
    model = wl.build()
    out = {}
    for m in micro_batches:
        try:
            device.check_fits(engine.held_state, lambda: wl.loss(model, wl.random_batch(m)).backward())
            out[m] = True
        except torch.OutOfMemoryError as e:
            out[m] = str(e)
        model.zero_grad(set_to_none=True)
    return {"fits": out, "peak": device.peak_bytes, "capacity": device.capacity}
