"""What Poplar needs of a model: :class:`ModelSource` (re-exported as ``poplar.models.workload.ModelSource``).

The profiler, the simulator, the planner, the measurements and training all need the
same things of a model, and nothing else: build it (seeded; on real, meta or fake
tensors), a batch of ``n`` samples, the loss of a micro-batch, its parameter count, a
stable identity for the caches, and a name to say.
"""

from __future__ import annotations

from typing import Callable, Protocol, runtime_checkable

import torch


@runtime_checkable
class ModelSource(Protocol):
    """What a model source implements: all that Poplar's profiler, simulator, planner and trainer ask of a model.

    It must pickle (spawned ranks get it as it is) and build the same model in every
    process from the same ``seed``.
    """

    seq_len: int    # tokens per sample (what throughput in tokens counts)

    @property
    def name(self) -> str:
        """What messages, profiles and plans call the model."""

    def build(self, seed: int = 0) -> torch.nn.Module:
        """The model, initialised from ``seed``; under ``torch.device("meta")`` or fake tensors, of any size."""

    @property
    def loss(self) -> Callable:
        """``loss(model, micro_batch)``: the scalar loss of a micro-batch (a batch as :meth:`random_batch` gives)."""

    def random_batch(self, n: int, seed: int = 0):
        """A batch of ``n`` samples of the right shapes: enough to time and size a step."""

    def n_params(self) -> int:
        """The model's parameters (without building it where that can be avoided)."""

    def cache_dict(self) -> dict:
        """Everything about the model that changes a device's profile (the profile cache's key)."""

    def identity(self) -> dict:
        """A stable identity in JSON values: equal for sources that build the same model with the same batches and
        loss (checkpoints record it, caches are keyed on it)."""


def build_for_rank(source: ModelSource, seed: int, device: torch.device | str = "cpu"):
    """``(model, weights)``: the model a rank trains. Where the source can (an optional ``build_empty(device)``,
    as a model directory's), its parameters on the meta device and ``weights`` the reader the engine fills each
    rank's shards from (no rank holds the whole model); otherwise built whole from ``seed`` and ``weights`` None."""
    build_empty = getattr(source, "build_empty", None)
    found = build_empty(device) if build_empty is not None else None
    return found if found is not None else (source.build(seed=seed), None)


def trained_and_frozen(source: ModelSource) -> tuple[int, int]:
    """The parameters of ``source``'s model the engine trains (its units: sharded, reduced, updated) and those it
    keeps frozen (weights alone, whole on every rank): a source's own count where it keeps one
    (``frozen_params()``, a LoRA source's), else every parameter trained."""
    frozen = getattr(source, "frozen_params", None)
    frozen = frozen() if callable(frozen) else 0
    return source.n_params() - frozen, frozen


def check_scalar_loss(loss: Callable, model: torch.nn.Module, batch, what: str, fix: str) -> None:
    """``loss(model, batch)`` (no gradients) is a finite scalar, or a ``ValueError`` in one line: ``what`` the
    source is, what the loss raised or gave, and ``fix``, what to give instead (before anything is profiled)."""
    try:
        with torch.no_grad():
            value = loss(model, batch)
    except Exception as e:   # the model and the loss do not fit together: one line, not the traceback
        first = str(e).splitlines()[0][:150] if str(e) else ""
        raise ValueError(f"{what}: its loss of a batch cannot be computed ({type(e).__name__}: {first}): "
                         f"{fix}") from None
    if not isinstance(value, torch.Tensor) or value.numel() != 1 or not bool(torch.isfinite(value).all()):
        kind = type(value).__name__ if not isinstance(value, torch.Tensor) else f"a tensor of {value.numel()}"
        raise ValueError(f"{what}: its loss of a batch is {kind}, not a finite scalar: {fix}")
