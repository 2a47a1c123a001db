"""Fake tensors for the simulator: shapes and dtypes, no data, and the values a step reads back."""

from __future__ import annotations

import contextlib

import torch
from torch._subclasses.fake_tensor import FakeTensorMode


class HostValues(FakeTensorMode):
    """Fake tensors whose values read back to the host are a finite step's: floats 1.0 (a finite loss and norm),
    flags true, counts 0. (One mode, not a second one above the fake mode: every operator of a step passes through
    each mode on the stack.)"""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            t = args[0]
            return True if t.dtype == torch.bool else (1.0 if t.is_floating_point() else 0)
        return super().__torch_dispatch__(func, types, args, kwargs)


_MODE: list[HostValues] = []   # one for the process: fake tensors kept from one simulation meet the next's


@contextlib.contextmanager
def fake_tensors():
    """Every tensor made inside is fake, and what is read back from one is :class:`HostValues`'."""
    if not _MODE:
        _MODE.append(HostValues())
    with _MODE[0]:
        yield
