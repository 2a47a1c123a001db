"""The heterogeneity-aware ZeRO engine: every rank its own micro-batch, exact updates.

Every rank ``i`` runs ``accum_steps[i]`` micro-batches of at most ``micro_batch_sizes[i]``
samples, near-equal and adding up to ``local_batch_sizes[i]``. A micro-batch's mean
loss is weighted by ``its size / global batch`` before its backward pass, and gradients
are *summed* over ranks, so the update equals that of one device computing the mean
loss over the whole global batch, however unevenly the batch was spread.

One mechanism serves all four ZeRO stages (see :mod:`poplar.engine.flat_param`):
- gradients are collected per unit by post-accumulate-grad hooks; once every parameter
  of a unit has its gradient, the unit's collective is launched asynchronously (in a
  fixed unit order, so every rank issues the same sequence) and overlaps the rest of
  the backward pass. Stages 0-1 synchronise only in a rank's last micro-step, so ranks
  may run different numbers of micro-steps; stages 2-3 reduce-scatter every micro-step;
- ZeRO-3 gathers a unit's parameters in a forward pre-hook and again when the gradient
  reaches the unit's outputs, prefetches the next unit, and frees them after use.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable, Literal, Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten, tree_map

from poplar.engine import collectives as C
from poplar.engine.batch import batch_size, split_batch
from poplar.engine.device import Device
from poplar.engine.dist import init_distributed
from poplar.engine.flat_param import FlatUnit
from poplar.engine.units import build_units
from poplar.plan import Plan

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
LossFn = Callable[[nn.Module, Any], torch.Tensor]

_DTYPES = {None: torch.float32, "fp32": torch.float32, "bf16": torch.bfloat16}


class EngineConfig(BaseModel):
    """Options of :func:`initialize`; every field has a sensible default."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    clip_grad_norm: float | None = Field(None, gt=0, description="max global L2 norm of the gradient; None: off")
    mixed_precision: Literal["bf16", "fp32"] | None = Field(
        None, description="'bf16': compute in bf16, keep fp32 master weights and fp32 gradient reduction")
    unit_classes: Sequence[type | str] | None = Field(
        None, description="module classes (or class names) that become units; default: ModuleList entries")
    unit_numel: int = Field(1_000_000, gt=0, description="other modules with this many parameters become units")
    prefetch: bool = Field(True, description="ZeRO-3: all-gather the next unit while this one computes")
    check_batches: bool = Field(True, description="verify every rank's local batch against the plan each step")
    max_inflight_reduces: int = Field(2, ge=1, description="ZeRO-2/3: gradient buckets in flight before the "
                                      "oldest is waited for and its full gradient freed")
    track_memory: bool = Field(False, description="record peak bytes by kind during each step (engine.peak_memory)")


class Engine:
    """Trains ``model`` with ``plan`` on the default process group. Build it with :func:`initialize`."""

    def __init__(self, model: nn.Module, optimizer: OptimizerFactory, plan: Plan, config: EngineConfig,
                 device: Device | None = None):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(plan, Plan):
            raise TypeError(f"plan must be a poplar.Plan, got {type(plan).__name__}")
        if not callable(optimizer) or isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError("optimizer must be a callable that builds an optimizer from a parameter list, "
                            "e.g. functools.partial(torch.optim.AdamW, lr=1e-3), not an optimizer instance")
        ctx = init_distributed()
        self.rank, self.world_size, self.device = ctx.rank, ctx.world_size, ctx.device
        plan.check_world_size(self.world_size)
        self.plan, self.config = plan, config
        self.rank_device = device or Device()
        self.accum_steps = plan.accum_steps[self.rank]
        self.compute_dtype = _DTYPES[config.mixed_precision]

        model.to(self.device)
        self._check_consistent(model)
        self.model = model
        self._broadcast_non_trainable()
        if self.compute_dtype != torch.float32:   # what the units do not hold computes in bf16 too
            frozen = [p for p in model.parameters() if not p.requires_grad]
            for t in list(model.buffers()) + frozen:
                if t.is_floating_point():
                    t.data = t.data.to(self.compute_dtype)
        specs = build_units(model, config.unit_classes, config.unit_numel)
        self.units = [FlatUnit(i, s.module, s.name, s.params, zero_stage=plan.zero_stage, rank=self.rank,
                               world_size=self.world_size, compute_dtype=self.compute_dtype, device=self.device)
                      for i, s in enumerate(specs)]
        self.zero_stage = plan.zero_stage
        self._launch_order = list(reversed(range(len(self.units))))   # ~ the order backward finishes them
        self._hooks: list = []
        self._register_grad_hooks()
        if self.zero_stage >= 3:
            self._forward_order: list[int] = []
            self._register_unshard_hooks()
        if self.compute_dtype != torch.float32:
            self._hooks.append(model.register_forward_pre_hook(self._cast_inputs, with_kwargs=True))

        self.optimizer = optimizer([u.master for u in self.units])
        if not isinstance(self.optimizer, torch.optim.Optimizer):
            raise TypeError(f"the optimizer factory returned {type(self.optimizer).__name__}, not a torch.optim.Optimizer")
        self.global_steps = 0
        self.last_grad_norm: float | None = None
        self.peak_memory: dict[str, int] = {}
        self._sync = False
        self._pending: list[tuple[FlatUnit, Any, torch.Tensor | None]] = []
        self._next_launch = 0
        self._batch_check = None
        # names for the pieces of work, only for a device that recognises them (see Device.span)
        self._micro_work = _micro_signature(self) if self.rank_device.names_work else None
        self._work = _work_signature(self, self._micro_work) if self.rank_device.names_work else None

    # ------------------------------------------------------------------ set-up checks
    def _check_consistent(self, model: nn.Module) -> None:
        """Every rank must hold the same plan and the same model: fail everywhere if not."""
        n_params = sum(p.numel() for p in model.parameters())
        # check_world_size passed, so every rank sends the same number of values.
        values = [n_params, self.plan.zero_stage, *self.plan.micro_batch_sizes, *self.plan.accum_steps,
                  *self.plan.local_batch_sizes]
        lo, hi = C.agree(values, self.device)
        if lo[0] != hi[0]:
            raise ValueError(f"ranks hold different models: parameter counts range from {lo[0]} to {hi[0]}; "
                             "build the same model on every rank")
        if lo[1:] != hi[1:]:
            raise ValueError(f"ranks hold different plans (rank {self.rank} has {self.plan}); "
                             "give every rank the same plan")

    def _broadcast_non_trainable(self) -> None:
        with torch.no_grad():
            for t in list(self.model.buffers()) + [p for p in self.model.parameters() if not p.requires_grad]:
                C.broadcast(t.data, src=0)

    def _cast_inputs(self, module, args, kwargs):
        cast = lambda t: t.to(self.compute_dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
        return tree_map(cast, args), tree_map(cast, kwargs)

    # ------------------------------------------------------------------ gradient hooks
    def _register_grad_hooks(self) -> None:
        for unit in self.units:
            for slot in unit.slots:
                self._hooks.append(slot.param.register_post_accumulate_grad_hook(self._grad_hook(unit, slot)))

    def _grad_hook(self, unit: FlatUnit, slot):
        def hook(param: torch.Tensor) -> None:
            unit.add_grad(slot, param.grad)
            param.grad = None
            unit.pending_grads -= 1
            if unit.pending_grads == 0:
                self._unit_backward_done(unit)
        return hook

    def _unit_backward_done(self, unit: FlatUnit) -> None:
        unit.grads_ready = True
        if self.config.track_memory:
            self._sample_memory()
        unit.reshard()
        if self._sync:
            self._launch_ready()

    def _launch_ready(self, force: bool = False) -> None:
        """Launch gradient collectives in the fixed unit order, as far as units are ready."""
        self._confirm_batch()
        self.rank_device.boundary()
        while self._next_launch < len(self._launch_order):
            unit = self.units[self._launch_order[self._next_launch]]
            if not (unit.grads_ready or force):
                return
            work, out = unit.reduce_grads()
            self._pending.append((unit, work, out))
            self._next_launch += 1
            if self.zero_stage >= 2:   # bound the full-size gradient buckets alive at once
                while len(self._pending) > self.config.max_inflight_reduces:
                    self._finish_oldest_reduce()

    def _finish_oldest_reduce(self) -> None:
        unit, work, out = self._pending.pop(0)
        with self.rank_device.waiting():
            work.wait()
        unit.finish_reduce(out)

    # ------------------------------------------------------------------ ZeRO-3 hooks
    def _register_unshard_hooks(self) -> None:
        for unit in self.units:
            self._hooks.append(unit.module.register_forward_pre_hook(self._pre_forward(unit)))
            self._hooks.append(unit.module.register_forward_hook(self._post_forward(unit)))

    def _unshard(self, unit: FlatUnit) -> None:
        self.rank_device.boundary()
        with self.rank_device.waiting():
            unit.unshard()

    def _prefetch(self, unit: FlatUnit, direction: int) -> None:
        if not self.config.prefetch or unit.index not in self._forward_order:
            return
        pos = self._forward_order.index(unit.index) + direction
        if 0 <= pos < len(self._forward_order):
            self.rank_device.boundary()
            self.units[self._forward_order[pos]].unshard(async_op=True)

    def _pre_forward(self, unit: FlatUnit):
        def hook(module, args):
            if unit.in_backward:   # activation checkpointing re-running the forward: already gathered
                self._unshard(unit)
                return
            if unit.index not in self._forward_order:
                self._forward_order.append(unit.index)
            self._unshard(unit)
            self._prefetch(unit, +1)
        return hook

    def _post_forward(self, unit: FlatUnit):
        def hook(module, args, output):
            if unit.in_backward:   # a recomputation inside backward: the backward still needs them
                return output
            if not torch.is_grad_enabled():
                unit.reshard()
                return output
            if unit.index != 0:   # the root stays gathered: its backward comes right away
                unit.reshard()
            tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
            if tensors:
                def pre_backward(_grads):
                    unit.in_backward = True
                    self._unshard(unit)
                    self._prefetch(unit, -1)
                register_multi_grad_hook(tensors, pre_backward, mode="any")
            return output
        return hook

    # ------------------------------------------------------------------ training
    def _start_batch_check(self, local_batch) -> None:
        """Share every rank's local batch size; the answer is awaited before the first collective.

        The all-reduce runs in the background while this rank computes, so a correct
        step pays no extra synchronisation. A rank whose own batch is wrong waits at once.
        """
        try:
            n, err = batch_size(local_batch), ""
        except ValueError as e:
            n, err = -1, str(e)
        sizes = torch.zeros(self.world_size, dtype=torch.int64, device=self.device)
        sizes[self.rank] = n
        if self.config.check_batches and self.world_size > 1:
            self._batch_check = (C.all_reduce(sizes, async_op=True), sizes, err)
        else:
            self._batch_check = (None, sizes, err)
        if n != self.plan.local_batch_size(self.rank):
            self._confirm_batch()

    def _confirm_batch(self) -> None:
        if self._batch_check is None:
            return
        work, sizes, err = self._batch_check
        self._batch_check = None
        if work is not None:
            with self.rank_device.waiting():
                work.wait()
        bad = [(r, int(n)) for r, n in enumerate(sizes.tolist())
               if n != self.plan.local_batch_size(r) and (work is not None or r == self.rank)]
        if not bad:
            return
        if err:
            raise ValueError(f"rank {self.rank}: {err}")
        what = "; ".join(f"rank {r} got {n if n >= 0 else 'an unreadable batch of'} samples, its plan slice is "
                         f"{self.plan.local_batch_size(r)} (micro-batches {self.plan.micro_batches(r)})"
                         for r, n in bad)
        raise ValueError(f"local batch does not match the plan: {what}. Give each rank "
                         "global_batch[plan.sample_range(rank)]")

    def train_batch(self, local_batch, loss_fn: LossFn) -> float:
        """One optimizer step on this rank's slice of the global batch.

        ``local_batch`` is a tensor, or a tuple/list/dict of tensors, whose first
        dimension has ``plan.local_batch_size(rank)`` samples. ``loss_fn(model,
        micro_batch)`` returns the mean loss over the micro-batch. Returns the mean loss
        over the whole global batch, the same on every rank.
        """
        with self.rank_device.step(self._rest_key(loss_fn)):
            return self._train_batch(local_batch, loss_fn)

    # Names for the pieces of this rank's work: the same work, the same name (see Device.span).
    def _rest_key(self, loss_fn: LossFn) -> str | None:
        """The step's work outside its micro-steps (the update, the bookkeeping): one name whatever the split.

        The update of a shard costs what it costs whatever micro-batches fed it, so every
        plan of an engine (the profiler's and the one trained) shares one calibration of it.
        Named per split instead, each plan calibrated its own in its first steps, and the
        plans measured 1-15% slower than their predictions (docs/plan.md).
        """
        return None if self._work is None else _digest(self._work, "rest", _name(loss_fn))

    def _micro_key(self, micro_batch, loss_fn: LossFn) -> str | None:
        """A micro-step: ``family@samples``, the family being the work per sample (see poplar.emulate.calibration)."""
        if self._work is None:
            return None
        per_sample = [(s[0][1:], s[1]) if isinstance(s, tuple) else s for s in _shapes(micro_batch)]
        return f"{_digest(self._micro_work, 'micro', per_sample, _name(loss_fn))}@{batch_size(micro_batch)}"

    def _train_batch(self, local_batch, loss_fn: LossFn) -> float:
        self._reset_step_state()
        self._start_batch_check(local_batch)
        global_batch = self.plan.global_batch_size
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        micro_batches = split_batch(local_batch, self.plan.micro_batches(self.rank), self.device)
        last = len(micro_batches) - 1
        for i, micro_batch in enumerate(micro_batches):
            with self.rank_device.span(self._micro_key(micro_batch, loss_fn)):
                self._begin_micro_step(sync=self.zero_stage >= 2 or i == last)
                with self._memory_accounting():
                    loss = loss_fn(self.model, micro_batch)
                    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
                        raise ValueError("loss_fn must return the mean loss of the micro-batch as a scalar tensor "
                                         f"that requires grad; got {type(loss).__name__}"
                                         f"{'' if not isinstance(loss, torch.Tensor) else tuple(loss.shape)}")
                    weight = batch_size(micro_batch) / global_batch
                    (loss.reshape(()) * weight).backward()
                self._end_micro_step()
            loss_sum += loss.detach().float().reshape(()) * weight
        self.rank_device.boundary()
        loss_work = C.all_reduce(loss_sum, async_op=True)
        self._step()
        with self.rank_device.waiting():
            loss_work.wait()
        return float(loss_sum)

    def _reset_step_state(self) -> None:
        """Clean gradient state, whatever an earlier (possibly failed) step left behind."""
        self._pending.clear()
        for unit in self.units:
            unit.reset_grads()
            unit.reshard()

    def _begin_micro_step(self, sync: bool) -> None:
        self._sync = sync
        self._next_launch = 0
        for unit in self.units:
            unit.begin_micro_step()
        if self.zero_stage >= 3:
            self._confirm_batch()     # the all-gathers below are this step's first collectives
            self._unshard(self.units[0])   # whatever loss_fn calls first, the root's parameters are there

    def _end_micro_step(self) -> None:
        if self.config.track_memory:
            self._sample_memory()
        for unit in self.units:
            unit.in_backward = False
            if not unit.grads_ready:   # some parameters unused in this micro-step
                unit.grads_ready = True
                unit.reshard()
        if self._sync:
            self._launch_ready(force=True)
            while self._pending:
                self._finish_oldest_reduce()

    def _clip_grads(self, grads: list[torch.Tensor]) -> None:
        max_norm = self.config.clip_grad_norm
        sq = torch.zeros((), dtype=torch.float32, device=self.device)
        for g in grads:
            sq += g.float().pow(2).sum()
        if self.zero_stage >= 1:   # each rank holds a shard: the squares add up across ranks
            self.rank_device.boundary()
            with self.rank_device.waiting():
                C.all_reduce(sq)
        norm = float(sq.sqrt())
        self.last_grad_norm = norm
        coef = max_norm / (norm + 1e-6)
        if coef < 1.0:
            for g in grads:
                g.mul_(coef)

    @torch.no_grad()
    def _step(self) -> None:
        grads = [u.owned_grad() for u in self.units]
        if self.config.clip_grad_norm is not None:
            self._clip_grads(grads)
        for unit, g in zip(self.units, grads):
            unit.master.grad = g
        self.optimizer.step()
        self.rank_device.boundary()
        works = [w for w in (u.refresh_params_after_step() for u in self.units) if w is not None]
        for unit in self.units:   # the next train_batch starts a new gradient window
            unit.master.grad = None
        with self.rank_device.waiting():
            for w in works:
                w.wait()
        self.global_steps += 1

    # ------------------------------------------------------------------ state
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full, unsharded fp32 parameters (and buffers) keyed like ``model.state_dict()``, on every rank.

        A collective in stages 1-3: call it on every rank.
        """
        full: dict[int, torch.Tensor] = {}
        for unit in self.units:
            flat = unit.full_master()
            for s in unit.slots:
                full[id(s.param)] = flat[s.offset:s.offset + s.numel].view(s.shape).clone()
        out = {}
        for key, t in self.model.state_dict(keep_vars=True).items():
            out[key] = full[id(t)] if id(t) in full else t.detach().clone()
        return out

    def sharded_state_dict(self) -> dict:
        """This rank's share of the training state, for ``torch.distributed.checkpoint``.

        fp32 masters and optimizer states under keys that name the rank where the stage
        shards them (``rank1.unit0.master``), so every rank writes its own shard; what
        every rank holds alike (stage-0 states, buffers, hyper-parameters, the step count)
        under plain keys, written once. Tensors are the engine's own: loading into this
        dict restores them in place (see :meth:`load_sharded_state_dict`).
        """
        tag = f"rank{self.rank}." if self.zero_stage >= 1 else ""
        out: dict = {f"{tag}unit{u.index}.master": u.master.data for u in self.units}
        opt = self.optimizer.state_dict()
        for idx, state in opt["state"].items():
            for name, value in state.items():
                out[f"{tag}optim.{idx}.{name}"] = value if isinstance(value, torch.Tensor) else torch.tensor(value)
        out["optim.param_groups"] = opt["param_groups"]
        for name, buf in self.model.named_buffers():
            out[f"buffer.{name}"] = buf
        out["global_steps"] = torch.tensor(self.global_steps)
        return out

    def prepare_sharded_load(self) -> dict:
        """A state dict shaped like a saved one, for ``dcp.load`` to fill before :meth:`load_sharded_state_dict`.

        A fresh optimizer has no state yet: one step with zero gradients creates it (every
        value is overwritten by the load, the parameters included).
        """
        if not self.optimizer.state:
            for u in self.units:
                u.master.grad = torch.zeros_like(u.master)
            self.optimizer.step()
            for u in self.units:
                u.master.grad = None
        return self.sharded_state_dict()

    @torch.no_grad()
    def load_sharded_state_dict(self, state: dict) -> None:
        """Restore from a dict that ``dcp.load`` filled (from :meth:`prepare_sharded_load`). Same world and stage."""
        tag = f"rank{self.rank}." if self.zero_stage >= 1 else ""
        for u in self.units:
            u.master.data.copy_(state[f"{tag}unit{u.index}.master"])
        opt = self.optimizer.state_dict()
        for idx, st in opt["state"].items():
            for name in list(st):
                st[name] = state[f"{tag}optim.{idx}.{name}"]
        opt["param_groups"] = state["optim.param_groups"]
        self.optimizer.load_state_dict(opt)
        for name, buf in self.model.named_buffers():
            buf.copy_(state[f"buffer.{name}"])
        self.global_steps = int(state["global_steps"])
        works = [w for w in (u.refresh_params_after_step() for u in self.units) if w is not None]
        for w in works:
            w.wait()

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load full parameters (e.g. from :meth:`full_state_dict`) on every rank."""
        own = self.model.state_dict(keep_vars=True)
        missing, unexpected = set(own) - set(state), set(state) - set(own)
        if missing or unexpected:
            raise ValueError(f"state dict does not match the model: missing {sorted(missing)[:5]}, "
                             f"unexpected {sorted(unexpected)[:5]}")
        slot_of = {id(s.param): (u, s) for u in self.units for s in u.slots}
        flats = {u.index: torch.zeros(u.padded_numel, device=self.device) for u in self.units}
        with torch.no_grad():
            for key, t in own.items():
                value = state[key].to(self.device)
                if id(t) in slot_of:
                    u, s = slot_of[id(t)]
                    if tuple(value.shape) != tuple(s.shape):
                        raise ValueError(f"{key}: shape {tuple(value.shape)} in the state dict, "
                                         f"{tuple(s.shape)} in the model")
                    flats[u.index][s.offset:s.offset + s.numel].copy_(value.reshape(-1))
                else:
                    t.data.copy_(value)
        for u in self.units:
            u.load_full_master(flats[u.index])

    def memory_report(self) -> dict[str, int]:
        """Bytes this rank holds now, by kind, measured from the tensors themselves.

        ``parameters``: the model's parameter storage (full or shard); ``master``: fp32
        master weights not shared with it; ``gradients``: gradient accumulators;
        ``optimizer``: optimizer states. Storages shared by views are counted once.
        """
        seen: set[int] = set()

        def nbytes(tensors: Iterable[torch.Tensor | None]) -> int:
            total = 0
            for t in tensors:
                if t is None:
                    continue
                st = t.untyped_storage()
                if st.nbytes() == 0 or st.data_ptr() in seen:
                    continue
                seen.add(st.data_ptr())
                total += st.nbytes()
            return total

        report = {
            "parameters": nbytes([u.full_param for u in self.units] + [u.param_shard for u in self.units]),
            "master": nbytes(u.master.data for u in self.units),
            "gradients": nbytes([u.grad_full for u in self.units] + [u.grad_shard for u in self.units]),
            "optimizer": nbytes(t for st in self.optimizer.state.values() for t in st.values()
                                if isinstance(t, torch.Tensor) and t.dim() > 0),
        }
        report["total"] = sum(report.values())
        return report

    def model_state_bytes(self) -> int:
        """Bytes of model state this rank holds through a micro-step, at their steady level.

        What the tensors hold now (:meth:`memory_report`), plus what a step allocates on
        the way: the full gradient accumulators of stages 0-1 before their first use, the
        full-size gradient buckets in flight in stages 2-3, and in ZeRO-3 the units
        gathered at once (the root, the current one and the prefetched one).
        """
        total = self.memory_report()["total"]
        largest = max(u.padded_numel for u in self.units)
        if self.zero_stage <= 1:
            total += sum(4 * u.padded_numel for u in self.units if u.grad_full is None)
        else:
            total += 4 * largest * (self.config.max_inflight_reduces + 1)
        if self.zero_stage >= 3:   # the allowance, not whatever happens to be gathered right now
            total -= sum(u.full_param.untyped_storage().nbytes() for u in self.units)
            itemsize = torch.finfo(self.compute_dtype).bits // 8
            total += itemsize * (self.units[0].padded_numel + 2 * largest)
        return total

    def _memory_accounting(self):
        """The device's accounting of one micro-step (only a device that wants the figures gets them)."""
        if not self.rank_device.tracks_memory:
            return contextlib.nullcontext()
        return self.rank_device.micro_step(self.model_state_bytes(), self._state_storages())

    def _state_storages(self) -> set[int]:
        tensors = [u.full_param for u in self.units] + [u.master.data for u in self.units]
        return {t.untyped_storage()._cdata for t in tensors}

    def _sample_memory(self) -> None:
        now = self.memory_report()
        self.peak_memory = {k: max(v, self.peak_memory.get(k, 0)) for k, v in now.items()}

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


def initialize(model: nn.Module, optimizer: OptimizerFactory, plan: Plan, config: EngineConfig | dict | None = None,
               *, device: Device | None = None, **overrides) -> Engine:
    """Wrap ``model`` for heterogeneous ZeRO training with ``plan``.

    Joins the default process group (torchrun's environment, NCCL on CUDA ranks, gloo on
    CPU), broadcasts rank 0's weights, shards what the stage shards and builds the
    optimizer on the shards.

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
    return Engine(model, optimizer, plan, config, device)


# ---------------------------------------------------------------------------- naming the work
def _digest(*parts) -> str:
    import hashlib

    return hashlib.sha256(repr(parts).encode()).hexdigest()[:24]


def _name(fn) -> str:
    fn = getattr(fn, "func", fn)   # functools.partial
    return f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', type(fn).__qualname__)}"


def _shapes(x) -> Any:
    leaves, _ = tree_flatten(x)
    return [(tuple(t.shape), str(t.dtype)) if isinstance(t, torch.Tensor) else repr(t) for t in leaves]


def _micro_signature(engine: Engine) -> str:
    """What makes a micro-step's forward and backward cost what they do: the model, its shards, the stage.

    Not the optimizer, nor options the micro-step does not run (clipping, batch checks):
    training with clipping does the same micro-steps as the profiler did without it.
    """
    model = engine.model
    config = getattr(model, "config", None)
    c = engine.config
    return _digest(f"{type(model).__module__}.{type(model).__qualname__}",
                   config.to_json_string() if hasattr(config, "to_json_string") else repr(config),
                   [(tuple(p.shape), str(p.dtype), p.requires_grad) for p in model.parameters()],
                   [(tuple(b.shape), str(b.dtype)) for b in model.buffers()],
                   [tuple(u.master.shape) for u in engine.units], engine.zero_stage, engine.world_size,
                   repr((c.mixed_precision, c.unit_classes, c.unit_numel, c.prefetch, c.max_inflight_reduces,
                         c.track_memory)), str(engine.device))


def _work_signature(engine: Engine, micro_signature: str) -> str:
    """What makes the rest of a step cost what it does: the micro-steps' signature, the optimizer, every option."""
    opt = engine.optimizer
    # the options that change the work (foreach, amsgrad, ...), not the numbers a schedule moves
    hyper = [sorted((k, v) for k, v in g.items() if isinstance(v, (bool, str)) or v is None) for g in opt.param_groups]
    return _digest(micro_signature, type(opt).__qualname__, repr(hyper), repr(engine.config))
