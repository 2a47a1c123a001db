"""Process-group set-up: the backend chosen from the hardware, a timeout on every wait."""

from __future__ import annotations

import gc
import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = float(os.environ.get("POPLAR_TIMEOUT_S", "600"))


@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    backend: str
    device: torch.device


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))


def choose_backend() -> str:
    """NCCL when this rank has its own CUDA device, gloo otherwise."""
    if torch.cuda.is_available() and torch.cuda.device_count() > _local_rank() and dist.is_nccl_available():
        return "nccl"
    return "gloo"


def context() -> DistContext:
    """The current process group as a :class:`DistContext` (it must be initialised)."""
    backend = dist.get_backend()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    return DistContext(dist.get_rank(), dist.get_world_size(), backend, device)


def init_distributed(timeout_s: float | None = None, backend: str | None = None) -> DistContext:
    """Join the process group described by torchrun's environment variables.

    Reuses an existing default group. Without ``WORLD_SIZE`` in the environment it makes
    a one-rank group, so the same code runs as a plain ``python`` script.
    """
    if dist.is_initialized():
        return context()
    backend = backend or choose_backend()
    timeout = timedelta(seconds=timeout_s or DEFAULT_TIMEOUT_S)
    if backend == "nccl":
        torch.cuda.set_device(_local_rank())
    if "WORLD_SIZE" in os.environ and can_rebuild():
        _join(backend, timeout, generation=0)
    elif "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, timeout=timeout)
    else:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                                timeout=timeout)
    return context()


def can_rebuild() -> bool:
    """Whether the group's store outlives every rank (torchrun's agent's, or poplar's launcher's): then a
    group whose collectives broke can be made again (:func:`rebuild_process_group`)."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and "MASTER_PORT" in os.environ


def _join(backend: str, timeout: timedelta, generation: int) -> None:
    # The agent's store outlives a restart of the group, and with it the previous
    # attempt's addresses under the same keys (gloo would connect to dead peers): each
    # attempt, and each rebuild within one, keeps its keys apart.
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(backend, store=dist.PrefixStore(f"poplar/attempt-{attempt}/group-{generation}", store),
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                            timeout=timeout)


def rebuild_process_group(generation: int, timeout_s: float | None = None) -> DistContext:
    """Leave the current group without waiting for its collectives, and join generation ``generation`` of it.

    Every rank calls this with the same ``generation`` after a failure that left
    collectives unmatched (one rank out of memory mid-step), once none of its own is in
    flight (gloo aborts a process that leaves a group with work in flight). The first to
    leave breaks the others' pending collectives (gloo closes its connections).
    """
    if not can_rebuild():
        raise RuntimeError("the process group cannot be rebuilt: its store is rank 0's (launch with torchrun or "
                           "poplar's launcher, whose store outlives the ranks)")
    backend = dist.get_backend() if dist.is_initialized() else choose_backend()
    if dist.is_initialized():
        dist.destroy_process_group()   # with nothing in flight (the caller waited): its connections close
        gc.collect()
    _join(backend, timedelta(seconds=timeout_s or DEFAULT_TIMEOUT_S), generation)
    return context()


def shutdown() -> None:
    """Leave the process group.

    The barrier first: without it gloo ranks often abort at exit. Then a garbage
    collection, so that process-group objects kept alive only by reference cycles are
    torn down now, while the interpreter is whole, rather than during its finalisation.
    """
    if dist.is_initialized():
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()
            gc.collect()
