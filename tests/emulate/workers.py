"""Ranks of an emulated cluster, for tests/emulate (importable by spawned processes)."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

import poplar
from poplar.data.synthetic import bigram_batches
from poplar.emulate import EmulatedDevice, parse_cluster
from poplar.models import TinyCausalLM, causal_lm_loss

MODEL = dict(vocab_size=256, d_model=128, n_layers=2, n_heads=4, max_seq_len=64)
OPTIMIZER = functools.partial(torch.optim.AdamW, lr=1e-3)


def make_model():
    torch.manual_seed(0)
    return TinyCausalLM(**MODEL)


def timed_steps(rank, world_size, cluster: dict, plan: dict, steps: int):
    """Train on the emulated cluster; return this rank's compute time per step (wall minus waits)."""
    spec = parse_cluster(cluster)
    spec.check_world_size(world_size)
    slowdown = spec.host_slowdown()
    device = EmulatedDevice(spec.device(rank), rank, slowdown)
    plan = poplar.Plan.from_dict(plan)
    engine = poplar.initialize(make_model(), OPTIMIZER, plan, device=device)
    lo, hi = plan.sample_range(rank)
    out = []
    for i, (x, y) in enumerate(bigram_batches(steps + 1, plan.global_batch_size, seq_len=MODEL["max_seq_len"],
                                              vocab_size=MODEL["vocab_size"])):
        engine.train_batch((x[lo:hi], y[lo:hi]), causal_lm_loss)
        if i > 0:   # the first step warms up
            out.append({"compute": device.step_wall_s - device.wait_s, "cpu": device.compute_cpu_s,
                        "target": device.target_s,
                        "wait": device.wait_s, "step": device.step_wall_s, "speed": device.speed,
                        "slowdown": slowdown})
    return out


def largest_fitting_micro_batch(rank, world_size, memory_gb: float, stage: int, limit: int = 64):
    """Grow the micro-batch until the emulated device runs out of memory; also report its peak bytes."""
    device = EmulatedDevice(parse_cluster({"devices": [{"kind": "d", "speed": 1.0, "memory_gb": memory_gb}]}).device(0))
    peaks, best, error = {}, 0, None
    for mbs in (1, 2, 4, 8, 16, 32, 64):
        if mbs > limit:
            break
        engine = poplar.initialize(make_model(), OPTIMIZER, poplar.Plan(stage, [mbs], 1), device=device)
        x, y = bigram_batches(1, mbs, seq_len=MODEL["max_seq_len"], vocab_size=MODEL["vocab_size"])[0]
        device.peak_bytes = 0
        try:
            engine.train_batch((x, y), causal_lm_loss)
            engine.train_batch((x, y), causal_lm_loss)   # the second step holds optimizer states too
        except torch.OutOfMemoryError as e:
            error = str(e)
            engine.close()
            break
        peaks[mbs] = device.peak_bytes
        best = mbs
        engine.close()
    return {"best": best, "peaks": peaks, "error": error}


def hold_exclusively(path: str, seconds: float, ready) -> None:
    """Hold the host's calibration lock exclusively for ``seconds`` (another process's calibration)."""
    import time

    from poplar.emulate.calibration import HostLock

    lock = HostLock(Path(path))
    lock.hold(exclusive=True)
    ready.set()
    time.sleep(seconds)
    lock.release()


def micro_step_times(rank, world_size, plans: list[dict], steps: int):
    """Train each plan in turn on one emulated device; return each plan's last step's micro-step times."""
    device = EmulatedDevice(parse_cluster({"devices": [{"kind": "d", "speed": 0.5, "memory_gb": 4.0}]}).device(0))
    out = []
    for p in plans:
        plan = poplar.Plan.from_dict(p)
        engine = poplar.initialize(make_model(), OPTIMIZER, plan, device=device)
        x, y = bigram_batches(1, plan.global_batch_size, seq_len=MODEL["max_seq_len"], vocab_size=MODEL["vocab_size"])[0]
        for _ in range(steps):
            engine.train_batch((x, y), causal_lm_loss)
        out.append([t * device.speed for t in device.micro_s])   # host CPU seconds, as calibrated
        engine.close()
    return out
