"""PyTorch Lightning trained by Poplar: :class:`PoplarStrategy`, ``Trainer(strategy="poplar")``.

Every rank has its own micro-batch size and accumulation count (a :class:`~poplar.Plan`), and
training equals single-device training on the whole global batch. The ``LightningModule`` is
unchanged::

    import lightning.pytorch as pl
    from poplar.integrations.lightning.strategy import PoplarStrategy

    strategy = PoplarStrategy(plan="plan.json", cluster="examples/cluster-3.yaml")
    pl.Trainer(strategy=strategy, max_steps=100).fit(model, train_loader)

What changes, and why:

- A batch Lightning hands a rank is its whole slice of one global batch; the engine cuts it
  into the plan's micro-batches and calls ``training_step(micro_batch, batch_idx)`` once for
  each, weighting each mean loss by its share of the global batch; backward, gradient
  reduction, clipping and the optimizer step happen inside (Lightning's own ``backward``,
  ``on_before/after_backward``, ``on_before_optimizer_step`` and ``configure_gradient_clipping``
  do not run). The step's loss Lightning logs as ``loss`` is the global batch's mean.
- The train ``DataLoader``'s dataset, ``collate_fn`` and workers are kept, its ``shuffle`` and
  sampler are not (``PoplarStrategy(shuffle=, seed=)`` decide: the same global batches on any
  world size and plan). With no plan and no cluster its ``batch_size`` and
  ``accumulate_grad_batches`` are every rank's (the even split, as DDP's); else the plan decides.
- ``gradient_clip_val`` clips the global gradient norm inside the engine (``gradient_clip_algorithm='value'``
  is refused); precision is ``'32-true'``, ``'bf16-mixed'`` or ``'16-mixed'`` (bf16 or fp16 compute, fp32
  master weights; fp16 with the engine's dynamic loss scale, ``EngineConfig.loss_scale``).
- ``configure_optimizers`` returns one optimizer (with one set of hyperparameters); the engine
  steps that very object on its flat shards, so learning-rate schedulers keep working.
- A checkpoint is a directory (see :mod:`~poplar.integrations.lightning.checkpoint_io`) that any
  world size and plan of the same global batch resumes from, mid-epoch too.
- Evaluation inside ``fit`` runs on the engine's weights, ``validate``/``test``/``predict`` alone
  on rank 0's; every rank evaluates the whole loader it is given (Lightning injects no
  distributed sampler), and in ZeRO-3 every rank must run as many evaluation batches.

Launching: under ``torchrun`` (or any launcher that sets ``WORLD_SIZE``/``RANK``/``LOCAL_RANK``, or
an initialised process group) the strategy joins that group; a plain ``python train.py``
starts one process per rank of the cluster file (or of the plan, or of the Trainer's ``devices``)
with Lightning's script launcher, as DDP does (one node; several nodes: torchrun).

``Trainer(strategy="poplar")`` (after importing this module) takes everything from the
environment: ``POPLAR_PLAN`` (a ``plan.json``) and ``POPLAR_CLUSTER`` (a cluster file or
preset), or ``POPLAR_CLUSTER``, ``POPLAR_WORKLOAD`` and ``POPLAR_GLOBAL_BATCH`` to plan. After
``fit``, ``strategy.runtime.steps_s`` holds each step's time on the device's clock.
"""

from __future__ import annotations

import atexit
import contextlib
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

try:
    from lightning.fabric.utilities.distributed import _sync_ddp_if_available
    from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
    from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
    from lightning.pytorch.trainer.states import RunningStage, TrainerFn
    from lightning.pytorch.utilities.rank_zero import rank_zero_only
    from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
except ImportError:   # pragma: no cover - only without Lightning
    raise ImportError("poplar.integrations.lightning.strategy needs PyTorch Lightning 2: pip install lightning") from None

from poplar.engine.config import EngineConfig
from poplar.engine.dist import choose_backend, init_distributed, shutdown
from poplar.integrations.lightning import checkpoint_io as checkpoints
from poplar.integrations.lightning.loader import even_settings, module_source, plan_train_loader
from poplar.integrations.lightning.options import engine_config, loss_of, take_accumulation, take_weights
from poplar.integrations.session import (Session, cluster_spec, from_environment, optimizer_factory, resolve_plan,
                                         resolve_planning)
from poplar.runtime.plans import load_plan
from poplar.runtime.replan_settings import replan_config
from poplar.plan import Plan

__all__ = ["PoplarStrategy"]

_WORKLOAD_ALONE = ("PoplarStrategy(workload=...) names what to profile on a cluster: give cluster= too (or "
                   "POPLAR_CLUSTER), or leave the workload out to train the loader's batch_size evenly, as DDP does")


class PoplarStrategy(ParallelStrategy):
    """Heterogeneity-aware ZeRO data parallelism for Lightning (see the module's docstring).

    ``plan``: a :class:`~poplar.Plan`, its dict or a ``plan.json``; without one, it is planned on ``cluster``
    over ``stages`` (every rank profiling) for ``global_batch`` samples (default: the train loader's
    ``batch_size`` on every rank): the LightningModule itself profiled on samples of its training data as its
    loader collates them, or ``workload`` (a Poplar model preset) where given. ``cluster``: a cluster file or
    preset whose emulated (or real) devices the ranks take (none: this host's GPU or CPU). Left out, they come from
    ``POPLAR_PLAN``, ``POPLAR_CLUSTER``, ``POPLAR_WORKLOAD``, ``POPLAR_GLOBAL_BATCH``. ``config``: the engine's
    :class:`~poplar.engine.config.EngineConfig` (or its dict). ``shuffle``, ``seed``: the order of the samples,
    drawn afresh each epoch from ``seed`` and the epoch (as ``poplar train``'s). ``replan``: a plan planned here
    is planned again while training as the steps measure (``"auto"``, ``"off"`` or a dict of
    :class:`~poplar.runtime.replanner.ReplanConfig`'s fields; docs/train.md). With no plan and no cluster, the
    loader's ``batch_size`` and ``accumulate_grad_batches`` on every rank (DDP's split), in the lowest of
    ``stages``, on the Trainer's ``devices``.
    """

    strategy_name = "poplar"

    def __init__(self, plan: Plan | dict | str | Path | None = None, *, cluster=None, workload=None,
                 global_batch: int | None = None, stages=(0, 1, 2, 3), config: EngineConfig | dict | None = None,
                 seed: int = 0, shuffle: bool = True, replan=None, **kwargs):
        super().__init__(**kwargs)
        self._replan, self._basis = replan_config(replan), None
        plan, cluster, workload, global_batch = from_environment(plan, cluster, workload, global_batch)
        self._plan = load_plan(plan) if plan is not None else None
        if self._plan is None and cluster is None and workload is not None:
            raise ValueError(_WORKLOAD_ALONE)
        self._cluster, self._cluster_named = cluster_spec(cluster), cluster   # named: as planning's lines say it
        if self._plan is not None and self._cluster is not None and self._cluster.world_size != self._plan.world_size:
            raise ValueError(f"the plan is for {self._plan.world_size} ranks but the cluster has "
                             f"{self._cluster.world_size} devices: give a plan for {self._cluster.world_size} ranks "
                             "or the cluster it was made for")
        if self._plan is not None:   # the global batch too, before anything starts
            resolve_plan(self._plan.world_size, self._plan, global_batch=global_batch)
        self._workload, self._global_batch, self._stages = workload, global_batch, tuple(stages)
        self._profiled = workload if self._plan is None else None   # planned from it: its step paces the ranks
        self._config = EngineConfig(**config) if isinstance(config, dict) else (config or EngineConfig())
        self.seed, self.shuffle = seed, shuffle
        self.runtime: Session | None = None   # this rank's process group, device and engine (kept after fit)
        self._live = False                     # the runtime trains (set up and not yet closed)
        self._trained = False                  # training ended normally: every rank gathers the weights
        self._sampler = None
        self._accumulation = None              # (trainer, its accumulate_grad_batches) the even split took
        self._rank, self._world = 0, self._launch_size()

    # ------------------------------------------------------------------ ranks and launching
    def _launch_size(self) -> int:
        """How many ranks a plain ``python train.py`` starts: the cluster's devices, else the plan's ranks, else
        the Trainer's ``devices`` (as DDP)."""
        if self._cluster is not None:
            return self._cluster.world_size
        return self._plan.world_size if self._plan is not None else len(self.parallel_devices or ()) or 1

    @property
    def plan(self) -> Plan | None:
        """The plan (None until planned, when planned from a cluster and workload)."""
        return self._plan

    @property
    def global_rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world

    @property
    def is_distributed(self) -> bool:
        return False   # so Lightning injects no distributed sampler: each rank's batches are its plan's slices

    @property
    def root_device(self) -> torch.device:
        backend = dist.get_backend() if dist.is_initialized() else choose_backend()
        return torch.device("cuda", self.local_rank) if backend == "nccl" else torch.device("cpu")

    def set_world_ranks(self) -> None:
        """This rank and the world: the process group's, the launcher's environment, or the ranks to launch."""
        if dist.is_available() and dist.is_initialized():
            self._rank, self._world = dist.get_rank(), dist.get_world_size()
        elif "WORLD_SIZE" in os.environ:   # torchrun sets RANK; Lightning's launcher LOCAL_RANK (one node)
            self._world = int(os.environ["WORLD_SIZE"])
            self._rank = int(os.environ.get("RANK", self.local_rank))
        else:
            self._rank, self._world = 0, self._launch_size()
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self._rank)
            self.cluster_environment.set_world_size(self._world)
        rank_zero_only.rank = utils_rank_zero_only.rank = self._rank
        if self._plan is not None:
            self._plan.check_world_size(self._world)
        if self._cluster is not None:
            self._cluster.check_world_size(self._world)

    def _configure_launcher(self) -> None:
        external = self.cluster_environment is None or self.cluster_environment.creates_processes_externally
        if not external and not dist.is_initialized() and self._world > 1:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self._world, 1)

    def setup_environment(self) -> None:
        """Join (or make) the process group, with poplar's timeout on every collective; decide the plan."""
        self.set_world_ranks()
        made = not dist.is_initialized()
        if made and self._world > 1:   # env:// needs RANK, which Lightning's own launcher does not set
            os.environ.setdefault("RANK", str(self._rank))
        init_distributed()
        if made:   # leave it at exit, every rank together (gloo aborts a process that leaves alone)
            atexit.register(shutdown)
        self.set_world_ranks()
        super().setup_environment()
        if self._plan is not None or self._workload is not None:   # else the module is profiled in setup
            self._plan, self._basis = resolve_planning(
                self._world, self._plan, cluster=self._cluster_named, workload=self._workload,
                global_batch=self._global_batch, stages=self._stages, config=self._config)

    # ------------------------------------------------------------------ checks and set-up
    def connect(self, model) -> None:
        super().connect(model)
        trainer = getattr(model, "_trainer", None)
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            self._check_trainer(trainer)   # before any process group: a mistake costs nothing

    def _check_trainer(self, trainer) -> None:
        if self._plan is None and self._cluster is None:   # the even split takes Lightning's accumulation
            self._accumulation = take_accumulation(trainer, self._accumulation)
            settings = even_settings(trainer, self._global_batch, self._accumulation[1], before_setup=True)
            if settings is not None:   # the loader given to fit: its split refused now, before any process group
                settings.even_split(self._world)
        self._config = engine_config(trainer, self.lightning_module, self.precision_plugin, self._config)

    def setup(self, trainer) -> None:
        """Build the engine on the module with the optimizer from ``configure_optimizers`` (fitting only)."""
        self.accelerator.setup(trainer)
        module = self.lightning_module
        if trainer.state.fn != TrainerFn.FITTING:
            self.model_to_device()
            self._broadcast_weights()
            return
        self._check_trainer(trainer)
        self.setup_optimizers(trainer)
        if len(self.optimizers) != 1:
            raise ValueError(f"configure_optimizers returned {len(self.optimizers)} optimizers: PoplarStrategy "
                             "steps one; return one optimizer")
        optimizer_factory(self.optimizers[0])   # its one-line refusals, before the engine is built
        if self._plan is None and self._cluster is None:   # the even split, as DDP's
            settings = even_settings(trainer, self._global_batch, self._accumulation[1])
            self._plan = resolve_planning(self._world, None, stages=self._stages, batch=settings)[0]
        elif self._plan is None:
            self._plan, self._basis = self._plan_module(trainer, module)
        self.runtime = Session(module, self.optimizers[0], self._plan, self._config, cluster=self._cluster,
                               basis=self._basis, replan=self._replan, workload=self._profiled,
                               scratch=os.path.join(trainer.default_root_dir, "poplar-restage"))
        self._live, self._trained, self._profiled = True, False, self._workload   # not the module's copy profiled
        self.model = module
        self.optimizers = [self.runtime.engine.optimizer]

    def _plan_module(self, trainer, module) -> tuple:
        """A cluster and no workload: the module itself profiled on its training data (every rank), and planned;
        the global batch, where not given, is the loader's ``batch_size`` on every rank (as DDP's)."""
        source, batch_size = module_source(trainer, module, loss_of)
        self._profiled = source
        global_batch = self._global_batch or (batch_size or 1) * self._world
        return resolve_planning(self._world, None, cluster=self._cluster_named, workload=source,
                                global_batch=global_batch, stages=self._stages, config=self._config, model=module)

    def _broadcast_weights(self) -> None:
        """Evaluation without training: every rank evaluates rank 0's weights."""
        if dist.is_initialized() and self._world > 1:
            with torch.no_grad():
                for t in self.lightning_module.state_dict().values():
                    dist.broadcast(t, src=0)

    def model_to_device(self) -> None:
        self.model.to(self.root_device)

    # ------------------------------------------------------------------ the training step
    def process_dataloader(self, dataloader: object) -> object:
        """The train loader batched as this rank's slice of every global batch; others as they are."""
        trainer = self.lightning_module._trainer
        if trainer is None or trainer.state.stage != RunningStage.TRAINING:
            return dataloader
        loader = plan_train_loader(dataloader, self._plan, self._rank, shuffle=self.shuffle, seed=self.seed)
        # the epoch now, restored or not: loader workers draw the order before Lightning calls set_epoch
        loader.batch_sampler.set_epoch(trainer.fit_loop.epoch_progress.current.processed)
        self._sampler = loader.batch_sampler
        if self.runtime is not None:
            self.runtime.follow(self._sampler)   # a re-plan reaches the batches cut from here on
        return loader

    def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """One whole optimizer step on this rank's slice; the global batch's mean loss."""
        batch, rest = args[0], args[1:]
        module = self.lightning_module

        def loss_fn(_model, micro_batch):
            return loss_of(module.training_step(micro_batch, *rest, **kwargs))

        loss = self.runtime.train_batch(batch, loss_fn)
        if self._sampler is not None:
            batch_idx = rest[0] if rest else kwargs.get("batch_idx", self._sampler.consumed)
            self._sampler.consumed = batch_idx + 1
        return torch.tensor(loss)

    def backward(self, closure_loss: torch.Tensor, optimizer, *args: Any, **kwargs: Any) -> torch.Tensor:
        return closure_loss   # the engine ran every micro-batch's backward in training_step

    def optimizer_step(self, optimizer, closure, model=None, **kwargs: Any) -> Any:
        return closure()   # training_step (inside the closure) took the step

    def optimizer_state(self, optimizer) -> dict:
        return {} if self._live else super().optimizer_state(optimizer)   # the engine's checkpoint holds it

    def on_train_end(self) -> None:
        self._trained = True

    # ------------------------------------------------------------------ evaluation
    @contextlib.contextmanager
    def _whole_root(self):
        """ZeRO-3 outside a training step: the root unit's parameters gathered (a collective) while it computes."""
        engine = self.runtime.engine if self._live else None
        if engine is None or not engine.stage.shards_parameters:
            yield
            return
        engine.units[0].unshard()
        try:
            yield
        finally:
            engine.units[0].reshard()

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._whole_root():
            return super().validation_step(*args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._whole_root():
            return super().test_step(*args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._whole_root():
            return super().predict_step(*args, **kwargs)

    # ------------------------------------------------------------------ collectives
    def reduce(self, tensor, group=None, reduce_op="mean"):
        if not isinstance(tensor, torch.Tensor):
            return tensor
        return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)

    def barrier(self, name: str | None = None) -> None:
        if dist.is_initialized():
            dist.barrier()

    def broadcast(self, obj, src: int = 0):
        if not dist.is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    # ------------------------------------------------------------------ checkpoints
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True   # the engine restores itself, so it must be built first

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False   # in the engine's checkpoint; the schedulers are still Lightning's to restore

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Full parameters keyed like ``module.state_dict()`` (a collective while training: every rank)."""
        return self.runtime.engine.full_state_dict() if self._live else super().lightning_module_state_dict()

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        """Every rank: a checkpoint directory at ``filepath`` (the engine's shards and Lightning's state)."""
        if not self._live:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        checkpoints.save(self.runtime, checkpoint, filepath, self.is_global_zero)

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        """Every rank: restore the engine (any world size and plan of the same global batch); Lightning's state."""
        if not self._live:   # evaluation: a Lightning file (as saved after fit) loads as it would elsewhere
            if Path(checkpoint_path).is_dir():
                raise ValueError(f"{checkpoint_path}: a PoplarStrategy checkpoint resumes training only; give it to "
                                 "trainer.fit(ckpt_path=...)")
            return super().load_checkpoint(checkpoint_path, weights_only)
        return checkpoints.load(self.runtime, checkpoint_path)

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        if not self._live:
            super().load_model_state_dict(checkpoint, strict)

    def load_optimizer_state_dict(self, checkpoint) -> None:
        pass   # the engine loaded it with its parameters

    def remove_checkpoint(self, filepath) -> None:
        if self.is_global_zero:
            checkpoints.remove(filepath)

    # ------------------------------------------------------------------ the end
    def teardown(self) -> None:
        """Close the engine and the device; after a finished fit the module holds the full trained weights."""
        if self._live:
            self._live = False
            try:
                state = self.runtime.engine.full_state_dict() if self._trained else None
            finally:
                self.runtime.close()
            if state is not None:
                take_weights(self.lightning_module, state)
        self._sampler = None
        if self._accumulation is not None:     # the Trainer's own setting back, as it was given
            (trainer, trainer.accumulate_grad_batches), self._accumulation = self._accumulation, None
        super().teardown()


StrategyRegistry.register("poplar", PoplarStrategy, description="Poplar's heterogeneity-aware ZeRO (the plan from "
                          "POPLAR_PLAN, the cluster from POPLAR_CLUSTER)", override=True)
