"""Ranks that issue a collective their peers size differently (spawned by test_flight)."""

import functools

import torch
import torch.distributed as dist

import poplar
from poplar.engine.collectives import Comm


def mismatched_broadcast(rank, world_size, plan_dict):
    """After an engine's set-up, the last rank broadcasts 10 floats where the others send 12."""
    model = torch.nn.Linear(3, 2)
    poplar.initialize(model, functools.partial(torch.optim.SGD, lr=0.1), poplar.Plan.from_dict(plan_dict))
    n = 10 if rank == world_size - 1 else 12
    Comm().broadcast(torch.zeros(n), src=0)
    dist.barrier()
    return n
