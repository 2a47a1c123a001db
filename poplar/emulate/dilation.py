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
  the fewest of what its run takes at most (``probe.most``: the profiler's largest
  micro-batch, a plan's global batch) and what the device's memory holds: where the
  probe names its model (``probe.model``), the bytes a forward and backward saves at 1
  and at 8 samples, beside the model's parameters, say how many samples fit the
  capacity at most (the model states only lower it); with neither, any number (the
  ratio of the costs per sample). A small card, or a large one whose memory is scaled
  down, runs no large micro-batch: its pace is set by the sizes it runs, not by a
  host-bound one it never will. Nor does a small model run the millions of samples a
  large card would hold: its step costs about the same at 1 and at 8 samples on both,
  and their difference (the host's noise) taken out that far would set a pace
  thousands of times slower than the work needs. Where a step at the largest is cheap
  on the host (under ``DIRECT_S``), it is timed there instead of taken out from 8;
- all-reduces, reduce-scatters and all-gathers of a few bytes, 64 KiB and 1 MiB a rank,
  none larger than the probe's model (``model_bytes``: no collective of its step carries
  more): the real collectives against the declared links (the median of several rounds:
  the host's occasional late wake-up is not the collective's cost). Gloo's reduce-scatter
  of 64 KiB takes milliseconds here, ten times its all-reduce: a model of a few hundred
  parameters never issues one, and is not paced by it.

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
# the work's probe at 1 and at 8 samples, in turn, runs for this long at least (3 rounds at least, MAX_ROUNDS at
# most): a small module's step takes a millisecond, and the difference of its two medians, taken out to the
# largest micro-batch, is its ratio; of 3 runs each, one after the other, the host's noise set that anywhere
# from 12 to 270 for a 6-17-9-2 MLP
PROBE_BUDGET_S = 0.2
DIRECT_S = 0.05   # host seconds of a step at the largest micro-batch below which it is timed there itself
MAX_ROUNDS = 100
COMM_NUMELS = (1, 16 * 1024, 256 * 1024)   # fp32 elements a rank of the probed collectives: a few bytes, 64 KiB, 1 MiB


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:   # not on Linux
        return os.cpu_count() or 1


def ranks_per_core() -> float:
    """Ranks of this host per core it has (torchrun and poplar.processes.spawn set LOCAL_WORLD_SIZE)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1.0, local / _cores())


def _timed(device, works, repeats: int = 5, budget_s: float = 0.0) -> list[tuple[float, float]]:
    """Real seconds of each of ``works`` on this host, the median of ``repeats`` rounds (or of as many more as fit
    in ``budget_s``, up to ``MAX_ROUNDS``: a short work's median is then steady), and its declared seconds on
    ``device``. The works run in turn within a round, so that a change in the host's load weighs on each alike."""
    real, declared, rounds = [[] for _ in works], [0.0] * len(works), 0
    while rounds <= repeats or (sum(map(sum, real)) < budget_s and rounds <= MAX_ROUNDS):
        for k, work in enumerate(works):
            counter = WorkCounter(device.gpu)
            start = time.perf_counter()
            with counter:
                work()
            if rounds:   # the first round warms the allocator and caches
                real[k].append(time.perf_counter() - start)
                declared[k] = counter.seconds
        rounds += 1
    return [(statistics.median(r), max(d, 1e-12)) for r, d in zip(real, declared)]


def _ratio(device, work, repeats: int = 5) -> float:
    ((real, declared),) = _timed(device, [work], repeats)
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


def comm_numels(world: int, most_bytes: int | None) -> list[int]:
    """The sizes the collectives are probed at (fp32 elements in all, over ``world`` ranks): ``COMM_NUMELS`` a
    rank, none past ``most_bytes`` (None: no bound).

    >>> comm_numels(2, None), comm_numels(2, 301 * 4)     # a 6-17-9-2 MLP's 301 parameters
    ([2, 32768, 524288], [2, 302])
    """
    largest = max(COMM_NUMELS) if most_bytes is None else max(1, -(-most_bytes // (4 * world)))
    return sorted({min(n, largest) * world for n in COMM_NUMELS})


def _comm_ratio(device, most_bytes: int | None = None) -> float:
    """The worst ratio of the real collectives to the declared links' time, at :func:`comm_numels` (the largest
    bound of any rank's ``most_bytes``: every rank issues the same collectives)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return 0.0
    from poplar.engine.collectives import all_gather_tensor, reduce_scatter_tensor

    world, unbounded = dist.get_world_size(), 2**62
    bound = torch.tensor([unbounded if most_bytes is None else most_bytes], dtype=torch.int64)
    dist.all_reduce(bound, op=dist.ReduceOp.MAX)
    worst = 0.0
    for numel in comm_numels(world, None if int(bound) == unbounded else int(bound)):
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


def model_bytes(probe) -> int | None:
    """The bytes of ``probe``'s model (``probe.model``) as its gradients are reduced (fp32 at least), the most any
    collective of its step carries; None where the probe names no model."""
    model = getattr(probe, "model", None)
    if model is None:
        return None
    return sum(p.numel() * max(p.element_size(), 4) for p in model.parameters())


def probe_ratio(device, probe) -> float:
    """The worst ratio of host to device time over the micro-batches ``probe``'s work can run on ``device``
    (:func:`largest_samples`): what the work the rank will run asks of the dilation."""
    most = largest_samples(device, probe)
    one, eight = _timed(device, [lambda: probe(1), lambda: probe(8)], 3, PROBE_BUDGET_S)
    if most is not None and 8 < most and _at(most, (1, *one), (8, *eight)) <= DIRECT_S:
        # cheap to run: timed where it will run rather than taken out from 8 samples (a host's threads, or a cut
        # in its kernels, makes the cost of a sample more at 8 no guide to it at the largest)
        one, top = _timed(device, [lambda: probe(1), lambda: probe(most)], 3, PROBE_BUDGET_S)
        return worst_ratio((1, *one), (most, *top), most)
    return worst_ratio((1, *one), (8, *eight), most)


def _at(m: int, small: tuple[int, float, float], large: tuple[int, float, float]) -> float:
    """Host seconds at ``m`` samples, on the line through two measured ``(micro_batch, host s, device s)``."""
    (m1, real_1, _), (m2, real_2, _) = small, large
    return real_2 + max(real_2 - real_1, 0.0) / (m2 - m1) * (m - m2)


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
    """The most samples ``probe``'s work runs at on ``device``: the fewer of ``probe.most`` (the largest micro-batch
    its run takes) and what a forward and backward of ``probe.model`` fits in ``device``'s capacity (from the bytes
    saved at 1 and 8 samples, linear in the samples); None where neither is known."""
    most, fits = getattr(probe, "most", None), _fits_at_most(device, probe)
    known = [n for n in (most, fits) if n is not None]
    return min(known) if known else None


def _fits_at_most(device, probe) -> int | None:
    """The most samples a forward and backward of ``probe``'s model fits in ``device``'s capacity; None where that
    is not known (no model, no capacity)."""
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
    ratios = [_ratio(device, _mlp_step(2)), _ratio(device, lambda: big.add_(1.0)),
              _comm_ratio(device, model_bytes(probe))]
    if probe is not None:
        ratios.append(probe_ratio(device, probe))
    return MARGIN * ranks_per_core() * max(ratios)
