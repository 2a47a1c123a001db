"""fp16's dynamic loss scaling: the scale a loss is multiplied by before its backward, and how it moves.

fp16 holds numbers between about 6e-8 and 65,504: a gradient smaller than the first is
lost (underflows to zero), one larger than the second becomes infinite. The loss is
multiplied by the scale before the backward, so the gradients are computed that many
times larger (kept above the underflow), and divided by it before the update. A step
whose gradient overflowed (any element infinite or NaN, on any rank) is skipped and the
scale lowered; after ``growth_interval`` good steps in a row it is raised again.

:class:`LossScaler` moves the scale as ``torch.amp.GradScaler`` does (``init_scale``,
``growth_factor``, ``backoff_factor``, ``growth_interval``; the scale held in float32,
as GradScaler's tensor is), with DeepSpeed's dynamic loss scaler's additions:
``hysteresis`` (overflows tolerated, each still skipped, before the scale is lowered;
restored when the scale grows, or after every good step with ``consecutive_hysteresis``)
and ``min_scale`` (an overflow at the minimum stops the run: nothing smaller can help).
With the defaults (hysteresis 1) it is GradScaler's sequence of scales, step for step
(``tests/engine/test_loss_scale.py``). ``dynamic=False`` keeps ``init_scale`` for good
(DeepSpeed's static ``loss_scale``).

>>> s = LossScaler(LossScaleConfig(init_scale=8.0, growth_interval=2))
>>> s.update(overflow=True), s.scale
(True, 4.0)
>>> [s.update(overflow=False) for _ in range(2)], s.scale
([False, True], 8.0)
"""

from __future__ import annotations

import struct

from pydantic import BaseModel, ConfigDict, Field, model_validator


class LossScaleConfig(BaseModel):
    """fp16's loss scaling (``torch.amp.GradScaler``'s names, DeepSpeed's ``hysteresis`` and ``min_scale``)."""

    model_config = ConfigDict(extra="forbid")

    init_scale: float = Field(2.0 ** 16, gt=0, description="the first scale (the static one when not dynamic)")
    growth_factor: float = Field(2.0, gt=1, description="the scale is multiplied by this after growth_interval "
                                 "good steps in a row")
    backoff_factor: float = Field(0.5, gt=0, lt=1, description="the scale is multiplied by this on an overflow")
    growth_interval: int = Field(2000, ge=1, description="good steps in a row before the scale grows")
    hysteresis: int = Field(1, ge=1, description="overflows (each step skipped) before the scale is lowered; "
                            "1 lowers it at every overflow, as GradScaler")
    consecutive_hysteresis: bool = Field(False, description="restore the hysteresis after every good step "
                                         "(else only when the scale grows)")
    min_scale: float = Field(1.0, gt=0, description="the scale is not lowered below this; an overflow at it stops "
                             "the run")
    dynamic: bool = Field(True, description="False: keep init_scale for good (an overflow skips the step)")

    @model_validator(mode="after")
    def _min_below_init(self) -> LossScaleConfig:
        if self.dynamic and self.min_scale > self.init_scale:
            raise ValueError(f"min_scale {self.min_scale} is above init_scale {self.init_scale}: lower min_scale")
        return self


def _f32(x: float) -> float:
    """``x`` rounded to float32, as GradScaler holds its scale."""
    return struct.unpack("f", struct.pack("f", x))[0] if abs(x) < 3.4e38 else float("inf")


class LossScaler:
    """The current scale and what moves it; the same on every rank (each step's overflow verdict is global)."""

    def __init__(self, config: LossScaleConfig):
        self.config = config
        self.scale = _f32(config.init_scale)
        self.growth_tracker = 0                  # good steps in a row since the scale last moved
        self.hysteresis_left = config.hysteresis

    @property
    def inv_scale(self) -> float:
        """What a scaled gradient is multiplied by to unscale it (float32, as GradScaler's)."""
        return _f32(1.0 / self.scale)

    @property
    def at_minimum(self) -> bool:
        """An overflow now would lower the scale below ``min_scale`` (or cannot lower it: static)."""
        c = self.config
        return not c.dynamic or (self.hysteresis_left <= 1 and self.scale <= c.min_scale)

    def update(self, overflow: bool) -> bool:
        """After a step: ``overflow`` (it was skipped) lowers the scale, a run of good ones raises it. Whether
        the scale changed."""
        c = self.config
        if not c.dynamic:
            return False
        before = self.scale
        if overflow:
            self.growth_tracker = 0
            if self.hysteresis_left > 1:
                self.hysteresis_left -= 1
            else:
                self.scale = max(_f32(self.scale * c.backoff_factor), c.min_scale)
            return self.scale != before
        self.growth_tracker += 1
        if c.consecutive_hysteresis:
            self.hysteresis_left = c.hysteresis
        if self.growth_tracker == c.growth_interval:
            grown = _f32(self.scale * c.growth_factor)
            if grown != float("inf"):
                self.scale = grown
            self.growth_tracker = 0
            self.hysteresis_left = c.hysteresis
        return self.scale != before

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker, "hysteresis_left": self.hysteresis_left}

    def load_state_dict(self, state: dict) -> None:
        self.scale = _f32(float(state["scale"]))
        self.growth_tracker = int(state["growth_tracker"])
        self.hysteresis_left = int(state["hysteresis_left"])
