"""ZeRO-3 unsharding: the hooks that gather a unit's parameters when it computes, and prefetching.

A unit is gathered in a forward pre-hook and freed in the forward post-hook (the root
unit stays gathered until its backward, which comes right away). When the gradient
reaches the unit's outputs (``register_multi_grad_hook``) it is gathered again, and
freed once all its parameters have their gradients (see :mod:`poplar.engine.grad_reduce`).
With prefetching, the next unit in the forward order recorded on the first pass
(reversed for backward) is gathered asynchronously while the current one computes.

A forward that re-runs inside the backward pass (activation checkpointing) finds the
unit gathered and leaves it so until its gradients are in.
"""

from __future__ import annotations

import torch
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten
from torch.utils.hooks import RemovableHandle

from poplar.engine.flat_unit import FlatUnit


class Unsharder:
    """Gathers each unit's parameters for its forward and backward, and frees them after."""

    def __init__(self, units: list[FlatUnit], prefetch: bool):
        self.units, self.prefetch = units, prefetch
        self._forward_order: list[int] = []   # unit indices, as the first forward pass ran them

    @property
    def gathered_numel(self) -> int:
        """The most parameters gathered at once: the root, the unit computing and the one prefetched (and, where
        shards differ in size, the buffers their gathers in flight go through)."""
        largest = max(u.padded_numel + u.gather_buffer_numel for u in self.units)
        return self.units[0].padded_numel + (2 if self.prefetch else 1) * largest

    def register_hooks(self) -> list[RemovableHandle]:
        handles = []
        for unit in self.units:
            handles.append(unit.module.register_forward_pre_hook(self._pre_forward(unit)))
            handles.append(unit.module.register_forward_hook(self._post_forward(unit)))
        return handles

    def begin_micro_step(self) -> None:
        self.units[0].unshard()   # whatever loss_fn calls first, the root's parameters are there

    def end_micro_step(self) -> None:
        for unit in self.units:
            unit.end_micro_step()

    def _prefetch(self, unit: FlatUnit, direction: int) -> None:
        if not self.prefetch or unit.index not in self._forward_order:
            return
        pos = self._forward_order.index(unit.index) + direction
        if 0 <= pos < len(self._forward_order):
            self.units[self._forward_order[pos]].unshard(async_op=True)

    def _pre_forward(self, unit: FlatUnit):
        def hook(module, args):
            if unit.in_backward:   # activation checkpointing re-running the forward: already gathered
                unit.unshard()
                return
            if unit.index not in self._forward_order:
                self._forward_order.append(unit.index)
            unit.unshard()
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
                    unit.pre_backward()
                    self._prefetch(unit, -1)
                register_multi_grad_hook(tensors, pre_backward, mode="any")
            return output
        return hook
