"""A user's own module on the command line: ``--model package.module:factory``.

The factory is imported and called with no argument. It returns either a
:class:`~poplar.models.workload.ModelSource` (the whole interface: build, loss, samples; used as
it is), or an ``nn.Module`` that maps token ids ``[n, seq]`` to logits ``[n, seq, vocab]``
(or an output with ``.logits``): a causal LM, trained on the next-token loss of the run's
text (:class:`FactorySource`). Each process imports and calls the factory itself (the
source pickles as its name), seeded, so every rank builds the same module.

A factory that is not importable, returns neither, or whose module's loss of a sample is
not a scalar is refused in one line before anything is profiled.
"""

from __future__ import annotations

import functools
import importlib

import torch
from pydantic import BaseModel, ConfigDict, Field

from poplar.models.source import check_scalar_loss


def looks_like_factory(model: str) -> bool:
    """``package.module:name``: a factory to import, not a preset or a path."""
    module, sep, name = model.partition(":")
    return bool(sep) and "/" not in model and bool(module) and name.isidentifier()


def load_factory(spec: str):
    """What ``package.module:name`` names, called (one line where it cannot be)."""
    module_name, _, name = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:
        raise ValueError(f"--model {spec}: module {module_name!r} cannot be imported ({type(e).__name__}: {e}): "
                         "check the name and that it is on PYTHONPATH") from None
    factory = getattr(module, name, None)
    if not callable(factory):
        raise ValueError(f"--model {spec}: {module_name} has no callable {name!r}: name a function that returns "
                         "the model")
    return factory()


def as_source(spec: str, seq_len: int | None = None, activation_checkpointing: bool = False):
    """The factory's own :class:`~poplar.models.workload.ModelSource`, or a :class:`FactorySource` of its module."""
    from poplar.models.source import ModelSource

    made = load_factory(spec)
    if isinstance(made, ModelSource) and not isinstance(made, torch.nn.Module):
        return made
    if not isinstance(made, torch.nn.Module):
        raise ValueError(f"--model {spec}: the factory returned {type(made).__name__}, not an nn.Module or a "
                         "poplar.models.workload.ModelSource")
    return FactorySource(factory=spec, seq_len=seq_len or 128, activation_checkpointing=activation_checkpointing)


class FactorySource(BaseModel):
    """A factory's causal LM as a :class:`~poplar.models.workload.ModelSource` (see the module)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    factory: str = Field(description="package.module:name, returning the module")
    seq_len: int = Field(128, gt=1)
    activation_checkpointing: bool = False

    def model_post_init(self, _context) -> None:
        info = _inspect(self.factory)
        if info["positions"] and self.seq_len > info["positions"]:
            raise ValueError(f"seq_len = {self.seq_len}: {self.factory} has {info['positions']} positions: use a "
                             "shorter sequence")
        check_scalar_loss(self.loss, self.build(), self.random_batch(1), f"--model {self.factory}",
                          "the module must map token ids [n, seq] to logits [n, seq, vocab] (the next-token loss "
                          "is read as logits)")

    @property
    def name(self) -> str:
        return self.factory.partition(":")[2]

    @property
    def vocab_size(self) -> int:
        return _inspect(self.factory)["vocab_size"]

    def identity(self) -> dict:
        return self.model_dump(mode="json")

    def build(self, seed: int = 0) -> torch.nn.Module:
        from poplar.models import checkpointing

        torch.manual_seed(seed)
        model = load_factory(self.factory)
        return checkpointing.enable(model) if self.activation_checkpointing else model

    @property
    def loss(self):
        return factory_lm_loss

    def random_batch(self, n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        x = torch.randint(0, self.vocab_size, (n, self.seq_len + 1), generator=g)
        return x[:, :-1], x[:, 1:]

    def n_params(self) -> int:
        return _inspect(self.factory)["n_params"]

    def cache_dict(self) -> dict:
        return {"model": "factory", **self.identity(), "shapes": _inspect(self.factory)["shapes"]}


def factory_lm_loss(model, batch) -> torch.Tensor:
    """The next-token loss of a module's logits (its output, or the output's ``logits``)."""
    from poplar.models.loss import next_token_loss

    out = model(batch[0])
    return next_token_loss(out if isinstance(out, torch.Tensor) else out.logits, batch)


@functools.lru_cache(maxsize=8)
def _inspect(spec: str) -> dict:
    """The module's vocabulary (its input embeddings' rows), positions, parameters and shapes, built once."""
    with torch.device("meta"):
        model = load_factory(spec)
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else next(
        (m for m in model.modules() if isinstance(m, torch.nn.Embedding)), None)
    if embeddings is None:
        raise ValueError(f"--model {spec}: the module has no token embedding (nn.Embedding) to read its "
                         "vocabulary from")
    config = getattr(model, "config", None)
    positions = getattr(config, "max_position_embeddings", None) or getattr(model, "max_seq_len", None)
    return {"vocab_size": int(embeddings.weight.shape[0]), "positions": positions,
            "n_params": sum(p.numel() for p in model.parameters()),
            "shapes": {n: list(p.shape) for n, p in model.named_parameters()}}
