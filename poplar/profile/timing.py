"""Timing steps and collectives on a rank's device clock, its waits for other ranks left out.

Every rank times ``n_points`` micro-batch sizes up to its own limit (spaced
geometrically), every rank at its own sizes: at each size a step of one micro-batch (the
point), and at the smallest ``PER_STEP_SIZES`` also a step of two: their difference is
what every further micro-step costs, and the rest what a step costs once (the update,
the same at any size). After warm-up rounds, the median over the timed rounds. Every timed
step runs in the device's step through :class:`~poplar.devices.steps.TimedSteps` (the step
loop a rank's training and the comparisons time theirs with).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

import poplar
from poplar.devices.base import Device
from poplar.devices.steps import TimedSteps
from poplar.engine import initialize
from poplar.engine.config import EngineConfig
from poplar.engine.loss_scale import LossScaleConfig
from poplar.profile.profile import CommProfile
from poplar.models.workload import Workload

PER_STEP_SIZES = 3   # the smallest sizes also timed with two micro-batches, for the once-per-step part
BETWEEN_MOST = 3    # collective sizes timed between a tiny buffer and the model's
SHARE_SKEW = 0.5     # unlike shares timed: one rank's weight 1 + this (and 1 + twice this), the others' 1
_OPTIMIZER_LR = 1e-4


def _adamw(params):
    return torch.optim.AdamW(params, lr=_OPTIMIZER_LR)


@dataclass
class RankRun:
    """One rank's profiling: its device, the workload, the engine options, and how it reports progress.

    ``rank`` and ``world_size`` are among the ranks profiled together: the cluster's, or
    those :meth:`among` names (the others left out); ``shares``: the model states' shares
    every engine of the run holds (:meth:`with_shares`; None: even).
    """

    device: Device
    rank: int
    world_size: int
    workload: Workload
    config: EngineConfig        # the engine training will use: its units, its precision
    warmup: int
    repeats: int
    kind: str = ""              # the device kind, as progress events name it
    progress: Any = None        # where ``(kind, stage, what)`` events go (``put``), or None: this rank is silent
    comm: Any = None            # the engines' collectives: the device's (None), or over the ranks profiled together
    group: Any = None           # the process group of the ranks profiled together (None: the world's)
    shares: tuple[float, ...] | None = None

    def engine(self, plan: poplar.Plan):
        """An engine of the workload's model with ``plan`` (and the run's shares), its collectives seen by the
        device."""
        if self.shares is not None:
            plan = plan.with_shard_shares(self.shares)
        config = self.config
        if config.mixed_precision == "fp16":   # every timed step applies its update: a scale that cannot overflow
            config = config.model_copy(update={"loss_scale": LossScaleConfig(init_scale=1.0, dynamic=False)})
        return initialize(self.workload.build(), _adamw, plan, config, comm=self.comm or self.device.comm)

    def note(self, stage: int, what: str) -> None:
        if self.progress is not None:
            self.progress.put((self.kind, stage, what))

    def everyone(self, flag: bool) -> bool:
        """Whether ``flag`` holds on every rank (each rank calls this at once)."""
        return all(self.each(flag))

    def each(self, flag: bool) -> list[bool]:
        """Every rank's ``flag``, in rank order (each rank calls this at once)."""
        flags = torch.zeros(self.world_size, dtype=torch.int64, device=self.device.torch_device)
        flags[self.rank] = int(flag)
        dist.all_reduce(flags, group=self.group)
        return [bool(f) for f in flags.tolist()]

    def agree_sizes(self, mine: list[int]) -> list[list[int]]:
        """Every rank's sizes to time, from this rank's ``mine``: row ``i`` is round ``i``'s micro-batch per rank."""
        sizes = torch.zeros(self.world_size, len(mine), dtype=torch.int64, device=self.device.torch_device)
        sizes[self.rank] = torch.tensor(mine)
        dist.all_reduce(sizes, group=self.group)
        return [[int(s) for s in sizes[:, i]] for i in range(len(mine))]

    def with_shares(self, shares: list[float]) -> RankRun:
        """The same run, every engine holding ``shares`` of the states (one weight a rank, stages 1-3)."""
        return replace(self, shares=tuple(shares))

    def among(self, members: list[int]) -> RankRun | None:
        """The run among ``members`` (ranks of this run) only: None on a rank left out. Every rank of the run
        calls it at once (the members' process group is made on every rank)."""
        base = list(range(self.world_size)) if self.group is None else dist.get_process_group_ranks(self.group)
        group = dist.new_group([base[r] for r in members])
        if self.rank not in members:
            return None
        comm = (self.comm or self.device.comm).on_group(group)
        return replace(self, rank=members.index(self.rank), world_size=len(members), comm=comm, group=group,
                       shares=None)


def point_sizes(max_micro_batch: int, n_points: int) -> list[int]:
    """``n_points`` micro-batch sizes from 1 to the limit, spaced geometrically (repeats allowed)."""
    if max_micro_batch <= 0:
        return [0] * n_points
    return [int(round(v)) for v in np.geomspace(1, max_micro_batch, n_points)]


def skewed_shares(capacities: list[int]) -> list[list[float]]:
    """The share vectors the once-per-step part is timed at with unlike shares (stages 1-3), for ranks of these
    memory capacities: the first rank with the most memory holds more than an even share, the others less, at
    two skews (so that a card with no room for more is never given more). None where every rank has as much
    memory: no plan takes unlike shares there (memory binds every rank alike: the planner's even split stands).

    >>> skewed_shares([80, 40]), fractions_held(skewed_shares([80, 40])[0])[1], skewed_shares([80, 80])
    ([[1.5, 1.0], [2.0, 1.0]], 0.4, [])
    """
    if len(set(capacities)) < 2:
        return []
    big = capacities.index(max(capacities))
    return [[1.0 + k * SHARE_SKEW * (r == big) for r in range(len(capacities))] for k in (1, 2)]


def fractions_held(shares: list[float]) -> list[float]:
    """Each rank's fraction of the sharded states."""
    total = sum(shares)
    return [s / total for s in shares]


def timed_step(device: Device, engine, batch, loss: Callable) -> float:
    """Busy seconds of one step on the device's clock (its waits for collectives left out)."""
    steps = TimedSteps(device, engine.held_state)
    steps.run(partial(engine.train_batch, batch, loss))
    return steps.busy_s[0]


def warm_up(engine, batch, loss: Callable, rounds: int) -> None:
    """Untimed steps (the optimizer's states made, the allocator and caches warm), outside any device step: no
    figure is read from them, so an emulated device runs them at the host's speed, not at its declared pace."""
    for _ in range(rounds):
        engine.train_batch(batch, loss)


def time_points(run: RankRun, stage: int, sizes: list[list[int]]) -> tuple[list[tuple[int, float]], float]:
    """This rank's points ``(micro_batch, seconds)`` at ``sizes`` (round ``i``: every rank's size), and the
    once-per-step part of a step (the median over the smallest sizes)."""
    n = len(sizes)
    twice = min(n, PER_STEP_SIZES)
    plans = [poplar.Plan(stage, row, 1) for row in sizes] + [poplar.Plan(stage, row, 2) for row in sizes[:twice]]
    times: list[list[float]] = [[] for _ in plans]
    if run.device.many_engines_at_once:
        groups = [list(range(len(plans)))]
    else:   # one size at a time: its step of one micro-batch and, if any, its step of two
        groups = [[i] + ([n + i] if i < twice else []) for i in range(n)]
    for group in groups:
        _time_group(run, stage, {i: plans[i] for i in group}, times)
        run.device.free_memory()   # the group's engines died with its frame
    one = [statistics.median(t) for t in times[:n]]
    two = [statistics.median(t) for t in times[n:]]
    per_step = [max(0.0, 2 * a - b) for a, b in zip(one, two)]
    return [(plans[i].micro_batch_sizes[run.rank], one[i]) for i in range(n)], statistics.median(per_step)


def _time_group(run: RankRun, stage: int, plans: dict[int, poplar.Plan], times: list[list[float]]) -> None:
    """Rounds of a step of every plan's engine, alive together; the timed rounds' busy seconds into ``times``."""
    wl = run.workload
    engines = {i: run.engine(plan) for i, plan in plans.items()}
    batches = {i: wl.random_batch(plan.local_batch_size(run.rank)) for i, plan in plans.items()}
    timed = {i: TimedSteps(run.device, engine.held_state) for i, engine in engines.items()}
    for i, engine in engines.items():
        warm_up(engine, batches[i], wl.loss, run.warmup)
    for r in range(run.repeats):
        run.note(stage, f"round {r + 1}/{run.repeats}")
        for i, engine in engines.items():
            timed[i].run(partial(engine.train_batch, batches[i], wl.loss))
    for i, engine in engines.items():
        times[i].extend(timed[i].busy_s)
        engine.close()


def _timed(device: Device, issue: Callable[[], Any], repeats: int) -> float:
    """Median device time of a step that runs ``issue()`` (after one untimed)."""
    return _timed_parts(device, issue, repeats)[0]


def _timed_parts(device: Device, issue: Callable[[], Any], repeats: int) -> tuple[float, float, float]:
    """Median device time of a step that runs ``issue()`` (after one untimed, outside a step: at the host's speed on
    an emulated device), of its wait, and of its compute."""
    issue()
    steps = TimedSteps(device)
    for _ in range(repeats):
        device.comm.barrier()
        steps.run(issue)
    return statistics.median(steps.step_s), statistics.median(steps.wait_s), statistics.median(steps.busy_s)


def _padded(numel: int, world: int) -> int:
    """``numel`` padded to a multiple of ``world`` (a reduce-scatter's buffer over its ranks)."""
    return -(-numel // world) * world


def between_sizes(units: list[int] | tuple[int, ...], numel: int, world: int) -> list[int]:
    """The sizes a collective over ``world`` ranks is also timed at, between a tiny buffer and ``numel``: the
    engine's distinct unit sizes (its buckets, as it issues them), padded to the ranks; at most
    :data:`BETWEEN_MOST` (the smallest, the middle and the largest)."""
    whole = _padded(numel, world)
    inside = sorted({_padded(n, world) for n in units} - {whole})
    inside = [n for n in inside if world * 64 < n < whole]
    return inside if len(inside) <= BETWEEN_MOST else [inside[0], inside[len(inside) // 2], inside[-1]]


def time_ops(device: Device, comm, numel: int, repeats: int, units: tuple[int, ...] = ()) -> CommProfile:
    """All-reduce, reduce-scatter and all-gather over ``comm``'s ranks, at ``numel`` (padded), at a tiny size and at
    the sizes between of ``units`` (:func:`between_sizes`)."""
    world = comm.world_size
    padded = _padded(numel, world)

    def timed(op: str, n: int) -> float:
        full, shard = torch.zeros(n, device=device.torch_device), torch.zeros(n // world, device=device.torch_device)
        issue = {"all_reduce": lambda: comm.all_reduce(full),
                 "reduce_scatter": lambda: comm.reduce_scatter(shard, full),
                 "all_gather": lambda: comm.all_gather(full, shard)}[op]
        return _timed(device, issue, repeats)

    ops, between = ("all_reduce", "reduce_scatter", "all_gather"), between_sizes(units, numel, world)
    return CommProfile(numel=padded, **{f"{op}_s": timed(op, padded) for op in ops},
                       latency_s={op: timed(op, world * 64) for op in ops},
                       between_s={op: [(n, timed(op, n)) for n in between] for op in ops})


def time_collectives(device: Device, numel: int, node_groups: list[list[int]] | None = None,
                     repeats: int = 3, units: tuple[int, ...] = ()) -> CommProfile:
    """The collectives at the model's size, at a tiny one and at the engine's unit sizes between (``units``), on
    the device's clock (a step each).

    On several nodes (``node_groups``) also the shaped ones: every node's collectives
    among its own ranks (each rank times its own node's; :attr:`ShapedComm.inside` holds
    this rank's only, the profiler puts the nodes' together) and the sum across nodes.
    """
    flat = time_ops(device, device.comm, numel, repeats, units)
    if not node_groups or len(node_groups) < 2:
        return flat
    from poplar.engine.layout import ShardLayout
    from poplar.profile.profile import ShapedComm

    layout = ShardLayout.build(device.comm, node_groups)
    inside = time_ops(device, layout.shard_comm, numel, repeats, units)

    def across(n: int) -> tuple[float, float]:
        """On the link (the wait: the all-to-all), and computing (the parts added in group order)."""
        shard = torch.zeros(layout.padded(n) // layout.shard_size, device=device.torch_device)
        _, wait, compute = _timed_parts(device, lambda: layout.reduce_across(shard, n), repeats)
        return wait, compute

    (link, add), (link_tiny, add_tiny) = across(numel), across(len(node_groups) * 64)
    between = [(n, across(n)[0]) for n in between_sizes(units, numel, 1)]   # the sum pads as it cuts
    shaped = ShapedComm(groups=node_groups, numel=numel, inside=[inside], reduce_across_s=link,
                        across_latency_s=link_tiny, across_between_s=between, sum_s=add, sum_latency_s=add_tiny)
    return flat.model_copy(update={"shaped": shaped})
