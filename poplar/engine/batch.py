"""A rank's local batch: counting its samples, checking them against the plan, cutting micro-batches.

A batch is a tensor, or a (nested) tuple/list/dict of tensors, all with the samples
along the first dimension. Non-tensor leaves are passed to every micro-batch as is.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from poplar.engine.collectives import Comm
from poplar.plan import Plan


def batch_size(batch: Any) -> int:
    """Number of samples in ``batch``; every tensor must agree on its first dimension."""
    leaves, _ = tree_flatten(batch)
    sizes = {tuple(t.shape[:1]) for t in leaves if isinstance(t, torch.Tensor)}
    if not sizes:
        raise ValueError(f"the batch holds no tensor (got {type(batch).__name__}): "
                         "pass a tensor or a tuple/list/dict of tensors")
    if () in sizes:
        raise ValueError("a tensor in the batch is 0-dimensional: every tensor needs the sample dimension first")
    if len(sizes) > 1:
        raise ValueError(f"the tensors in the batch disagree on the number of samples: {sorted(s[0] for s in sizes)}")
    return next(iter(sizes))[0]


def split_batch(batch: Any, sizes: int | list[int], device: torch.device | None = None) -> list[Any]:
    """Consecutive micro-batches (views, no copy on the same device).

    ``sizes``: one micro-batch size for all (the last takes what is left), or the size
    of each micro-batch in order, which must add up to the batch's samples.
    """
    n = batch_size(batch)
    if isinstance(sizes, int):
        sizes = [min(sizes, n - start) for start in range(0, n, sizes)]
    elif sum(sizes) != n:
        raise ValueError(f"micro-batch sizes {sizes} add up to {sum(sizes)}, but the batch has {n} samples")
    leaves, spec = tree_flatten(batch)
    if device is not None:
        leaves = [t.to(device, non_blocking=True) if isinstance(t, torch.Tensor) else t for t in leaves]
    out, start = [], 0
    for size in sizes:
        part = [t[start:start + size] if isinstance(t, torch.Tensor) else t for t in leaves]
        out.append(tree_unflatten(part, spec))
        start += size
    return out


class BatchCheck:
    """Every rank's local batch size against the plan, checked without a synchronisation of its own.

    :meth:`start` shares this rank's size in a background all-reduce while the rank
    computes; :meth:`confirm` awaits it before the step's first collective, so a correct
    step pays no extra synchronisation and a wrong batch on one rank is a ``ValueError``
    naming it on every rank, not a hang. A rank whose own batch is wrong fails at once.
    """

    def __init__(self, plan: Plan, rank: int, world_size: int, device: torch.device, comm: Comm,
                 enabled: bool = True):
        self.plan, self.rank, self.world_size, self.device, self.comm = plan, rank, world_size, device, comm
        self.enabled = enabled
        self._pending = None   # (work or None, sizes, this rank's error) until confirmed

    def start(self, local_batch) -> None:
        try:
            n, err = batch_size(local_batch), ""
        except ValueError as e:
            n, err = -1, str(e)
        sizes = torch.zeros(self.world_size, dtype=torch.int64, device=self.device)
        sizes[self.rank].fill_(n)   # (assigning a number makes a tensor of it first, off the CPU: two kernels)
        if self.enabled and self.world_size > 1:
            self._pending = (self.comm.all_reduce(sizes, async_op=True), sizes, err, n)
        else:
            self._pending = (None, sizes, err, n)
        if n != self.plan.local_batch_size(self.rank):
            self.confirm()

    def abandon(self):
        """The step is given up: its in-flight check (a work, or None) for the caller to finish."""
        pending, self._pending = self._pending, None
        return pending[0] if pending is not None else None

    def confirm(self) -> None:
        """Raise if any rank's batch (only this rank's, when not shared) does not match the plan."""
        if self._pending is None:
            return
        work, sizes, err, own = self._pending
        self._pending = None
        if work is not None:
            work.wait()
        plan = self.plan
        # unshared, only this rank's own count is known: read from the host, not back from the tensor
        counts = enumerate(sizes.tolist()) if work is not None else [(self.rank, own)]
        bad = [(r, int(n)) for r, n in counts if n != plan.local_batch_size(r)]
        if not bad:
            return
        if err:
            raise ValueError(f"rank {self.rank}: {err}")
        what = "; ".join(f"rank {r} got {n if n >= 0 else 'an unreadable batch of'} samples, its plan slice is "
                         f"{plan.local_batch_size(r)} (micro-batches {plan.micro_batches(r)})"
                         for r, n in bad)
        raise ValueError(f"local batch does not match the plan: {what}. Give each rank "
                         "global_batch[plan.sample_range(rank)]")
