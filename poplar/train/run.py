"""`poplar train`: from a configuration to trained ranks, in the order a reader follows it.

1. :func:`~poplar.train.launching.resolve_launch` decides once how the ranks come to be
   (torchrun's, the one GPU here, or spawned here on an emulated cluster or plain CPUs);
2. the launcher checks the run directory, prepares the data once (the tokenizer is
   cached, so the ranks read it back), obtains the plan (:mod:`poplar.train.planning`:
   ``--plan``, the run's own on resume, or profile + plan) and writes the run's files
   (:mod:`poplar.train.run_dir`), refusing bad input before anything is written;
3. every rank builds a :class:`~poplar.train.trainer.Trainer` on its device and trains.

Each rank trains on its slice of every global batch
(:class:`poplar.data.text.GlobalBatches`); rank 0 writes one JSON line per step
(:mod:`poplar.train.metrics`). Checkpoints (``torch.distributed.checkpoint``) are
sharded and atomic; ``resume`` continues from the newest one exactly where an
uninterrupted run would be.
"""

from __future__ import annotations

from pathlib import Path

import poplar
from poplar.train.checkpointer import check_resume
from poplar.train.config import TrainConfig
from poplar.train.dataset import named_model, prepare_data, workload_of
from poplar.train.evaluation import check_eval_data, say_evaluation
from poplar.train.export import check_export_dir, check_exportable, export_run
from poplar.plan import check_global_batch
from poplar.train.launching import Launch, cluster_of, on_planned_ranks, precision_of, resolve_launch
from poplar.train.planning import get_plan, given_plan, plan_basis
from poplar.train.reporters import check_reporters
from poplar.train.run_dir import check_out, write_run_files
from poplar.models.workload import ModelSource


def train_rank(rank: int, world_size: int, cfg: TrainConfig, launch: Launch, plan_dict: dict, wl: ModelSource,
               cluster=None, return_state: bool = False, basis: dict | None = None) -> dict:
    """One rank: its device (``cluster``'s, read by the launcher), its :class:`~poplar.train.trainer.Trainer`, the
    loop; rank 0's figures and the plan it ended with (re-planned, or lowered where a rank ran out of memory).
    ``basis``: what it plans again from (:func:`~poplar.train.planning.plan_basis`)."""
    from poplar.planner.replan import PlanBasis
    from poplar.train.trainer import Trainer

    with launch.device(rank, wl, cluster, cfg.engine.mixed_precision) as device:
        trainer = Trainer(cfg, poplar.Plan.from_dict(plan_dict), wl, device, rank, world_size,
                          basis=None if basis is None else PlanBasis.from_dict(basis))
        out = trainer.train()
        state = trainer.engine.full_state_dict() if return_state else None
        plan = trainer.engine.plan.to_dict()
        trainer.close()
    return {**out, "state": state if rank == 0 else None, "plan": plan}


def run_training(cfg: TrainConfig, return_state: bool = False, timeout_s: float = 3600,
                 nproc: int | None = None, progress=None) -> dict:
    """Train; returns rank 0's losses (and full parameters if asked).

    Under ``torchrun`` this process is one rank (every rank calls this). Otherwise it
    launches the ranks itself: one per device of ``cfg.cluster``, or ``nproc`` plain
    CPU ranks with ``cfg.plan``. ``progress`` hears of the profiling, if any
    (:class:`poplar.progress.Progress` shows it). The cluster file and the plan given
    are read once, here, and handed on.
    """
    cluster = cluster_of(cfg)
    launch = resolve_launch(cfg, nproc, cluster=cluster)
    cfg, chosen = precision_of(cfg, launch, cluster)
    if cfg.export:
        check_export_dir(cfg.export)
    if not cfg.plan:   # everything the command line tells is checked before data, profile or processes
        check_global_batch(cfg.global_batch, launch.world_size)
    check_reporters(cfg.report_to)
    check_eval_data(cfg)
    if launch.restarted:   # torchrun restarted the group after a failure: continue from the newest checkpoint
        cfg = cfg.model_copy(update={"resume": True})
    if launch.in_process:
        return _exported(cfg, _run_in_process(cfg, launch, cluster, return_state, progress, chosen))
    if chosen:
        print(chosen, flush=True)
    from poplar.processes.spawn import spawn

    out_dir = check_out(cfg.out, cfg.resume, steps=cfg.steps)
    given = given_plan(cfg, named_model(cfg.model_data), launch.world_size, cluster)   # before the data: a wrong plan, at once
    prepared = prepare_data(cfg.model_data, progress)     # prepared once, shown: the ranks read it back
    wl = workload_of(cfg.model_data, prepared)
    _check_resume(cfg, wl, given)
    say_evaluation(cfg, prepared)                         # so are the evaluation samples
    if cfg.export:
        check_exportable(wl)
    plan, result = _plan(cfg, wl, given, launch.world_size, cluster, False, progress)
    out_dir.mkdir(parents=True, exist_ok=True)     # only now: a run refused writes nothing
    cfg, launch, cluster = on_planned_ranks(cfg, launch, plan, result.ranks if result else None, out_dir, cluster)
    basis = plan_basis(cfg, result, launch.world_size, cluster)
    write_run_files(cfg, out_dir, plan, result, cluster, basis)
    ranks = spawn(train_rank, launch.world_size, cfg, launch, plan.to_dict(), wl, cluster, return_state, basis,
                  timeout_s=timeout_s)
    return _exported(cfg, _finish(cfg, out_dir, poplar.Plan.from_dict(ranks[0]["plan"]), result, ranks[0]))


def _exported(cfg: TrainConfig, result: dict) -> dict:
    """After the ranks are done (their group left): the model written where ``--export`` says, by rank 0 (or the
    launcher) of a run that reached its last step (not one preempted or stopped early: `poplar export` later)."""
    done = "summary" in result and not result.get("preempted") and (cfg.stop_at or cfg.steps) >= cfg.steps
    return {**result, "exported": export_run(cfg.out, cfg.export) if cfg.export and done else None}


def _run_in_process(cfg: TrainConfig, launch: Launch, cluster, return_state: bool, progress=None,
                    say: str | None = None) -> dict:
    """This process is one rank: torchrun's, or a group of one here (``init_distributed`` makes it). ``say``: a
    line rank 0 prints first."""
    import torch.distributed as dist

    from poplar.engine.dist import init_distributed, shutdown

    out_dir = check_out(cfg.out, cfg.resume, launch.restarted, cfg.steps)    # every rank sees the same directory: all refuse alike
    given = given_plan(cfg, named_model(cfg.model_data), launch.world_size, cluster)
    init_distributed()
    rank = dist.get_rank()
    prepared = None    # rank 0's; the others read the cache it wrote
    try:
        if rank == 0:
            if say:
                print(say, flush=True)
            prepared = prepare_data(cfg.model_data, progress)   # trains and caches the tokenizer once
        dist.barrier()
        wl = workload_of(cfg.model_data, prepared)
        _check_resume(cfg, wl, given)
        if rank == 0:
            say_evaluation(cfg, prepared)                       # the evaluation samples prepared, once
            out_dir.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        if cfg.export:
            check_exportable(wl)
        plan, result = _plan(cfg, wl, given, launch.world_size, cluster, True, progress)
        basis = plan_basis(cfg, result, launch.world_size, cluster)
        if rank == 0:
            write_run_files(cfg, out_dir, plan, result, cluster, basis)
        dist.barrier()
        mine = train_rank(rank, launch.world_size, cfg, launch, plan.to_dict(), wl, cluster, return_state, basis)
        plan = poplar.Plan.from_dict(mine["plan"])
        return _finish(cfg, out_dir, plan, result, mine) if rank == 0 else {**mine, "plan": plan}
    finally:
        shutdown()


def _check_resume(cfg: TrainConfig, wl: ModelSource, given) -> None:
    """A resume that would fail (damaged checkpoints, another run's), refused before anything is said or profiled."""
    check_resume(cfg.checkpointing, wl, cfg.global_batch if given is None else given.global_batch_size)


def _plan(cfg: TrainConfig, wl: ModelSource, given, world_size: int, cluster, distributed: bool, progress):
    """The plan ``given`` (:func:`given_plan`, read once) or made; and the planner's result."""
    return get_plan(cfg, wl, world_size, given, cluster, distributed=distributed, progress=progress)


def _finish(cfg: TrainConfig, out_dir: Path, plan, result, mine: dict) -> dict:
    from poplar.train.report import plot_runs, read_log, summarize

    records = read_log(out_dir / "log.jsonl")
    report = plot_runs({cfg.baseline: records}, out_dir / "report.png", title=f"{cfg.model}, {plan}")
    return {**mine, "plan": plan, "planning": result, "summary": summarize(records), "report": report}
