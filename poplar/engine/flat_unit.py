"""One unit's parameters as flat buffers and shards: :class:`FlatUnit` and its explicit states.

The unit's parameters are laid end to end in one flat buffer, padded to a multiple of
the ranks sharing it; each owns a slice (its shard): rank ``r`` the ``r``-th when flat,
a group's ``i``-th rank the ``i``-th of its group's copy when hybrid, equal slices unless
the plan gives the ranks shares (see :mod:`poplar.engine.layout`). What is kept in full and what only as a shard is the ZeRO
stage's (see :mod:`poplar.stages`); this one class serves all four.

The model's own ``nn.Parameter`` objects stay registered on their modules; their data
are views into ``full_param``. ZeRO-3 frees ``full_param``'s storage (resizes it to
zero) after use and re-allocates it for the next all-gather, so every view, including
those autograd saved for the backward pass, sees the gathered values again.

The unit owns its state: where its parameters are (:class:`ParamState`) and where the
gradient of the current micro-step is (:class:`GradState`). Both change only through
its named transitions, which the hooks call (as FSDP2's ``FSDPParamGroup``):
:meth:`~FlatUnit.unshard` / :meth:`~FlatUnit.reshard` around its forward,
:meth:`~FlatUnit.pre_backward` when the gradient reaches it, :meth:`~FlatUnit.accumulate_grad`
per parameter and :meth:`~FlatUnit.post_backward` when its backward is done,
:meth:`~FlatUnit.reduce_grads` / :meth:`~FlatUnit.finish_reduce` for its gradient collective.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from poplar.engine.layout import ShardLayout
from poplar.engine.unit_state import GradState, ParamState, Slot
from poplar.engine.weights import values_to_read
from poplar.stages import ZeroStage


class FlatUnit:
    """One unit's flat parameter, master and gradient buffers, sharded as ``stage`` says."""

    def __init__(self, index: int, module: nn.Module, name: str, params: list[nn.Parameter], *, stage: ZeroStage,
                 layout: ShardLayout, compute_dtype: torch.dtype, device: torch.device):
        self.index, self.module, self.name = index, module, name
        self.layout = layout
        # what this unit keeps only as its shard
        self.shard_optim, self.shard_grads, self.shard_params = (
            stage.shards_optimizer, stage.shards_gradients, stage.shards_parameters)
        self.compute_dtype = compute_dtype
        offset, slots = 0, []
        for i, p in enumerate(params):
            slots.append(Slot(p, i, offset, p.numel(), p.shape))
            offset += p.numel()
        self.slots = slots
        self.numel = offset
        self.padded_numel = layout.padded(offset)
        self.shard_start, shard_stop = layout.shard_range(offset)
        self.shard_numel = shard_stop - self.shard_start
        sizes = layout.slice_sizes(offset)
        # every rank's slice in this rank's group where they differ (its collectives' uneven forms), else None
        self.slice_sizes = sizes if len(set(sizes)) > 1 else None
        self._build_params(device)

        # Gradients: fp32 accumulators. grad_full is the full (padded) flat gradient; it
        # persists across micro-steps in stages 0-1 and lives one micro-step in 2-3.
        # A gradient window runs from one optimizer step to the next; the first write of
        # each parameter (and of the shard) in a window copies, later ones add, so no
        # buffer needs zeroing between steps.
        self.grad_full: torch.Tensor | None = None
        self.grad_shard = torch.zeros(self.shard_numel, device=device) if self.shard_optim else None
        self._written = [False] * len(slots)
        self._shard_written = False
        self.grad_state = GradState.IDLE
        self._pending_grads = 0    # parameters whose gradient this micro-step has not arrived yet
        self._in_backward = False  # ZeRO-3: the gradient has reached this unit's outputs
        self._gather_work = None
        self._reduce_work, self._reduce_out = None, None
        self._across_work = None   # hybrid: the sum across groups in flight

    @property
    def gather_buffer_numel(self) -> int:
        """Elements an all-gather of this unit holds besides its output while in flight: where shards differ in
        size, every rank's padded to the largest, and this rank's padded copy (see
        :mod:`poplar.engine.collectives`)."""
        sizes = self.slice_sizes
        return 0 if sizes is None else (len(sizes) + 1) * max(sizes)

    @property
    def comm(self):
        """The world's collectives (the broadcast of the initial values; flat stage 0's all-reduce)."""
        return self.layout.comm

    @property
    def shard_comm(self):
        """The shard group's collectives (the world's when flat); looked up each time, as a group may be remade."""
        return self.layout.shard_comm

    def _build_params(self, device: torch.device) -> None:
        """The flat parameter (and its fp32 master), identical on every rank: rank 0's values.

        Parameters on the meta device have no values yet (:mod:`poplar.engine.weights` reads them into the
        master): they are replaced by new parameters, views into the flat buffer (``replaced``, by the old
        one's ``id``), and in ZeRO-3 nothing but the shard is ever allocated."""
        empty = values_to_read((s.param for s in self.slots), device)
        dtype = self.compute_dtype
        mixed = dtype != torch.float32
        if empty and self.shard_params:
            self.master = nn.Parameter(torch.zeros(self.shard_numel, device=device))
            self.param_shard = self.master.data if not mixed else self.master.data.to(dtype)
            self.full_param = torch.empty(self.padded_numel, dtype=dtype, device=device)
        else:
            self._build_full(device, empty)
        self.param_state = ParamState.UNSHARDED
        self.replaced: dict[int, nn.Parameter] = {}
        for i, s in enumerate(self.slots):   # the module's parameters become views into the flat buffer
            view = self.full_param[s.offset:s.offset + s.numel].view(s.shape)
            if empty and s.param.is_meta:   # (its own version counter, as a view's data: not the flat buffer's)
                new = nn.Parameter(torch.empty(0, dtype=dtype, device=device))
                self.replaced[id(s.param)] = new
                self.slots[i] = s = dataclasses.replace(s, param=new)
            s.param.data = view
        if self.shard_params:
            self._free_full()

    def _build_full(self, device: torch.device, empty: bool) -> None:
        full = torch.zeros(self.padded_numel, dtype=torch.float32, device=device)
        if not empty:
            with torch.no_grad():
                for s in self.slots:
                    full[s.offset:s.offset + s.numel].copy_(s.param.detach().reshape(-1))
            # over the world: only the unit's own elements, since each group pads it to its own size
            self.comm.broadcast(full[:self.numel], src=0)
        dtype = self.compute_dtype
        mixed = dtype != torch.float32
        if not self.shard_params:
            self.full_param = full.to(dtype) if mixed else full
            if not mixed:   # the optimizer steps on (a slice of) the very buffer the model reads
                self.master = nn.Parameter(self.full_param if not self.shard_optim
                                           else self.owned_slice(self.full_param))
            else:
                self.master = nn.Parameter(full if not self.shard_optim else self.owned_slice(full).clone())
            self.param_shard = None
        else:
            self.master = nn.Parameter(self.owned_slice(full).clone())
            self.param_shard = self.master.data if not mixed else self.master.data.to(dtype)
            self.full_param = torch.empty(self.padded_numel, dtype=dtype, device=device)

    def recut(self, move) -> None:
        """Between steps, every rank at once, after the layout's shares changed: this rank's shards where the new
        cut puts them (``move(shard)``: its slice of the new cut, :meth:`ShardLayout.recut`). The optimizer's
        states are the caller's to move."""
        self.shard_start, shard_stop = self.layout.shard_range(self.numel)
        self.shard_numel = shard_stop - self.shard_start
        sizes = self.layout.slice_sizes(self.numel)
        self.slice_sizes = sizes if len(set(sizes)) > 1 else None
        if not self.shard_optim:
            return
        if not self.shard_params and self.compute_dtype == torch.float32:
            self.master.data = self.owned_slice(self.full_param)    # every rank holds the whole buffer: a view again
        else:
            self.master.data = move(self.master.data)
        if self.shard_params:
            mixed = self.compute_dtype != torch.float32
            self.param_shard = self.master.data if not mixed else self.master.data.to(self.compute_dtype)
        self.master.grad = None
        self.grad_shard = torch.zeros(self.shard_numel, device=self.master.device)
        self._shard_written = False

    # -- parameters ---------------------------------------------------------------------
    def _free_full(self) -> None:
        self.full_param.untyped_storage().resize_(0)
        self.param_state = ParamState.SHARDED

    @property
    def in_backward(self) -> bool:
        """ZeRO-3: whether this micro-step's gradient has reached the unit (a forward now is a recomputation)."""
        return self._in_backward

    def unshard(self, async_op: bool = False) -> None:
        """SHARDED -> GATHERING (-> UNSHARDED unless ``async_op``): the all-gather that makes the unit whole."""
        if self.param_state is ParamState.SHARDED:
            self.full_param.untyped_storage().resize_(self.padded_numel * self.full_param.element_size())
            self._gather_work = self.shard_comm.all_gather(self.full_param, self.param_shard, async_op=True,
                                                           sizes=self.slice_sizes)
            self.param_state = ParamState.GATHERING
        if not async_op:
            self.wait_unshard()

    def wait_unshard(self) -> None:
        """GATHERING -> UNSHARDED."""
        if self.param_state is ParamState.GATHERING:
            self._gather_work.wait()
            self._gather_work = None
            self.param_state = ParamState.UNSHARDED

    def reshard(self) -> None:
        """ZeRO-3: -> SHARDED, the gathered parameters freed (an all-gather in flight is finished first)."""
        if self.shard_params:
            self.wait_unshard()
            if self.param_state is ParamState.UNSHARDED:
                self._free_full()

    def pre_backward(self) -> None:
        """The gradient reached the unit's outputs: its parameters are needed (again) until its backward is done."""
        self._in_backward = True
        self.unshard()

    def abandon_collectives(self) -> list:
        """A step is given up: the collectives in flight (works), for the caller to finish.

        The unit stays GATHERING / REDUCING, as it is, until :meth:`reset_after_abandon`.
        """
        return [w for w in (self._gather_work, self._reduce_work, self._across_work) if w is not None]

    def reset_after_abandon(self) -> None:
        """After :meth:`abandon_collectives`' works are done: only the shard again, no gradient of the step."""
        self._gather_work = None
        self._reduce_work, self._reduce_out, self._across_work = None, None, None
        if self.shard_params and self.param_state is not ParamState.SHARDED:
            self._free_full()
        self.reset_grads()
        self._in_backward = False
        self.master.grad = None

    def refresh_params_after_step(self):
        """After the optimizer stepped on the fp32 master, bring the model's parameters up to date.

        Returns the in-flight all-gather work (stages 1-2), or None.
        """
        if self.shard_params:
            if self.param_shard is not self.master.data:
                self.param_shard.copy_(self.master.data)
            return None
        if not self.shard_optim:
            if self.full_param is not self.master.data:
                self.full_param.copy_(self.master.data)
            return None
        # The input must not alias the output: in fp32 the master is a view into full_param.
        shard = self.master.data.to(self.compute_dtype, copy=True)
        return self.shard_comm.all_gather(self.full_param, shard, async_op=True, sizes=self.slice_sizes)

    # -- gradients ----------------------------------------------------------------------
    def begin_micro_step(self) -> None:
        """-> ACCUMULATING: every parameter's gradient of this micro-step is to come."""
        self._pending_grads = len(self.slots)
        self.grad_state = GradState.ACCUMULATING
        self._in_backward = False

    def end_micro_step(self) -> None:
        """The micro-step's backward is over: a forward from now on is not a recomputation."""
        self._in_backward = False

    @property
    def grads_ready(self) -> bool:
        """Every parameter's gradient of this micro-step is in (or the unit's backward was declared done)."""
        return self.grad_state is not GradState.ACCUMULATING and self.grad_state is not GradState.IDLE

    def _new_grad_full(self) -> torch.Tensor:
        g = torch.empty(self.padded_numel, device=self.full_param.device)
        g[self.numel:].zero_()   # padding
        return g

    def accumulate_grad(self, slot: Slot) -> bool:
        """Take ``slot``'s parameter's gradient into the flat gradient; True once the last one is in (-> READY)."""
        grad = slot.param.grad
        if self.grad_full is None:
            self.grad_full = self._new_grad_full()
        region = self.grad_full[slot.offset:slot.offset + slot.numel]
        if self._written[slot.index]:
            region.add_(grad.reshape(-1))
        else:
            region.copy_(grad.reshape(-1))
            self._written[slot.index] = True
        slot.param.grad = None
        self._pending_grads -= 1
        if self._pending_grads == 0:
            self.grad_state = GradState.READY
            return True
        return False

    def post_backward(self) -> None:
        """The unit's backward is done (-> READY, parameters it did not use too): ZeRO-3 reshards."""
        if self.grad_state is GradState.ACCUMULATING:
            self.grad_state = GradState.READY
        self.reshard()

    def _complete_grad_full(self) -> torch.Tensor:
        """The full gradient with zeros where no parameter wrote this window (unused ones)."""
        if self.grad_full is None:
            self.grad_full = self._new_grad_full()
        for s in self.slots:
            if not self._written[s.index]:
                self.grad_full[s.offset:s.offset + s.numel].zero_()
                self._written[s.index] = True
        return self.grad_full

    def reduce_grads(self) -> None:
        """READY -> REDUCING: launch this unit's gradient collective, all-reduce (stage 0) or reduce-scatter.

        Hybrid, the reduce-scatter is the group's, and stage 0's all-reduce is its first level (a
        reduce-scatter in the group); :meth:`start_across` then sums the groups' shards.
        """
        grad_full = self._complete_grad_full()
        if not self.shard_optim and not self.layout.hybrid:
            self._reduce_work = self.comm.all_reduce(grad_full, async_op=True)
        else:
            self._reduce_out = torch.empty(self.shard_numel, device=grad_full.device)
            self._reduce_work = self.shard_comm.reduce_scatter(self._reduce_out, grad_full, async_op=True,
                                                               sizes=self.slice_sizes)
        self.grad_state = GradState.REDUCING

    def finish_reduce(self) -> None:
        """REDUCING -> REDUCED: wait for the collective; a reduce-scatter's output adds into ``grad_shard``."""
        work, out = self._reduce_work, self._reduce_out
        self._reduce_work, self._reduce_out = None, None
        work.wait()
        if out is not None and not self.shard_optim:   # hybrid stage 0: the shard's sum across groups is next
            self._reduce_out = out
        elif out is not None:
            if self._shard_written:
                self.grad_shard.add_(out)
            else:
                self.grad_shard.copy_(out)
                self._shard_written = True
        if self.shard_optim:   # the full gradient has been reduced into the shard: a new window
            self.grad_full = None
            self._written = [False] * len(self.slots)
        self.grad_state = GradState.REDUCED

    def start_across(self) -> None:
        """Hybrid, after the step's last reduce: launch the sum of this rank's gradient shard across groups."""
        shard = self._reduce_out if not self.shard_optim else self.owned_grad()
        self._across_work = self.layout.reduce_across(shard, self.numel, async_op=True)

    def finish_across(self):
        """Wait for :meth:`start_across`'s sum. Stage 0: returns the in-flight gather of the summed shards into
        the full gradient (the two-level all-reduce's last level); otherwise None."""
        work, self._across_work = self._across_work, None
        work.wait()
        if self.shard_optim:
            return None
        out, self._reduce_out = self._reduce_out, None
        return self.shard_comm.all_gather(self.grad_full, out, async_op=True, sizes=self.slice_sizes)

    def owned_grad(self) -> torch.Tensor:
        """The gradient this rank applies: the full one (stage 0) or its shard."""
        if self.shard_optim:
            if not self._shard_written:
                self.grad_shard.zero_()
            return self.grad_shard
        return self._complete_grad_full()

    def owned_slice(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a full (padded) flat buffer of the unit: where a sharding rank's shard would lie."""
        return flat[self.shard_start:self.shard_start + self.shard_numel]

    def attach_grad(self, grad: torch.Tensor | None) -> None:
        """Hand ``grad`` to the optimizer as the master's gradient (None: none)."""
        self.master.grad = grad

    def reset_grads(self) -> None:
        """-> IDLE: a new gradient window (after a step, or after a step that failed half-way)."""
        self._written = [False] * len(self.slots)
        self._shard_written = False
        if self.shard_grads:
            self.grad_full = None
        for s in self.slots:
            s.param.grad = None
        self._pending_grads = 0
        self.grad_state = GradState.IDLE

    # -- full values --------------------------------------------------------------------
    def full_master(self) -> torch.Tensor:
        """The whole unit's fp32 master values on every rank (a collective when sharded)."""
        if not self.shard_optim:
            return self.master.data.float()
        full = torch.empty(self.padded_numel, dtype=torch.float32, device=self.master.device)
        self.shard_comm.all_gather(full, self.master.data.float().contiguous(), sizes=self.slice_sizes)
        return full

    def load_full_master(self, full: torch.Tensor) -> None:
        """Set the unit's parameters from a full fp32 flat buffer (identical on every rank)."""
        with torch.no_grad():
            self.master.data.copy_(full if not self.shard_optim else self.owned_slice(full))
            if self.shard_params:
                self.param_shard.copy_(self.master.data)
            else:
                self.full_param.copy_(full)
