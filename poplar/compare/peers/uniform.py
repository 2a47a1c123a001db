"""What every peer's setup shares: a ZeRO stage, and the same micro-batch and accumulation on every rank.

Peers (DeepSpeed, torch's own systems) cannot give ranks different micro-batches, as
Poplar's plans do: every rank trains ``micro_batch_size * accum_steps`` samples a step.

>>> setup = UniformSetup(zero_stage=1, micro_batch_size=4, accum_steps=2, world_size=3)
>>> setup.global_batch_size, setup.local_batch_size(rank=2)
(24, 8)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class UniformSetup:
    """The batch shape of a peer (its setups extend it with what they need)."""

    zero_stage: int
    micro_batch_size: int
    accum_steps: int
    world_size: int

    name = "peer"

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.accum_steps * self.world_size

    def local_batch_size(self, rank: int) -> int:
        return self.micro_batch_size * self.accum_steps

    def micro_batches(self, local_batch: tuple[torch.Tensor, torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's ``(inputs, targets)`` as ``accum_steps`` micro-batches of ``micro_batch_size`` samples."""
        inputs, targets = local_batch
        m, a = self.micro_batch_size, self.accum_steps
        if inputs.shape[0] != m * a:
            raise ValueError(f"{self.name} takes {m * a} samples per rank ({a} micro-batches of {m}); "
                             f"got {inputs.shape[0]}")
        return list(zip(inputs.split(m), targets.split(m)))
