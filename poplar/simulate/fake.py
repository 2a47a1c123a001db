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
        if func is _GROUPED_MM and args[0].dtype != torch.bfloat16:
            return _grouped_mm_of(super().__torch_dispatch__, types, args, kwargs or {})
        return super().__torch_dispatch__(func, types, args, kwargs)


_GROUPED_MM = getattr(torch.ops.aten, "_grouped_mm", None)
if _GROUPED_MM is not None:
    _GROUPED_MM = _GROUPED_MM.default


def _grouped_mm_of(dispatch, types, args, kwargs):
    """A grouped matrix product (a mixture of experts' layers) in fp32 or fp16, which the devices' kernels run and
    torch's shape function refuses (it knows bf16 only): its output's shape taken at bf16, in the inputs' dtype."""
    a, b, *rest = args
    kwargs = dict(kwargs)
    dtype = kwargs.pop("out_dtype", None) or a.dtype
    out = dispatch(_GROUPED_MM, types, (a.to(torch.bfloat16), b.to(torch.bfloat16), *rest), kwargs)
    return out.to(dtype)


_MODE: list[HostValues] = []   # one for the process: fake tensors kept from one simulation meet the next's


@contextlib.contextmanager
def fake_tensors():
    """Every tensor made inside is fake, and what is read back from one is :class:`HostValues`'."""
    if not _MODE:
        _MODE.append(HostValues())
    with _MODE[0]:
        yield
