"""The collectives the engine uses, in one place: all-reduce, reduce-scatter, all-gather.

All take flat, contiguous tensors whose length is a multiple of the world size (units
are padded for that), so they map onto the even-sized collectives every backend has.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# torch 2.13 renamed the *_tensor collectives; keep working on older releases too.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_reduce(tensor: torch.Tensor, op=dist.ReduceOp.SUM, async_op: bool = False):
    return dist.all_reduce(tensor, op=op, async_op=async_op)


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, async_op: bool = False):
    """Sum ``input`` (full, padded) over ranks; this rank receives its ``output`` shard."""
    return _reduce_scatter(output, input, op=dist.ReduceOp.SUM, async_op=async_op)


def all_gather(output: torch.Tensor, input: torch.Tensor, async_op: bool = False):
    """Concatenate every rank's ``input`` shard into ``output`` (full, padded)."""
    return _all_gather(output, input, async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int = 0):
    return dist.broadcast(tensor, src=src)


def agree(values: list[int], device: torch.device) -> tuple[list[int], list[int]]:
    """Element-wise (min, max) of integer ``values`` across ranks: one small all-reduce."""
    t = torch.tensor(values + [-v for v in values], dtype=torch.int64, device=device)
    all_reduce(t, op=dist.ReduceOp.MAX)
    n = len(values)
    return [-int(v) for v in t[n:].tolist()], [int(v) for v in t[:n].tolist()]
