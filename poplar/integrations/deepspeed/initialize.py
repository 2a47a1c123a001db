"""For DeepSpeed users: ``poplar.initialize(model=..., optimizer=..., config="ds_config.json")``.

The call takes DeepSpeed's arguments and returns what ``deepspeed.initialize`` returns,
``(engine, optimizer, training_dataloader, lr_scheduler)``, so switching is a change of
import. The config is read by :mod:`~poplar.integrations.deepspeed.ds_config`; the plan comes from
``plan=`` (or the config's ``poplar.plan``, or ``POPLAR_PLAN``), or is profiled and
planned on ``cluster=`` (the model given, or ``workload=``; or ``poplar.cluster``/``poplar.models.workload``,
``POPLAR_CLUSTER``/``POPLAR_WORKLOAD``). With neither, the config is taken as DeepSpeed takes
it: ``train_batch_size``, ``train_micro_batch_size_per_gpu`` and ``gradient_accumulation_steps``
give every rank the same micro-batch and accumulation count, with DeepSpeed's consistency
rules (:mod:`~poplar.integrations.batch_settings`). The engine answers DeepSpeed's calls:

    for batch in loader:               # this rank's micro-batches, its plan's sizes
        loss = engine(batch)           # the forward
        engine.backward(loss)          # weighted by the micro-batch's share of the global batch
        engine.step()                  # the update, after this rank's last micro-batch of the step

Ranks run different numbers of micro-batches per step (the plan's); each rank's
``engine.step()`` acts on its own last one, and the update is the single device's on
the global batch.
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import torch

from poplar.engine.batch import batch_size
from poplar.engine.config import EngineConfig
from poplar.integrations.batch_settings import launched_rank, launched_world_size
from poplar.integrations.sampler import plan_loader
from poplar.integrations.deepspeed.ds_config import build_optimizer, read_ds_config
from poplar.integrations.session import Session, from_environment, resolve_planning

_UNUSED_ARGS = ("args", "mpu", "mesh_param", "distributed_port", "dist_init_required")


def initialize(args=None, model: torch.nn.Module | None = None, optimizer=None, model_parameters=None,
               training_data=None, lr_scheduler=None, collate_fn=None, config=None, config_params=None, *,
               plan=None, cluster=None, workload=None, loss=None, **unused):
    """DeepSpeed's ``initialize``, trained by Poplar: ``(engine, optimizer, training_dataloader, lr_scheduler)``.

    ``model_parameters`` is accepted and not needed (the engine shards the model's own);
    ``lr_scheduler``: a scheduler built on ``optimizer``, or a callable of the optimizer.
    Without a plan or a ``workload``, a ``cluster`` plans the model given, profiled on
    samples of ``training_data`` (collated by ``collate_fn``) with ``loss(model, batch)``
    (default: the model's own output, a scalar or one with ``.loss``). Without a plan or a
    cluster, every rank trains the even split of the config's batch fields, as DeepSpeed does.
    """
    from poplar.engine.dist import init_distributed

    if isinstance(args, torch.nn.Module):   # poplar.initialize(model, optimizer, config=...): Poplar's order
        args, model, optimizer = None, args, model if model is not None else optimizer
    if model is None:
        raise ValueError("poplar.initialize needs model=: the torch.nn.Module to train")
    config = config if config is not None else config_params
    if config is None:
        raise ValueError("poplar.initialize needs config=: a DeepSpeed config (a JSON file or a dict) with "
                         "train_batch_size, or give plan= for the engine alone")
    extra = sorted(set(unused) - set(_UNUSED_ARGS))
    if extra:
        raise TypeError(f"poplar.initialize got unexpected argument {extra[0]!r}")
    world = launched_world_size()
    settings = read_ds_config(config, world)     # a config refused costs nothing: no process group yet
    if launched_rank() == 0 and settings.ignored_line():
        print(settings.ignored_line(), flush=True)
    engine_config = EngineConfig(clip_grad_norm=settings.clip_grad_norm, mixed_precision=settings.precision,
                                 loss_scale=settings.loss_scale)
    poplar = settings.poplar   # the config's poplar section, then the environment, fill what the call leaves out
    plan, cluster, workload, _ = from_environment(plan if plan is not None else poplar.get("plan"),
                                                  cluster if cluster is not None else poplar.get("cluster"),
                                                  workload or poplar.get("workload"), settings.global_batch)
    if plan is None and cluster is not None and workload is None:   # the model given, profiled on its data
        workload = _module_source(model, loss, training_data, collate_fn)
    opt = _optimizer(optimizer, settings)
    if plan is None and cluster is not None:
        init_distributed()     # the ranks profile together; a plan given or the even split needs no group yet
    profiled = workload if plan is None else None   # planned from it: its step paces the ranks
    plan, basis = plan_of(world, settings, engine_config, plan, cluster, workload, model)
    runtime = Session(model, opt, plan, engine_config, cluster=cluster, basis=basis, replan=poplar.get("replan"),
                      workload=profiled)
    if callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
        lr_scheduler = lr_scheduler(runtime.engine.optimizer)
    engine = DeepSpeedStyleEngine(runtime, lr_scheduler)
    loader = None
    if training_data is not None:
        seed = int(settings.poplar.get("seed", 0))
        loader = plan_loader(training_data, plan, runtime.rank, collate_fn=collate_fn, seed=seed, micro_batches=True)
        runtime.follow(loader.batch_sampler)     # a re-plan reaches the micro-batches cut from here on
        engine.loader = loader
    return engine, runtime.engine.optimizer, loader, lr_scheduler


def _module_source(model, loss, training_data, collate_fn):
    from torch.utils.data import default_collate

    from poplar.integrations.module_source import ModuleSource, output_loss

    if training_data is None:
        raise ValueError("planning from a cluster profiles your model on samples of training_data: give "
                         "training_data= (or a plan, or workload=)")
    return ModuleSource(model, loss or output_loss, training_data, collate_fn or default_collate)


def plan_of(world_size: int, settings, config: EngineConfig, plan, cluster, workload, model=None):
    stages = (settings.stage,) if settings.stage is not None else tuple(settings.poplar.get("stages", (0, 1, 2, 3)))
    plan, basis = resolve_planning(world_size, plan, cluster=cluster, workload=workload,
                                   global_batch=settings.global_batch, stages=stages, config=config, model=model,
                                   batch=settings.batch)
    if settings.stage is not None and plan.zero_stage != settings.stage:
        raise ValueError(f"the plan is for ZeRO stage {plan.zero_stage}, the config's zero_optimization.stage is "
                         f"{settings.stage}: make them agree")
    return plan, basis


def _optimizer(optimizer, settings):
    if optimizer is not None and settings.optimizer is not None:
        raise ValueError("an optimizer is given both as optimizer= and in the config's `optimizer` section: "
                         "keep one")
    if optimizer is not None:
        return optimizer
    if settings.optimizer is None:
        raise ValueError("no optimizer: pass optimizer= (a torch optimizer on model.parameters()) or give the "
                         "config an `optimizer` section (Adam, AdamW or SGD)")
    return build_optimizer(settings.optimizer)


class DeepSpeedStyleEngine:
    """DeepSpeed's engine calls on Poplar's engine: ``engine(batch)``, ``backward(loss)``, ``step()``, checkpoints."""

    def __init__(self, runtime: Session, lr_scheduler=None):
        self.runtime, self.lr_scheduler = runtime, lr_scheduler
        self.module = runtime.engine.model
        self.loader = None
        self._step = ExitStack()          # the device's step, open from a step's first forward to its update
        self._sizes: list[int] = []       # this step's micro-batch sizes still to come
        self._current = 0                 # the size of the micro-batch whose backward is next
        self._step_open = False
        self.last_loss: float | None = None   # the global mean loss of the last step

    # -- the loop ------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def forward(self, *args, **kwargs):
        engine = self.runtime.engine
        if not torch.is_grad_enabled():     # evaluation: a plain forward (ZeRO-3 gathers as it goes)
            return self.module(*args, **kwargs)
        if not self._sizes and not self._step_open:
            self._step.enter_context(self.runtime.step())
            self._step_open = True
            engine.begin_step()
            self._sizes = list(engine.plan.micro_batches(self.runtime.rank))
        if not self._sizes:
            raise RuntimeError(f"rank {self.runtime.rank} ran its {engine.plan.micro_batches(self.runtime.rank)} "
                               "micro-batches of this step: call engine.step() after each backward")
        self._current = self._check_size(args, kwargs, self._sizes.pop(0))
        engine.begin_micro_step()
        return self.module(*args, **kwargs)

    def _check_size(self, args, kwargs, want: int) -> int:
        try:
            got = batch_size((args, kwargs))
        except ValueError:
            return want        # inputs of several sizes (or none): the plan's size is the micro-batch's
        if got != want:
            raise ValueError(f"rank {self.runtime.rank}: a micro-batch of {got} samples, its plan says {want} "
                             f"(micro-batches {self.runtime.plan.micro_batches(self.runtime.rank)}): feed the "
                             "loader poplar.initialize returned (training_data=), or the plan's micro-batches")
        return got

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> None:
        """The micro-batch's backward; ``loss`` is its mean over the micro-batch's samples."""
        if not self._step_open:
            raise RuntimeError("engine.backward before engine(batch): run the forward through the engine")
        self.runtime.engine.backward(loss, self._current)

    def step(self, lr_kwargs=None) -> None:
        """The update after this rank's last micro-batch of the step (before it: nothing, as in DeepSpeed)."""
        if not self._step_open or self._sizes:
            return
        try:
            self.last_loss = self.runtime.engine.end_step()
        finally:
            self._step.close()
            self._step_open = False
        if self.lr_scheduler is not None:
            self.lr_scheduler.step(**(lr_kwargs or {}))

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the micro-batch in progress is this rank's last of the step."""
        return self._step_open and not self._sizes

    def zero_grad(self) -> None:
        """Nothing to do: every step starts from clean gradients."""

    def train(self, mode: bool = True):
        self.module.train(mode)
        return self

    def eval(self):
        return self.train(False)

    # -- what DeepSpeed's engine tells ------------------------------------------------------
    def train_batch_size(self) -> int:
        return self.runtime.plan.global_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.runtime.plan.micro_batch_sizes[self.runtime.rank]

    def gradient_accumulation_steps(self) -> int:
        return self.runtime.plan.accum_steps[self.runtime.rank]

    @property
    def global_steps(self) -> int:
        """Optimizer steps taken, skipped ones (an fp16 overflow) included, as DeepSpeed counts them."""
        return self.runtime.engine.global_steps + self.runtime.engine.skipped_steps

    @property
    def skipped_steps(self) -> int:
        return self.runtime.engine.skipped_steps

    @property
    def cur_scale(self) -> float:
        """fp16's current loss scale (1 in bf16 and fp32), as DeepSpeed's fp16 optimizers name it."""
        return self.runtime.engine.loss_scale

    @property
    def global_rank(self) -> int:
        return self.runtime.rank

    @property
    def world_size(self) -> int:
        return self.runtime.world_size

    @property
    def device(self) -> torch.device:
        return self.runtime.engine.device

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.runtime.engine.optimizer

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        return self.runtime.engine.last_grad_norm

    # -- checkpoints --------------------------------------------------------------------------
    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest: bool = True, **_) -> Path:
        """Every rank: a resharding checkpoint under ``save_dir`` (named by step; ``tag`` is not used)."""
        extras = {"client_state": client_state or {},
                  "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None}
        return self.runtime.save(save_dir, {"global_batch": self.train_batch_size()}, extras=extras, keep=0)

    def load_checkpoint(self, load_dir, tag=None, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True, **_):
        """Every rank, any world size and plan: the newest checkpoint under ``load_dir``; ``(path, client_state)``.

        The loader ``initialize`` returned continues with the next global batch."""
        if not load_optimizer_states:
            raise ValueError("load_optimizer_states=False: Poplar restores the whole training state; load the "
                             "weights alone with engine.module.load_state_dict")
        meta = self.runtime.load(load_dir, {"global_batch": self.train_batch_size()})
        extras = meta.get("extras") or {}
        if load_lr_scheduler_states and self.lr_scheduler is not None and extras.get("lr_scheduler") is not None:
            self.lr_scheduler.load_state_dict(extras["lr_scheduler"])
        if self.loader is not None:
            sampler = self.loader.batch_sampler
            sampler.set_epoch(self.global_steps // sampler.steps_per_epoch)
            sampler.skip_steps = self.global_steps % sampler.steps_per_epoch
        return meta["path"], extras.get("client_state", {})

    def close(self) -> None:
        self._step.close()
        self.runtime.close()
