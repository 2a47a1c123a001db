"""Measuring every device kind in every ZeRO stage, on a cluster of real or emulated GPUs.

Every rank's device (:func:`poplar.devices.rank_device`: its GPU, or an emulated one)
times the work the same way: a step inside ``device.step()``, its busy time on the
device's clock, its waits for collectives left out. The profiler never reads a device's
declared figures: it measures, so on an emulated cluster the profile against the
declared model is a real test of the profiler and the spline.

Per stage, each rank
1. builds the engine for that stage and takes two steps of two micro-batches of 1, so
   the model states it holds at their most (optimizer states, and the gradients
   accumulated between micro-steps) are all there;
2. finds the largest micro-batch that fits its memory: it grows the micro-batch, then
   bisects, running forward and backward on a local copy of the model under its
   device's memory accounting (the activations do not depend on the stage; the model
   states do and come from step 1). An out-of-memory is caught, cleaned up after, and
   never strands the other ranks, since this probe has no collectives;
3. times ``n_points`` micro-batch sizes up to that limit (spaced geometrically), every
   rank at its own sizes: at each size a step of one micro-batch (the point), and at
   the smallest ``PER_STEP_SIZES`` also a step of two: their difference is what every
   further micro-step costs, and the rest what a step costs once (the update, the same
   at any size). After warm-up rounds, the median over ``repeats`` rounds.
Then the collectives are timed at the model's size and at a tiny one (their latency).
Identical devices share one profile; profiles are cached on disk, keyed by what changes
them (an emulated device's are in its declared seconds, so nothing of the host is in
the key).

On real CUDA devices (a discovered cluster, see :mod:`poplar.profile.discover`) the
probe runs out of memory for real (the local model on the GPU, the stage's other model
states held beside it as a reserved buffer), and the sizes are timed one after another
rather than with every size's engine alive at once (a real GPU holds each engine's
states for real, so at the limit only one fits).
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import statistics
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

import poplar
from poplar.cluster.catalogue import peak_tflops
from poplar.cluster.spec import parse_cluster
from poplar.devices.cuda import CudaDevice
from poplar.emulate import EmulatedDevice
from poplar.engine import collectives as C
from poplar.engine.engine import EngineConfig
from poplar.engine.units import build_units
from poplar.workload import Workload, as_workload
from poplar.profile.profile import CommProfile, DeviceProfile, ModelInfo, Profile, StageProfile

_OPTIMIZER_LR = 1e-4
PER_STEP_SIZES = 3   # the smallest sizes also timed with two micro-batches, for the once-per-step part
HEADROOM = 0.01      # of a device's memory, left free by the largest micro-batch the profiler reports
# on a real GPU more: the probe runs on a freshly emptied allocator, a training step on one
# that earlier allocations have fragmented (an H100 at bf16 had 2.6 GiB reserved but unusable)
REAL_HEADROOM = 0.04


def default_cache_dir() -> Path:
    return Path(os.environ.get("POPLAR_CACHE_DIR", Path.home() / ".cache" / "poplar" / "profiles"))


def cache_key(workload: str | Workload, kind: dict, stage: int, world_size: int, dtype: str = "fp32",
              max_micro_batch: int = 256, real: bool = False) -> str:
    """Everything that changes a device's stage profile: model, its shapes, device, stage, world, dtype.

    ``kind``: the device's declared figures (an emulated device), or the GPU's name,
    memory and capability (``real``: the software driving it counts too). Nothing of
    the host: an emulated device's profile is in its own declared seconds.
    """
    key = {"workload": as_workload(workload).cache_dict(), "device": kind, "stage": stage, "world_size": world_size,
           "dtype": dtype, "max_micro_batch": max_micro_batch, "poplar": poplar.__version__}
    if real:
        key["software"] = {"torch": torch.__version__, "cuda": torch.version.cuda,
                           "cudnn": torch.backends.cudnn.version()}
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
        device.check_fits(lambda: (state_bytes, own), lambda: wl.loss(model, batch).backward())
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


def _check_real_device(spec, rank: int) -> None:
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


def point_sizes(max_micro_batch: int, n_points: int) -> list[int]:
    """``n_points`` micro-batch sizes from 1 to the limit, spaced geometrically (repeats allowed)."""
    if max_micro_batch <= 0:
        return [0] * n_points
    return [int(round(v)) for v in np.geomspace(1, max_micro_batch, n_points)]


def _time_collectives(device, numel: int, repeats: int = 3) -> CommProfile:
    """The collectives at the model's size and at a tiny one, on the device's clock (a step each)."""
    world = dist.get_world_size()
    here = _tensor_device(device)
    padded = -(-numel // world) * world
    small = world * 64

    def timed(op: str, n: int) -> float:
        full, shard = torch.zeros(n, device=here), torch.zeros(n // world, device=here)
        run = {"all_reduce": lambda: C.all_reduce(full), "reduce_scatter": lambda: C.reduce_scatter(shard, full),
               "all_gather": lambda: C.all_gather(full, shard)}[op]
        out = []
        for i in range(repeats + 1):
            C.barrier()
            with device.step():
                run()
            if i:
                out.append(device.step_s)
        return statistics.median(out)

    ops = ("all_reduce", "reduce_scatter", "all_gather")
    return CommProfile(numel=padded, **{f"{op}_s": timed(op, padded) for op in ops},
                       latency_s={op: timed(op, small) for op in ops})


def _timed_step(device, engine, batch, loss) -> float:
    """Busy seconds of one step on the device's clock (its waits for collectives left out)."""
    with device.step(engine.held_state):
        engine.train_batch(batch, loss)
    return device.compute_s


def profile_rank(rank: int, world_size: int, workload: str | Workload | dict, cluster: dict, stages: list[int],
                 n_points: int = 6, warmup: int = 1, repeats: int = 2, progress=None, max_micro_batch: int = 256,
                 dtype: str = "fp32") -> dict:
    """What each rank of the cluster runs. Returns its per-stage figures and the collectives' times."""
    from poplar.devices import rank_device

    spec = parse_cluster(cluster)
    spec.check_world_size(world_size)
    with rank_device(spec, rank, as_workload(workload)) as device:
        return _profile_rank(device, rank, world_size, as_workload(workload), spec, stages, n_points, warmup,
                             repeats, progress, max_micro_batch, dtype)


def _profile_rank(device, rank, world_size, wl: Workload, spec, stages, n_points, warmup, repeats, progress,
                  max_micro_batch, dtype) -> dict:
    mixed = _mixed_precision(dtype)
    real = spec.is_real
    if real:
        _check_real_device(spec, rank)
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
                                   mixed_precision=mixed)
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
        batch = wl.random_batch(2)
        for _ in range(2):    # optimizer states, then accumulated gradients, exist now
            _timed_step(device, engine, batch, wl.loss)
        state = engine.model_state_bytes()
        engine.close()
        engine = None
        if real:   # the probe holds the states itself (its model and a reserved buffer)
            _free_gpu()
        # some capacity kept free: the whole local batch sits on the device during a step
        # (the engine moves it there at once), more than the probe's single micro-batch
        headroom = int((REAL_HEADROOM if real else HEADROOM) * device.capacity)
        limit = largest_micro_batch(device, wl, state + headroom, limit=max_micro_batch, dtype=dtype)
        sizes = torch.zeros(world_size, n_points, dtype=torch.int64, device=here)
        sizes[rank] = torch.tensor(point_sizes(limit, n_points))
        dist.all_reduce(sizes)
        # At each size a step of one micro-batch (the point); at the smallest sizes also a
        # step of two: their difference is what every further micro-step costs, the rest
        # what a step costs once (the update, the same at any size)
        twice = min(n_points, PER_STEP_SIZES)
        plans = [poplar.Plan(stage, [int(s) for s in sizes[:, i]], 1) for i in range(n_points)]
        plans += [poplar.Plan(stage, [int(s) for s in sizes[:, i]], 2) for i in range(twice)]
        times: list[list[float]] = [[] for _ in plans]
        # a real GPU holds every engine's states for real: there, one size at a time
        per_size = [[i] + ([n_points + i] if i < twice else []) for i in range(n_points)]
        for group in (per_size if real else [range(len(plans))]):
            engines = {i: poplar.initialize(wl.build(), optimizer, plans[i], mixed_precision=mixed) for i in group}
            batches = {i: wl.random_batch(plans[i].local_batch_size(rank)) for i in group}
            for r in range(warmup + repeats):
                note(stage, f"round {r + 1}/{warmup + repeats}")
                for i, engine in engines.items():
                    busy = _timed_step(device, engine, batches[i], wl.loss)
                    if r >= warmup:
                        times[i].append(busy)
            for engine in engines.values():
                engine.close()
            engines = engine = None
            if real:
                _free_gpu()
        one = [statistics.median(t) for t in times[:n_points]]
        two = [statistics.median(t) for t in times[n_points:]]
        per_step = [max(0.0, 2 * a - b) for a, b in zip(one, two)]
        points = [(plans[i].micro_batch_sizes[rank], one[i]) for i in range(n_points)]
        out["stages"][stage] = {"max": limit, "state_bytes": state, "points": points, "note": "",
                                "per_step": statistics.median(per_step)}
        note(stage, "done")
    out["comm"] = _time_collectives(device, wl.n_params()).model_dump()
    out["dilation"], out["overruns"] = device.dilation, device.overruns
    return out


def _tensor_device(device) -> torch.device:
    """Where this rank's tensors for collectives live: its GPU if it is a real one."""
    return device.torch_device if isinstance(device, CudaDevice) else torch.device("cpu")


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


def profile_cluster(workload: str | Workload, cluster: dict, stages=(0, 1, 2, 3), n_points: int = 6, warmup: int = 1,
                    repeats: int | None = None, cache_dir: Path | None = None, use_cache: bool = True, progress=None,
                    on_poll=None, max_micro_batch: int = 256, timeout_s: float = 900,
                    distributed: bool = False, dtype: str = "fp32") -> tuple[Profile, dict]:
    """Profile ``workload`` (a model name, or a :class:`Workload`) on ``cluster``, launching its ranks.

    ``cluster`` is emulated (a cluster file's content) or the real CUDA devices of the
    running group (:func:`poplar.profile.discover.discover_cluster`); real devices are
    profiled only with ``distributed=True``.

    ``repeats``: timed rounds after ``warmup`` (default: 3 on real GPUs, 1 on an
    emulated cluster, whose time is deterministic). The largest micro-batch searched is
    ``max_micro_batch`` (a plan never needs more than its global batch). ``dtype``: the compute dtype of the training to plan (``bf16``:
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
    if repeats is None:   # an emulated device's time is its declared model's: one timed round is the figure
        repeats = 3 if spec.is_real else 1
    cache_dir = Path(cache_dir or default_cache_dir())
    kinds = {d.kind: d for d in spec.devices}
    keys = {(k, s): cache_key(wl, _kind_key(spec, d), s, world, dtype=dtype, max_micro_batch=max_micro_batch,
                              real=spec.is_real)
            for k, d in kinds.items() for s in stages}
    cached = {}
    if use_cache:
        for ks, key in keys.items():
            path = cache_dir / f"{key}.json"
            if path.exists():
                cached[ks] = StageProfile.model_validate_json(path.read_text())
    # the collectives and the ranks' synchronisation depend on the whole cluster
    comm_key = cache_key(wl, spec.model_dump(), -1, world, dtype=dtype, real=spec.is_real)
    comm_path = cache_dir / f"comm-{comm_key}.json"
    comm = CommProfile.model_validate_json(comm_path.read_text()) if use_cache and comm_path.exists() else None
    todo = [s for s in stages if any((k, s) not in cached for k in kinds)]
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
        comm = CommProfile(**ranks[0]["comm"])
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
        rated = peak_tflops(d.cuda.name, dtype) if d.cuda is not None else d.peak_tflops(dtype)
        devices[k] = DeviceProfile(kind=k, memory_gb=spec.memory_bytes(d) / 2**30, rated_tflops=rated,
                                   stages=stage_profiles)
    model = wl.build()
    n_params = sum(p.numel() for p in model.parameters())
    units = [sum(p.numel() for p in u.params) for u in build_units(model, None, EngineConfig().unit_numel)]
    profile = Profile(model=ModelInfo(name=wl.model, n_params=n_params, unit_numels=units, seq_len=wl.seq_len,
                                      dtype=dtype),
                      ranks=[d.kind for d in spec.rank_devices()], devices=devices, comm=comm)
    summary = {"measured": sorted(measured), "from_cache": sorted(ks for ks in cached if ks not in measured),
               "dilation": ranks[0].get("dilation") if todo or missing_comm else None,
               "overruns": sum(r.get("overruns", 0) for r in ranks) if todo or missing_comm else 0}
    return profile, summary


def _kind_key(spec, kind) -> dict:
    """What sets a kind's profile: its figures (the catalogue's too) and its scaled memory; not its count or node."""
    data = kind.model_dump(exclude={"count", "node"})
    if kind.cuda is None:
        data["resolved"] = {"memory_bytes": spec.memory_bytes(kind), "bandwidth_gbs": kind.bandwidth_gbs,
                            "tflops": {d: kind.peak_tflops(d) for d in ("fp32", "bf16")}}
    return data


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(text)
    tmp.replace(path)
