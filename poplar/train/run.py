"""`poplar train`: from a configuration to trained ranks, in the order a reader follows it.

1. :func:`~poplar.train.launching.settle` resolves once what the command asked: the config as
   the run trains it (the precision chosen where it is ``auto``, a resume where torchrun
   restarted the group), how the ranks come to be (torchrun's, the one GPU here, or spawned
   here on an emulated cluster or plain CPUs) and the cluster, read; everything the command
   line tells is checked before data, profile or processes;
2. the launcher (or rank 0) prepares the data once (:func:`~poplar.train.dataset.prepare_run_data`)
   and hands it to every rank, the plan is obtained (:mod:`poplar.train.planning`: ``--plan``,
   the run's own on resume, or profile + plan) and the run's files are written
   (:mod:`poplar.train.run_dir`), refusing bad input before anything is written: all of it one
   immutable :class:`~poplar.train.description.Run`;
3. every rank trains it (:func:`~poplar.train.trainer.train_rank`); where a re-plan takes other ranks of the
   emulated cluster, the ranks stop after a checkpoint and the launcher starts the run again on them
   (:mod:`poplar.train.relaunch`: the log reads as one run's).

The steps are the same whether the ranks are spawned here or this process is one of them;
what differs (who runs the ranks, who prepares, how they wait for each other) is
:class:`~poplar.train.launching.Spawned` or :class:`~poplar.train.launching.InProcess`.

Each rank trains on its slice of every global batch
(:class:`poplar.data.text.GlobalBatches`); rank 0 writes one JSON line per step
(:mod:`poplar.train.metrics`). Checkpoints (``torch.distributed.checkpoint``) are
sharded and atomic; ``resume`` continues from the newest one exactly where an
uninterrupted run would be.
"""

from __future__ import annotations

from pathlib import Path

from poplar.plan import check_global_batch
from poplar.train.checkpointer import check_resume
from poplar.train.config import TrainConfig
from poplar.train.dataset import named_model, own_model, prepare_run_data
from poplar.train.description import Run
from poplar.train.evaluation import check_eval_data, say_evaluation
from poplar.train.export import check_export_dir, check_exportable, export_run
from poplar.train.launching import InProcess, Spawned, on_planned_ranks, settle
from poplar.train.planning import get_plan, given_plan
from poplar.train.relaunch import joined, relaunched, whole_cluster
from poplar.train.reporters import check_reporters
from poplar.train.run_dir import check_out, write_run_files
from poplar.train.trainer import train_rank


def run_training(cfg: TrainConfig, return_state: bool = False, timeout_s: float = 3600,
                 nproc: int | None = None, progress=None) -> dict:
    """Train; returns rank 0's losses (and full parameters if asked).

    Under ``torchrun`` this process is one rank (every rank calls this). Otherwise it
    launches the ranks itself: one per device of ``cfg.cluster``, or ``nproc`` plain
    CPU ranks with ``cfg.plan``. ``progress`` hears of the profiling, if any
    (:class:`poplar.progress.Progress` shows it). Everything is resolved once, here, into the
    :class:`~poplar.train.description.Run` the ranks train.
    """
    cfg, launch, cluster, said = settle(cfg, nproc)
    ranks = InProcess(launch) if launch.in_process else Spawned(timeout_s)
    if cfg.export:    # everything the command line tells is checked before data, profile or processes
        check_export_dir(cfg.export)
    if not cfg.plan:
        check_global_batch(cfg.global_batch, launch.world_size)
    check_reporters(cfg.report_to)
    own = own_model(cfg.model_data)     # the model's own identity, resolved once
    named = named_model(cfg.model_data, own)
    check_eval_data(cfg, own)
    if said and ranks.lead:
        print(said, flush=True)
    check_out(cfg.out, cfg.resume, launch.restarted, cfg.steps)   # every process sees the same directory: all refuse
    given = given_plan(cfg, named, launch.world_size, cluster)     # before the data: a wrong plan, at once
    with ranks:
        data = ranks.share(lambda: prepare_run_data(cfg.model_data, own, progress))   # prepared once, by one
        check_resume(cfg.checkpointing, data.model, cfg.global_batch if given is None else given.global_batch_size)
        if ranks.lead:
            say_evaluation(cfg, data)
        if cfg.export:
            check_exportable(data.model)
        plan, result, basis = get_plan(cfg, data.model, launch.world_size, given, cluster, ranks.distributed,
                                       progress)
        if ranks.lead:
            Path(cfg.out).mkdir(parents=True, exist_ok=True)     # only now: a run refused writes nothing
        whole = whole_cluster(launch, cluster, basis)   # where a re-plan may start the run again on others
        launch, cluster, cluster_file = on_planned_ranks(launch, plan, result.ranks if result else None, cluster,
                                                         cfg.out)
        run = Run(cfg, launch, cluster, data, plan, result, basis, cluster_file, whole)
        if ranks.lead:
            write_run_files(run)
        ranks.barrier()                     # the run's files are written before any rank starts
        mine = ranks.train(train_rank, run, return_state)
        while mine.get("relaunch"):         # a re-plan took other ranks: started again on them (spawned ranks)
            run = relaunched(run, mine["relaunch"])
            write_run_files(run)
            mine = joined(mine, ranks.train(train_rank, run, return_state))
    return _finished(run, mine, result) if ranks.lead else {**mine, "exported": None}


def _finished(run: Run, mine: dict, planning) -> dict:
    """Rank 0's (or the launcher's) result: its figures and the plan it ended with, the planner's result
    (``planning``), the log summarised and drawn; and, once the ranks are done (their group left), the model
    written where ``--export`` says, of a run that reached its last step (not one preempted or stopped early:
    `poplar export` later)."""
    from poplar.train.report import plot_runs, read_log, summarize

    cfg, out_dir = run.config, Path(run.config.out)
    records = read_log(out_dir / "log.jsonl")
    report = plot_runs({cfg.baseline: records}, out_dir / "report.png", title=f"{cfg.model}, {mine['plan']}")
    done = not mine.get("preempted") and (cfg.stop_at or cfg.steps) >= cfg.steps
    return {**mine, "planning": planning, "summary": summarize(records), "report": report,
            "exported": export_run(cfg.out, cfg.export) if cfg.export and done else None}
