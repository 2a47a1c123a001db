"""Measuring every device kind in every ZeRO stage, on an (emulated) cluster.

Per stage, each rank
1. builds the engine for that stage and takes two steps of two micro-batches of 1, so
   the model states it holds at their most (optimizer states, and the gradients
   accumulated between micro-steps) are all there;
2. finds the largest micro-batch that fits its memory: it grows the micro-batch, then
   bisects, running forward and backward on a local copy of the model under its
   device's memory accounting (the activations do not depend on the stage; the model
   states do and come from step 1). An out-of-memory is caught, cleaned up after, and
   never strands the other ranks, since this probe has no collectives;
3. trains at ``n_points`` micro-batch sizes up to that limit, every rank at its own
   sizes, one step of each size per round (so drifts of the host fall on all sizes
   alike). Each step has two micro-batches: the first one's compute is what every
   further micro-step costs; the rest of the step's compute (the step's wall time minus
   its waits for collectives) is what a step costs once (synchronisation, the update).
   A point is their sum: a step of one micro-batch. After warm-up rounds, the median
   over ``repeats`` rounds.
Then the collectives are timed at the model's size. Identical devices share one
profile; profiles are cached on disk, keyed by what changes them.

On real CUDA devices (a discovered cluster, see :mod:`poplar.profile.discover`) the same
steps run on the GPUs themselves: the probe runs out of memory for real (the local model
on the GPU, the stage's other model states held beside it as a reserved buffer), steps
are timed by :class:`~poplar.engine.cuda_device.CudaDevice`, and the sizes are timed
one after another rather than with every size's engine alive at once (a real GPU holds
each engine's states for real, so at the limit only one fits; and a GPU's speed does not
drift the way this host's shared vCPUs do, which is what the interleaving is for).
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

import poplar
from poplar.emulate import EmulatedDevice, parse_cluster
from poplar.emulate.calibration import calibration
from poplar.engine import collectives as C
from poplar.engine.cuda_device import CudaDevice
from poplar.engine.engine import EngineConfig
from poplar.engine.units import build_units
from poplar.workload import Workload, as_workload
from poplar.profile.profile import CommProfile, DeviceProfile, ModelInfo, Profile, StageProfile

_OPTIMIZER_LR = 1e-4
HEADROOM = 0.01      # of a device's memory, left free by the largest micro-batch the profiler reports
# on a real GPU more: the probe runs on a freshly emptied allocator, a training step on one
# that earlier allocations have fragmented (an H100 at bf16 had 2.6 GiB reserved but unusable)
REAL_HEADROOM = 0.04


def default_cache_dir() -> Path:
    return Path(os.environ.get("POPLAR_CACHE_DIR", Path.home() / ".cache" / "poplar" / "profiles"))


def cache_key(workload: str | Workload, kind: dict, stage: int, world_size: int, slowdown: float,
              dtype: str = "fp32", max_micro_batch: int = 256, real: bool = False) -> str:
    """Everything that changes a device's stage profile: model, its shapes, device, stage, world, dtype.

    ``real``: ``kind`` is a real CUDA device (its dict names the GPU, its memory and
    capability); the host's calibration then means nothing, the software driving the
    GPU does.
    """
    key = {"workload": as_workload(workload).cache_dict(), "device": kind, "stage": stage, "world_size": world_size,
           "slowdown": round(slowdown, 6), "dtype": dtype, "max_micro_batch": max_micro_batch,
           "poplar": poplar.__version__}
    if real:
        key["software"] = {"torch": torch.__version__, "cuda": torch.version.cuda,
                           "cudnn": torch.backends.cudnn.version()}
    else:
        key["calibration"] = calibration().id
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]


# ---------------------------------------------------------------------------- in each rank
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def compute_dtype(mixed_precision: str | None) -> str:
    """The profile dtype of a training's ``mixed_precision``: ``none`` (or None, ``fp32``) is fp32, ``bf16`` bf16."""
    dtype = {"none": "fp32", "fp32": "fp32", "bf16": "bf16"}.get((mixed_precision or "none").strip().lower())
    if dtype is None:
        raise ValueError(f"mixed precision {mixed_precision!r}: give none (fp32) or bf16")
    return dtype


def _mixed_precision(dtype: str) -> str | None:
    """The engine's ``mixed_precision`` for a profile's compute ``dtype``."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    return None if dtype == "fp32" else dtype


def _probe_model(wl: Workload, dtype: str, device: torch.device | None = None) -> torch.nn.Module:
    """The local model the memory probe runs: in the compute dtype, as the engine holds it (buffers too)."""
    return wl.build().to(device=device, dtype=DTYPES[dtype])


def _probe_fits(device: EmulatedDevice, model, wl: Workload, micro_batch: int, state_bytes: int) -> bool:
    """One forward+backward of ``micro_batch`` samples on the local model: does it fit?"""
    batch = wl.random_batch(micro_batch, seed=micro_batch)
    own = {p.untyped_storage()._cdata for p in model.parameters()}
    try:
        with device.micro_step(state_bytes, own):
            wl.loss(model, batch).backward()
        return True
    except torch.OutOfMemoryError:
        return False
    finally:
        model.zero_grad(set_to_none=True)
        gc.collect()


def largest_micro_batch(device: EmulatedDevice | CudaDevice, workload: str | Workload, state_bytes: int,
                        limit: int = 4096, dtype: str = "fp32") -> int:
    """Grow the micro-batch until the device runs out of memory, then bisect. 0: not even 1 fits.

    ``state_bytes``: the model states held meanwhile. On a real GPU, the part of them the
    probe's own model does not hold is held as a reserved buffer. ``dtype``: the
    compute dtype (``bf16``: the model's parameters and activations in bf16, as the
    engine's mixed precision computes).
    """
    wl = as_workload(workload)
    _mixed_precision(dtype)
    if isinstance(device, CudaDevice):
        return _largest_on_gpu(device, wl, state_bytes, limit, dtype)
    model = _probe_model(wl, dtype)
    return _grow_then_bisect(lambda m: _probe_fits(device, model, wl, m, state_bytes), limit)


def _grow_then_bisect(fits: Callable[[int], bool], limit: int) -> int:
    """The largest ``m <= limit`` with ``fits(m)``, found by doubling then bisecting; 0 if not even 1 fits."""
    if not fits(1):
        return 0
    good, bad = 1, None
    while bad is None:
        nxt = good * 2
        if nxt > limit:
            return good
        if fits(nxt):
            good = nxt
        else:
            bad = nxt
    while bad - good > 1:
        mid = (good + bad) // 2
        if fits(mid):
            good = mid
        else:
            bad = mid
    return good


# ---------------------------------------------------------------------------- on a real GPU
def _free_gpu() -> None:
    """Give back what dead tensors held, so the next probe starts from the same memory."""
    gc.collect()           # reference cycles (an engine's hooks, autograd graphs) hold GPU tensors too
    torch.cuda.empty_cache()


def _drop_grad(param: torch.Tensor) -> None:
    param.grad = None


def _largest_on_gpu(device: CudaDevice, wl: Workload, state_bytes: int, limit: int, dtype: str = "fp32") -> int:
    """Real out-of-memory: the local model on the GPU, the rest of ``state_bytes`` reserved beside it."""
    model = _probe_model(wl, dtype, device.torch_device)
    own = sum(st.nbytes() for st in {p.untyped_storage()._cdata: p.untyped_storage()
                                     for p in model.parameters()}.values())
    # the engine hands each gradient to its own buffers (counted in state_bytes) and frees
    # it at once: so does the probe, or its gradients would count twice
    hooks = [p.register_post_accumulate_grad_hook(_drop_grad) for p in model.parameters() if p.requires_grad]
    try:
        with device.reserve(state_bytes - own):
            return _grow_then_bisect(lambda m: _fits_on_gpu(device, model, wl, m), limit)
    finally:
        for h in hooks:
            h.remove()
        model = None
        _free_gpu()


def _fits_on_gpu(device: CudaDevice, model, wl: Workload, micro_batch: int) -> bool:
    """One forward+backward of ``micro_batch`` samples on the GPU: does it fit?"""
    fits = True
    try:
        _forward_backward(device, model, wl, micro_batch)
    except torch.OutOfMemoryError:
        fits = False
    except RuntimeError as e:   # cuBLAS reports its own failed allocations otherwise
        if "CUBLAS_STATUS_ALLOC_FAILED" not in str(e):
            raise
        fits = False
    # after the handler: the error's traceback no longer holds the batch and the graph
    model.zero_grad(set_to_none=True)
    _free_gpu()
    return fits


def _forward_backward(device: CudaDevice, model, wl: Workload, micro_batch: int) -> None:
    # in a frame of its own, so the batch and the graph die with it
    batch = tuple(t.to(device.torch_device) for t in wl.random_batch(micro_batch, seed=micro_batch))
    wl.loss(model, batch).backward()
    torch.cuda.synchronize(device.index)   # an asynchronous failure surfaces here, not in the next probe


def _real_device(spec, rank: int) -> CudaDevice:
    """This rank's GPU, checked against the cluster's description on every rank alike (no rank left waiting)."""
    from poplar.engine.dist import context
    from poplar.profile.discover import local_properties

    if context().device.type != "cuda":   # the group's backend: every rank raises alike
        raise ValueError("real CUDA devices are profiled with one GPU per rank over NCCL: launch under torchrun on "
                         "GPU machines (or in this process on one GPU)")
    here, expected = local_properties(), spec.device(rank).cuda
    ok = torch.tensor([int(here == expected)], device=context().device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    fix = "profile the devices the ranks run on (discover them: no --cluster)"
    if here != expected:
        raise ValueError(f"rank {rank} runs on {here.kind}, but the cluster describes {expected.kind}: {fix}")
    if not ok.item():
        raise ValueError(f"another rank's GPU differs from the cluster's description: {fix}")
    return CudaDevice()


def point_sizes(max_micro_batch: int, n_points: int) -> list[int]:
    """``n_points`` micro-batch sizes from 1 to the limit, spaced geometrically (repeats allowed)."""
    if max_micro_batch <= 0:
        return [0] * n_points
    return [int(round(v)) for v in np.geomspace(1, max_micro_batch, n_points)]


def _time_collectives(numel: int, repeats: int = 3, device: torch.device | None = None) -> CommProfile:
    """``device``: where the buffers live (a GPU under NCCL, whose collectives return before they finish)."""
    world = dist.get_world_size()
    padded = -(-numel // world) * world
    device = device or torch.device("cpu")
    full, shard = torch.zeros(padded, device=device), torch.zeros(padded // world, device=device)
    done = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

    def timed(fn) -> float:
        fn()
        done()
        out = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            fn()
            done()
            out.append(time.perf_counter() - start)
        return statistics.median(out)

    return CommProfile(numel=padded, all_reduce_s=timed(lambda: C.all_reduce(full)),
                       reduce_scatter_s=timed(lambda: C.reduce_scatter(shard, full)),
                       all_gather_s=timed(lambda: C.all_gather(full, shard)))


def profile_rank(rank: int, world_size: int, workload: str | Workload | dict, cluster: dict, stages: list[int], n_points: int = 5,
                 warmup: int = 1, repeats: int = 6, progress=None, max_micro_batch: int = 256,
                 dtype: str = "fp32") -> dict:
    """What each rank of the cluster runs. Returns its per-stage figures and the collectives' times."""
    wl = as_workload(workload)
    mixed = _mixed_precision(dtype)
    spec = parse_cluster(cluster)
    spec.check_world_size(world_size)
    real = spec.is_real
    device = _real_device(spec, rank) if real else EmulatedDevice(spec.device(rank), rank, spec.host_slowdown())
    here = _tensor_device(device)   # NCCL's collectives take the GPU's tensors
    optimizer = lambda params: torch.optim.AdamW(params, lr=_OPTIMIZER_LR)  # noqa: E731
    out: dict = {"kind": spec.device(rank).kind, "stages": {}}
    def note(stage: int, what: str) -> None:
        if progress is not None and rank == 0:
            progress.put((stage, what))

    for stage in stages:
        note(stage, "memory")
        # two micro-steps of one sample: the states held between micro-steps (accumulated
        # gradients) count too, as they will in any plan that accumulates
        engine = poplar.initialize(wl.build(), optimizer, poplar.Plan(stage, [1] * world_size, 2),
                                   device=device, mixed_precision=mixed)
        state_before = engine.model_state_bytes()
        # a real GPU already holds the engine's tensors: the probe reserves only the rest
        held = state_before - engine.memory_report()["total"] if real else state_before
        fits_one = largest_micro_batch(device, wl, held, limit=1, dtype=dtype) == 1
        ok = torch.tensor([1 if fits_one else 0], device=here)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if not ok.item():
            engine.close()
            engine = None
            if real:
                _free_gpu()
            out["stages"][stage] = {"max": 1 if fits_one else 0, "state_bytes": state_before, "points": [],
                                    "note": "not timed: a device of this cluster does not fit micro-batch 1"}
            note(stage, "done")
            continue
        engine.train_batch(wl.random_batch(2), wl.loss)   # optimizer states now exist
        if not real:   # an emulated device also sees the states at the start of every micro-step
            device.peak_state_bytes = 0
        engine.train_batch(wl.random_batch(2), wl.loss)   # ... and so do gradients
        state = max(engine.model_state_bytes(), 0 if real else device.peak_state_bytes)
        engine.close()
        engine = None
        if real:   # the probe holds the states itself (its model and a reserved buffer)
            _free_gpu()
        # 1% of the capacity kept free: the whole local batch sits on the device during a
        # step (the engine moves it there at once), so with accumulation the inputs take
        # more than in the probe's single micro-batch (520 bytes a sample for `tiny`)
        headroom = int((REAL_HEADROOM if real else HEADROOM) * device.capacity)
        limit = largest_micro_batch(device, wl, state + headroom, limit=max_micro_batch, dtype=dtype)
        sizes = torch.zeros(world_size, n_points, dtype=torch.int64, device=here)
        sizes[rank] = torch.tensor(point_sizes(limit, n_points))
        dist.all_reduce(sizes)
        # every size's engine at once, timed in interleaved rounds (one step of each size per
        # round), so a drift of the host's speed falls on every size alike. Each step has two
        # micro-batches: the first one's time is what every further micro-step costs, and the
        # rest of the step (the synchronisation, the update) is what a step costs once.
        plans = [poplar.Plan(stage, [int(s) for s in sizes[:, i]], 2) for i in range(n_points)]
        times: list[list[float]] = [[] for _ in plans]
        per_step = []
        # a real GPU holds every engine's states for real: there, one size at a time
        for group in ([[i] for i in range(n_points)] if real else [range(n_points)]):
            engines = {i: poplar.initialize(wl.build(), optimizer, plans[i], device=device, mixed_precision=mixed)
                       for i in group}
            batches = {i: wl.random_batch(plans[i].local_batch_size(rank)) for i in group}
            for r in range(warmup + repeats):
                note(stage, f"round {r + 1}/{warmup + repeats}")
                for i, engine in engines.items():
                    engine.train_batch(batches[i], wl.loss)     # back to this size: settle first
                    if r < warmup:
                        continue
                    engine.train_batch(batches[i], wl.loss)
                    if real:   # the GPU's own time: nothing to split
                        micro = device.micro_s[0]
                    else:      # the step's compute as measured, split as its calibrated work is (a lag of
                        # the host behind the device's time falls on every part alike)
                        micro = device.micro_s[0] * device.compute_s / device.target_s
                    once = max(0.0, device.compute_s - 2 * micro)
                    times[i].append(micro + once)              # a step of one micro-batch
                    per_step.append(once)
            for engine in engines.values():
                engine.close()
            engines = engine = None
            if real:
                _free_gpu()
        points = [(plan.micro_batch_sizes[rank], statistics.median(t)) for plan, t in zip(plans, times)]
        out["stages"][stage] = {"max": limit, "state_bytes": state, "points": points, "note": "",
                                "per_step": statistics.median(per_step)}
        note(stage, "balanced plan")
        out.setdefault("sync", {})[stage] = _calibrate_sync(rank, world_size, stage, wl, spec, device,
                                                            optimizer, out["kind"], out["stages"][stage], repeats,
                                                            mixed)
        note(stage, "done")
    out["comm"] = _time_collectives(wl.n_params(), device=here).model_dump()
    return out


def _tensor_device(device) -> torch.device:
    """Where this rank's tensors for collectives live: its GPU if it is a real one."""
    return device.torch_device if isinstance(device, CudaDevice) else torch.device("cpu")


def _calibrate_sync(rank: int, world_size: int, stage: int, wl: Workload, spec, device, optimizer, kind: str,
                    mine: dict, repeats: int, mixed: str | None = None) -> tuple[float, int]:
    """Time a step beyond the slowest rank's compute, on a plan balanced by what was just measured.

    The ranks synchronise at collectives (in ZeRO-2/3 inside every micro-step, unit by
    unit), so a step lasts longer than its slowest rank computes: collectives that are
    not hidden, and the ranks' small drifts between sync points. Returns the median
    excess per step and the plan's accumulation count it was measured at.
    """
    from poplar.planner.cost import CostModel
    from poplar.planner.search import allocate

    seen = [None] * world_size
    dist.all_gather_object(seen, (kind, mine))
    devices = {k: DeviceProfile(kind=k, memory_gb=1.0, stages={stage: _merge_stage([m for kk, m in seen if kk == k])})
               for k in dict.fromkeys(x[0] for x in seen)}
    interim = Profile(model=ModelInfo(name=wl.model, n_params=1, seq_len=1), ranks=[x[0] for x in seen],
                      devices=devices)
    cost = CostModel(interim, stage)
    plan = allocate(cost, sum(kc.max_micro_batch * cost.rank_kinds.count(k) for k, kc in cost.kinds.items()))
    engine = poplar.initialize(wl.build(), optimizer, plan, device=device, mixed_precision=mixed)
    batch = wl.random_batch(plan.local_batch_size(rank))
    walls, busy = [], []
    for i in range(1 + 2 * repeats):
        engine.train_batch(batch, wl.loss)
        if i:
            walls.append(device.step_wall_s)
            busy.append(device.compute_s)
    engine.close()
    engine = None
    if isinstance(device, CudaDevice):
        _free_gpu()
    figures = torch.tensor([statistics.median(walls), statistics.median(busy)], dtype=torch.float64,
                           device=_tensor_device(device))
    everyone = [torch.zeros_like(figures) for _ in range(world_size)]
    dist.all_gather(everyone, figures)
    step = statistics.median(float(f[0]) for f in everyone)
    slowest = max(float(f[1]) for f in everyone)
    return max(0.0, step - slowest), max(plan.accum_steps)


# ---------------------------------------------------------------------------- the whole cluster
def _merge_stage(entries: list[dict]) -> StageProfile:
    """One kind's stage profile from its ranks' figures: the smallest limit, median times."""
    return StageProfile(max_micro_batch=min(m["max"] for m in entries),
                        state_bytes=max(m["state_bytes"] for m in entries),
                        points=_merge_points([m["points"] for m in entries]),
                        per_step_s=statistics.median(m.get("per_step", 0.0) for m in entries),
                        note=entries[0]["note"])


def _merge_points(point_lists: list[list[tuple[int, float]]]) -> list[tuple[int, float]]:
    """Identical devices share one profile: the median time at each micro-batch size."""
    by_size: dict[int, list[float]] = {}
    for points in point_lists:
        for m, t in points:
            by_size.setdefault(int(m), []).append(float(t))
    return [(m, statistics.median(ts)) for m, ts in sorted(by_size.items())]


def profile_cluster(workload: str | Workload, cluster: dict, stages=(0, 1, 2, 3), n_points: int = 5, warmup: int = 1,
                    repeats: int = 6, cache_dir: Path | None = None, use_cache: bool = True, progress=None,
                    on_poll=None, max_micro_batch: int = 256, timeout_s: float = 900,
                    distributed: bool = False, dtype: str = "fp32") -> tuple[Profile, dict]:
    """Profile ``workload`` (a model name, or a :class:`Workload`) on ``cluster``, launching its ranks.

    ``cluster`` is emulated (a cluster file's content) or the real CUDA devices of the
    running group (:func:`poplar.profile.discover.discover_cluster`); real devices are
    profiled only with ``distributed=True``.

    The largest micro-batch searched is ``max_micro_batch`` (a plan never needs more
    than its global batch). ``dtype``: the compute dtype of the training to plan (``bf16``:
    the engine's bf16 mixed precision; time and memory differ from fp32's). Returns the
    :class:`Profile` and a summary of the cache
    (which (kind, stage) were measured, which were read back).

    ``distributed=True``: this process is one rank of a running group (torchrun); every
    rank calls this, rank 0's view of the cache decides what is measured, and rank 0
    alone writes the cache. ``progress`` then only needs a ``put`` method.
    """
    from poplar.launch import spawn

    wl = as_workload(workload)
    _mixed_precision(dtype)
    spec = parse_cluster(cluster)
    if spec.is_real and not distributed:
        raise ValueError("real CUDA devices are profiled by the ranks that run on them: call with distributed=True "
                         "in a running process group (poplar profile does so under torchrun, or on one GPU)")
    world = spec.world_size
    slowdown = spec.host_slowdown()
    cache_dir = Path(cache_dir or default_cache_dir())
    kinds = {d.kind: d for d in spec.devices}
    keys = {(k, s): cache_key(wl, d.model_dump(), s, world, slowdown, dtype=dtype, max_micro_batch=max_micro_batch,
                              real=spec.is_real)
            for k, d in kinds.items() for s in stages}
    cached = {}
    if use_cache:
        for ks, key in keys.items():
            path = cache_dir / f"{key}.json"
            if path.exists():
                cached[ks] = StageProfile.model_validate_json(path.read_text())
    # the collectives and the ranks' synchronisation depend on the whole cluster
    comm_key = cache_key(wl, spec.model_dump(), -1, world, slowdown, dtype=dtype, real=spec.is_real)
    comm_path = cache_dir / f"comm-{comm_key}.json"
    comm = CommProfile.model_validate_json(comm_path.read_text()) if use_cache and comm_path.exists() else None
    todo = [s for s in stages if any((k, s) not in cached for k in kinds) or comm is None or s not in comm.sync_s]
    rank = dist.get_rank() if distributed else 0
    if distributed:   # every rank must measure the same stages: rank 0's cache decides
        decided = [todo, comm is None]
        dist.broadcast_object_list(decided, src=0)
        todo, missing_comm = decided
    else:
        missing_comm = comm is None
    measured: dict = {}
    if todo or missing_comm:
        if distributed:
            mine = profile_rank(rank, world, wl.model_dump(), cluster, todo, n_points, warmup, repeats, progress,
                                max_micro_batch, dtype)
            ranks = [None] * world
            dist.all_gather_object(ranks, mine)
        else:
            ranks = spawn(profile_rank, world, wl.model_dump(), cluster, todo, n_points, warmup, repeats, progress,
                          max_micro_batch, dtype, timeout_s=timeout_s, on_poll=on_poll)
        old = comm
        comm = CommProfile(**ranks[0]["comm"])
        if old is not None:
            comm.sync_s, comm.sync_accum = dict(old.sync_s), dict(old.sync_accum)
        for s, (excess, accum) in ranks[0].get("sync", {}).items():
            comm.sync_s[int(s)], comm.sync_accum[int(s)] = excess, accum
        for s in todo:
            for k in kinds:
                measured[(k, s)] = _merge_stage([r["stages"][s] for r in ranks if r["kind"] == k])
        if rank == 0:
            cache_dir.mkdir(parents=True, exist_ok=True)
            for ks, sp in measured.items():
                _write_atomic(cache_dir / f"{keys[ks]}.json", sp.model_dump_json())
            _write_atomic(comm_path, comm.model_dump_json())
    devices = {}
    for k, d in kinds.items():
        stage_profiles = {s: measured.get((k, s)) or cached[(k, s)] for s in stages}
        devices[k] = DeviceProfile(kind=k, memory_gb=d.memory_gb, speed=d.speed, stages=stage_profiles)
    model = wl.build()
    n_params = sum(p.numel() for p in model.parameters())
    units = [sum(p.numel() for p in u.params) for u in build_units(model, None, EngineConfig().unit_numel)]
    profile = Profile(model=ModelInfo(name=wl.model, n_params=n_params, unit_numels=units, seq_len=wl.seq_len,
                                      dtype=dtype),
                      ranks=[d.kind for d in spec.rank_devices()], devices=devices, comm=comm)
    summary = {"measured": sorted(measured), "from_cache": sorted(ks for ks in cached if ks not in measured)}
    return profile, summary


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(text)
    tmp.replace(path)
