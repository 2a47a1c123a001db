"""`poplar profile` as one call: the cluster resolved, its ranks launched as this process was launched.

- Under torchrun, or on real CUDA devices (the one GPU here), this process is one rank
  of the group: it joins it and profiles with the others.
- Otherwise it spawns the emulated cluster's ranks itself.
Either way rank 0 gets the profile, and progress events reach ``progress.put`` in this
process.
"""

from __future__ import annotations

import os

from poplar.cluster.spec import ClusterSpec, load_cluster
from poplar.engine.config import EngineConfig
from poplar.profile.options import ProfileOptions
from poplar.profile.profile import Profile
from poplar.profile.profiler import profile_cluster
from poplar.models.workload import Workload


def cluster_to_profile(cluster: str | None, command: str = "profile") -> ClusterSpec:
    """A cluster file or preset; ``None`` (or ``none``): the real CUDA devices the ranks run on, discovered.

    Discovering joins the process group (torchrun's, or one rank here): call it on every rank.
    """
    if cluster is not None and cluster.strip().lower() not in ("", "none"):
        return load_cluster(cluster)
    return discover_devices(command)


def discover_devices(command: str):
    """The real CUDA devices the ranks run on; joins the process group (torchrun's, or one rank here)."""
    from poplar.engine.dist import init_distributed
    from poplar.profile.discover import cuda_devices_here, discover_cluster, no_devices_message

    n = cuda_devices_here()
    if n == 0:
        raise ValueError(no_devices_message())
    if "WORLD_SIZE" not in os.environ and n > 1:
        raise ValueError(f"{n} CUDA devices here: launch one rank per device, `torchrun --standalone "
                         f"--nproc-per-node {n} -m poplar.cli.main {command} ...` (or CUDA_VISIBLE_DEVICES=0 for one)")
    init_distributed()
    return discover_cluster()


def run_profile(workload: Workload, spec: ClusterSpec, options: ProfileOptions, config: EngineConfig | None = None,
                progress=None) -> tuple[Profile, dict] | None:
    """Profile ``workload`` on ``spec``: rank 0's profile and summary (None on the group's other ranks).

    ``progress``: where this process shows the ranks' ``(kind, stage, what)`` events (``put``).
    """
    if "WORLD_SIZE" not in os.environ and not spec.is_real:   # the emulated ranks are this process's to spawn
        return profile_cluster(workload, spec, options, config=config, progress=progress)
    # this process is a rank: torchrun's, or the one GPU's here (a GPU is profiled by the rank that runs on it)
    from poplar.engine.dist import init_distributed, shutdown

    ctx = init_distributed()
    spec.check_world_size(ctx.world_size)
    result = profile_cluster(workload, spec, options, config=config, progress=progress, distributed=True)
    shutdown()
    return result if ctx.rank == 0 else None
