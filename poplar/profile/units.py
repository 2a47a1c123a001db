"""The engine's units as a profile records them: their parameters and their share of the compute.

The cost model follows the engine's schedule unit by unit (:mod:`poplar.planner.schedule`):
it needs what each unit moves (its parameters) and when its compute runs (its share of
the forward's FLOPs, counted once on a one-sample forward with the same formulas that
pace an emulated device, :func:`poplar.emulate.model.op_cost`). A unit's FLOPs are its
own: the operators that run while it is the innermost unit running, its sub-units' left
to them. The root unit holds what no other unit runs (embeddings, final norm, head).
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from poplar.emulate.model import op_cost
from poplar.engine.config import EngineConfig
from poplar.engine.units import build_units
from poplar.models.workload import Workload, as_workload


# a training step's model FLOPs are the forward's and the backward's, twice the forward's: the one count of model
# FLOPs (and so of MFU) everywhere, from the forward's counted operator by operator (unit_flops)
STEP_FLOPS_PER_FORWARD = 3


def step_flops_per_sample(workload, config: EngineConfig | None = None) -> float:
    """Model FLOPs of one sample in a training step, counted on fake tensors (a model of any size, nothing
    allocated): :data:`STEP_FLOPS_PER_FORWARD` times its forward's (:func:`unit_flops`)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    wl = as_workload(workload)
    with FakeTensorMode():
        return STEP_FLOPS_PER_FORWARD * sum(unit_flops(wl, config, wl.build()))


def _model(workload: str | Workload | torch.nn.Module) -> torch.nn.Module:
    return workload if isinstance(workload, torch.nn.Module) else as_workload(workload).build()


def unit_numels(workload: str | Workload | torch.nn.Module, config: EngineConfig | None = None) -> list[int]:
    """Parameters of each unit the engine builds from the model with ``config`` (the root first).

    >>> unit_numels("tiny") == unit_numels("tiny", EngineConfig())
    True
    """
    config = config or EngineConfig()
    return [sum(p.numel() for p in u.params) for u in build_units(_model(workload), config.unit_classes,
                                                                  config.unit_numel)]


def bucket_numels(workload: str | Workload, config: EngineConfig | None = None) -> tuple[int, ...]:
    """:func:`unit_numels` of the workload's model: the sizes of the engine's gradient buckets, which the
    collectives are also timed at. Built on fake tensors (a model of any size, nothing allocated; a module given
    with real weights copied as fake ones); where a model's own code cannot run on them, built as it is."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    wl = as_workload(workload)
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            return tuple(unit_numels(wl.build(), config))
    except Exception:     # (a model's code that reads values, say): the sizes are what matter, not how fast
        return tuple(unit_numels(wl.build(), config))


class _FlopsByUnit(TorchDispatchMode):
    """Adds each operator's FLOPs to the unit on top of ``stack`` (the innermost one running)."""

    def __init__(self, stack: list[int], flops: list[float]):
        super().__init__()
        self.stack, self.flops = stack, flops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        cost = op_cost(func, args, kwargs, out)
        if cost is not None:
            self.flops[self.stack[-1]] += cost[0]
        return out


def unit_flops(workload: str | Workload, config: EngineConfig | None = None,
               model: torch.nn.Module | None = None) -> list[float]:
    """Forward FLOPs of one sample in each unit (the root first), each unit's own; ``model``: the
    workload's, already built (its weights are not changed).

    >>> flops = unit_flops("tiny")
    >>> len(flops) == len(unit_numels("tiny")) and min(flops) > 0
    True
    """
    config, wl = config or EngineConfig(), as_workload(workload)
    model = model if model is not None else wl.build()
    specs = build_units(model, config.unit_classes, config.unit_numel)
    stack, flops = [0], [0.0] * len(specs)
    handles = []

    def leave(*_):
        stack.pop()      # a forward hook returning something would replace the output

    for i, spec in enumerate(specs[1:], 1):
        handles.append(spec.module.register_forward_pre_hook(lambda *_, i=i: stack.append(i)))
        handles.append(spec.module.register_forward_hook(leave))
    try:
        with torch.no_grad(), _FlopsByUnit(stack, flops):
            wl.loss(model, wl.random_batch(1, seed=0))
    finally:
        for h in handles:
            h.remove()
    return flops
