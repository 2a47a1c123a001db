"""Functions for tests/processes/test_spawn.py, importable by spawned processes."""

import atexit
import os
import time

import torch
import torch.distributed as dist


def rank_sum(rank, world_size):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return rank, float(t)


def fail_on_rank_1(rank, world_size):
    if rank == 1:
        raise KeyError("rank one is broken")
    dist.barrier()
    return rank


def hang_on_rank_0(rank, world_size):
    if rank == 0:
        time.sleep(3600)
    return rank


def abort_at_exit(rank, world_size):
    atexit.register(os.abort)   # as gloo's teardown sometimes does, after the work is done
    return rank * 2
