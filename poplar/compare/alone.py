"""Each kind of device alone: its homogeneous cluster simulated and planned, beside the whole cluster's.

The paper's baselines 1 and 2 (:mod:`poplar.compare.evaluate`): the same devices, nodes and links
with the other kinds left out. Each is a simulation and a plan of its own, independent of
the whole cluster's, so they run in worker processes while this process simulates and plans
the whole cluster (:class:`AloneRuns`): as many workers as the machine has cores to spare.
Each kind is a job; the kinds of one world size are next to each other, keyed by it (a process counts
that world's steps once, for all of them): the workers take the jobs from the first, this process,
done with the whole cluster, from the last (:class:`poplar.processes.pool.SharedJobs`, which says how
the workers are started, and what happens to the jobs of one that dies).
"""

from __future__ import annotations

from poplar.cluster.spec import ClusterSpec
from poplar.compare.comparison import Contender
from poplar.models.workload import Workload
from poplar.planner import make_plan
from poplar.planner.planner import PlanningError, PlanResult
from poplar.processes.pool import SharedJobs
from poplar.profile.fits import check_holds_states
from poplar.profile.options import ProfileOptions
from poplar.simulate.profile import simulate_profile


def alone_cluster(spec: ClusterSpec, kind: str) -> ClusterSpec:
    """``spec`` with only the devices of ``kind``: on the same nodes, over the same links."""
    return spec.model_copy(update={"devices": [d for d in spec.devices if d.kind == kind]})


def plan_alone(kind: str, workload: Workload, spec: ClusterSpec, global_batch: int,
               options: ProfileOptions) -> tuple[Contender, PlanResult | None]:
    """``kind`` alone on ``spec``: simulated and planned (its allocation ``"<kind> alone"``, predicted), or why it
    cannot run ``global_batch``."""
    sub = alone_cluster(spec, kind)
    name, ranks = f"{kind} alone", sub.world_size
    if global_batch < ranks:
        return Contender(name, kind=kind, ranks=ranks, why_not=f"a global batch of {global_batch} is smaller than "
                          f"its {ranks} ranks"), None
    try:     # devices that cannot hold the model's states together: no plan, said at once (not a failed run)
        check_holds_states(workload, sub, options.precision)
    except ValueError as e:
        return Contender(name, kind=kind, ranks=ranks, why_not=str(e)), None
    try:
        result = make_plan(simulate_profile(workload, sub, options), global_batch, options.stages)
    except PlanningError as e:
        return Contender(name, kind=kind, ranks=ranks, why_not=str(e)), None
    return Contender(name, result.plan, result.predicted.samples_per_s, result.predicted.step_s, kind=kind,
                      ranks=ranks, label=result.chosen.label), result


def jobs_of(spec: ClusterSpec, kinds: list[str]) -> list[str]:
    """``kinds`` in the order they are taken (planning a kind alone at 512 ranks takes as long as counting its
    steps): those whose clusters alone have as many ranks together, the larger such groups first: the workers
    take from the first, this process from the last, so a world's steps are mostly counted in one process."""
    by_size: dict[int, list[str]] = {}
    for kind in kinds:
        by_size.setdefault(alone_cluster(spec, kind).world_size, []).append(kind)
    return [k for group in sorted(by_size.values(), key=len, reverse=True) for k in group]


class AloneRuns(SharedJobs):
    """Each of ``kinds`` alone (:func:`plan_alone`), begun at once in up to ``workers`` processes (None: the cores
    to spare), forked or spawned as ``fork`` says (None: where it is safe); :meth:`results` runs here what no
    worker has taken, and waits for the rest. A context manager: leaving it ends the workers."""

    def __init__(self, workload: Workload, spec: ClusterSpec, kinds: list[str], global_batch: int,
                 options: ProfileOptions, workers: int | None = None, fork: bool | None = None):
        self.kinds = list(kinds)
        ordered = jobs_of(spec, self.kinds)
        super().__init__(plan_alone, ordered, (workload, spec, global_batch, options),
                         keys=[alone_cluster(spec, k).world_size for k in ordered], workers=workers, fork=fork)

    def results(self) -> list[tuple[Contender, PlanResult | None]]:
        """Each kind's answer, in the order of ``kinds``."""
        answers = dict(zip(self.items, super().results()))
        return [answers[k] for k in self.kinds]
