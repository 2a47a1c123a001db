"""A model directory's weights read by slice: the engine's :class:`~poplar.engine.weights.WeightReader` of safetensors.

:func:`parameters_on_meta` builds a model whose parameters are on the meta device and
whose buffers are real (computed as the model computes them, e.g. rotary frequencies);
:class:`SafetensorsWeights` then gives each rank only the elements its shards hold,
through safetensors' own slicing of its memory-mapped files (one file or a sharded
index): the rows of each tensor that a flat unit's slice touches, cast to fp32 from
whatever dtype the checkpoint holds. A tied parameter is asked for under all its names
and read under the one the checkpoint saved.
"""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path

import torch
from torch import nn

WEIGHTS, WEIGHTS_INDEX = "model.safetensors", "model.safetensors.index.json"


def names_of(model: nn.Module) -> dict[int, tuple[str, ...]]:
    """Every name each parameter is registered under, by ``id`` (a tied parameter has several), in registration
    order."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return {k: tuple(v) for k, v in names.items()}


@contextlib.contextmanager
def parameters_on_meta():
    """Modules built inside have their parameters on the meta device (no values, nothing allocated beyond a
    moment) and their buffers where they are built."""
    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        register(module, name, param)
        if param is not None and not param.is_meta:
            module.register_parameter(name, nn.Parameter(param.to("meta"), requires_grad=param.requires_grad))

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def weight_files(directory: str | Path) -> dict[str, Path]:
    """Each saved tensor's file: the index's map, or every tensor of the single file."""
    path = Path(directory)
    if (path / WEIGHTS_INDEX).is_file():
        index = json.loads((path / WEIGHTS_INDEX).read_text())
        return {name: path / f for name, f in index.get("weight_map", {}).items()}
    if (path / WEIGHTS).is_file():
        from safetensors import safe_open

        with safe_open(path / WEIGHTS, framework="pt") as f:
            return {name: path / WEIGHTS for name in f.keys()}
    return {}


class SafetensorsWeights:
    """A model directory's safetensors as a :class:`~poplar.engine.weights.WeightReader` (see the module).

    ``prefix``: the model's ``base_model_prefix`` (a checkpoint of the base model saves its
    names without it, one of the head model with it).
    """

    def __init__(self, directory: str | Path, prefix: str = ""):
        self.files = weight_files(directory)
        self.prefix = prefix

    def key(self, names: tuple[str, ...]) -> str | None:
        """The saved name of a parameter registered under ``names`` (None: not saved)."""
        p = self.prefix + "."
        for name in names:
            for candidate in (name, name[len(p):] if name.startswith(p) else p + name):
                if candidate in self.files:
                    return candidate
        return None

    @contextlib.contextmanager
    def _slice(self, key: str):
        """The saved tensor as a lazy slice; its file is mapped only while it is open (the pages read leave the
        host's memory with it)."""
        from safetensors import safe_open

        with safe_open(self.files[key], framework="pt") as f:
            yield f.get_slice(key)

    def read(self, names: tuple[str, ...], start: int, stop: int) -> torch.Tensor:
        key = self.key(names)
        if key is None:
            raise KeyError(f"{names[0]}: not in the weights")
        with self._slice(key) as part:
            shape = part.get_shape()
            if len(shape) == 0:
                return part[...].reshape(-1)[start:stop].float()
            row = math.prod(shape[1:])
            first, last = start // row, -(-stop // row)   # the rows the elements lie in
            rows = part[first:last].reshape(-1)
        return rows[start - first * row:stop - first * row].float()

    def read_whole(self, key: str) -> torch.Tensor:
        with self._slice(key) as part:
            return part[:] if part.get_shape() else part[...]
