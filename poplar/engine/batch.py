"""Cutting a rank's local batch into micro-batches.

A batch is a tensor, or a (nested) tuple/list/dict of tensors, all with the samples
along the first dimension. Non-tensor leaves are passed to every micro-batch as is.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten


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
