"""A user's own module as a :class:`~poplar.models.workload.ModelSource`: what an integration holds, profiled as it is.

An integration given a cluster and no plan profiles the user's actual module on samples
of the user's actual dataset, collated as the framework collates them, and plans from
that (no preset to name). :class:`ModuleSource` is that module: ``build`` copies it as
it stands (its weights, its dtype), ``random_batch`` draws samples of the dataset (seeded)
and collates them, ``loss`` is the framework's loss of a micro-batch.

Its identity (the profile cache's key) is what changes a device's profile: the module's
class, its parameters' names, shapes and dtypes, and the collated batch's shapes; a
second run of the same model and data reads its profile from the cache.
"""

from __future__ import annotations

import copy
import hashlib
import json
import random
from collections.abc import Callable, Sequence

import torch
from torch.utils._pytree import tree_flatten


class ModuleSource:
    """``module`` with ``loss(model, batch)``, drawing batches of ``collate([dataset[i], ...])``."""

    def __init__(self, module: torch.nn.Module, loss: Callable, dataset: Sequence, collate: Callable,
                 name: str | None = None):
        if not hasattr(dataset, "__len__") or len(dataset) == 0:
            raise ValueError("planning from a cluster profiles your model on samples of your training data: give "
                             "a map-style dataset with samples (len and indexing)")
        self.module, self._loss, self.dataset, self.collate = module, loss, dataset, collate
        self._name = name or type(module).__name__
        sample = self.random_batch(1)
        self.seq_len = _tokens_per_sample(sample)
        _check_loss(module, loss, sample)

    @property
    def name(self) -> str:
        return self._name

    def build(self, seed: int = 0) -> torch.nn.Module:
        """The module as the user gave it (a copy: profiling steps on it); ``seed`` plays no part."""
        return copy.deepcopy(self.module)

    @property
    def loss(self) -> Callable:
        return self._loss

    def random_batch(self, n: int, seed: int = 0):
        """``n`` samples of the dataset (drawn with replacement, seeded), collated."""
        rng = random.Random(seed)
        return self.collate([self.dataset[rng.randrange(len(self.dataset))] for _ in range(n)])

    def n_params(self) -> int:
        return sum(p.numel() for p in self.module.parameters())

    def cache_dict(self) -> dict:
        params = [[name, list(p.shape), str(p.dtype)] for name, p in self.module.named_parameters()]
        leaves, _ = tree_flatten(self.random_batch(2))
        sample = [[list(t.shape), str(t.dtype)] for t in leaves if isinstance(t, torch.Tensor)]
        text = json.dumps({"class": type(self.module).__qualname__, "params": params, "sample": sample})
        return {"model": "module", "name": self.name, "digest": hashlib.sha256(text.encode()).hexdigest()[:20],
                "seq_len": self.seq_len}

    def identity(self) -> dict:
        return self.cache_dict()


def _tokens_per_sample(batch) -> int:
    """Tokens a sample: an ``input_ids`` tensor's second dimension where there is one, else 1."""
    ids = batch.get("input_ids") if isinstance(batch, dict) else None
    return int(ids.shape[1]) if isinstance(ids, torch.Tensor) and ids.dim() == 2 else 1


def output_loss(model, batch) -> torch.Tensor:
    """The model's own loss of a batch: its output where that is a scalar, else the output's ``loss`` (a Hugging
    Face model given ``labels``). A dict batch is passed as keywords, a tuple or list as arguments."""
    if isinstance(batch, dict):
        out = model(**batch)
    elif isinstance(batch, (tuple, list)):
        out = model(*batch)
    else:
        out = model(batch)
    if isinstance(out, torch.Tensor):
        return out
    return out["loss"] if isinstance(out, dict) else getattr(out, "loss", out)


def _check_loss(module: torch.nn.Module, loss: Callable, sample) -> None:
    """The loss of one sample is a finite scalar (a forward here, without gradients), or one line says what to give."""
    from poplar.engine.batch import split_batch
    from poplar.models.source import check_scalar_loss

    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    check_scalar_loss(loss, module, split_batch(sample, 1, device)[0], type(module).__name__,
                      "give loss= (a function of the model and a batch), or workload= (a preset), or a plan")
