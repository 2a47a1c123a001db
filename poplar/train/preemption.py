"""SIGTERM (what Slurm and Kubernetes send before they stop a job): finish the step, checkpoint, exit 0."""

from __future__ import annotations

import os
import signal
import sys
import threading

import torch


class Preemption:
    """A first SIGTERM asks for a checkpoint at the end of the step; a second stops now.

    The signal may reach the ranks in different steps, so :meth:`agreed` asks every rank
    after each step (one one-number all-reduce) and all stop after the same one.
    """

    def __init__(self, comm, tensor_device: torch.device):
        self.comm, self.tensor_device = comm, tensor_device
        self.requested = False
        self._previous = None

    def __enter__(self) -> Preemption:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def _on_sigterm(self, signum, frame) -> None:
        if self.requested:
            print("poplar: a second SIGTERM: stopping now, without a checkpoint", file=sys.stderr, flush=True)
            os._exit(128 + signal.SIGTERM)
        self.requested = True

    def agreed(self) -> bool:
        """True on every rank when SIGTERM reached any of them (every rank calls this after each step)."""
        flag = torch.tensor([1.0 if self.requested else 0.0], device=self.tensor_device)
        self.comm.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item() > 0)
