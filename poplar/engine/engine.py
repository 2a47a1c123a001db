"""The heterogeneity-aware ZeRO engine: every rank its own micro-batch, exact updates.

Every rank ``i`` runs ``accum_steps[i]`` micro-batches of at most ``micro_batch_sizes[i]``
samples, near-equal and adding up to ``local_batch_sizes[i]``. A micro-batch's mean
loss is weighted by ``its size / global batch`` before its backward pass, and gradients
are *summed* over ranks, so the update equals that of one device computing the mean
loss over the whole global batch, however unevenly the batch was spread.

This file holds :class:`Engine` (construction, the training step, clipping, the
optimizer step) and :func:`initialize`. One mechanism serves all four ZeRO stages, the
stage (:mod:`poplar.stages`) deciding only what is sharded (each rank its shard group's:
``Plan.group_stages``; what crosses groups every rank issues alike). Its parts live beside it:

- :mod:`~poplar.engine.flat_unit`: one unit's flat buffers, its shards and their states;
- :mod:`~poplar.engine.grad_reduce`: gradient hooks and each unit's gradient collective.
  Stages that reduce once per step do so in a rank's last micro-step only, so ranks may
  run different numbers of micro-steps; the others reduce-scatter every micro-step;
- :mod:`~poplar.engine.unshard`: ZeRO-3's gathering of parameters, and prefetch;
- :mod:`~poplar.engine.state_dict`, :mod:`~poplar.engine.memory`: saving and loading
  (:class:`EngineState`), bytes held (:class:`ModelStateMemory`, reading the schedule the
  gradient reducer and the unsharder publish), each given what it needs;
- :mod:`~poplar.engine.collectives`: every collective, as methods of the :class:`Comm` the
  engine is given (a device gives one that observes them); :mod:`~poplar.engine.flight`, the
  last one each rank issued, for a launcher to read if the rank dies;
- :mod:`~poplar.engine.agreement`: what every rank must agree on before the first collective;
- :mod:`~poplar.engine.update`: the update (fp16's loss scale undone, the global norm and the verdict on it,
  clipping, the optimizer), :mod:`~poplar.engine.loss_scale` the scale.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils._pytree import tree_map

from poplar.engine.agreement import check_same_everywhere, check_shape
from poplar.engine.batch import BatchCheck, batch_size, split_batch
from poplar.engine.collectives import Comm
from poplar.engine.config import EngineConfig, LossFn, OptimizerFactory
from poplar.engine.flat_unit import FlatUnit
from poplar.engine.grad_reduce import GradReducer
from poplar.engine.layout import ShardLayout, check_collective_sizes
from poplar.engine.memory import ModelStateMemory
from poplar.engine.phase import StepPhase
from poplar.engine.state_dict import EngineState
from poplar.engine.units import build_units
from poplar.engine.unshard import Unsharder
from poplar.engine.update import NonFiniteError, Update, UpdateOutOfMemoryError
from poplar.engine.weights import WeightReader, check_empty_model, read_weights, values_to_read
from poplar.plan import Plan
from poplar.stages import stage

__all__ = ["Engine", "EngineConfig", "NonFiniteError", "UpdateOutOfMemoryError", "initialize"]


class Engine:
    """Trains ``model`` with ``plan`` over ``comm``'s process group. Build it with :func:`initialize`."""

    def __init__(self, model: nn.Module, optimizer: OptimizerFactory, plan: Plan, config: EngineConfig,
                 comm: Comm | None = None, weights: WeightReader | None = None):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(plan, Plan):
            raise TypeError(f"plan must be a poplar.Plan, got {type(plan).__name__}")
        if not callable(optimizer) or isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError("optimizer must be a callable that builds an optimizer from a parameter list, "
                            "e.g. functools.partial(torch.optim.AdamW, lr=1e-3), not an optimizer instance")
        self.comm = comm if comm is not None else Comm()
        self.device = self.comm.torch_device()
        self.rank, self.world_size = self.comm.rank, self.comm.world_size
        self.config = config
        self._adopt(plan)
        self.zero_stage = plan.zero_stage
        self.stage = stage(plan.stage_of(self.rank))   # this rank's group's (a plan may give each group its own)
        self.compute_dtype = config.compute_dtype

        frozen = self._cast_untrained(model)
        empty = values_to_read(model.parameters(), self.device)
        if empty:   # its values are read into the shards (poplar.engine.weights)
            check_empty_model(model, self.device, weights)
        elif any(t.device != self.device for t in [*model.parameters(), *model.buffers()]):
            model.to(self.device)   # (a model already there is left as built: its tensors may be a subclass's)
        check_same_everywhere(self.comm, plan, model, self.device)
        self.model = model
        self._broadcast_non_trainable()
        specs = build_units(model, config.unit_classes, config.unit_numel)
        check_shape(plan, self.world_size, [s.params for s in specs])
        self.shard_layout = ShardLayout.build(self.comm, plan.shard_groups, plan.shard_shares)
        self.units = [FlatUnit(i, s.module, s.name, s.params, stage=self.stage, layout=self.shard_layout,
                               compute_dtype=self.compute_dtype, device=self.device)
                      for i, s in enumerate(specs)]
        if empty:
            read_weights(model, self.units, weights)

        self._reducer = GradReducer(self.units, self.stage, config.max_inflight_reduces,
                                    before_launch=lambda: self._batch_check.confirm())
        self._hooks = self._reducer.register_hooks()
        self._unsharder = Unsharder(self.units, config.prefetch) if self.stage.shards_parameters else None
        if self._unsharder is not None:
            self._hooks += self._unsharder.register_hooks()
        if self.compute_dtype != torch.float32:
            self._hooks.append(model.register_forward_pre_hook(self._cast_inputs, with_kwargs=True))

        self._optimizer_factory = optimizer
        self.optimizer = optimizer([u.master for u in self.units])
        if not isinstance(self.optimizer, torch.optim.Optimizer):
            raise TypeError(f"the optimizer factory returned {type(self.optimizer).__name__}, not a torch.optim.Optimizer")
        self._update = Update(self.units, self.optimizer, self.stage, self.shard_layout, self.comm, config,
                              self.device, mixed=plan.group_stages is not None)
        self._state = EngineState(model, self.units, self.optimizer, self.device, self.comm)
        self._memory = ModelStateMemory(self.units, self.optimizer, self.compute_dtype, self._reducer, self._unsharder,
                                        frozen)
        self.global_steps = 0
        self.skipped_steps = 0
        self._loss_sum = torch.zeros(())

    @property
    def on_unit_done(self) -> list:
        """Callables run as each unit's backward finishes, before ZeRO-3 frees its parameters (to sample memory)."""
        return self._reducer.on_unit_done

    # ------------------------------------------------------------------ set-up checks
    def _cast_untrained(self, model: nn.Module) -> list[nn.Parameter]:
        """The frozen parameters (no unit holds them: LoRA's base weights, whole on every rank), returned; they and
        the buffers in the compute precision (they compute in bf16 too), cast before the model moves to the device,
        where they are never held in fp32."""
        frozen = [p for p in model.parameters() if not p.requires_grad]
        if self.compute_dtype != torch.float32:
            for t in [*model.buffers(), *frozen]:
                if t.is_floating_point():
                    t.data = t.data.to(self.compute_dtype)
        return frozen

    def _broadcast_non_trainable(self) -> None:
        with torch.no_grad():
            for t in list(self.model.buffers()) + [p for p in self.model.parameters() if not p.requires_grad]:
                self.comm.broadcast(t.data, src=0)

    def _cast_inputs(self, module, args, kwargs):
        cast = lambda t: t.to(self.compute_dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
        return tree_map(cast, args), tree_map(cast, kwargs)

    # ------------------------------------------------------------------ training
    def train_batch(self, local_batch, loss_fn: LossFn) -> float:
        """One optimizer step on this rank's slice of the global batch.

        ``local_batch`` is a tensor, or a tuple/list/dict of tensors, whose first
        dimension has ``plan.local_batch_size(rank)`` samples. ``loss_fn(model,
        micro_batch)`` returns the mean loss over the micro-batch. Returns the mean loss
        over the whole global batch, the same on every rank.
        """
        self._batch_check.start(local_batch)
        self.begin_step()
        for micro_batch in split_batch(local_batch, self.plan.micro_batches(self.rank), self.device):
            self.begin_micro_step()
            self.backward(loss_fn(self.model, micro_batch), batch_size(micro_batch))
        return self.end_step()

    # train_batch's parts, for loops that drive the micro-steps (DeepSpeed's): begin_step, then per
    # micro-batch begin_micro_step before its forward and backward after it, then end_step.
    def begin_step(self) -> None:
        """Start an optimizer step: clean gradient state, no micro-step taken."""
        self._reset_step_state()
        self._phase.begin_step()
        self._loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)

    def begin_micro_step(self) -> None:
        """Before the forward of this rank's next micro-batch of the step."""
        last = self._phase.begin_micro_step()
        self._begin_micro_step(sync=self.stage.reduces_every_micro_step or last, last=last)

    def backward(self, loss: torch.Tensor, n_samples: int) -> None:
        """The backward of a micro-batch of ``n_samples`` whose mean loss is ``loss``, weighted by its share of
        the global batch."""
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
            raise ValueError("loss_fn must return the mean loss of the micro-batch as a scalar tensor "
                             f"that requires grad; got {type(loss).__name__}"
                             f"{'' if not isinstance(loss, torch.Tensor) else tuple(loss.shape)}")
        weight = n_samples / self.plan.global_batch_size
        self._update.scaled(loss.reshape(()), weight).backward()
        self._end_micro_step()
        self._loss_sum += loss.detach().float().reshape(()) * weight
        self._phase.end_micro_step()

    def end_step(self) -> float:
        """Reduce what is left and apply the update; the mean loss over the global batch, the same on every rank."""
        self._phase.end_step()
        loss_sum = self._loss_sum
        local_finite = bool(torch.isfinite(loss_sum))
        loss_work = self.comm.all_reduce(loss_sum, async_op=True)
        try:
            step = self.global_steps + self.skipped_steps + 1
            applied = self._update.apply(step, local_finite)
            if applied:
                self.global_steps += 1
            else:
                self.skipped_steps += 1
        finally:
            loss_work.wait()
        return float(loss_sum)

    @property
    def last_grad_norm(self) -> float | None:
        """The global gradient norm of the last step (unscaled; NaN or infinite where that step was skipped)."""
        return self._update.last_grad_norm

    @property
    def loss_scale(self) -> float:
        """The scale each micro-batch's loss is multiplied by before its backward: fp16's dynamic loss scale
        (:mod:`poplar.engine.loss_scale`), 1 in bf16 and fp32."""
        return self._update.loss_scale

    def abandon_step(self) -> None:
        """Give up a step that failed part-way (one rank out of memory), before the group is rebuilt.

        The parameters and optimizer state are as before the step (it failed before its
        update). Every collective this rank still has in flight is waited for, its error
        ignored: each either completes (the other ranks issued it earlier) or fails at
        once (its partner left), and a group must have none in flight to be left cleanly.
        """
        works = [w for u in self.units for w in u.abandon_collectives()] + [self._batch_check.abandon()]
        for w in works:
            if w is not None:
                try:
                    w.wait()
                except Exception:  # its partner left: it has failed, which is all we wait for
                    pass
        self._reducer.reset()
        for unit in self.units:
            unit.reset_after_abandon()

    def set_plan(self, plan: Plan) -> None:
        """Train with ``plan`` from the next step: another split of the global batch (or another global batch:
        a batch-size schedule), on the same world, stage(s) and shape; other shares of the states are cut in place.
        Every rank calls it, between steps."""
        if not isinstance(plan, Plan):
            raise TypeError(f"plan must be a poplar.Plan, got {type(plan).__name__}")
        if not plan.same_shape(self.plan):
            raise ValueError(f"set_plan keeps the ZeRO stage ({self.zero_stage}) and the shape ({self.plan.shape}); "
                             f"got {plan}: build a new engine for another (a checkpoint resumes in any)")
        if plan.share_fractions != self.plan.share_fractions and self.stage.shards_optimizer:
            # a shape every rank sizes alike, known from the layout alone: refused before anything moves
            check_collective_sizes(self.world_size, plan.shard_groups, plan.shard_shares, [u.numel for u in self.units])
            self._recut(plan.shard_shares)
        self._adopt(plan)

    def rebuild(self, plan: Plan, save: Callable[[], None], load: Callable[[], None]) -> None:
        """Train with ``plan`` of another ZeRO stage or shape from the next step: ``save()`` writes the states (a
        checkpoint), the engine is built again on its model with ``plan`` (this object, so whoever holds it holds
        the new one), and ``load()`` reads them back resharded, as a resume on another stage does. Every rank
        calls it, between steps."""
        save()
        self.close()
        with torch.no_grad():   # the units' tensors as built (ZeRO-3 freed their storage): the values come from load
            for param in self.model.parameters():   # (a frozen one is in no unit and no checkpoint: kept as it is)
                if param.requires_grad:
                    param.data = torch.empty(param.shape, dtype=param.dtype, device=param.device)
        self.__init__(self.model, self._optimizer_factory, plan, self.config, comm=self.comm)
        load()

    def _recut(self, shares) -> None:
        """Every rank at once, between steps: the sharded states cut at ``shares`` (None: evenly), moved in place
        (one all-to-all a tensor in each shard group); every update stays what it was."""
        layout = self.shard_layout
        before = [layout.slice_sizes(u.numel) for u in self.units]
        layout.set_shares(shares)
        for unit, held in zip(self.units, before):
            wanted = layout.slice_sizes(unit.numel)
            move = lambda t, held=held, wanted=wanted: layout.recut(t, held, wanted)   # noqa: E731
            states = self.optimizer.state.get(unit.master, {})
            for key, value in list(states.items()):
                if torch.is_tensor(value) and value.shape == unit.master.shape:
                    states[key] = move(value)
            unit.recut(move)

    def _adopt(self, plan: Plan) -> None:
        """``plan`` for the steps from now on (checked against the world): this rank's micro-steps, the batch
        check."""
        plan.check_world_size(self.world_size)
        self.plan = plan
        self.accum_steps = plan.accum_steps[self.rank]
        self._phase = StepPhase(self.accum_steps)
        self._batch_check = BatchCheck(plan, self.rank, self.world_size, self.device, self.comm,
                                       enabled=self.config.check_batches)

    def regroup(self) -> None:
        """After the default process group was rebuilt: make the shard groups again (every rank, hybrid plans)."""
        self.shard_layout.make_groups()

    def _reset_step_state(self) -> None:
        """Clean gradient state, whatever an earlier (possibly failed) step left behind."""
        self._reducer.reset()
        for unit in self.units:
            unit.reshard()

    def _begin_micro_step(self, sync: bool, last: bool) -> None:
        self._reducer.begin_micro_step(sync, last)
        for unit in self.units:
            unit.begin_micro_step()
        if self._unsharder is not None:
            self._batch_check.confirm()     # the all-gathers below are this step's first collectives
            self._unsharder.begin_micro_step()

    def _end_micro_step(self) -> None:
        if self._unsharder is not None:
            self._unsharder.end_micro_step()
        self._reducer.end_micro_step()

    # ------------------------------------------------------------------ state (poplar.engine.state_dict)
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full, unsharded fp32 parameters (and buffers) keyed like ``model.state_dict()``, on every rank.

        A collective in stages 1-3: call it on every rank.
        """
        return self._state.full_state_dict()

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load full parameters (e.g. from :meth:`full_state_dict`) on every rank."""
        self._state.load_full_state_dict(state)

    def sharded_state_dict(self) -> dict:
        """The training state for ``torch.distributed.checkpoint``, under global keys with its layout (and the
        steps skipped, fp16's loss scale)."""
        return {**self._state.sharded_state_dict(self.global_steps), **self._counts()}

    def prepare_sharded_load(self) -> dict:
        """A state dict shaped like a saved one, for ``dcp.load`` to fill before :meth:`load_sharded_state_dict`."""
        return {**self._state.prepare_sharded_load(self.global_steps), **self._counts()}

    def _counts(self) -> dict:
        return {"skipped_steps": torch.tensor(self.skipped_steps), **self._update.state_dict()}

    def load_sharded_state_dict(self, state: dict, hyperparameters: list[dict] | None = None) -> None:
        """Restore from a dict that ``dcp.load`` filled (from :meth:`prepare_sharded_load`), any layout saved.

        A checkpoint without a loss scale (written in bf16 or fp32) leaves fp16's where it is."""
        self.global_steps = self._state.load_sharded_state_dict(state, hyperparameters)
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self._update.load_state_dict(state)

    def optimizer_hyperparameters(self) -> list[dict]:
        """The optimizer's parameter groups without their parameters, as JSON values (lr, betas, ...)."""
        return self._state.optimizer_hyperparameters()

    def layout(self) -> list[dict]:
        """The units as a checkpoint records them: a checkpoint loads only into the same units."""
        return self._state.layout()

    # ------------------------------------------------------------------ memory (poplar.engine.memory)
    def memory_report(self) -> dict[str, int]:
        """Bytes this rank holds now, by kind (parameters, master, gradients, optimizer, total)."""
        return self._memory.report()

    def model_state_bytes(self) -> int:
        """Bytes of model state this rank holds through a micro-step, at their steady level."""
        return self._memory.model_state_bytes()

    def held_state(self) -> tuple[int, set[int]]:
        """What a device's memory accounting needs: :meth:`model_state_bytes` and the storages it counts."""
        return self._memory.held_state()

    def close(self) -> None:
        """Remove the engine's hooks from the model."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


def initialize(model: nn.Module, optimizer: OptimizerFactory, plan: Plan, config: EngineConfig | dict | None = None,
               *, comm: Comm | None = None, weights: WeightReader | None = None, **overrides) -> Engine:
    """Wrap ``model`` for heterogeneous ZeRO training with ``plan``.

    Joins the default process group (torchrun's environment, NCCL on CUDA ranks, gloo on
    CPU), broadcasts rank 0's weights, shards what the stage shards and builds the
    optimizer on the shards. ``comm``: the :class:`~poplar.engine.collectives.Comm` every
    collective goes through (default: the default group's, unobserved); a device's
    ``device.comm`` lets the device see them. A model built with its parameters on the
    meta device is read from ``weights`` straight into each rank's shards
    (:mod:`poplar.engine.weights`): no rank holds the whole model.

    Example (under ``torchrun --nproc-per-node 2``)::

        import functools, torch, poplar
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        plan = poplar.Plan(zero_stage=1, micro_batch_sizes=[3, 1], accum_steps=[1, 3])
        engine = poplar.initialize(model, functools.partial(torch.optim.AdamW, lr=1e-3), plan)
        x, y = torch.randn(6, 8), torch.randn(6, 1)          # the global batch
        lo, hi = plan.sample_range(engine.rank)
        loss_fn = lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1])
        loss = engine.train_batch((x[lo:hi], y[lo:hi]), loss_fn)
    """
    if config is None:
        config = EngineConfig(**overrides)
    elif isinstance(config, dict):
        config = EngineConfig(**{**config, **overrides})
    elif overrides:
        config = config.model_copy(update=overrides)
    return Engine(model, optimizer, plan, config, comm, weights)
