"""Weights read straight into each rank's shards: a model built with its parameters on the meta device.

A model whose trainable parameters are on the meta device holds no values; the engine
lays its units out as usual, and each rank reads from a :class:`WeightReader` only the
elements its fp32 master holds: its shard where the stage shards the optimizer (its
share of it, where the plan gives shares), the whole unit elsewhere. A unit's slice of
the flat buffer runs across the ends of several parameters, so the reader is asked for
a range of a parameter's flattened elements, never for the whole model. In ZeRO-3 no
rank ever holds more than its shards and the reader's one slice.

The reader is the model source's (e.g. :mod:`poplar.models.weights`: safetensors read by
slice); the engine knows nothing of files.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch import nn

from poplar.models.weights import names_of


@runtime_checkable
class WeightReader(Protocol):
    """Where a model's values are: elements ``[start, stop)`` of a parameter, flattened."""

    def read(self, names: tuple[str, ...], start: int, stop: int) -> torch.Tensor:
        """Elements ``[start, stop)`` of the flattened parameter registered under ``names`` (all its names: a
        tied one has several), as a 1-D tensor of any floating dtype (the engine casts to fp32)."""


def values_to_read(params, device: torch.device) -> bool:
    """Whether the values of ``params`` are to be read into the shards: some on the meta device, for a device that
    holds values (on the meta device itself, a dry run's such as the simulator's, they are the model's own)."""
    return device.type != "meta" and any(p.is_meta for p in params)


def check_empty_model(model: nn.Module, device: torch.device, reader) -> None:
    """A model with parameters on the meta device: they are read from ``reader`` (which must be given), only the
    trainable ones can be, and the rest of the model (its buffers) is on the engine's device already."""
    if reader is None:
        raise ValueError("the model's parameters are on the meta device: give initialize weights= (a "
                         "WeightReader) to read them into the shards, or build the model with its values")
    if not isinstance(reader, WeightReader):
        raise TypeError(f"weights must be a WeightReader (read(names, start, stop)), got {type(reader).__name__}")
    real = [n for n, p in model.named_parameters() if not p.is_meta and p.requires_grad]
    if real:
        raise ValueError(f"{real[0]} has values where other parameters are on the meta device: build every "
                         "trainable parameter on the meta device, or none")
    frozen = [n for n, p in model.named_parameters() if p.is_meta and not p.requires_grad]
    if frozen:
        raise ValueError(f"{frozen[0]}: a frozen parameter on the meta device is not read into shards: build the "
                         "frozen parameters with their values")
    elsewhere = [n for n, t in [*model.named_parameters(), *model.named_buffers()]
                 if not t.is_meta and t.device != device]
    if elsewhere:
        raise ValueError(f"{elsewhere[0]} is on another device than the engine's ({device}): build the model's "
                         "buffers and real parameters under torch.device(...) of the rank")


@torch.no_grad()
def read_into_master(unit, names: dict[int, tuple[str, ...]], reader: WeightReader) -> None:
    """Fill the elements of ``unit``'s fp32 master this rank holds from ``reader``, one parameter's slice at a
    time; the model's parameters are brought up to date from the master after (a gather in stages 1-2)."""
    lo = unit.shard_start if unit.shard_optim else 0
    hi = min(unit.numel, lo + unit.master.numel())
    master = unit.master.data
    for s in unit.slots:
        a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
        if a >= b:
            continue
        values = reader.read(names[id(s.param)], a - s.offset, b - s.offset)
        if values.numel() != b - a:
            raise ValueError(f"{names[id(s.param)][0]}: the weights gave {values.numel()} values for elements "
                             f"{a - s.offset}..{b - s.offset}: they do not match the model's shapes")
        master[a - lo:b - lo].copy_(values.reshape(-1))


def read_weights(model: nn.Module, units, reader: WeightReader) -> None:
    """The meta parameters the units replaced swapped for their replacements wherever the model registers them,
    every unit's master read from ``reader``, and the model's parameters brought up to date from it."""
    replaced = {k: v for u in units for k, v in u.replaced.items()}
    for name, p in list(model.named_parameters(remove_duplicate=False)):
        if id(p) in replaced:
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, replaced[id(p)])
    names = names_of(model)
    for unit in units:
        read_into_master(unit, names, reader)
    works = [w for w in (u.refresh_params_after_step() for u in units) if w is not None]
    for w in works:
        w.wait()
