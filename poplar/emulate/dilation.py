"""Choosing the time dilation: how many wall seconds one declared device second takes on this host.

A modelled GPU does in microseconds what this host's CPU does in milliseconds, so the
emulated cluster runs ``D`` times slower than declared, one ``D`` for every rank. It
must be large enough that the real work of any span fits inside ``D`` times its
declared time, also while ranks share cores: then the wall clock is the declared clock
times ``D`` and nothing the host does shows. It is chosen once, at start, by timing
small probes of each kind of work on this host against their declared time:

- a small network's forward, backward and update: bound by the per-operator cost (the
  host's dispatch against the GPU's kernel launch);
- a large element-wise operation: bound by memory bandwidth;
- where the caller names the work it will run (``probe(m)``: a forward and backward
  of ``m`` samples, in the dtype the run computes in), that work at 1 and at 8
  samples: its fixed cost and its cost per sample (host and device are both close to
  linear in ``m``, so the worst ratio over any ``m`` is the worse of the two);
- all-reduces, reduce-scatters and all-gathers of a few bytes, 64 KiB and 1 MiB a rank:
  the real collectives against the declared links.

``D`` is the largest ratio of real to declared time, times the ranks per core on this
host, times ``MARGIN``. Only the pace depends on it: every figure is reported in
declared seconds.
"""

from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist

from poplar.emulate.model import WorkCounter

MARGIN = 2.5


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:   # not on Linux
        return os.cpu_count() or 1


def ranks_per_core() -> float:
    """Ranks of this host per core it has (torchrun and poplar.launch set LOCAL_WORLD_SIZE)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1.0, local / _cores())


def _timed(device, work, repeats: int = 5) -> tuple[float, float]:
    """Real seconds of ``work()`` on this host (median) and its declared seconds on ``device``."""
    real, declared = [], 0.0
    for i in range(repeats + 1):
        counter = WorkCounter(device.gpu)
        start = time.perf_counter()
        with counter:
            work()
        if i:   # the first run warms the allocator and caches
            real.append(time.perf_counter() - start)
            declared = counter.seconds
    return statistics.median(real), max(declared, 1e-12)


def _ratio(device, work, repeats: int = 5) -> float:
    real, declared = _timed(device, work, repeats)
    return real / declared


def _mlp_step(batch: int):
    torch.manual_seed(0)
    layers = torch.nn.Sequential(torch.nn.Linear(128, 512), torch.nn.GELU(), torch.nn.Linear(512, 128),
                                 torch.nn.LayerNorm(128))
    x = torch.randn(batch, 16, 128)
    opt = torch.optim.AdamW(layers.parameters(), lr=1e-4)

    def work():
        layers(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return work


def _comm_ratio(device) -> float:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return 0.0
    from poplar.engine.collectives import all_gather_tensor, reduce_scatter_tensor

    world = dist.get_world_size()
    worst = 0.0
    for numel in (world, 16 * 1024 * world, 256 * 1024 * world):
        full, shard = torch.zeros(numel), torch.zeros(numel // world)
        for op, run in (("all_reduce", lambda: dist.all_reduce(full)),
                        ("reduce_scatter", lambda: reduce_scatter_tensor(shard, full)),
                        ("all_gather", lambda: all_gather_tensor(full, shard))):
            real = []
            for i in range(4):
                dist.barrier()
                start = time.perf_counter()
                run()
                if i:
                    real.append(time.perf_counter() - start)
            worst = max(worst, statistics.median(real) / device.network.seconds(op, 4 * numel))
    return worst


def _probe_ratios(device, probe) -> list[float]:
    """The fixed and the per-sample cost of the caller's own work, host against device."""
    (real_1, declared_1), (real_8, declared_8) = (_timed(device, lambda m=m: probe(m), repeats=3) for m in (1, 8))
    per_sample = max(real_8 - real_1, 0.0) / max(declared_8 - declared_1, 1e-12)
    return [real_1 / declared_1, per_sample]


def choose_dilation(device, probe=None) -> float:
    """This rank's dilation for ``device`` (an :class:`~poplar.devices.emulated.EmulatedDevice`); the cluster takes the largest.

    ``probe(m)``: the work the rank will run, at ``m`` samples (optional).
    """
    env = os.environ.get("POPLAR_DILATION")
    if env:   # a fixed figure, for a comparison across runs
        return float(env)
    big = torch.zeros(4 * 2**20)
    ratios = [_ratio(device, _mlp_step(2)), _ratio(device, lambda: big.add_(1.0)), _comm_ratio(device)]
    if probe is not None:
        ratios += _probe_ratios(device, probe)
    return MARGIN * ranks_per_core() * max(ratios)
