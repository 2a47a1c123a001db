"""The compute precisions, defined once: their names, their torch dtypes, and how input is read.

``fp32`` computes and keeps everything in float32; ``bf16`` and ``fp16`` are the
engine's mixed precisions (the model computes in bfloat16 or float16, fp32 master weights
and fp32 gradient reduction; fp16 with dynamic loss scaling, :mod:`poplar.engine.loss_scale`).
``none`` (or ``None``) means no mixed precision, i.e. ``fp32``. The engine's
configuration, the training configuration, the profiler and its cache read these
names from here.

>>> precision("none"), precision("BF16"), torch_dtype("fp16")
('fp32', 'bf16', torch.float16)
>>> precision("fp8")
Traceback (most recent call last):
...
ValueError: precision 'fp8': choose one of fp32, bf16, fp16 (none is fp32)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import BeforeValidator

if TYPE_CHECKING:   # torch only where a dtype is made: a name is checked without it (a refusal comes first)
    import torch

NAMES = ("fp32", "bf16", "fp16")
ALIASES = {"none": "fp32", "float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16"}


def precision(name: str | None) -> str:
    """The canonical name (``fp32``, ``bf16`` or ``fp16``) of ``name``; a clear ``ValueError`` for anything else."""
    key = "fp32" if name is None else str(name).strip().lower()
    key = ALIASES.get(key, key)
    if key not in NAMES:
        raise ValueError(f"precision {name!r}: choose one of {', '.join(NAMES)} (none is fp32)")
    return key


def torch_dtype(name: str | None) -> torch.dtype:
    """The dtype the model computes in under precision ``name``."""
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision(name)]


FASTEST_FIRST = ("bf16", "fp16", "fp32")   # a GPU's tensor cores run bf16 and fp16 alike, fp32 far slower


def fastest(computes) -> str:
    """The fastest precision every device ``computes(name)`` (bf16 over fp16: the same speed, a range that
    needs no loss scale)."""
    return next(p for p in FASTEST_FIRST if computes(p))


# a pydantic field type: accepts every spelling above, holds the canonical name
Precision = Annotated[Literal["fp32", "bf16", "fp16"], BeforeValidator(precision)]


def cast_model(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """``model`` on ``device``, its floating-point tensors in ``dtype``, in place (as ``model.to``).

    Each tensor's ``.data`` is replaced: ``model.to`` swaps a tensor subclass's whole
    tensor instead (a fake tensor's, in the simulator), which a model holding weak
    references to its parameters refuses.
    """
    import torch

    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            want = dtype if t.is_floating_point() else t.dtype
            if t.device != device or t.dtype != want:
                t.data = t.data.to(device=device, dtype=want)
    return model
