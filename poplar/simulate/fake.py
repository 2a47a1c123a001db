"""Fake tensors for the simulator: shapes and dtypes, no data, and the values a step reads back."""

from __future__ import annotations

import contextlib

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode


class HostValues(TorchDispatchMode):
    """Values read back to the host from fake tensors: floats 1.0 (a finite loss and norm), flags true, counts 0."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            t = args[0]
            return True if t.dtype == torch.bool else (1.0 if t.is_floating_point() else 0)
        return func(*args, **(kwargs or {}))


_MODE: list[FakeTensorMode] = []   # one for the process: fake tensors kept from one simulation meet the next's


@contextlib.contextmanager
def fake_tensors():
    """Every tensor made inside is fake, and what is read back from one is :class:`HostValues`'."""
    if not _MODE:
        _MODE.append(FakeTensorMode())
    with _MODE[0], HostValues():
        yield
