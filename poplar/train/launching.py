"""How a run's ranks come to be, decided once at the edge: :class:`Launch`.

``poplar train`` runs in one of three ways, and everything that tells them apart (the
environment torchrun sets, the GPUs here, the cluster file, ``--nproc``) is read here
and nowhere else:

- under ``torchrun`` (``WORLD_SIZE`` is set): this process is one rank of the group;
- one GPU here and no cluster file: this process is the one rank, on its GPU;
- otherwise the launcher starts the ranks itself (:func:`poplar.processes.spawn.spawn`): one per
  device of the emulated cluster, or ``--nproc`` plain CPU ranks (which need a plan).

>>> from poplar.train.config import TrainConfig
>>> resolve_launch(TrainConfig(cluster="both-differ"), None, env={}, gpus=0)
Launch(in_process=False, world_size=2, devices='emulated', restarted=False)
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from poplar.train.config import TrainConfig

Devices = Literal["emulated", "cuda", "cpu"]


@dataclass(frozen=True)
class Launch:
    """One run's launch: whether this process is a rank, how many ranks, on which devices, a restart or not."""

    in_process: bool      # this process is one rank (torchrun's, or the one GPU's here); else it spawns them
    world_size: int
    devices: Devices      # the emulated cluster's GPUs, real CUDA devices, or this host's CPU
    restarted: bool       # torchrun restarted the group after a failure: the run resumes by itself

    def device(self, rank: int, workload, cluster=None, precision: str = "fp32"):
        """This rank's device, which times its steps (and, emulated, paces them and caps their memory);
        ``cluster``: the emulated cluster's :class:`~poplar.cluster.spec.ClusterSpec`; ``precision``: the
        dtype the rank computes in (an emulated device's pace fits it)."""
        from poplar.devices import rank_device_of

        return rank_device_of(cluster if self.devices == "emulated" else None, rank, workload,
                              cuda=self.devices == "cuda", precision=precision)


def cluster_of(cfg: TrainConfig):
    """The run's cluster file or preset, read (None: none given). Read once, at the edge, and handed on."""
    if not cfg.cluster:
        return None
    from poplar.cluster.spec import load_cluster

    return load_cluster(cfg.cluster)


def resolve_launch(cfg: TrainConfig, nproc: int | None = None, env: Mapping[str, str] | None = None,
                   gpus: int | None = None, cluster=None) -> Launch:
    """The :class:`Launch` of ``cfg`` here; refuses (``ValueError``, one line) a launch that cannot work.
    ``cluster``: ``cfg``'s cluster, read (:func:`cluster_of`; read here where not given)."""
    env = os.environ if env is None else env
    if gpus is None:
        from poplar.profile.discover import cuda_devices_here

        gpus = cuda_devices_here()
    restarted = int(env.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0
    if cluster is None:
        cluster = cluster_of(cfg)
    world = None if cluster is None else cluster.world_size
    if "WORLD_SIZE" in env:
        ranks = int(env["WORLD_SIZE"])
        if world is not None and world != ranks:
            raise ValueError(f"torchrun started {ranks} ranks, but the cluster file describes {world} devices: "
                             "launch one rank per device")
        return Launch(True, ranks, "emulated" if cfg.cluster else ("cuda" if gpus else "cpu"), restarted)
    if world is None and nproc is None and gpus == 1:   # the one GPU here: this process is its rank
        return Launch(True, 1, "cuda", restarted)
    if world is not None:
        if nproc is not None and nproc != world:
            raise ValueError(f"--nproc {nproc}, but the cluster file describes {world} devices: give one of them")
        return Launch(False, world, "emulated", restarted)
    if nproc:
        return Launch(False, nproc, "cpu", restarted)
    if gpus > 1:
        raise ValueError(f"{gpus} CUDA devices here: launch one rank per device, `torchrun --standalone "
                         f"--nproc-per-node {gpus} -m poplar.cli.main train ...`; or give --cluster FILE|PRESET "
                         "(an emulated cluster), or --nproc with --plan (plain CPU ranks)")
    raise ValueError("no cluster file and no CUDA device to discover here: give --cluster FILE|PRESET (an "
                     "emulated cluster), or --nproc with --plan (plain CPU ranks), or launch under torchrun")


def on_planned_ranks(cfg: TrainConfig, launch: Launch, plan, ranks: list[int] | None, out_dir: Path,
                     cluster) -> tuple[TrainConfig, Launch, object]:
    """Where the plan is for some of the emulated cluster's devices only (``ranks``: the planner left the others
    out, as none of their shares lets them hold the model, or as it is faster without them), the run's cluster is
    those devices (``cluster.yaml`` in the run directory) and only their ranks are launched: the run's
    configuration, launch and cluster."""
    if launch.devices != "emulated" or launch.in_process or ranks is None or plan.world_size == launch.world_size:
        return cfg, launch, cluster
    path = out_dir / "cluster.yaml"
    cluster = cluster.subset(ranks)
    path.write_text(cluster.to_yaml())
    return cfg.model_copy(update={"cluster": str(path)}), replace(launch, world_size=len(ranks)), cluster


def precision_of(cfg: TrainConfig, launch: Launch, cluster=None) -> tuple[TrainConfig, str | None]:
    """``cfg`` with its precision checked against the devices the run computes on, before anything runs (a
    V100 or T4 has no bf16: refused in one line naming fp16), and chosen where it is ``auto``; with the line
    that says what was chosen (None where nothing was)."""
    from poplar.cluster.kinds import no_dtype_line
    from poplar.precision import fastest

    if launch.devices == "emulated" and cluster is not None:
        computes = lambda p: all(g.computes(p) for g in cluster.devices)   # noqa: E731
        lacking = lambda p: [g.kind for g in cluster.devices if not g.computes(p)]   # noqa: E731
    elif launch.devices == "cuda":
        import torch

        majors = [torch.cuda.get_device_capability(i)[0] for i in range(torch.cuda.device_count())]
        computes = lambda p: p != "bf16" or all(m >= 8 for m in majors)   # noqa: E731  (bf16 from Ampere)
        lacking = lambda p: [torch.cuda.get_device_name(i) for i, m in enumerate(majors) if m < 8]   # noqa: E731
    else:   # a CPU computes each of them
        computes, lacking = (lambda p: True), (lambda p: [])
    if cfg.auto_precision:
        chosen = fastest(computes)
        why = "" if chosen == "bf16" else f" ({', '.join(lacking('bf16'))}: no bf16 hardware)"
        engine = cfg.engine.model_copy(update={"mixed_precision": chosen})
        return cfg.model_copy(update={"engine": engine}), f"poplar: mixed precision auto: {chosen}{why}"
    want = cfg.engine.mixed_precision
    if launch.devices == "emulated" and cluster is not None:
        cluster.check_precision(want)    # the line every command gives (the command line asks it first)
    elif not computes(want):
        raise ValueError(no_dtype_line(want, lacking(want)))
    return cfg, None
