"""Functions for tests/progress/test_relay.py, importable by spawned processes."""

import contextlib
import io

import torch.distributed as dist
from rich.console import Console

from poplar.progress import Progress
from poplar.progress.relay import relayed

KINDS = ["a100", "t4", "v100"]   # rank r reports the kind KINDS[r], as the first rank of each kind does


def report_twice(rank: int, world_size: int) -> list[str] | None:
    """Two waits one after the other, every rank reporting its kind's stages 0 and 1 (rank 0 shows them): what
    rank 0's display printed in each, as in a log."""
    printed = []
    for wait in ("first", "second"):
        log = Console(file=io.StringIO(), width=200)   # a log, as rich takes a pipe
        with Progress(log, f"{wait}: profiling") if rank == 0 else contextlib.nullcontext() as shown:
            with relayed(shown) as events:
                for stage in (0, 1):
                    events.put((KINDS[rank], stage, "memory"))
                    events.put((KINDS[rank], stage, "done"))
                dist.barrier()   # every rank has reported: rank 0 leaves with every event shown
        printed.append(log.file.getvalue())
    return printed if rank == 0 else None
