"""torch's own data parallelism as peers: DDP, ZeroRedundancyOptimizer + DDP, FSDP2.

One :class:`TorchSetup` per ZeRO stage, naming what torch itself offers for what that
stage shards:

====== ============================================== ==========================
stage  torch                                          shards
====== ============================================== ==========================
0      ``DistributedDataParallel``                    nothing (replicas)
1      ``ZeroRedundancyOptimizer`` + DDP              optimizer states
2      FSDP2 ``fully_shard(reshard_after_forward=False)`` + gradients
3      FSDP2 ``fully_shard(reshard_after_forward=True)``  + parameters
====== ============================================== ==========================

A setup is a small picklable value built in the parent; every rank of a launch calls
``setup.start(workload)`` on its joined process group and steps the :class:`TorchPeer`
with ``train_batch(local_batch)``, one optimizer step, as DeepSpeed's peer
(:mod:`poplar.compare.peers.deepspeed`) is stepped. These peers run on the real clock (the
engine benchmark, ``bench/bench_engine.py``); they are not routed through a device.

Accumulation follows each system's own semantics: DDP and ZeroRedundancyOptimizer
skip the gradient all-reduce (``no_sync``) on all but the last micro-step; FSDP2
reduce-scatters on every micro-step, as ZeRO-2/3 do. The loss is divided by the
micro-steps, so every system takes the same optimizer step.

>>> TorchSetup(zero_stage=2, micro_batch_size=4, accum_steps=2, world_size=2).name
'FSDP2 reshard_after_forward=False'
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass

import torch
from torch import nn

from poplar.compare.peers.deepspeed import LR
from poplar.compare.peers.uniform import UniformSetup
from poplar.models.workload import Workload

NAMES = {0: "torch DDP", 1: "torch ZeroRedundancyOptimizer + DDP",
         2: "FSDP2 reshard_after_forward=False", 3: "FSDP2 reshard_after_forward=True"}


@dataclass(frozen=True)
class TorchSetup(UniformSetup):
    """Which torch system trains (by the ZeRO stage it stands for), and every rank's micro-batch and accumulation."""

    lr: float = LR
    seed: int = 0               # the model's initial weights (Workload.build)

    def __post_init__(self):
        if self.zero_stage not in NAMES:
            raise ValueError(f"zero_stage = {self.zero_stage}: torch's peers stand for stages 0-3")

    @property
    def name(self) -> str:
        return NAMES[self.zero_stage]

    def config(self) -> dict:
        return asdict(self)

    def start(self, workload: Workload, comm=None) -> TorchPeer:
        """The peer on this rank. Its collectives are torch's own, issued from C++ (DDP's buckets, FSDP2's
        hooks), so no device can observe or pace them: ``comm``, if given, must observe nothing."""
        if getattr(comm, "observer", None) is not None:
            raise ValueError(f"{self.name}: torch issues its collectives from C++, where a device cannot see them; "
                             "measure it on the host's clock (no device comm), as bench/bench_engine.py does")
        return TorchPeer(self, workload)


def _layers(model: nn.Module) -> list[nn.Module]:
    """The model's repeated layers (every ``nn.ModuleList``'s entries): FSDP2 shards each as one group."""
    return [layer for m in model.modules() if isinstance(m, nn.ModuleList) for layer in m]


def _wrap(setup: TorchSetup, model: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer, object]:
    """The model as the system runs it, its optimizer, and its ``no_sync`` (None: it syncs every micro-step)."""
    if setup.zero_stage <= 1:
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(model)
        if setup.zero_stage == 0:
            return ddp, torch.optim.AdamW(ddp.parameters(), lr=setup.lr), ddp.no_sync
        from torch.distributed.optim import ZeroRedundancyOptimizer

        optimizer = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=setup.lr)
        return ddp, optimizer, ddp.no_sync
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (setup.world_size,))
    reshard = setup.zero_stage == 3
    for layer in _layers(model):
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    return model, torch.optim.AdamW(model.parameters(), lr=setup.lr), None


class TorchPeer:
    """A torch system training this rank's share of every global batch."""

    def __init__(self, setup: TorchSetup, workload: Workload):
        self.setup, self.workload = setup, workload
        self.model, self.optimizer, self._no_sync = _wrap(setup, workload.build(seed=setup.seed))

    def train_batch(self, local_batch: tuple[torch.Tensor, torch.Tensor]) -> float:
        """One optimizer step on this rank's ``(inputs, targets)``; returns this rank's mean loss."""
        micro_batches = self.setup.micro_batches(local_batch)
        a = len(micro_batches)
        total = torch.zeros(())
        for i, micro_batch in enumerate(micro_batches):
            skip_sync = self._no_sync is not None and i < a - 1
            with self._no_sync() if skip_sync else contextlib.nullcontext():
                loss = self.workload.loss(self.model, micro_batch) / a
                loss.backward()
            total += loss.detach()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(total)

    def close(self) -> None:
        """Nothing to release: the wrappers go with the model."""
