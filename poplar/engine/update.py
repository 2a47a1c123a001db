"""A step's update: the gradient unscaled (fp16), its global norm, the verdict on it, clipping, the optimizer.

The verdict is global: the norm is the whole gradient's, the same bits on every rank,
so every rank applies, skips or raises alike, with no collective of its own. A
non-finite norm (a NaN or infinite loss or gradient on any rank) leaves the update out:

- fp16 with a dynamic loss scale: it is an overflow, the normal way the scale finds its
  level: the step is skipped and the scale lowered (:mod:`poplar.engine.loss_scale`); at
  the minimum scale the run stops, naming the step;
- otherwise, as ``on_nonfinite`` says: :class:`NonFiniteError`, or the step skipped.
"""

from __future__ import annotations

import math

import torch

from poplar.engine.collectives import Comm
from poplar.engine.config import EngineConfig
from poplar.engine.flat_unit import FlatUnit
from poplar.engine.layout import ShardLayout
from poplar.engine.loss_scale import LossScaler
from poplar.stages import ZeroStage


class NonFiniteError(FloatingPointError):
    """A step's loss or gradient was NaN or infinite (``on_nonfinite='raise'``, or fp16 at its minimum loss
    scale); the update was not applied."""

    def __init__(self, message: str, step: int, ranks: list[int]):
        super().__init__(message)
        self.step, self.ranks = step, ranks


class UpdateOutOfMemoryError(torch.OutOfMemoryError):
    """Out of memory inside the optimizer's update: some ranks may have applied it, so the step cannot be re-run."""


class Update:
    """Applies (or leaves out) each step's update to the units' fp32 masters."""

    def __init__(self, units: list[FlatUnit], optimizer: torch.optim.Optimizer, stage: ZeroStage,
                 layout: ShardLayout, comm: Comm, config: EngineConfig, device: torch.device, mixed: bool = False):
        self.units, self.optimizer, self.stage, self.layout = units, optimizer, stage, layout
        # the norm's squares summed over the world: where this rank shards, or where another group's ranks do
        self.world_norm = stage.shards_optimizer or mixed
        self.comm, self.config, self.device = comm, config, device
        self.scaler = LossScaler(config.loss_scale) if config.mixed_precision == "fp16" else None
        self.last_grad_norm: float | None = None

    @property
    def loss_scale(self) -> float:
        """What each micro-batch's loss is multiplied by before its backward (1 but in fp16)."""
        return self.scaler.scale if self.scaler is not None else 1.0

    def scaled(self, loss: torch.Tensor, weight: float) -> torch.Tensor:
        """A micro-batch's mean ``loss`` weighted by its share of the global batch, and scaled (fp16: in fp32,
        where the product cannot overflow)."""
        if self.scaler is None:
            return loss * weight
        return loss.float() * (weight * self.scaler.scale)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """fp16's loss scale as a checkpoint holds it (nothing in bf16 and fp32)."""
        if self.scaler is None:
            return {}
        s = self.scaler.state_dict()
        return {"loss_scale": torch.tensor([s["scale"], s["growth_tracker"], s["hysteresis_left"]],
                                           dtype=torch.float64)}

    def load_state_dict(self, state: dict) -> None:
        if self.scaler is not None and "loss_scale" in state:
            scale, tracker, hysteresis = state["loss_scale"].tolist()
            self.scaler.load_state_dict({"scale": scale, "growth_tracker": tracker, "hysteresis_left": hysteresis})

    @torch.no_grad()
    def apply(self, step: int, local_finite: bool) -> bool:
        """Step ``step``'s update (its gradients reduced); whether it was applied (False: skipped).

        ``local_finite``: whether this rank's loss was finite (to name the ranks whose was not).
        """
        grads = [u.owned_grad() for u in self.units]
        if self.scaler is not None:
            torch._foreach_mul_(grads, self.scaler.inv_scale)
        # a non-finite loss on any rank makes the (global) gradient norm non-finite too
        norm = self.last_grad_norm = self._grad_norm(grads)
        if not math.isfinite(norm):
            self._nonfinite(step, local_finite)
            return False
        if self.config.clip_grad_norm is not None:
            coef = self.config.clip_grad_norm / (norm + 1e-6)
            if coef < 1.0:
                torch._foreach_mul_(grads, coef)
        for unit, g in zip(self.units, grads):
            unit.attach_grad(g)
        try:
            self.optimizer.step()
            works = [w for w in (u.refresh_params_after_step() for u in self.units) if w is not None]
            for unit in self.units:   # the next step starts a new gradient window
                unit.attach_grad(None)
            for w in works:
                w.wait()
        except torch.OutOfMemoryError as e:   # ranks may be apart now: recovery must not re-run the step
            raise UpdateOutOfMemoryError(str(e)) from e
        if self.scaler is not None:
            self.scaler.update(overflow=False)
        return True

    def _grad_norm(self, grads: list[torch.Tensor]) -> float:
        """The global L2 norm of the gradient (NaN or infinity when any part of it is)."""
        if self.world_norm and not self.stage.shards_optimizer:
            # a replicating group beside sharding ones: each of its ranks adds its slice's squares, so every rank
            # joins the one sum below and each group's copy counts once, as a sharding group's does
            grads = [u.owned_slice(g) for u, g in zip(self.units, grads)]
        # one pass over each gradient, no temporary of its size (as clip_grad_norm_ does)
        norms = torch._foreach_norm(grads) if grads else [torch.zeros((), device=self.device)]
        sq = torch.linalg.vector_norm(torch.stack(norms).float()).square()
        if self.world_norm:   # each rank holds a slice of its group's copy: the squares add up across ranks
            self.comm.all_reduce(sq)      # over the world (each group's copy once): the same bits everywhere
            sq /= self.layout.replicas
        return float(sq.sqrt())

    def _nonfinite(self, step: int, local_finite: bool) -> None:
        """Every rank alike (the norm is global): an overflow (fp16), or raise or skip (``on_nonfinite``)."""
        for unit in self.units:
            unit.attach_grad(None)
        scaler = self.scaler
        if scaler is not None and scaler.config.dynamic and not scaler.at_minimum:
            scaler.update(overflow=True)
            return
        ranks = self._nonfinite_ranks(local_finite)
        what = (f"the loss is non-finite on rank{'s' * (len(ranks) > 1)} {', '.join(map(str, ranks))}" if ranks
                else f"the gradient norm is {self.last_grad_norm} (every rank's loss is finite)")
        if scaler is not None and scaler.config.dynamic:
            raise NonFiniteError(
                f"step {step}: {what} at the minimum fp16 loss scale ({scaler.scale:g}); the update was not "
                "applied. The model overflows fp16 at every scale: lower the learning rate, clip the gradient, "
                "lower loss_scale.min_scale, or train in bf16 or fp32", step, ranks)
        if self.config.on_nonfinite == "skip":
            return
        raise NonFiniteError(f"step {step}: {what}; the update was not applied. Lower the learning rate or clip "
                             "the gradient, or set on_nonfinite='skip' to leave such steps out", step, ranks)

    def _nonfinite_ranks(self, local_finite: bool) -> list[int]:
        """The ranks whose loss was not finite (a collective: every rank calls it alike)."""
        flags = torch.zeros(self.comm.world_size, dtype=torch.float32, device=self.device)
        self.comm.all_gather(flags, torch.tensor([0.0 if local_finite else 1.0], device=self.device))
        return [r for r in range(self.comm.world_size) if flags[r] > 0]
