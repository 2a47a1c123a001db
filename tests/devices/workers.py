"""Rank functions for the device tests (module level, so spawned processes can import them)."""

from __future__ import annotations

import time

import torch

from poplar.devices import Device
from poplar.engine.collectives import Comm

LATE_S = 0.3     # how long rank 1 computes before it joins the collective


def wait_for_a_late_rank(rank: int, world_size: int) -> dict:
    """Rank 1 computes (sleeps) before an all-reduce inside its step; rank 0 joins at once and waits for it."""
    device = Device()
    C = device.comm
    with device:
        C.barrier()                   # outside a step: no wait is counted
        t = torch.full((4,), float(rank + 1))
        with device.step():
            if rank == 1:
                time.sleep(LATE_S)
            C.all_reduce(t)
        sync = {"step_s": device.step_s, "wait_s": device.wait_s, "compute_s": device.compute_s,
                "sum": t.tolist()}
        # an asynchronous collective that both ranks compute beside: done by the time it is waited for
        C.barrier()
        with device.step():
            work = C.all_reduce(torch.ones(4), async_op=True)
            time.sleep(LATE_S)
            work.wait()
        overlapped = {"step_s": device.step_s, "wait_s": device.wait_s}
        # a plain Comm beside it is not the device's: rank 0's wait for the late rank goes unseen
        C.barrier()
        with device.step():
            if rank == 1:
                time.sleep(LATE_S)
            Comm().all_reduce(torch.ones(4))
        plain = {"step_s": device.step_s, "wait_s": device.wait_s}
    return {"sync": sync, "overlapped": overlapped, "plain_comm": plain}
