"""A run that goes on on other ranks: a re-plan changed who takes part (:mod:`poplar.runtime.replanner`).

The ranks stop after a step, its checkpoint written, and tell their launcher the re-plan's
profile ranks, its plan and their speeds (``relaunch`` in
:meth:`poplar.train.trainer.Trainer.train`'s result). The launcher starts the run again on
those devices of the whole cluster (:func:`relaunched`), resuming from that checkpoint, which
any world size, plan and stage reads exactly (the same global batches, in the same order);
it writes the run's files again (``plan.json``, ``basis.json`` with the speeds, ``config.yaml``,
``cluster.json``, ``cluster.yaml`` where some devices sit out), so ``--resume`` continues
where the run now is. The log goes on as one run's, the re-plan recorded in it as any other
(with the ranks before and after).
"""

from __future__ import annotations

from dataclasses import replace

from poplar.train.description import Run
from poplar.train.launching import Launch, on_planned_ranks


def whole_cluster(launch: Launch, cluster, basis):
    """The cluster a re-plan may start the run again on any devices of (``Run.whole``): the command's emulated
    cluster, where this process launches the ranks and ``basis``'s profile is of its devices; None otherwise."""
    if launch.in_process or launch.devices != "emulated" or basis is None or cluster is None:
        return None
    return cluster if basis.profile.world_size == cluster.world_size else None


def relaunched(run: Run, moving: dict) -> Run:
    """``run`` as it goes on after ``moving`` (the ranks' ``relaunch``: ``step``, ``ranks``, ``plan``,
    ``speeds``): on those profile ranks' devices of ``run.whole``, resuming, with the re-plan's plan, planning
    again from the same profile at the speeds measured."""
    from poplar.planner.replan import PlanBasis

    ranks, whole, plan = [int(r) for r in moving["ranks"]], run.whole, moving["plan"]
    everyone = replace(run.launch, world_size=whole.world_size)
    launch, cluster, cluster_file = on_planned_ranks(everyone, plan, ranks, whole, run.config.out)
    basis = PlanBasis(run.basis.profile, ranks, [float(s) for s in moving["speeds"]])
    config = run.config.model_copy(update={"resume": True})
    return replace(run, config=config, launch=launch, cluster=cluster, plan=plan, planning=None, basis=basis,
                   cluster_file=cluster_file)


def joined(before: dict, after: dict) -> dict:
    """One run's result (rank 0's) from two launches' one after the other: the losses of both, from the first's
    start; the rest the later's."""
    return {**after, "losses": [*before["losses"], *after["losses"]], "start": before["start"]}
