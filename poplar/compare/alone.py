"""Each kind of device alone: its homogeneous cluster simulated and planned, beside the whole cluster's.

The paper's baselines 1 and 2 (:mod:`poplar.compare.evaluate`): the same devices, nodes and links
with the other kinds left out. Each is a simulation and a plan of its own, independent of
the whole cluster's, so they run in worker processes while this process simulates and plans
the whole cluster (:class:`AloneRuns`): as many workers as the machine has cores to spare.
Each kind is a job; the kinds of one world size are next to each other (a process counts
that world's steps once, for all of them). Each worker takes its jobs from the first; this
process, done with the whole cluster, takes from the last the jobs no worker has begun and
tells the worker to skip them, but for a worker's next kind of the world it is on (a plan
there, a count of that world's steps here).

The workers are :mod:`poplar.processes.pool`' (forked from this process where that is safe: no second import of
torch and the model's library); one that dies without its answers is warned of and its jobs are run here.
"""

from __future__ import annotations

import os
import select
import warnings

from pydantic import BaseModel, ConfigDict

from poplar.cluster.spec import ClusterSpec
from poplar.planner import make_plan
from poplar.planner.planner import PlanningError, PlanResult
from poplar.profile.fits import check_holds_states
from poplar.profile.options import ProfileOptions
from poplar.simulate.profile import simulate_profile
from poplar.processes.pool import Worker, WorkerDied
from poplar.models.workload import Workload



class Alone(BaseModel):
    """The homogeneous cluster of one kind: its own best plan, or why it has none."""

    model_config = ConfigDict(extra="forbid")

    kind: str
    ranks: int
    label: str = ""
    samples_per_s: float | None = None
    why_not: str = ""


def alone_cluster(spec: ClusterSpec, kind: str) -> ClusterSpec:
    """``spec`` with only the devices of ``kind``: on the same nodes, over the same links."""
    return spec.model_copy(update={"devices": [d for d in spec.devices if d.kind == kind]})


def plan_alone(kind: str, workload: Workload, spec: ClusterSpec, global_batch: int,
               options: ProfileOptions) -> tuple[Alone, PlanResult | None]:
    """``kind`` alone on ``spec``: simulated and planned, or why it cannot run ``global_batch``."""
    sub = alone_cluster(spec, kind)
    if global_batch < sub.world_size:
        return Alone(kind=kind, ranks=sub.world_size, why_not=f"a global batch of {global_batch} is smaller than "
                     f"its {sub.world_size} ranks"), None
    try:     # devices that cannot hold the model's states together: no plan, said at once (not a failed run)
        check_holds_states(workload, sub, options.precision)
    except ValueError as e:
        return Alone(kind=kind, ranks=sub.world_size, why_not=str(e)), None
    try:
        result = make_plan(simulate_profile(workload, sub, options), global_batch, options.stages)
    except PlanningError as e:
        return Alone(kind=kind, ranks=sub.world_size, why_not=str(e)), None
    return Alone(kind=kind, ranks=sub.world_size, label=result.chosen.label,
                 samples_per_s=result.predicted.samples_per_s), result


def spare_cores() -> int:
    """The cores this process may use, less the one it runs on (none where pipes cannot be waited on together)."""
    if os.name != "posix":
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(0, cores - 1)


Answer = tuple[Alone, PlanResult | None]



def jobs_of(spec: ClusterSpec, kinds: list[str]) -> list[list[str]]:
    """``kinds`` in jobs of one kind each (planning a kind alone at 512 ranks takes as long as counting its steps),
    those whose clusters alone have as many ranks together, the larger such groups first: a worker takes its jobs
    from the first, this process from the last, so a world's steps are mostly counted in one process."""
    by_size: dict[int, list[str]] = {}
    for kind in kinds:
        by_size.setdefault(alone_cluster(spec, kind).world_size, []).append(kind)
    return [[k] for group in sorted(by_size.values(), key=len, reverse=True) for k in group]


class AloneRuns:
    """Each of ``kinds`` alone, begun at once in up to ``workers`` processes (None: :func:`spare_cores`), forked
    or fresh as ``fork`` says (None: :func:`forking`); :meth:`results` runs here what no worker has begun or
    takes next with its steps counted, and waits for the rest. A context manager: leaving it ends the workers."""

    def __init__(self, workload: Workload, spec: ClusterSpec, kinds: list[str], global_batch: int,
                 options: ProfileOptions, workers: int | None = None, fork: bool | None = None):
        self.kinds, self.args = kinds, (workload, spec, global_batch, options)
        self.jobs = jobs_of(spec, kinds)
        self.worlds = [alone_cluster(spec, job[0]).world_size for job in self.jobs]
        n = min(len(self.jobs), spare_cores() if workers is None else max(0, workers))
        self.workers: list[Worker] = []
        self.done: dict[int, list[Answer]] = {}
        try:
            for i in range(n):
                self.workers.append(Worker({j: self.jobs[j] for j in range(i, len(self.jobs), n)}, plan_alone,
                                           self.args, fork))
        except BaseException:
            self.__exit__()
            raise

    def results(self) -> list[Answer]:
        """Each kind's answer, in the order of ``kinds``."""
        while len(self.done) < len(self.jobs):
            self._take(timeout=0)
            begun = {j for w in self.workers for j in w.begun}
            left = self._left_to_workers()
            free = [j for j in range(len(self.jobs)) if j not in self.done and j not in begun and j not in left]
            if free:
                job = free[-1]
                # a world no worker is on: its other kinds too, whose steps this process will then have counted
                working = {self.worlds[j] for j in begun if j not in self.done}
                for j in (j for j in free if j == job or self.worlds[job] not in working
                          and self.worlds[j] == self.worlds[job]):
                    for w in self.workers:
                        w.skip(j)
                self.done[job] = [plan_alone(k, *self.args) for k in self.jobs[job]]
            else:
                self._take(timeout=None)
        out = {k: a for j, answers in self.done.items() for k, a in zip(self.jobs[j], answers)}
        return [out[k] for k in self.kinds]

    def _left_to_workers(self) -> set[int]:
        """The jobs a worker takes next with its steps counted: its next one, where of the world of the one it is
        on (a plan there, a count of the world's steps here)."""
        left = set()
        for w in self.workers:
            now = [j for j in w.begun if j not in self.done]
            later = [j for j in w.jobs if j not in w.begun and j not in w.skipped and j not in self.done]
            if now and later and self.worlds[later[0]] == self.worlds[max(now)]:
                left.add(later[0])
        return left

    def _take(self, timeout: float | None) -> None:
        """The answers the workers sent, waiting up to ``timeout`` seconds (None: until one sends). A worker that
        ended without its answers is warned of and dropped: its jobs are left for this process."""
        while True:     # every message sent so far, not one: what a worker has begun must be known here at once
            waiting = self._waiting()
            ready = select.select([w.fd for w in waiting], [], [], timeout)[0] if waiting else []
            if not ready:
                return
            timeout = 0
            for w in waiting:
                if w.fd in ready:
                    self._receive(w)

    def _waiting(self) -> list[Worker]:
        """The workers with a job to hand back: one not done here, begun there or not told to skip (one told to
        skip all its jobs left may end: it is not waited for)."""
        return [w for w in self.workers
                if any(j not in self.done and (j in w.begun or j not in w.skipped) for j in w.jobs)]

    def _receive(self, w: Worker) -> None:
        try:
            for job, answers in w.receive():
                self.done.setdefault(job, answers)
        except WorkerDied as e:
            warnings.warn(f"{e} (simulating them alone); simulating them here instead", RuntimeWarning, stacklevel=4)
            self.workers.remove(w)
            w.close()

    def __enter__(self) -> AloneRuns:
        return self

    def __exit__(self, *exc) -> None:
        for w in self.workers:
            w.close()
