"""What the engine's model state holds in memory: bytes by kind, and the steady level of a step.

:class:`ModelStateMemory` measures the units' and the optimizer's tensors, and the frozen
parameters (LoRA's base weights: no unit holds them, every rank keeps them whole in the
compute precision, with no gradient, no master and no optimizer state); what a step
allocates on the way it reads from the schedule the engine's parts publish (the
gradient buckets alive at once, :attr:`GradReducer.full_buckets_alive`; the parameters
gathered at once, :attr:`Unsharder.gathered_numel`), so the two cannot drift apart.
:class:`~poplar.engine.engine.Engine` exposes it as ``memory_report``,
``model_state_bytes`` and ``held_state``.
"""

from __future__ import annotations

from typing import Iterable

import torch

from poplar.engine.flat_unit import FlatUnit
from poplar.engine.grad_reduce import GradReducer
from poplar.engine.unshard import Unsharder


def _storage_bytes(tensors: Iterable[torch.Tensor | None], seen: set[int]) -> int:
    """Bytes of the storages behind ``tensors``, each counted once (``seen`` holds those already counted)."""
    total = 0
    for t in tensors:
        if t is None:
            continue
        st = t.untyped_storage()
        if st.nbytes() == 0 or st._cdata in seen:
            continue
        seen.add(st._cdata)
        total += st.nbytes()
    return total


class ModelStateMemory:
    """The bytes of the units' buffers and the optimizer's states, now and through a step."""

    def __init__(self, units: list[FlatUnit], optimizer: torch.optim.Optimizer, compute_dtype: torch.dtype,
                 reducer: GradReducer, unsharder: Unsharder | None, frozen: list[torch.Tensor] = ()):
        self.units, self.optimizer, self.compute_dtype = units, optimizer, compute_dtype
        self.reducer, self.unsharder = reducer, unsharder
        self.frozen = list(frozen)    # the parameters no unit holds (their storage read at each count)

    def report(self) -> dict[str, int]:
        """Bytes this rank holds now, by kind, measured from the tensors themselves.

        ``parameters``: the model's parameter storage (full or shard); ``master``: fp32
        master weights not shared with it; ``gradients``: gradient accumulators;
        ``optimizer``: optimizer states; ``frozen``: the frozen parameters, weights alone. Storages shared by views
        are counted once.
        """
        seen: set[int] = set()
        units = self.units
        report = {
            "parameters": _storage_bytes([u.full_param for u in units] + [u.param_shard for u in units], seen),
            "master": _storage_bytes((u.master.data for u in units), seen),
            "gradients": _storage_bytes([u.grad_full for u in units] + [u.grad_shard for u in units], seen),
            "optimizer": _storage_bytes((t for st in self.optimizer.state.values() for t in st.values()
                                         if isinstance(t, torch.Tensor) and t.dim() > 0), seen),
            "frozen": _storage_bytes(self.frozen, seen),
        }
        report["total"] = sum(report.values())
        return report

    def model_state_bytes(self) -> int:
        """Bytes of model state this rank holds through a micro-step, at their steady level.

        What the tensors hold now (:meth:`report`), plus what a step allocates on the way:
        the full gradient accumulators that live through the step (stages 0-1) before
        their first use, or the full-size gradient buckets alive at once (stages 2-3); and
        in ZeRO-3 the parameters gathered at once instead of whatever is gathered now.
        """
        units = self.units
        total = self.report()["total"]
        buckets = self.reducer.full_buckets_alive
        if buckets is None:
            total += sum(4 * u.padded_numel for u in units if u.grad_full is None)
        else:
            total += 4 * max(u.padded_numel for u in units) * buckets
        if self.unsharder is not None:   # the allowance, not whatever happens to be gathered right now
            total -= sum(u.full_param.untyped_storage().nbytes() for u in units)
            total += torch.finfo(self.compute_dtype).bits // 8 * self.unsharder.gathered_numel
        return total

    def held_state(self) -> tuple[int, set[int]]:
        """:meth:`model_state_bytes` and the storages it counts.

        The storages are the engine's own buffers that autograd saves by reference
        (``untyped_storage()._cdata``), so a device's accounting of saved activations skips them.
        """
        tensors = [u.full_param for u in self.units] + [u.master.data for u in self.units] + self.frozen
        return self.model_state_bytes(), {t.untyped_storage()._cdata for t in tensors}
