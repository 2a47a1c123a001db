"""One unit's parameters as flat buffers and shards: :class:`FlatUnit` and its explicit states.

The unit's parameters are laid end to end in one flat buffer, padded to a multiple of
the world size; rank ``r`` owns the ``r``-th equal slice (its shard). What is kept in
full and what only as a shard is the ZeRO stage's (see :mod:`poplar.stages`); this one
class serves all four.

The model's own ``nn.Parameter`` objects stay registered on their modules; their data
are views into ``full_param``. ZeRO-3 frees ``full_param``'s storage (resizes it to
zero) after use and re-allocates it for the next all-gather, so every view, including
those autograd saved for the backward pass, sees the gathered values again.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch
from torch import nn

from poplar.engine import collectives as C
from poplar.stages import ZeroStage


class ParamState(Enum):
    SHARDED = "sharded"        # only this rank's shard exists (ZeRO-3 at rest)
    GATHERING = "gathering"    # an all-gather into full_param is in flight
    UNSHARDED = "unsharded"    # full_param holds every parameter


@dataclass(frozen=True)
class Slot:
    """Where one parameter lives in its unit's flat buffer."""
    param: nn.Parameter
    index: int
    offset: int
    numel: int
    shape: torch.Size


class FlatUnit:
    """One unit's flat parameter, master and gradient buffers, sharded as ``stage`` says."""

    def __init__(self, index: int, module: nn.Module, name: str, params: list[nn.Parameter], *, stage: ZeroStage,
                 rank: int, world_size: int, compute_dtype: torch.dtype, device: torch.device):
        self.index, self.module, self.name = index, module, name
        self.rank, self.world_size = rank, world_size
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
        self.padded_numel = -(-offset // world_size) * world_size
        self.shard_numel = self.padded_numel // world_size
        self.shard_start = rank * self.shard_numel

        # Every rank builds the full flat buffer once from its own module, then rank 0's
        # values are broadcast so every replica starts identical.
        full = torch.zeros(self.padded_numel, dtype=torch.float32, device=device)
        with torch.no_grad():
            for s in slots:
                full[s.offset:s.offset + s.numel].copy_(s.param.detach().reshape(-1))
        C.broadcast(full, src=0)

        mixed = compute_dtype != torch.float32
        if not self.shard_params:
            self.full_param = full.to(compute_dtype) if mixed else full
            if not mixed:   # the optimizer steps on (a slice of) the very buffer the model reads
                self.master = nn.Parameter(self.full_param if not self.shard_optim else self._my_shard(self.full_param))
            else:
                master = full if not self.shard_optim else self._my_shard(full).clone()
                self.master = nn.Parameter(master)
            self.param_shard = None
            self.state = ParamState.UNSHARDED
        else:
            self.master = nn.Parameter(self._my_shard(full).clone())
            self.param_shard = self.master.data if not mixed else self.master.data.to(compute_dtype)
            self.full_param = torch.empty(self.padded_numel, dtype=compute_dtype, device=device)
            self.state = ParamState.UNSHARDED   # until _free below
        del full
        for s in slots:   # the module's parameters become views into the flat buffer
            s.param.data = self.full_param[s.offset:s.offset + s.numel].view(s.shape)
        if self.shard_params:
            self._free_full()

        # Gradients: fp32 accumulators. grad_full is the full (padded) flat gradient; it
        # persists across micro-steps in stages 0-1 and lives one micro-step in 2-3.
        # A gradient window runs from one optimizer step to the next; the first write of
        # each parameter (and of the shard) in a window copies, later ones add, so no
        # buffer needs zeroing between steps.
        self.grad_full: torch.Tensor | None = None
        self.grad_shard = torch.zeros(self.shard_numel, device=device) if self.shard_optim else None
        self._written = [False] * len(slots)
        self._shard_written = False
        self._gather_work = None
        self.pending_grads = 0   # parameters whose gradient this micro-step has not arrived yet
        self.grads_ready = False
        self.in_backward = False  # ZeRO-3: the gradient has reached this unit's outputs

    # -- parameters ---------------------------------------------------------------------
    def _my_shard(self, flat: torch.Tensor) -> torch.Tensor:
        return flat[self.shard_start:self.shard_start + self.shard_numel]

    def _free_full(self) -> None:
        self.full_param.untyped_storage().resize_(0)
        self.state = ParamState.SHARDED

    def unshard(self, async_op: bool = False) -> None:
        """Start (or finish) the all-gather that makes every parameter of the unit whole."""
        if self.state is ParamState.SHARDED:
            self.full_param.untyped_storage().resize_(self.padded_numel * self.full_param.element_size())
            self._gather_work = C.all_gather(self.full_param, self.param_shard, async_op=True)
            self.state = ParamState.GATHERING
        if not async_op:
            self.wait_unshard()

    def wait_unshard(self) -> None:
        if self.state is ParamState.GATHERING:
            self._gather_work.wait()
            self._gather_work = None
            self.state = ParamState.UNSHARDED

    def abandon_collectives(self):
        """A step is given up: hand over the in-flight all-gather (if any) for the caller to finish."""
        work, self._gather_work = self._gather_work, None
        if self.state is ParamState.GATHERING:
            self.state = ParamState.UNSHARDED
        return work

    def reset_after_abandon(self) -> None:
        """After :meth:`abandon_collectives`' work is done: only the shard again, no gradient of the step."""
        if self.shard_params and self.state is not ParamState.SHARDED:
            self._free_full()
        self.reset_grads()
        self.pending_grads = 0
        self.in_backward = False

    def reshard(self) -> None:
        """ZeRO-3: free the gathered parameters, keep only this rank's shard."""
        if self.shard_params:
            self.wait_unshard()
            if self.state is ParamState.UNSHARDED:
                self._free_full()

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
        return C.all_gather(self.full_param, shard, async_op=True)

    # -- gradients ----------------------------------------------------------------------
    def begin_micro_step(self) -> None:
        self.pending_grads = len(self.slots)
        self.grads_ready = False
        self.in_backward = False

    def _new_grad_full(self) -> torch.Tensor:
        g = torch.empty(self.padded_numel, device=self.full_param.device)
        g[self.numel:].zero_()   # padding
        return g

    def add_grad(self, slot: Slot, grad: torch.Tensor) -> None:
        if self.grad_full is None:
            self.grad_full = self._new_grad_full()
        region = self.grad_full[slot.offset:slot.offset + slot.numel]
        if self._written[slot.index]:
            region.add_(grad.reshape(-1))
        else:
            region.copy_(grad.reshape(-1))
            self._written[slot.index] = True

    def _complete_grad_full(self) -> torch.Tensor:
        """The full gradient with zeros where no parameter wrote this window (unused ones)."""
        if self.grad_full is None:
            self.grad_full = self._new_grad_full()
        for s in self.slots:
            if not self._written[s.index]:
                self.grad_full[s.offset:s.offset + s.numel].zero_()
                self._written[s.index] = True
        return self.grad_full

    def reduce_grads(self):
        """Launch this unit's gradient collective: all-reduce (stage 0) or reduce-scatter.

        Returns ``(work, shard_out)``; ``shard_out`` is added into ``grad_shard`` once
        the work completes (see :meth:`finish_reduce`).
        """
        grad_full = self._complete_grad_full()
        if not self.shard_optim:
            return C.all_reduce(grad_full, async_op=True), None
        out = torch.empty(self.shard_numel, device=grad_full.device)
        return C.reduce_scatter(out, grad_full, async_op=True), out

    def finish_reduce(self, shard_out: torch.Tensor | None) -> None:
        if shard_out is not None:
            if self._shard_written:
                self.grad_shard.add_(shard_out)
            else:
                self.grad_shard.copy_(shard_out)
                self._shard_written = True
        if self.shard_optim:   # the full gradient has been reduced into the shard: a new window
            self.grad_full = None
            self._written = [False] * len(self.slots)

    def owned_grad(self) -> torch.Tensor:
        """The gradient this rank applies: the full one (stage 0) or its shard."""
        if self.shard_optim:
            if not self._shard_written:
                self.grad_shard.zero_()
            return self.grad_shard
        return self._complete_grad_full()

    def reset_grads(self) -> None:
        """Start a new gradient window (after a step, or after a step that failed half-way)."""
        self._written = [False] * len(self.slots)
        self._shard_written = False
        if self.shard_grads:
            self.grad_full = None
        for s in self.slots:
            s.param.grad = None
        self.grads_ready = False

    # -- full values --------------------------------------------------------------------
    def full_master(self) -> torch.Tensor:
        """The whole unit's fp32 master values on every rank (a collective when sharded)."""
        if not self.shard_optim:
            return self.master.data.float()
        full = torch.empty(self.padded_numel, dtype=torch.float32, device=self.master.device)
        C.all_gather(full, self.master.data.float().contiguous())
        return full

    def load_full_master(self, full: torch.Tensor) -> None:
        """Set the unit's parameters from a full fp32 flat buffer (identical on every rank)."""
        with torch.no_grad():
            self.master.data.copy_(full if not self.shard_optim else self._my_shard(full))
            if self.shard_params:
                self.param_shard.copy_(self.master.data)
            else:
                self.full_param.copy_(full)
