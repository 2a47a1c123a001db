"""Training with given plans on a cluster and measuring what they really do.

One launch of the cluster's ranks measures several plans one after another, in
alternating rounds (plan A, B, C, A, B, C, ...). Per plan: the step's time on the
devices' clock (median over the measured steps; on an emulated cluster, declared
seconds) and every rank's busy time (compute; waits for other ranks excluded), and
the emulated devices' overruns (spans whose real work ran past their declared time:
0 on a quiet host).

Peers (:mod:`poplar.compare.peers`: DeepSpeed) take part in the same rounds, under the same
emulated devices. They start first and run their warm-up steps before Poplar's engines
are built, so a peer that cannot run fails the launch within seconds, as
:class:`poplar.compare.peers.PeerFailed` naming the peer and why; the caller can measure again
without it.
"""

from __future__ import annotations

import contextlib
import statistics
from typing import Callable

import torch
import torch.distributed as dist

import poplar
from poplar.cluster.spec import parse_cluster
from poplar.devices import rank_device
from poplar.devices.steps import TimedSteps
from poplar.engine import initialize
from poplar.engine.config import EngineConfig
from poplar.compare.peers import PeerFailed
from poplar.models.workload import Workload, as_workload


class _Peer:
    """A started peer with this rank's batch; whatever fails in it is a :class:`PeerFailed` naming it."""

    def __init__(self, setup, wl: Workload, rank: int, comm):
        self.setup, self.rank = setup, rank
        with self._failing():
            self.peer = setup.start(wl, comm)
            self.batch = wl.random_batch(setup.local_batch_size(rank), seed=rank)

    @contextlib.contextmanager
    def _failing(self):
        try:
            yield
        except Exception as e:
            s, what = self.setup, f"{type(e).__name__}: {e}".splitlines()[0]
            raise PeerFailed(f"{s.name} (ZeRO-{s.zero_stage}, micro-batch {s.micro_batch_size} x {s.accum_steps}) "
                             f"failed on rank {self.rank}: {what}") from e

    def train_batch(self) -> float:
        with self._failing():
            return self.peer.train_batch(self.batch)

    def held_state(self) -> tuple[int, set[int]]:
        return self.peer.held_state()


def _measure_rank(rank: int, world_size: int, workload, cluster: dict, plans: list[dict], steps: int,
                  warmup: int, rounds: int, peers: list = (), config: EngineConfig | None = None) -> list[dict]:
    wl = as_workload(workload)
    config = config or EngineConfig()
    with rank_device(parse_cluster(cluster), rank, wl, config.mixed_precision) as device:
        return _measure(device, rank, wl, plans, steps, warmup, rounds, peers, config)


def _measure(device, rank: int, wl: Workload, plans: list[dict], steps: int, warmup: int, rounds: int,
             peers, config: EngineConfig | None = None) -> list[dict]:
    started = [_Peer(setup, wl, rank, device.comm) for setup in peers]
    runs: list[tuple[Callable[[], float], TimedSteps]] = []   # one step of each contender, and its steps timed
    for peer in started:     # warm-up, before Poplar's engines exist
        for _ in range(warmup):
            TimedSteps(device, peer.held_state).run(peer.train_batch, keep=False)
    optimizer = lambda params: torch.optim.AdamW(params, lr=1e-4)  # noqa: E731
    engines = []
    for p in plans:
        plan = poplar.Plan.from_dict(p)
        engine = initialize(wl.build(), optimizer, plan, config, comm=device.comm)
        batch = wl.random_batch(plan.local_batch_size(rank), seed=rank)
        engines.append(engine)
        runs.append((lambda engine=engine, batch=batch: engine.train_batch(batch, wl.loss),
                     TimedSteps(device, engine.held_state)))
    for run, timed in runs:       # warm-up, every plan (the peers have had theirs)
        for _ in range(warmup):
            timed.run(run, keep=False)
    runs += [(peer.train_batch, TimedSteps(device, peer.held_state)) for peer in started]
    per_round = max(1, steps // rounds)
    for _ in range(rounds):
        for run, timed in runs:
            dist.barrier()
            timed.run(run, keep=False)   # the first step after a switch realigns the ranks
            for _ in range(per_round):
                timed.run(run)
    for engine in engines:
        engine.close()
    for peer in started:
        peer.peer.close()
    return [{"step_s": statistics.median(t.step_s), "busy_s": statistics.median(t.busy_s), "steps": len(t.step_s),
             "overruns": t.overruns} for _, t in runs]


def measure_plans(workload: str | Workload, cluster: dict, plans: list[poplar.Plan], steps: int = 12, warmup: int = 2,
                  rounds: int = 3, timeout_s: float = 900, peers: list = (),
                  config: EngineConfig | None = None) -> list[dict]:
    """Train each plan, then each peer (a :mod:`poplar.compare.peers` setup), on the emulated ``cluster`` and measure it.

    Returns, per plan and then per peer: ``step_s`` (median time of a step on the
    devices' clock, the slowest rank's view), ``busy_s`` (each rank's median busy time),
    ``samples_per_s`` and ``overruns`` (summed over ranks). Raises
    :class:`poplar.compare.peers.PeerFailed` when a peer cannot run. Where a plan cannot run
    (out of memory, say) in the shared launch, each is measured again in a launch of
    its own, so that the others' figures are kept; the one that fails alone is
    ``{"failed": its one line}``. ``config``: the engine's options (default: its defaults), as training's.
    """
    from poplar.engine.agreement import check_plans_before_launch
    from poplar.processes.spawn import RankFailed

    check_plans_before_launch(plans, as_workload(workload).build, config)
    args = (workload, cluster, steps, warmup, rounds, timeout_s, config)
    try:
        return _launch(*args, plans, peers)
    except RankFailed as e:
        if len(plans) < 2:
            raise
        first = e.line
    out = []
    for plan in plans:
        try:
            out += _launch(*args, [plan], ())
        except RankFailed as e:
            out.append({"failed": e.line})
    if all("failed" not in m for m in out):   # each ran alone: together they did not fit
        for m in out:
            m["alone"] = first
    return out + (_launch(*args, [], peers) if peers else [])


def _launch(workload, cluster: dict, steps: int, warmup: int, rounds: int, timeout_s: float, config, plans: list,
            peers) -> list[dict]:
    """One launch measuring ``plans`` and ``peers`` (see :func:`measure_plans`)."""
    from poplar.processes.spawn import RankFailed, spawn

    spec = parse_cluster(cluster)
    try:
        ranks = spawn(_measure_rank, spec.world_size, as_workload(workload), cluster,
                      [p.to_dict() for p in plans], steps, warmup, rounds, list(peers), config, timeout_s=timeout_s)
    except RankFailed as e:
        if e.error != PeerFailed.__name__:
            raise
        raise PeerFailed(e.error_message) from None
    out = []
    for i, what in enumerate([*plans, *peers]):
        step = max(r[i]["step_s"] for r in ranks)
        out.append({"step_s": step, "busy_s": [r[i]["busy_s"] for r in ranks],
                    "samples_per_s": what.global_batch_size / step, "steps": ranks[0][i]["steps"],
                    "overruns": sum(r[i]["overruns"] for r in ranks)})
    return out
