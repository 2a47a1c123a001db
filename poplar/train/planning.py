"""The plan a run trains with: ``--plan``, the run's own on resume, or profile + plan on its cluster."""

from __future__ import annotations

import json
from pathlib import Path

import poplar
from poplar.plan import check_global_batch
from poplar.train.config import TrainConfig
from poplar.runtime.plans import basis_of, load_plan, profile_and_plan
from poplar.train.run_dir import same_cluster
from poplar.models.workload import Workload


def get_plan(cfg: TrainConfig, wl: Workload, world_size: int, given, cluster, distributed: bool = False,
             progress=None):
    """The plan to train with, the planner's result (None where one is ``given``: :func:`given_plan`) and what the
    ranks plan again from (:func:`plan_basis`); ``cluster``: the run's, read (None: none given).

    ``progress(title)``: a context that hears of the profiling's progress
    (:class:`poplar.progress.Progress`).
    """
    from poplar.engine.agreement import check_plans_before_launch

    plan, result = given, None
    if given is None:
        check_global_batch(cfg.global_batch, world_size)
        spec = cluster if cluster is not None else _discovered(distributed)
        spec.check_world_size(world_size)
        plan, result = plan_on(cfg, wl, spec, distributed, progress)
    basis = plan_basis(cfg, result, world_size, cluster)
    check_plans_before_launch([plan], wl.build, cfg.engine)
    return plan, result, basis


def given_plan(cfg: TrainConfig, wl: Workload, world_size: int, cluster):
    """The plan the run is given (``--plan``, or its own on a resume on the same ``cluster``); None: it plans.
    Read once a process: what it returns is handed on."""
    if cfg.plan:
        plan = load_plan_for(cfg, wl)
        plan.check_world_size(world_size)
        return plan
    previous = Path(cfg.out) / "plan.json"
    if cfg.resume and previous.exists() and same_cluster(cfg.out, world_size, cluster):   # the run's own, as it was
        return poplar.Plan.load(previous)
    return None


def plan_basis(cfg: TrainConfig, result, world_size: int, cluster):
    """What the ranks plan again from as they measure (:class:`~poplar.planner.replan.PlanBasis`): the planner's
    profile and ranks, or, resuming on the same cluster with the run's own plan, what the run wrote
    (``basis.json``); None where the plan was given."""
    if result is not None:
        return basis_of(result)
    written = Path(cfg.out) / "basis.json"
    if cfg.resume and not cfg.plan and written.is_file() and same_cluster(cfg.out, world_size, cluster):
        from poplar.planner.replan import PlanBasis

        return PlanBasis.from_dict(json.loads(written.read_text()))
    return None


def _discovered(distributed: bool):
    """Without a cluster file: the ranks' own GPUs, discovered."""
    from poplar.profile.discover import discover_cluster

    if distributed and _on_cuda():
        return discover_cluster()
    raise ValueError("without a cluster file only real CUDA ranks are profiled (torchrun's on GPUs, or the one "
                     "GPU here), and these are plain CPU ranks: give --plan, or --cluster FILE|PRESET for an "
                     "emulated cluster")


def plan_on(cfg: TrainConfig, wl: Workload, spec, distributed: bool, progress=None):
    """Profile (or read the cache) on ``spec`` and plan; the chosen allocation's plan and the planner's result."""
    title = f"{cfg.cluster or 'the GPUs here'}: profiling {wl.name} (cached after the first run)"
    result = profile_and_plan(wl, spec, cfg.global_batch, cfg.stages, cfg.engine, distributed,
                              use_cache=cfg.profile_cache, progress=progress, title=title,
                              may_leave_out=not distributed)   # torchrun's group is started: every rank trains
    if cfg.baseline == "poplar":
        return result.plan, result
    alloc = result.allocations()[cfg.baseline]
    if alloc.plan is None:
        raise ValueError(f"the {cfg.baseline} baseline cannot run stage {result.stage}: {alloc.why_not}")
    return alloc.plan, result


def load_plan_for(cfg: TrainConfig, wl: Workload):
    """``cfg.plan``, refused where it was planned for another model or sequence length, or is not a plan, or splits
    another global batch than the one asked for."""
    path = Path(cfg.plan)
    plan = load_plan(path, name=f"--plan {path}", model=(wl.name, wl.seq_len))
    if plan.global_batch_size != cfg.global_batch and "global_batch" in cfg.model_fields_set:
        raise ValueError(f"--plan {path} splits a global batch of {plan.global_batch_size} samples, and "
                         f"--global-batch is {cfg.global_batch}: give one of them (the plan's is used without it)")
    return plan


def _on_cuda() -> bool:
    """This rank computes on its own GPU (the process group runs over NCCL)."""
    import torch.distributed as dist

    from poplar.engine.dist import context

    return dist.is_initialized() and context().device.type == "cuda"
