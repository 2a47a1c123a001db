"""The real CUDA devices of the launched ranks, as a cluster: no cluster file needed.

Every rank reads its own GPU's properties (name, memory, compute capability), the
ranks gather them in rank order, and consecutive identical devices become one kind
(named after the GPU, e.g. ``NVIDIA H100 80GB HBM3 (79.1 GiB, sm_90)``). The result
is a :class:`~poplar.cluster.spec.ClusterSpec` whose kinds carry their properties
(``cuda``) instead of declared figures, so the profiler measures the devices themselves.

>>> group_devices([CudaProperties(name="NVIDIA A100-SXM4-80GB", total_memory=85_899_345_920, major=8, minor=0),
...                CudaProperties(name="Tesla T4", total_memory=15_828_320_256, major=7, minor=5),
...                CudaProperties(name="Tesla T4", total_memory=15_828_320_256, major=7, minor=5)]).rank_devices()[2].kind
'Tesla T4 (14.7 GiB, sm_75)'
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from itertools import groupby

import torch
import torch.distributed as dist

from poplar.cluster.kinds import CudaProperties
from poplar.cluster.spec import ClusterSpec, DeviceGroup, presets


def no_devices_message() -> str:
    return ("no cluster file and no CUDA device to discover here: give --cluster FILE|PRESET (an emulated cluster: "
            f"a YAML file, or one of the presets {', '.join(presets())})")


def cuda_devices_here() -> int:
    """How many CUDA devices this process can use (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def local_properties(index: int | None = None) -> CudaProperties:
    """This rank's GPU (default: the current device)."""
    if not torch.cuda.is_available():
        raise ValueError(no_devices_message())
    props = torch.cuda.get_device_properties(torch.cuda.current_device() if index is None else index)
    return CudaProperties(name=props.name, total_memory=props.total_memory, major=props.major, minor=props.minor)


def group_devices(records: Sequence[CudaProperties]) -> ClusterSpec:
    """Ranks' devices (in rank order) as a cluster: identical consecutive devices are one group.

    The same GPU further on starts a new group of the same kind (ranks keep their order,
    and the profiler measures each kind once however many groups it has).
    """
    if not records:
        raise ValueError("no devices to describe: at least one rank is needed")
    groups = [DeviceGroup(kind=props.kind, count=len(list(same)), memory_gb=props.total_memory / 2**30,
                          cuda=props)
              for props, same in groupby(records)]
    return ClusterSpec(devices=groups)


def discover_cluster() -> ClusterSpec:
    """The launched ranks' GPUs, in rank order. A collective when a process group runs: call it on every rank.

    Every rank takes part even when it has no GPU, and every rank then raises alike, so
    no rank is left waiting for another that gave up.
    """
    mine = local_properties() if torch.cuda.is_available() else None
    where = (socket.gethostname(), torch.cuda.current_device()) if mine is not None else None
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (mine, where))
    else:
        everyone = [(mine, where)]
    without = [r for r, (props, _) in enumerate(everyone) if props is None]
    if len(without) == len(everyone):
        raise ValueError(no_devices_message())
    if without:
        raise ValueError(f"ranks {without} have no CUDA device: discovery needs one GPU per rank; launch on GPU "
                         "machines only, or give --cluster FILE|PRESET for an emulated cluster")
    seen: dict = {}
    for rank, (_, at) in enumerate(everyone):
        if at in seen:
            raise ValueError(f"ranks {seen[at]} and {rank} share cuda:{at[1]} on {at[0]}: launch one rank per GPU "
                             "(torchrun --nproc-per-node = the GPUs of each machine)")
        seen[at] = rank
    return group_devices([props for props, _ in everyone])
