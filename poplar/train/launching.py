"""How a run's ranks come to be, decided once at the edge: :class:`Launch`.

``poplar train`` runs in one of three ways, and everything that tells them apart (the
environment torchrun sets, the GPUs here, the cluster file, ``--nproc``) is read here
and nowhere else:

- under ``torchrun`` (``WORLD_SIZE`` is set): this process is one rank of the group;
- one GPU here and no cluster file: this process is the one rank, on its GPU;
- otherwise the launcher starts the ranks itself (:func:`poplar.processes.spawn.spawn`): one per
  device of the emulated cluster, or ``--nproc`` plain CPU ranks (which need a plan).

:func:`settle` reads them with the config's cluster and precision, once; :class:`Spawned` and
:class:`InProcess` are what differs between the two ways the ranks run (who runs them, who
prepares, how they wait for each other), under one pipeline (:func:`poplar.train.run.run_training`).

>>> from poplar.cluster.spec import load_cluster
>>> resolve_launch(load_cluster("both-differ"), None, env={}, gpus=0)
Launch(in_process=False, world_size=2, devices='emulated', restarted=False, rank=0)
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
    rank: int = 0         # this process's rank where it is one (torchrun's RANK); 0: the launcher, the one GPU's

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


def resolve_launch(cluster, nproc: int | None = None, env: Mapping[str, str] | None = None,
                   gpus: int | None = None) -> Launch:
    """The :class:`Launch` here of a run on ``cluster`` (its :class:`~poplar.cluster.spec.ClusterSpec`, read by
    :func:`cluster_of`; None: none given); refuses (``ValueError``, one line) a launch that cannot work."""
    env = os.environ if env is None else env
    if gpus is None:
        from poplar.profile.discover import cuda_devices_here

        gpus = cuda_devices_here()
    restarted = int(env.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0
    world = None if cluster is None else cluster.world_size
    if "WORLD_SIZE" in env:
        ranks = int(env["WORLD_SIZE"])
        if world is not None and world != ranks:
            raise ValueError(f"torchrun started {ranks} ranks, but the cluster file describes {world} devices: "
                             "launch one rank per device")
        return Launch(True, ranks, "emulated" if cluster is not None else ("cuda" if gpus else "cpu"), restarted,
                      int(env.get("RANK", "0")))
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


def settle(cfg: TrainConfig, nproc: int | None = None) -> tuple[TrainConfig, Launch, object, str | None]:
    """The run's config as it trains, its :class:`Launch` and its cluster (read: a
    :class:`~poplar.cluster.spec.ClusterSpec`, None without one), decided once, here; with the line that says the
    precision chosen (None where it was not ``auto``). The config is resolved here and nowhere later: its precision
    where it is ``auto`` (:func:`precision_of`), ``resume`` where torchrun restarted the group after a failure
    (it continues from the newest checkpoint)."""
    cluster = cluster_of(cfg)
    launch = resolve_launch(cluster, nproc)
    precision, said = precision_of(cfg, launch, cluster)
    update = {"resume": True} if launch.restarted else {}
    if precision != cfg.engine.mixed_precision:
        update["engine"] = cfg.engine.model_copy(update={"mixed_precision": precision})
    return (cfg.model_copy(update=update) if update else cfg), launch, cluster, said


def on_planned_ranks(launch: Launch, plan, ranks: list[int] | None, cluster,
                     out: str) -> tuple[Launch, object, str | None]:
    """Where the plan is for some of the emulated cluster's devices only (``ranks``: the planner left the others
    out, as none of their shares lets them hold the model, or as it is faster without them), the run's cluster is
    those devices and only their ranks are launched: the run's launch and cluster, and the file the cluster is
    written to for a resume (``cluster.yaml`` in the run directory; None where the cluster is the command's)."""
    if launch.devices != "emulated" or launch.in_process or ranks is None or plan.world_size == launch.world_size:
        return launch, cluster, None
    path = Path(out) / "cluster.yaml"
    cluster = cluster.subset(ranks)
    path.write_text(cluster.to_yaml())
    return replace(launch, world_size=len(ranks)), cluster, str(path)


def precision_of(cfg: TrainConfig, launch: Launch, cluster=None) -> tuple[str, str | None]:
    """The precision the run computes in: ``cfg``'s, checked against the devices the run computes on, before
    anything runs (a V100 or T4 has no bf16: refused in one line naming fp16), or chosen where it is ``auto``; with
    the line that says what was chosen (None where nothing was)."""
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
        return chosen, f"poplar: mixed precision auto: {chosen}{why}"
    want = cfg.engine.mixed_precision
    if launch.devices == "emulated" and cluster is not None:
        cluster.check_precision(want)    # the line every command gives (the command line asks it first)
    elif not computes(want):
        raise ValueError(no_dtype_line(want, lacking(want)))
    return want, None


class Spawned:
    """The ranks started here (:func:`poplar.processes.spawn.spawn`), this process their launcher: it prepares the
    data, plans (profiling as a process of its own) and writes the run's files alone, then hands the run to every
    rank."""

    lead = True          # says, prepares and writes
    distributed = False  # plans alone

    def __init__(self, timeout_s: float):
        self.timeout_s = timeout_s

    def __enter__(self) -> Spawned:
        return self

    def __exit__(self, *exc) -> None:
        return None

    def share(self, make):
        """``make()``'s value: the ranks receive it with the run."""
        return make()

    def barrier(self) -> None:
        """Nothing to wait for: the ranks start once the launcher is done."""

    def train(self, train_rank, run, return_state: bool) -> dict:
        """Every rank trains ``run`` (``train_rank(rank, world_size, run, return_state)``, importable); rank 0's
        result."""
        from poplar.processes.spawn import spawn

        return spawn(train_rank, run.world_size, run, return_state, timeout_s=self.timeout_s)[0]


class InProcess:
    """This process is one rank (torchrun's, or the one GPU's here), in the group from entering to leaving: rank 0
    says, prepares the data and writes the run's files, the others wait for it and receive what it prepared; every
    rank plans (profiling together) and trains."""

    distributed = True

    def __init__(self, launch: Launch):
        self.rank, self.world_size, self.lead = launch.rank, launch.world_size, launch.rank == 0

    def __enter__(self) -> InProcess:
        from poplar.engine.dist import init_distributed

        init_distributed()
        return self

    def __exit__(self, *exc) -> None:
        from poplar.engine.dist import shutdown

        shutdown()

    def share(self, make):
        """``make()``, made by rank 0 alone, on every rank (broadcast: no rank makes it again, whatever its node's
        disk holds); where it raised, its error raised on every rank (none is left waiting)."""
        if self.world_size == 1:
            return make()
        import torch.distributed as dist

        box = [None]
        if self.lead:
            try:
                box = [make()]
            except Exception as e:   # every rank raises it, below
                box = [e]
        dist.broadcast_object_list(box, src=0)
        if isinstance(box[0], Exception):
            raise box[0]
        return box[0]

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier()

    def train(self, train_rank, run, return_state: bool) -> dict:
        """This rank trains ``run`` (``train_rank(rank, world_size, run, return_state)``); its result."""
        return train_rank(self.rank, run.world_size, run, return_state)
