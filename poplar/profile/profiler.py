"""Measuring every device kind of a cluster, real or emulated, in every ZeRO stage.

Every rank's device (:func:`poplar.devices.rank_device`: its GPU, or an emulated one)
times the work the same way (:mod:`poplar.profile.rank`): a step inside
``device.step()``, its busy time on the device's clock, its waits for collectives left
out. The profiler never reads a device's declared figures: it measures, so on an
emulated cluster the profile against the declared model is a real test of the profiler
and the spline.

Identical devices share one profile (:func:`merge_stage`); profiles are cached on disk
(:mod:`poplar.profile.cache`). The units recorded in the profile are those the engine
builds with the same :class:`~poplar.engine.config.EngineConfig` the profile measured.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics

import torch.distributed as dist

from poplar.cluster.catalogue import gpu, peak_tflops
from poplar.cluster.spec import ClusterSpec, DeviceGroup, parse_cluster
from poplar.engine.config import EngineConfig
from poplar.profile.cache import ProfileCache, cache_key, default_cache_dir
from poplar.profile.fits import check_states_fit
from poplar.profile.options import ProfileOptions
from poplar.profile.probe import largest_micro_batch
from poplar.profile.profile import CommProfile, DeviceProfile, EngineOptions, ModelInfo, Profile, StageProfile
from poplar.profile.rank import RankProfile, profile_rank
from poplar.profile.timing import point_sizes
from poplar.profile.units import unit_flops, unit_numels
from poplar.progress.relay import relayed
from poplar.models.workload import Workload, as_workload

__all__ = ["ProfileOptions", "cache_key", "default_cache_dir", "largest_micro_batch", "merge_stage",
           "point_sizes", "profile_cluster", "profile_rank", "unit_numels"]


def profile_cluster(workload: str | Workload, cluster: dict | ClusterSpec, options: ProfileOptions | None = None, *,
                    config: EngineConfig | None = None, progress=None, on_poll=None, distributed: bool = False,
                    **fields) -> tuple[Profile, dict]:
    """Profile ``workload`` (a model name, or a :class:`Workload`) on ``cluster``, launching its ranks.

    ``cluster`` is emulated (a cluster file's content) or the real CUDA devices of the
    running group (:func:`poplar.profile.discover.discover_cluster`); real devices are
    profiled only with ``distributed=True``. ``options`` (or its fields as keywords):
    what is measured and how. ``config``: the engine's options training will use (its
    units, its buckets; its precision is ``options.precision``). ``progress``: the ranks'
    ``(kind, stage, what)`` events go to its ``put`` (the first rank of each kind reports; in a running group,
    rank 0's shows every rank's: :func:`poplar.progress.relay.relayed`);
    ``on_poll`` is called while spawned ranks run.

    Returns the :class:`Profile` and a summary: which (kind, stage) were measured, which
    read back from the cache, the emulated pace (``dilation``) and its ``overruns``.

    ``distributed=True``: this process is one rank of a running group (torchrun); every
    rank calls this, rank 0's view of the cache decides what is measured, and rank 0
    alone writes the cache.

    >>> options = ProfileOptions(stages=(0,), n_points=3)
    >>> profile, summary = profile_cluster("tiny", load_cluster("memory-differs").model_dump(), options,
    ...                                    config=EngineConfig(unit_numel=10**5))  # doctest: +SKIP
    >>> profile.stage("a100-40gb", 0).max_micro_batch, summary["measured"]  # doctest: +SKIP
    (98, [('a100-40gb', 0), ('a100-80gb', 0)])
    """
    options = options or ProfileOptions()
    if fields:
        options = ProfileOptions(**{**options.model_dump(exclude_unset=True), **fields})
    config = (config or EngineConfig()).model_copy(update={"mixed_precision": options.precision})
    wl, spec = as_workload(workload), parse_cluster(cluster)
    check_states_fit(wl, spec, options.precision)
    if spec.is_real and not distributed:
        raise ValueError("real CUDA devices are profiled by the ranks that run on them: call with distributed=True "
                         "in a running process group (poplar profile does so under torchrun, or on one GPU)")
    cache = ProfileCache(options.cache_dir, wl, spec, options.stages, options.precision, options.max_micro_batch,
                         config)
    cached, comm = still_current(cache, spec) if options.use_cache else ({}, None)
    if distributed:   # every rank must measure the same stages and plan from the same profile: rank 0's cache
        decided = [cached, comm]
        dist.broadcast_object_list(decided, src=0)
        cached, comm = decided
    kinds = list(dict.fromkeys(d.kind for d in spec.devices))
    todo = [s for s in options.stages if any((k, s) not in cached for k in kinds)]
    measured: dict[tuple[str, int], StageProfile] = {}
    ranks: list[RankProfile] = []
    if todo or comm is None:
        ranks = _run_ranks(wl, spec, options.model_copy(update={"stages": tuple(todo)}), config, progress, on_poll,
                           distributed)
        comm = merged_comm(ranks)
        measured = {(k, s): merge_stage([r.stages[s] for r in ranks if r.kind == k]) for s in todo for k in kinds}
        if not distributed or dist.get_rank() == 0:
            cache.save(measured, comm)
    profile = assemble(wl, spec, options.precision, config, {**cached, **measured}, comm)
    summary = {"measured": sorted(measured), "from_cache": sorted(ks for ks in cached if ks not in measured),
               "dilation": ranks[0].dilation if ranks else None, "overruns": sum(r.overruns for r in ranks)}
    return profile, summary


def still_current(cache: ProfileCache, spec: ClusterSpec) -> tuple[dict, CommProfile | None]:
    """The cached stages and collectives still current: what was written before a figure was recorded is not."""
    # stages written before their anatomy was measured are measured again
    cached = {ks: sp for ks, sp in cache.stages().items() if sp.anatomy is not None or not sp.points}
    comm = cache.comm()
    if comm is not None and (comm.between_s is None or len(spec.node_groups()) > 1 and
                             (comm.shaped is None or comm.shaped.sum_s is None)):
        comm = None   # written before the sizes between, or the collectives on the nodes, were timed: again
    return cached, comm


def _run_ranks(wl: Workload, spec: ClusterSpec, options: ProfileOptions, config: EngineConfig, progress, on_poll,
               distributed: bool) -> list[RankProfile]:
    """Every rank's figures: this process's and the group's (``distributed``), or from spawned ranks."""
    args = (wl, spec.model_dump(), options, config)
    if distributed:   # a kind's first rank may be another process: its events reach rank 0's display
        with relayed(progress) as events:
            mine = profile_rank(dist.get_rank(), spec.world_size, *args, events)
            ranks: list = [None] * spec.world_size
            dist.all_gather_object(ranks, mine)
        return ranks
    from poplar.processes.spawn import spawn

    queue = None if progress is None else mp.get_context("spawn").Queue()

    def poll() -> None:   # the ranks are other processes: their events cross through the queue
        while queue is not None and not queue.empty():
            progress.put(queue.get())
        if on_poll is not None:
            on_poll()

    ranks = spawn(profile_rank, spec.world_size, *args, queue, timeout_s=options.spawn_timeout_s(spec.world_size),
                  on_poll=poll)
    poll()   # the last events (a stage done) may arrive after the last wait
    return ranks


def merge_stage(entries: list[StageProfile]) -> StageProfile:
    """One kind's stage profile from its ranks' figures: the smallest limit, median times."""
    return StageProfile(max_micro_batch=min(m.max_micro_batch for m in entries),
                        state_bytes=max(m.state_bytes for m in entries),
                        points=_merge_points([m.points for m in entries]),
                        per_step_s=statistics.median(m.per_step_s for m in entries),
                        note=entries[0].note, anatomy=entries[0].anatomy, memory_points=_merge_memory(entries),
                        share_steps=_merge_points([m.share_steps for m in entries], float),
                        share_gathers=_merge_points([m.share_gathers for m in entries], float))


def _merge_memory(entries: list[StageProfile]) -> list[tuple[int, int]]:
    """Identical devices' memory points: at each, the most states and the smallest micro-batch."""
    lists = [e.memory_points for e in entries]
    if any(len(p) != len(lists[0]) for p in lists):
        return []
    return [(max(p[i][0] for p in lists), min(p[i][1] for p in lists)) for i in range(len(lists[0]))]


def _merge_points(point_lists: list[list[tuple]], at=int) -> list[tuple]:
    """Identical devices share one profile: at each micro-batch size (or share: ``at``), the median of each
    figure timed there."""
    by_size: dict = {}
    for points in point_lists:
        for m, *figures in points:
            by_size.setdefault(at(m), []).append([float(f) for f in figures])
    return [(m, *(statistics.median(column) for column in zip(*rows))) for m, rows in sorted(by_size.items())]


def _rated_tflops(kind: DeviceGroup, precision: str) -> float | None:
    """The data sheet's peak: a discovered GPU's by its name in the catalogue, else the cluster file's."""
    return peak_tflops(kind.cuda.name, precision) if kind.cuda is not None else kind.peak_tflops(precision)


def _rated_bandwidth(kind: DeviceGroup) -> float | None:
    """The data sheet's memory bandwidth (a discovered GPU's by its name in the catalogue), or the cluster file's;
    None where neither knows it."""
    try:
        return gpu(kind.cuda.name).memory_bandwidth_gbs if kind.cuda is not None else kind.bandwidth_gbs
    except (KeyError, ValueError, TypeError, AttributeError):
        return None


def merged_comm(ranks: list[RankProfile]) -> CommProfile:
    """Rank 0's collectives, with each node's own timed by its first rank."""
    comm = ranks[0].comm
    if comm.shaped is None:
        return comm
    inside = [ranks[g[0]].comm.shaped.inside[0] for g in comm.shaped.groups]
    return comm.model_copy(update={"shaped": comm.shaped.model_copy(update={"inside": inside})})


def assemble(wl: Workload, spec: ClusterSpec, precision: str, config: EngineConfig,
             stages: dict[tuple[str, int], StageProfile], comm: CommProfile | None,
             info: ModelInfo | None = None) -> Profile:
    """The profile of ``stages`` and ``comm`` on ``spec``; ``info``: the model's (:func:`model_info`), where known."""
    kinds = {d.kind: d for d in spec.devices}
    devices = {k: DeviceProfile(kind=k, memory_gb=spec.memory_bytes(d) / 2**30,
                                rated_tflops=_rated_tflops(d, precision), memory_bandwidth_gbs=_rated_bandwidth(d),
                                stages={s: sp for (kk, s), sp in sorted(stages.items()) if kk == k})
               for k, d in kinds.items()}
    engine = EngineOptions(**config.model_dump(include=set(EngineOptions.model_fields)))
    return Profile(model=info or model_info(wl, precision, config), ranks=[d.kind for d in spec.rank_devices()],
                   devices=devices, comm=comm, engine=engine)


def model_info(wl: Workload, precision: str, config: EngineConfig) -> ModelInfo:
    """What a profile says of the model: its parameters, the engine's units of it and their FLOPs (the model
    built: on fake tensors, where made inside them)."""
    model = wl.build()
    return ModelInfo(name=wl.name, n_params=sum(p.numel() for p in model.parameters()),
                     frozen_params=sum(p.numel() for p in model.parameters() if not p.requires_grad),
                     unit_numels=unit_numels(model, config), unit_flops=unit_flops(wl, config, model),
                     seq_len=wl.seq_len, dtype=precision)
