"""What a profile measures and how: one small, validated value (:class:`ProfileOptions`).

>>> ProfileOptions(stages=[2, 0], precision="none").stages, ProfileOptions(precision="none").precision
((0, 2), 'fp32')
"""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, field_validator

from poplar.precision import Precision
from poplar.stages import parse_stages


TIMEOUT_PER_STAGE_S = 450   # a stage of an emulated cluster whose ranks each have a core to themselves


class ProfileOptions(BaseModel):
    """How :func:`~poplar.profile.profiler.profile_cluster` measures; every field has a sensible default."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    stages: tuple[int, ...] = Field((0, 1, 2, 3), description="ZeRO stages to profile")
    n_points: int = Field(6, ge=1, description="micro-batch sizes timed per stage, 1 to the largest that fits")
    warmup: int = Field(1, ge=0, description="untimed rounds before the timed ones")
    repeats: int | None = Field(None, ge=1, description="timed rounds, the median counts; None: the device's "
                                "default (3 on a GPU, 1 on an emulated device, whose time is deterministic)")
    max_micro_batch: int = Field(256, ge=1, description="largest micro-batch the memory search tries (a plan "
                                 "never needs more than its global batch)")
    # ``dtype``: the name earlier callers gave it
    precision: Precision = Field("fp32", validation_alias=AliasChoices("precision", "dtype"),
                                 description="the compute of the training to plan: fp32, or bf16 (the engine's bf16 "
                                 "mixed precision; time and memory differ from fp32's)")
    use_cache: bool = Field(True, description="read profiles cached on disk (measured ones are written anyway)")
    cache_dir: Path | None = Field(None, description="where profiles are cached; None: default_cache_dir()")
    timeout_s: float | None = Field(None, gt=0, description="how long spawned emulated ranks may take; None: "
                                    "TIMEOUT_PER_STAGE_S a stage, times the ranks per core where they share cores")

    def spawn_timeout_s(self, world_size: int) -> float:
        """How long ``world_size`` spawned ranks may take to profile ``stages`` on this host."""
        if self.timeout_s is not None:
            return self.timeout_s
        sharing = max(1.0, world_size / (os.cpu_count() or 1))
        return TIMEOUT_PER_STAGE_S * max(1, len(self.stages)) * sharing

    @field_validator("stages", mode="before")
    @classmethod
    def _known_stages(cls, value):
        return tuple(parse_stages(value))   # the one check of a stage list
