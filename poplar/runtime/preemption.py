"""SIGTERM (what Slurm and Kubernetes send before they stop a job): finish the step, checkpoint, exit 0."""

from __future__ import annotations

import os
import signal
import sys

import torch

from poplar.processes.sigterm import SigtermCounter


class Preemption:
    """A first SIGTERM asks for a checkpoint at the end of the step; a second stops now.

    The signal may reach the ranks in different steps, so :meth:`agreed` asks every rank
    after each step (one one-number all-reduce) and all stop after the same one.
    """

    def __init__(self, comm, tensor_device: torch.device):
        self.comm, self.tensor_device = comm, tensor_device
        self.requested = False
        self._counter = SigtermCounter(self._on_sigterm)

    def __enter__(self) -> Preemption:
        self._counter.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._counter.__exit__(*exc)

    def _on_sigterm(self, count: int) -> None:
        if count > 1:
            print("poplar: a second SIGTERM: stopping now, without a checkpoint", file=sys.stderr, flush=True)
            os._exit(128 + signal.SIGTERM)
        self.requested = True

    def agreed(self) -> bool:
        """True on every rank when SIGTERM reached any of them (every rank calls this after each step)."""
        flag = torch.tensor([1.0 if self.requested else 0.0], device=self.tensor_device)
        self.comm.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item() > 0)
