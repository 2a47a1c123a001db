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
  samples: host and device are both close to linear in ``m``, so the worst ratio over
  the micro-batches the rank can run is at the smallest or the largest. The largest is
  what the device's memory holds: where the probe names its model (``probe.model``),
  the bytes a forward and backward saves at 1 and at 8 samples, beside the model's
  parameters, say how many samples fit the capacity at most (the model states only
  lower it); else any number (the ratio of the costs per sample). A small card, or a
  large one whose memory is scaled down, runs no large micro-batch: its pace is set
  by the sizes it runs, not by a host-bound one it never will;
- all-reduces, reduce-scatters and all-gathers of a few bytes, 64 KiB and 1 MiB a rank:
  the real collectives against the declared links (the median of several rounds: the
  host's occasional late wake-up is not the collective's cost).

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
# timed rounds of each probed collective, the median counts: a host's scheduler wakes a rank late now and then
# (here one collective in ten took ten times the others); a span that late is absorbed by the pace, or counted
# as an overrun, while three rounds let a single late one set the pace of the whole run
COMM_REPEATS = 9


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
            for i in range(COMM_REPEATS + 1):
                dist.barrier()
                start = time.perf_counter()
                run()
                if i:
                    real.append(time.perf_counter() - start)
            worst = max(worst, statistics.median(real) / device.network.seconds(op, 4 * numel))
    return worst


def _probe_ratio(device, probe) -> float:
    """The worst ratio of host to device time over the micro-batches ``probe``'s work can run on ``device``."""
    (real_1, declared_1), (real_8, declared_8) = (_timed(device, lambda m=m: probe(m), repeats=3) for m in (1, 8))
    return worst_ratio((1, real_1, declared_1), (8, real_8, declared_8), largest_samples(device, probe))


def worst_ratio(small: tuple[int, float, float], large: tuple[int, float, float], most: int | None) -> float:
    """The largest ratio of host to device time over micro-batches from 1 to ``most`` (None: any number), both
    times linear in the micro-batch through the two measured ``(micro_batch, host s, device s)`` points.

    >>> worst_ratio((1, 2.0, 1.0), (8, 9.0, 1.7), None)    # a sample more: 1 s on the host, 0.1 s on the device
    10.0
    >>> round(worst_ratio((1, 2.0, 1.0), (8, 9.0, 1.7), 8), 3), round(worst_ratio((1, 2.0, 1.0), (8, 9.0, 1.7), 18), 3)
    (5.294, 7.037)
    """
    (m1, real_1, declared_1), (m2, real_2, declared_2) = small, large
    host = max(real_2 - real_1, 0.0) / (m2 - m1)
    dev = max(declared_2 - declared_1, 1e-12) / (m2 - m1)
    worst = max(real_1 / declared_1, real_2 / declared_2)
    if most is None:
        return max(worst, host / dev)
    beyond = max(most - m2, 0)
    return max(worst, (real_2 + host * beyond) / (declared_2 + dev * beyond))


def largest_samples(device, probe) -> int | None:
    """The most samples a forward and backward of ``probe``'s model fits in ``device``'s capacity, from the bytes
    saved at 1 and 8 samples (linear in the samples); None where that is not known (no model, no capacity)."""
    model, capacity = getattr(probe, "model", None), getattr(device, "capacity", None)
    if model is None or not capacity or not hasattr(device, "saved_bytes"):
        return None
    one, eight = (device.saved_bytes(model, lambda m=m: probe(m)) for m in (1, 8))
    per_sample = (eight - one) / 7
    if per_sample <= 0:
        return None
    return max(1, int((capacity - (one - per_sample)) // per_sample))


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
        ratios.append(_probe_ratio(device, probe))
    return MARGIN * ranks_per_core() * max(ratios)
