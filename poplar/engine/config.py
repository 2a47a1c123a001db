"""The engine's options (:class:`EngineConfig`) and the types of what a user hands it."""

from __future__ import annotations

from typing import Any, Callable, Literal, Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from poplar.engine.loss_scale import LossScaleConfig
from poplar.precision import Precision, torch_dtype

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
LossFn = Callable[[nn.Module, Any], torch.Tensor]

class EngineConfig(BaseModel):
    """Options of :func:`~poplar.engine.engine.initialize`; every field has a sensible default.

    >>> EngineConfig(clip_grad_norm=1.0).max_inflight_reduces
    2
    """

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    clip_grad_norm: float | None = Field(None, gt=0, description="max global L2 norm of the gradient; None: off")
    mixed_precision: Precision = Field(
        "fp32", description="'bf16' or 'fp16': compute in bf16 or fp16, keep fp32 master weights and fp32 gradient "
        "reduction (fp16 with dynamic loss scaling: loss_scale); 'fp32' (or None, 'none'): no mixed precision "
        "(poplar.precision)")
    loss_scale: LossScaleConfig = Field(default_factory=LossScaleConfig,
                                        description="fp16's loss scaling (poplar.engine.loss_scale); unused otherwise")
    unit_classes: Sequence[type | str] | None = Field(
        None, description="module classes (or class names) that become units; default: ModuleList entries")
    unit_numel: int = Field(1_000_000, gt=0, description="other modules with this many parameters become units")
    prefetch: bool = Field(True, description="ZeRO-3: all-gather the next unit while this one computes")
    check_batches: bool = Field(True, description="verify every rank's local batch against the plan each step")
    max_inflight_reduces: int = Field(2, ge=1, description="ZeRO-2/3: gradient buckets in flight before the "
                                      "oldest is waited for and its full gradient freed")
    on_nonfinite: Literal["raise", "skip"] = Field(
        "raise", description="a NaN or infinite loss or gradient: 'raise' NonFiniteError (naming the step and the "
        "ranks), or 'skip' the update (parameters and optimizer state untouched; engine.skipped_steps counts them). "
        "fp16 with a dynamic loss scale skips such a step and lowers the scale whatever this says, and raises at "
        "the minimum scale")

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the model computes in (its parameters, buffers and floating inputs)."""
        return torch_dtype(self.mixed_precision)
