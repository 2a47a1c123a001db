"""Measuring every device kind in every ZeRO stage, on an (emulated) cluster.

Per stage, each rank
1. builds the engine for that stage and takes one step at micro-batch 1, so the model
   states it holds (optimizer states included) are all there;
2. finds the largest micro-batch that fits its memory: it grows the micro-batch, then
   bisects, running forward and backward on a local copy of the model under its
   device's memory accounting (the activations do not depend on the stage; the model
   states do and come from step 1). An out-of-memory is caught, cleaned up after, and
   never strands the other ranks, since this probe has no collectives;
3. trains a few steps at each of ``n_points`` micro-batch sizes up to that limit,
   every rank at its own sizes, and records its compute time per step (the step's
   wall time minus its waits for collectives), after warm-up, median of repeats.
Then the collectives are timed at the model's size. Identical devices share one
profile; profiles are cached on disk, keyed by what changes them.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

import poplar
from poplar.emulate import EmulatedDevice, parse_cluster
from poplar.engine import collectives as C
from poplar.models import MODEL_PRESETS, build_model, causal_lm_loss, random_token_batch
from poplar.profile.profile import CommProfile, DeviceProfile, ModelInfo, Profile, StageProfile

_OPTIMIZER_LR = 1e-4


def default_cache_dir() -> Path:
    return Path(os.environ.get("POPLAR_CACHE_DIR", Path.home() / ".cache" / "poplar" / "profiles"))


def cache_key(model_name: str, kind: dict, stage: int, world_size: int, slowdown: float, dtype: str = "fp32",
              max_micro_batch: int = 256) -> str:
    """Everything that changes a device's stage profile: model, its shapes, device, stage, world, dtype."""
    model = build_model(model_name)
    shapes = [list(p.shape) for p in model.parameters()]
    key = {"model": model_name, "config": MODEL_PRESETS[model_name], "shapes": shapes, "device": kind,
           "stage": stage, "world_size": world_size, "slowdown": round(slowdown, 6), "dtype": dtype,
           "max_micro_batch": max_micro_batch,
           "poplar": poplar.__version__}
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]


# ---------------------------------------------------------------------------- in each rank
def _probe_fits(device: EmulatedDevice, model, model_name: str, micro_batch: int, state_bytes: int) -> bool:
    """One forward+backward of ``micro_batch`` samples on the local model: does it fit?"""
    batch = random_token_batch(model_name, micro_batch, seed=micro_batch)
    own = {p.untyped_storage()._cdata for p in model.parameters()}
    try:
        with device.micro_step(state_bytes, own):
            causal_lm_loss(model, batch).backward()
        return True
    except torch.OutOfMemoryError:
        return False
    finally:
        model.zero_grad(set_to_none=True)
        gc.collect()


def largest_micro_batch(device: EmulatedDevice, model_name: str, state_bytes: int, limit: int = 4096) -> int:
    """Grow the micro-batch until the device runs out of memory, then bisect. 0: not even 1 fits."""
    model = build_model(model_name)
    if not _probe_fits(device, model, model_name, 1, state_bytes):
        return 0
    good, bad = 1, None
    while bad is None:
        nxt = good * 2
        if nxt > limit:
            return good
        if _probe_fits(device, model, model_name, nxt, state_bytes):
            good = nxt
        else:
            bad = nxt
    while bad - good > 1:
        mid = (good + bad) // 2
        if _probe_fits(device, model, model_name, mid, state_bytes):
            good = mid
        else:
            bad = mid
    return good


def point_sizes(max_micro_batch: int, n_points: int) -> list[int]:
    """``n_points`` micro-batch sizes from 1 to the limit, spaced geometrically (repeats allowed)."""
    if max_micro_batch <= 0:
        return [0] * n_points
    return [int(round(v)) for v in np.geomspace(1, max_micro_batch, n_points)]


def _timed_steps(engine, device, model_name: str, micro_batch: int, warmup: int, repeats: int) -> float:
    batch = random_token_batch(model_name, micro_batch)
    times = []
    for i in range(warmup + repeats):
        engine.train_batch(batch, causal_lm_loss)
        if i >= warmup:
            times.append(device.compute_s)
    return statistics.median(times)


def _time_collectives(numel: int, repeats: int = 3) -> CommProfile:
    world = dist.get_world_size()
    padded = -(-numel // world) * world
    full, shard = torch.zeros(padded), torch.zeros(padded // world)

    def timed(fn) -> float:
        fn()
        out = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            fn()
            out.append(time.perf_counter() - start)
        return statistics.median(out)

    return CommProfile(numel=padded, all_reduce_s=timed(lambda: C.all_reduce(full)),
                       reduce_scatter_s=timed(lambda: C.reduce_scatter(shard, full)),
                       all_gather_s=timed(lambda: C.all_gather(full, shard)))


def profile_rank(rank: int, world_size: int, model_name: str, cluster: dict, stages: list[int], n_points: int = 4,
                 warmup: int = 1, repeats: int = 5, progress=None, max_micro_batch: int = 256) -> dict:
    """What each rank of the cluster runs. Returns its per-stage figures and the collectives' times."""
    spec = parse_cluster(cluster)
    spec.check_world_size(world_size)
    device = EmulatedDevice(spec.device(rank), rank, spec.host_slowdown())
    optimizer = lambda params: torch.optim.AdamW(params, lr=_OPTIMIZER_LR)  # noqa: E731
    out: dict = {"kind": spec.device(rank).kind, "stages": {}}
    def note(stage: int, what: str) -> None:
        if progress is not None and rank == 0:
            progress.put((stage, what))

    for stage in stages:
        note(stage, "memory")
        engine = poplar.initialize(build_model(model_name), optimizer, poplar.Plan(stage, [1] * world_size, 1),
                                   device=device)
        state_before = engine.model_state_bytes()
        fits_one = largest_micro_batch(device, model_name, state_before, limit=1) == 1
        ok = torch.tensor([1 if fits_one else 0])
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if not ok.item():
            engine.close()
            out["stages"][stage] = {"max": 1 if fits_one else 0, "state_bytes": state_before, "points": [],
                                    "note": "not timed: a device of this cluster does not fit micro-batch 1"}
            note(stage, "done")
            continue
        engine.train_batch(random_token_batch(model_name, 1), causal_lm_loss)   # optimizer states now exist
        state = engine.model_state_bytes()
        engine.close()
        limit = largest_micro_batch(device, model_name, state, limit=max_micro_batch)
        sizes = torch.zeros(world_size, n_points, dtype=torch.int64)
        sizes[rank] = torch.tensor(point_sizes(limit, n_points))
        dist.all_reduce(sizes)
        points = []
        for i in range(n_points):
            note(stage, f"point {i + 1}/{n_points}")
            plan = poplar.Plan(stage, [int(s) for s in sizes[:, i]], 1)
            engine = poplar.initialize(build_model(model_name), optimizer, plan, device=device)
            seconds = _timed_steps(engine, device, model_name, plan.micro_batch_sizes[rank], warmup, repeats)
            engine.close()
            points.append((plan.micro_batch_sizes[rank], seconds))
        out["stages"][stage] = {"max": limit, "state_bytes": state, "points": points, "note": ""}
        note(stage, "done")
    n_params = sum(p.numel() for p in build_model(model_name).parameters())
    out["comm"] = _time_collectives(n_params).model_dump()
    return out


# ---------------------------------------------------------------------------- the whole cluster
def _merge_points(point_lists: list[list[tuple[int, float]]]) -> list[tuple[int, float]]:
    """Identical devices share one profile: the median time at each micro-batch size."""
    by_size: dict[int, list[float]] = {}
    for points in point_lists:
        for m, t in points:
            by_size.setdefault(int(m), []).append(float(t))
    return [(m, statistics.median(ts)) for m, ts in sorted(by_size.items())]


def profile_cluster(model_name: str, cluster: dict, stages=(0, 1, 2, 3), n_points: int = 4, warmup: int = 1,
                    repeats: int = 5, cache_dir: Path | None = None, use_cache: bool = True, progress=None,
                    on_poll=None, max_micro_batch: int = 256, timeout_s: float = 900,
                    distributed: bool = False) -> tuple[Profile, dict]:
    """Profile ``model_name`` on the emulated ``cluster``, launching its ranks locally.

    The largest micro-batch searched is ``max_micro_batch`` (a plan never needs more
    than its global batch). Returns the :class:`Profile` and a summary of the cache
    (which (kind, stage) were measured, which were read back).

    ``distributed=True``: this process is one rank of a running group (torchrun); every
    rank calls this, rank 0's view of the cache decides what is measured, and rank 0
    alone writes the cache. ``progress`` then only needs a ``put`` method.
    """
    from poplar.launch import spawn

    spec = parse_cluster(cluster)
    world = spec.world_size
    slowdown = spec.host_slowdown()
    cache_dir = Path(cache_dir or default_cache_dir())
    kinds = {d.kind: d for d in spec.devices}
    keys = {(k, s): cache_key(model_name, d.model_dump(), s, world, slowdown, max_micro_batch=max_micro_batch)
            for k, d in kinds.items() for s in stages}
    cached = {}
    if use_cache:
        for ks, key in keys.items():
            path = cache_dir / f"{key}.json"
            if path.exists():
                cached[ks] = StageProfile.model_validate_json(path.read_text())
    comm_path = cache_dir / f"comm-{cache_key(model_name, {}, -1, world, slowdown)}.json"
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
            mine = profile_rank(rank, world, model_name, cluster, todo, n_points, warmup, repeats, progress,
                                max_micro_batch)
            ranks = [None] * world
            dist.all_gather_object(ranks, mine)
        else:
            ranks = spawn(profile_rank, world, model_name, cluster, todo, n_points, warmup, repeats, progress,
                          max_micro_batch, timeout_s=timeout_s, on_poll=on_poll)
        comm = CommProfile(**ranks[0]["comm"])
        for s in todo:
            for k in kinds:
                mine = [r["stages"][s] for r in ranks if r["kind"] == k]
                measured[(k, s)] = StageProfile(max_micro_batch=min(m["max"] for m in mine),
                                                state_bytes=max(m["state_bytes"] for m in mine),
                                                points=_merge_points([m["points"] for m in mine]),
                                                note=mine[0]["note"])
        if rank == 0:
            cache_dir.mkdir(parents=True, exist_ok=True)
            for ks, sp in measured.items():
                _write_atomic(cache_dir / f"{keys[ks]}.json", sp.model_dump_json())
            _write_atomic(comm_path, comm.model_dump_json())
    devices = {}
    for k, d in kinds.items():
        stage_profiles = {s: measured.get((k, s)) or cached[(k, s)] for s in stages}
        devices[k] = DeviceProfile(kind=k, memory_gb=d.memory_gb, speed=d.speed, stages=stage_profiles)
    n_params = sum(p.numel() for p in build_model(model_name).parameters())
    profile = Profile(model=ModelInfo(name=model_name, n_params=n_params, seq_len=MODEL_PRESETS[model_name]["max_seq_len"]),
                      ranks=[d.kind for d in spec.rank_devices()], devices=devices, comm=comm)
    summary = {"measured": sorted(measured), "from_cache": sorted(ks for ks in cached if ks not in measured)}
    return profile, summary


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(text)
    tmp.replace(path)
