"""The collectives' figures of a simulated profile: the profiler's own timing, on simulated devices.

The flat collectives and each node's own are timed by :mod:`poplar.profile.timing` on a
:class:`~poplar.devices.simulated.SimulatedDevice`, whose collectives take the network
model's time; the sum across nodes is the network's exchange, then the engine's own
adding of the parts (:mod:`poplar.engine.layout`, run as the engine runs it, its all-to-all not issued).
No engine runs here, so the tensors are meta tensors (shapes only, as fake ones, but dispatched without the fake mode's
bookkeeping: the sum across 512 nodes is thousands of operators).
"""

from __future__ import annotations

import torch

from poplar.cluster.spec import ClusterSpec
from poplar.devices.simulated import SimulatedDevice
from poplar.engine.layout import ShardLayout
from poplar.profile.profile import CommProfile, ShapedComm
from poplar.profile.timing import between_sizes, time_ops

REPEATS = 1   # the network model is deterministic


def simulated_comm(spec: ClusterSpec, numel: int, units: tuple[int, ...] = ()) -> CommProfile:
    """What :func:`poplar.profile.timing.time_collectives` measures on ``spec``, for ``numel`` parameters in
    ``units`` (the engine's unit sizes)."""
    groups = spec.node_groups()
    with torch.device("meta"):
        first = _on_meta(SimulatedDevice(spec, 0))
        flat = time_ops(first, first.comm, numel, REPEATS, units)
        if len(groups) < 2:
            return flat
        links, nodes = spec.intra_links(), spec.rank_nodes()
        alike: dict[tuple, CommProfile] = {}   # nodes of as many ranks over the same link time the same
        inside = []
        for g in groups:
            key = (len(g), links[nodes[g[0]]])
            if key not in alike:
                device = _on_meta(SimulatedDevice(spec, g[0]))
                alike[key] = time_ops(device, device.comm.among(g), numel, REPEATS, units)
            inside.append(alike[key])
        link, add = _across(first, groups, numel)
        link_tiny, add_tiny = _across(first, groups, len(groups) * 64)
        between = [(n, _across(first, groups, n)[0]) for n in between_sizes(units, numel, 1)]
    shaped = ShapedComm(groups=groups, numel=numel, inside=inside, reduce_across_s=link, across_latency_s=link_tiny,
                        across_between_s=between, sum_s=add, sum_latency_s=add_tiny)
    return flat.model_copy(update={"shaped": shaped})


def _on_meta(device: SimulatedDevice) -> SimulatedDevice:
    device.torch_device = torch.device("meta")
    return device


def _across(device: SimulatedDevice, groups: list[list[int]], numel: int) -> tuple[float, float]:
    """The sum across the groups of ``numel`` elements, for ``device``'s rank: on the links (the wait), and adding
    (the engine's own compute around the exchange: the parts sent cut out, those received added)."""
    layout = ShardLayout(device.comm.world_size, groups, device.rank)
    layout.comm = device.comm
    if layout.counterparts is not None:    # the engine's own groups, made without a process group
        layout.across_comm = device.comm.among(layout.counterparts)
    shard = torch.zeros(layout.padded(numel) // layout.shard_size)
    with device.step():
        layout.reduce_across(shard, numel)
    return device.wait_s, device.compute_s
