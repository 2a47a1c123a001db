"""Training with given plans on an emulated cluster and measuring what they really do.

One launch of the cluster's ranks measures several plans one after another, in
alternating rounds (plan A, B, C, A, B, C, ...), so drifts of a shared, noisy host
fall on every plan alike. Per plan: the step's wall time (median over the measured
steps) and every rank's busy time (compute; waits for other ranks excluded).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

import poplar
from poplar.emulate import EmulatedDevice, parse_cluster
from poplar.workload import Workload, as_workload


def _measure_rank(rank: int, world_size: int, workload: dict, cluster: dict, plans: list[dict], steps: int,
                  warmup: int, rounds: int) -> list[dict]:
    wl = as_workload(workload)
    spec = parse_cluster(cluster)
    device = EmulatedDevice(spec.device(rank), rank, spec.host_slowdown())
    optimizer = lambda params: torch.optim.AdamW(params, lr=1e-4)  # noqa: E731
    engines, batches = [], []
    for p in plans:
        plan = poplar.Plan.from_dict(p)
        engines.append(poplar.initialize(wl.build(), optimizer, plan, device=device))
        batches.append(wl.random_batch(plan.local_batch_size(rank), seed=rank))
    walls: list[list[float]] = [[] for _ in plans]
    busy: list[list[float]] = [[] for _ in plans]
    for i, engine in enumerate(engines):          # warm-up, every plan
        for _ in range(warmup):
            engine.train_batch(batches[i], wl.loss)
    per_round = max(1, steps // rounds)
    for _ in range(rounds):
        for i, engine in enumerate(engines):
            dist.barrier()
            engine.train_batch(batches[i], wl.loss)   # the first step after a switch realigns the ranks
            for _ in range(per_round):
                start = time.perf_counter()
                engine.train_batch(batches[i], wl.loss)
                walls[i].append(time.perf_counter() - start)
                busy[i].append(device.compute_s)
    for engine in engines:
        engine.close()
    return [{"step_s": statistics.median(w), "busy_s": statistics.median(b), "steps": len(w)}
            for w, b in zip(walls, busy)]


def measure_plans(workload: str | Workload, cluster: dict, plans: list[poplar.Plan], steps: int = 12, warmup: int = 2,
                  rounds: int = 3, timeout_s: float = 900) -> list[dict]:
    """Train each plan on the emulated ``cluster`` and measure it.

    Returns, per plan: ``step_s`` (median wall time of a step, the slowest rank's view),
    ``busy_s`` (each rank's median busy time) and ``samples_per_s``.
    """
    from poplar.launch import spawn

    spec = parse_cluster(cluster)
    ranks = spawn(_measure_rank, spec.world_size, as_workload(workload).model_dump(), cluster, [p.to_dict() for p in plans], steps, warmup,
                  rounds, timeout_s=timeout_s)
    out = []
    for i, plan in enumerate(plans):
        step = max(r[i]["step_s"] for r in ranks)
        out.append({"step_s": step, "busy_s": [r[i]["busy_s"] for r in ranks],
                    "samples_per_s": plan.global_batch_size / step, "steps": ranks[0][i]["steps"]})
    return out
