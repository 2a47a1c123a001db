"""One `poplar train` run as its ranks train it: :class:`Run`, resolved once at the edge and never rewritten.

:func:`poplar.train.run.run_training` settles what the command asked (the config, the
precision chosen where it is ``auto``, a resume where torchrun restarted the group, the
launch, the cluster read), prepares the data and obtains the plan, once, in the launcher
(or rank 0); what it found flows down to every rank as one value. Nothing downstream rewrites
the config or reads a cluster from its name (which is only said, in the profiling's title):
the cluster is ``Run.cluster``, the planned ranks' only where the planner left devices out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from poplar.cluster.spec import ClusterSpec
    from poplar.plan import Plan
    from poplar.planner.replan import PlanBasis
    from poplar.planner.result import PlanResult
    from poplar.train.config import TrainConfig
    from poplar.train.dataset import RunData
    from poplar.train.launching import Launch


@dataclass(frozen=True)
class Run:
    """What every rank of a run trains, and how.

    ``config``: as the run trains it (its precision chosen, ``resume`` set where torchrun restarted the group);
    ``launch``: how the ranks came to be, and how many; ``cluster``: the emulated cluster the ranks run on (None:
    none given); ``data``: the model and its data, prepared once; ``plan``: the plan the ranks start with;
    ``planning``: the planner's result (None: the plan was given); ``basis``: what the ranks plan again from
    (None: the plan is kept); ``cluster_file``: where the run's cluster was written, where the planner left
    devices out (what the run directory's config names, for a resume); ``whole``: the cluster whose devices the
    basis's profile ranks are, where the launcher can start the run again on any of them (a re-plan that changes
    who takes part; None: it cannot, torchrun's ranks or a cluster file of some of them)."""

    config: TrainConfig
    launch: Launch
    cluster: ClusterSpec | None
    data: RunData
    plan: Plan
    planning: PlanResult | None = None
    basis: PlanBasis | None = None
    cluster_file: str | None = None
    whole: ClusterSpec | None = None

    @property
    def model(self):
        """The model trained (a :class:`~poplar.models.source.ModelSource`)."""
        return self.data.model

    @property
    def world_size(self) -> int:
        return self.launch.world_size

    def device_rank(self, rank: int) -> int:
        """The rank of launched rank ``rank``'s device in the whole cluster, where the run may be started again on
        others (``whole``: the basis's profile rank); ``rank`` otherwise."""
        return rank if self.whole is None else self.basis.ranks[rank]

    def record(self) -> dict:
        """The config as the run directory records it (``config.yaml``, what a resume starts from; what the
        reporters are told): the cluster the run's own file, where the planner left devices out."""
        record = self.config.model_dump(mode="json")
        return record if self.cluster_file is None else {**record, "cluster": self.cluster_file}
