"""One rank's session of a framework's training loop trained by Poplar: :class:`Session`.

The session is the integrations' glue over :mod:`poplar.runtime` (a rank's life for every
front end: :class:`~poplar.runtime.rank.RankRuntime`, the re-planner, the checkpoints).
Every integration does the same four things, here once:

1. join the process group (torchrun's environment; a plain ``python`` run is one rank);
2. decide the plan (:func:`resolve_plan`): one given (a :class:`~poplar.Plan`, its dict or a
   ``plan.json``), or profiled and planned on a cluster (a cluster file or preset, and the
   :class:`~poplar.models.workload.Workload` that names the model, as ``poplar train`` does), or with
   neither the even split of the front end's own batch settings
   (:mod:`~poplar.integrations.batch_settings`, as DeepSpeed and DDP split them);
3. take the rank's device (:func:`poplar.devices.rank_device_of`, as ``poplar train``'s ranks): the
   emulated GPU of a cluster file, the GPU it runs on, or this host's CPU, which times (and,
   emulated, paces) every step;
4. build the engine with the user's optimizer (:func:`optimizer_factory`) and run steps in
   the device's step (:meth:`Session.train_batch`); save and load the same resharding
   checkpoints as ``poplar train`` (:meth:`Session.save`, :meth:`Session.load`).
"""

from __future__ import annotations

import contextlib
import os
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from poplar.devices import rank_device_of
from poplar.engine.config import EngineConfig
from poplar.integrations.batch_settings import BatchSettings, even_plan
from poplar.integrations.step_plans import FollowedPlan, PlanSchedule
from poplar.plan import Plan
from poplar.runtime.plans import basis_of, load_plan, profile_and_plan
from poplar.runtime.rank import RankRuntime
from poplar.runtime.replan_settings import replan_config
from poplar.runtime.replanner import replanner_for


def resolve_plan(world_size: int, plan=None, **planning) -> Plan:
    """The plan this group trains with: ``plan``, or profiled and planned (see :func:`resolve_planning`)."""
    return resolve_planning(world_size, plan, **planning)[0]


def resolve_planning(world_size: int, plan=None, *, cluster=None, workload=None, global_batch: int | None = None,
                     stages=(0, 1, 2, 3), config: EngineConfig | None = None, model: torch.nn.Module | None = None,
                     batch: BatchSettings | None = None):
    """``(plan, basis)``: ``plan`` (basis None), or profiled and planned on ``cluster`` for ``workload`` with the
    :class:`~poplar.planner.replan.PlanBasis` it came from (to plan again as the steps measure), or with neither
    the even split of the front end's own ``batch`` settings in the lowest of ``stages`` (basis None).

    Every rank calls it (profiling is collective). Checked against the launched
    ``world_size``, ``global_batch`` (when given) and ``model`` (the workload profiled
    must be its size) before anything is profiled.
    """
    if plan is not None:
        plan = load_plan(plan)
        plan.check_world_size(world_size)
        if global_batch is not None and plan.global_batch_size != global_batch:
            raise ValueError(f"the plan splits a global batch of {plan.global_batch_size} samples, the "
                             f"configuration asks for {global_batch}: make them agree (or leave the plan out to "
                             f"plan {global_batch})")
        return plan, None
    if cluster is None and workload is None and batch is not None:   # as the front end's framework splits it
        return even_plan(world_size, batch, stages), None
    if cluster is None or workload is None or global_batch is None:
        raise ValueError("Poplar needs a plan: give plan= (a poplar.Plan or a plan.json from `poplar plan`), or "
                         "cluster= (a cluster file or preset) with workload= (the model preset to profile) and "
                         "a global batch")
    if model is not None:
        _check_workload_is(model, workload)
    return _profile_and_plan(world_size, cluster, workload, global_batch, tuple(stages), config or EngineConfig())


def _check_workload_is(model: torch.nn.Module, workload) -> None:
    """The workload profiled must be the model trained: refuse another size before minutes of profiling."""
    from poplar.models.workload import as_workload

    wl = as_workload(workload)
    n = sum(p.numel() for p in model.parameters())
    if n != wl.n_params():
        raise ValueError(f"workload {wl.name} has {wl.n_params():,} parameters, the model trained has {n:,}: "
                         "profile the workload this model is (its preset, seq_len and vocab_size), or give a plan")


def _profile_and_plan(world_size: int, cluster, workload, global_batch: int, stages, config) -> tuple:
    """Every rank profiles and plans; rank 0 shows what is profiled, how far it is, and the plan chosen (as
    ``poplar train`` does: bars in a terminal, a line per stage in a log)."""
    import time

    import torch.distributed as dist

    from poplar.plan import check_global_batch
    from poplar.progress import Progress, console, say
    from poplar.models.workload import as_workload

    name = str(cluster) if isinstance(cluster, (str, Path)) and ":" not in str(cluster) else "the cluster"
    spec, wl = cluster_spec(cluster), as_workload(workload)
    spec.check_world_size(world_size)
    check_global_batch(global_batch, world_size)
    out = console() if not dist.is_initialized() or dist.get_rank() == 0 else None
    shown: list[Progress] = []

    def progress(title: str) -> Progress:
        shown.append(Progress(out, title))
        return shown[-1]

    start = time.monotonic()
    result = profile_and_plan(wl, spec, global_batch, stages, config, distributed=True,
                              progress=progress if out is not None else None,
                              title=profiling_title(name, wl.name, spec, stages), may_leave_out=False)
    if out is not None:
        how = "profiled and planned" if any(p.heard for p in shown) else "planned (the profile read from the cache)"
        plan = str(result.plan) if result.plan.world_size <= 8 else result.plan.summary()
        say(out, f"{name}: {how} in {time.monotonic() - start:.0f} s: {plan}; {result.reason}")
    return result.plan, basis_of(result)


def profiling_title(name: str, model: str, spec, stages) -> str:
    """The first line a profiling prints: what is profiled, where, in which stages, and how long it takes.

    >>> from poplar.cluster.spec import load_cluster
    >>> print(profiling_title("memory-bound", "LitTiny", load_cluster("memory-bound"), (0, 1, 2, 3)))
    ... # doctest: +NORMALIZE_WHITESPACE
    memory-bound: profiling LitTiny on 1 x a100-80gb, 1 x t4-16gb in ZeRO stages 0-3
    (cached after the first run): each stage is shown as it ends
    """
    stages = sorted(stages)
    if len(stages) == 1:
        which = f"stage {stages[0]}"
    elif stages == list(range(stages[0], stages[-1] + 1)):
        which = f"stages {stages[0]}-{stages[-1]}"
    else:
        which = "stages " + ", ".join(map(str, stages))
    kinds = ", ".join(f"{d.count} x {d.kind}" for d in spec.devices)
    takes = "this takes a few minutes on the GPUs" if spec.is_real else "each stage is shown as it ends"
    return f"{name}: profiling {model} on {kinds} in ZeRO {which} (cached after the first run): {takes}"


def cluster_spec(cluster):
    """A :class:`~poplar.cluster.spec.ClusterSpec` from itself, a cluster file or a preset's name (None: None)."""
    if cluster is None or not isinstance(cluster, (str, Path)):
        return cluster
    from poplar.cluster.spec import load_cluster

    return load_cluster(cluster)


def from_environment(plan, cluster, workload, global_batch) -> tuple:
    """What was left out, from ``POPLAR_PLAN``, ``POPLAR_CLUSTER``, ``POPLAR_WORKLOAD`` and ``POPLAR_GLOBAL_BATCH``."""
    env = os.environ
    batch = env.get("POPLAR_GLOBAL_BATCH") or None
    if global_batch is None and batch is not None:
        if not batch.isdigit():
            raise ValueError(f"POPLAR_GLOBAL_BATCH={batch!r}: give the global batch as a whole number of samples")
        global_batch = int(batch)
    return (plan if plan is not None else env.get("POPLAR_PLAN") or None,
            cluster if cluster is not None else env.get("POPLAR_CLUSTER") or None,
            workload if workload is not None else env.get("POPLAR_WORKLOAD") or None, global_batch)


def optimizer_factory(optimizer):
    """What the engine builds its optimizer with, from a factory (as is) or an optimizer built on the model.

    An optimizer instance is kept (so a learning-rate scheduler built on it still drives
    it) and given the engine's flat parameters instead of the model's: it must be fresh
    (no state) and have one set of hyperparameters, as the engine flattens a unit's
    parameters together.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        if callable(optimizer):
            return optimizer
        raise TypeError(f"optimizer must be a torch.optim.Optimizer or a factory of one, got {type(optimizer).__name__}")
    settings = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    differ = sorted({k for s in settings[1:] for k in s if s.get(k) != settings[0].get(k)})
    if differ:
        raise ValueError(f"the optimizer's {len(settings)} parameter groups differ in {', '.join(differ)}: Poplar "
                         "flattens each unit's parameters together, so give one set of hyperparameters (one group)")
    if optimizer.state:
        raise ValueError("the optimizer has taken steps (its state is not empty): give Poplar a fresh optimizer")

    def rebind(params: list) -> torch.optim.Optimizer:
        optimizer.param_groups = []
        optimizer.state = defaultdict(dict)
        optimizer.add_param_group({**settings[0], "params": list(params)})
        return optimizer
    return rebind


class Session(RankRuntime):
    """This rank's process group, device and engine (:class:`~poplar.runtime.rank.RankRuntime`, as ``poplar train``'s
    ranks); steps timed (and paced) by the device; the plan its framework's loader cuts with followed.

    Enter nothing by hand: the device starts here (on every rank at once) and stops in :meth:`close`.
    """

    def __init__(self, model: torch.nn.Module, optimizer, plan: Plan, config: EngineConfig | dict | None = None,
                 cluster=None, basis=None, replan=None, scratch: str | Path | None = None, workload=None):
        """``basis``: the planning ``plan`` came from (:func:`resolve_planning`), to plan again as the steps measure
        once the data follow the schedule (:meth:`follow`); ``replan``: when
        (:func:`~poplar.runtime.replanner.replan_config`); ``scratch``: a folder every rank reads where a re-plan may change the ZeRO stage through a checkpoint
        (None: the stage is kept); ``workload``: what the plan was profiled from (the module given as a
        :class:`~poplar.integrations.module_source.ModuleSource`, or a preset), whose step an emulated
        cluster's pace is probed with as the profiler's is (None: the host's own probes alone)."""
        from poplar.engine.dist import init_distributed
        from poplar.models.workload import as_workload

        ctx = init_distributed()
        self.rank, self.world_size = ctx.rank, ctx.world_size
        plan.check_world_size(self.world_size)
        cluster = cluster_spec(cluster)
        if cluster is not None:
            cluster.check_world_size(self.world_size)
        precision = (EngineConfig(**config) if isinstance(config, dict) else config or EngineConfig()).mixed_precision
        device = rank_device_of(cluster, self.rank, None if workload is None else as_workload(workload),
                                precision=precision, most=plan.global_batch_size)   # no micro-batch is larger
        device.__enter__()
        super().__init__(device, model, optimizer_factory(optimizer), plan, config)
        self.schedule, self.scratch = PlanSchedule(plan), scratch
        self.following = FollowedPlan(None, self.schedule, self.rank, lambda p: self.change_plan(p, self.scratch))
        self._replanner = replanner_for(replan_config(replan), basis, plan, self.world_size,
                                        restage=scratch is not None)

    @property
    def replans(self) -> list:
        """Each re-plan taken (:class:`~poplar.runtime.replanner.Replan`), in order."""
        return self.following.replans

    def follow(self, sampler) -> None:
        """Cut ``sampler``'s batches (a :class:`~poplar.integrations.sampler.PlanBatchSampler`) by this session's
        schedule: re-planning starts here, as a new plan now reaches the data too."""
        if sampler.schedule is not self.schedule:
            self.schedule.pending.extend(sampler.schedule.pending)
            self.schedule.skip += sampler.schedule.skip
            sampler.schedule = self.schedule
        self.following.replanner = self._replanner

    @contextlib.contextmanager
    def step(self):
        """One optimizer step (see :meth:`RankRuntime.step`) with the plan its batch was cut with; its figures
        observed after it."""
        self.following.before_step(self.engine, self.device)
        with super().step() as device:
            yield device
        self.following.after_step(self.engine, self.device)

    def save(self, path: str | Path, meta: dict[str, Any], extras=None, keep: int = 1) -> Path:
        """Every rank: a sharded, atomic checkpoint under directory ``path`` (any world size reads it).

        ``meta``: JSON values a resume checks; ``extras``: rank 0's picklable loop state;
        ``keep``: how many checkpoints under ``path`` are kept (0: all).
        """
        from poplar.runtime.checkpoint import save_checkpoint

        steps = self.engine.global_steps + self.engine.skipped_steps   # every step taken, applied or skipped
        meta = {**meta, "plan": self.engine.plan.to_dict()}           # a resume continues with it
        return save_checkpoint(self.engine, path, steps, meta, keep=keep, extras=extras)

    def load(self, path: str | Path, expect: dict[str, Any]) -> dict:
        """Every rank: restore from the newest checkpoint under ``path`` (written by :meth:`save`, on any world
        size); its meta, with its ``extras`` and its ``path``."""
        from poplar.runtime.checkpoint import CheckpointError, find_resumable, load_checkpoint, read_extras

        found = find_resumable(path, report=lambda *_: None)
        if found is None:
            raise CheckpointError(f"{path}: no complete Poplar checkpoint there; give the directory a Poplar "
                                  "integration saved to")
        meta = load_checkpoint(self.engine, found, expect)
        self._continue_with(meta.get("plan"))
        return {**meta, "extras": read_extras(found), "path": str(found)}

    def _continue_with(self, saved: dict | None) -> None:
        """A re-planned run's last plan, where this run could have re-planned to it (the same ranks, global batch,
        stage and shape): the steps from here are cut and trained with it."""
        if saved is None or self._replanner is None:
            return
        plan, now = Plan.from_dict(saved), self.engine.plan
        same_stage = plan.same_shape(now)
        if plan == now or (plan.world_size, plan.global_batch_size) != (now.world_size, now.global_batch_size) or (
                not same_stage and self.scratch is None):
            return
        self.change_plan(plan, self.scratch)
        self.schedule.change(plan, len(self.schedule.pending))
        self._replanner = replanner_for(self._replanner.config, self._replanner.basis, plan, self.world_size,
                                        restage=self._replanner.restage)
        if self.following.replanner is not None:
            self.following.replanner = self._replanner

    def close(self) -> None:
        super().close()
        self.device.__exit__(None, None, None)
