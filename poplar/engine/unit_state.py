"""A unit's explicit states (where its parameters are, where its gradient is) and where each parameter lies in
its flat buffer: what :class:`~poplar.engine.flat_unit.FlatUnit` moves between through its named transitions."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch
from torch import nn


class ParamState(Enum):
    SHARDED = "sharded"        # only this rank's shard exists (ZeRO-3 at rest)
    GATHERING = "gathering"    # an all-gather into full_param is in flight
    UNSHARDED = "unsharded"    # full_param holds every parameter


class GradState(Enum):
    """Where the unit's gradient of the current micro-step is."""
    IDLE = "idle"                  # no micro-step under way (between steps)
    ACCUMULATING = "accumulating"  # backward is adding its parameters' gradients
    READY = "ready"                # every parameter's gradient of the micro-step is in
    REDUCING = "reducing"          # its gradient collective is in flight
    REDUCED = "reduced"            # reduced across ranks (into the shard where the stage shards it)


@dataclass(frozen=True)
class Slot:
    """Where one parameter lives in its unit's flat buffer."""
    param: nn.Parameter
    index: int
    offset: int
    numel: int
    shape: torch.Size
