"""LoRA: small adapters (PEFT's) trained beside a model's frozen weights.

:class:`LoraSettings` is the training config's ``lora:`` section (``--lora
r=16,alpha=32,targets=q_proj,v_proj``). :class:`LoraSource` is a
:class:`~poplar.models.workload.ModelSource`: another source's model (a model directory, a
preset, a factory's module) wrapped by ``peft.get_peft_model``, the same way in every
process: the adapters' initial values are drawn from the run's seed (PEFT draws them
from torch's global generator, which differs between processes), so every rank and a
single device start from the same adapters. PEFT freezes the base weights; the engine
then makes units of the adapters alone: only they have gradients, fp32 masters and
optimizer states, sharded as the stage shards them, while the frozen weights are held
whole on every rank in the compute precision (:mod:`poplar.engine.memory` counts them).

Its identity (what checkpoints, plans and the profile cache are keyed on) is the base's
with the settings that change the model, so a LoRA run never reads a full fine-tune's
profile. Targets that match no module of the model, and PEFT missing, are refused in one
line when the source is made, before anything is profiled.

>>> LoraSettings.model_validate("on").r, LoraSettings(targets="q_proj").targets
(16, ['q_proj'])
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

INSTALL = "pip install 'poplar-zero[lora]'"
ALL_LINEAR = "all-linear"   # PEFT's name for every linear layer but the output head


class LoraSettings(BaseModel):
    """LoRA adapters (PEFT's) trained beside the model's frozen weights (:mod:`poplar.models.lora`).

    On the command line: ``--lora r=16,alpha=32,targets=q_proj,v_proj`` (or ``--lora on`` for these defaults)."""

    model_config = ConfigDict(extra="forbid")

    r: int = Field(16, gt=0, description="the adapters' rank")
    alpha: float = Field(32.0, gt=0, description="their updates are scaled by alpha / r")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapters' input")
    targets: list[str] | str | None = Field(None, description="module names (or name endings) that get adapters, "
                                            "'all-linear', or none: PEFT's default for the model's family")
    merge: bool = Field(False, description="--export also writes the merged model (adapters folded into the "
                        "weights) beside the adapter")

    @model_validator(mode="before")
    @classmethod
    def _on(cls, data: Any) -> Any:
        """``lora: true`` / ``--lora on`` for the defaults."""
        if data is True or (isinstance(data, str) and data.strip().lower() in ("on", "true", "yes", "default")):
            return {}
        return data

    @field_validator("targets", mode="before")
    @classmethod
    def _targets(cls, v: Any) -> Any:
        """One name or ``'all-linear'``; a list of names, none empty."""
        if isinstance(v, str):
            v = v.strip()
            return v if v == ALL_LINEAR else [v]
        if isinstance(v, list) and not all(isinstance(x, str) and x.strip() for x in v):
            raise ValueError("targets: give module names, e.g. q_proj,v_proj")
        return [x.strip() for x in v] if isinstance(v, list) else v

    def model_key(self) -> dict:
        """The settings that make the model what it is (``merge`` only says what an export writes)."""
        return self.model_dump(mode="json", exclude={"merge"})


def require_peft():
    """The ``peft`` module, or one line naming the extra that installs it."""
    try:
        import peft
    except ImportError:
        raise ValueError(f"--lora needs PEFT, which is not installed: {INSTALL}") from None
    return peft


def task_type(base) -> str | None:
    """PEFT's task for ``base``'s model: a causal LM's (its wrapper takes ``input_ids=`` and exports as one), a
    sequence classifier's (PEFT also trains the head), or none (the module called as it is)."""
    task = getattr(base, "task", None) or ("causal-lm" if getattr(base, "family", None) == "llama" else None)
    return {"causal-lm": "CAUSAL_LM", "sequence-classification": "SEQ_CLS"}.get(task)


def wrap(model, settings: LoraSettings, seed: int, task: str | None, name: str = "the model"):
    """``model`` with LoRA adapters (PEFT's ``get_peft_model``, which freezes every other weight), their initial
    values drawn from ``seed`` whatever the process's generator holds; one line where the targets match nothing."""
    import torch

    peft = require_peft()
    config = peft.LoraConfig(r=settings.r, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                             target_modules=settings.targets, task_type=task)
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        warnings.simplefilter("ignore")     # transformers' deprecation notices as PEFT reads the model
        torch.manual_seed(seed)
        try:
            return _on_fake_tensors(peft.get_peft_model, model, config)
        except ValueError as e:   # no module matches (or PEFT knows no default for the family): what there is
            raise ValueError(_no_target_line(settings, model, name, str(e))) from None


def _on_fake_tensors(get_peft_model, model, config):
    """``get_peft_model(model, config)``; where the model's tensors are a subclass's (the fake ones FLOPs are
    counted on, for a model of any size), the adapters made on the meta device and then as the model's tensors are
    (values that are never read): PEFT moves each adapter to its layer's device with ``Module.to``, which cannot
    swap a fake parameter, and leaves one on the meta device where it is."""
    import torch

    first = next(model.parameters(), None)
    if first is None or type(first.data) is torch.Tensor:
        return get_peft_model(model, config)
    with torch.device("meta"):
        wrapped = get_peft_model(model, config)
    for module in wrapped.modules():
        for key, p in list(module.named_parameters(recurse=False)):
            if p.device.type == "meta":
                made = torch.empty(p.shape, dtype=p.dtype, device=first.device)
                setattr(module, key, torch.nn.Parameter(made, requires_grad=p.requires_grad))
    return wrapped


def _no_target_line(settings: LoraSettings, model, name: str, error: str) -> str:
    """What is wrong with the targets, and which the model has: the name endings of its layers PEFT adapts (linear
    ones, GPT-2's Conv1D)."""
    endings = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                      if n and type(m).__name__ in ("Linear", "Conv1D")})
    named = [e for e in endings if not e.isdigit()]
    example = "q_proj,v_proj" if {"q_proj", "v_proj"} <= set(endings) else ",".join(named[:2]) or ALL_LINEAR
    targets = settings.targets if isinstance(settings.targets, str) else ",".join(settings.targets or [])
    if not settings.targets:
        what = f"PEFT has no default targets for {name}: name them"
    elif "not found" in error:
        what = f"targets={targets} match no module of {name}"
    else:    # a module PEFT cannot adapt (a norm, say): its own words
        what = f"targets={targets} cannot be adapted in {name} ({error.splitlines()[0][:150]})"
    return (f"--lora: {what}; its linear layers' names end in {', '.join(endings) or 'nothing'} (e.g. "
            f"targets={example}, or {ALL_LINEAR})")


@dataclass(frozen=True)
class LoraSource:
    """``base`` (a :class:`~poplar.models.workload.ModelSource`) with LoRA adapters of ``lora``: itself a model source
    (see the module). What it does not say itself (a directory, a vocabulary, a task), its base says."""

    base: Any
    lora: LoraSettings

    def __post_init__(self) -> None:
        require_peft()     # PEFT there, targets that match: refused now, before anything is profiled
        _inspect(self)

    def __getattr__(self, name: str):
        if name.startswith("__") or name in ("base", "lora"):    # (unpickling asks before the fields are set)
            raise AttributeError(name)
        return getattr(self.base, name)

    @property
    def seq_len(self) -> int:
        return self.base.seq_len

    @property
    def name(self) -> str:
        return f"{self.base.name} LoRA r={self.lora.r}"

    def build(self, seed: int = 0):
        """The base's model (its weights, or initialised from ``seed``), wrapped; on meta or fake tensors too."""
        return wrap(self.base.build(seed=seed), self.lora, seed, task_type(self.base), self.base.name)

    def build_empty(self, device=None):
        """None: the frozen weights need their values on every rank (the engine reads only trained parameters
        into shards), so the model is built whole."""
        return None

    @property
    def layers(self) -> int | None:
        """The base's alike layers, where it builds fewer of them (the simulator's :mod:`poplar.simulate.layers`)."""
        return getattr(self.base, "layers", None) if getattr(self.base, "build_layers", None) else None

    def build_layers(self, layers: int, seed: int = 0):
        return wrap(self.base.build_layers(layers, seed), self.lora, seed, task_type(self.base), self.base.name)

    @property
    def loss(self):
        return self.base.loss

    def random_batch(self, n: int, seed: int = 0):
        return self.base.random_batch(n, seed)

    def n_params(self) -> int:
        """Every parameter: the base's and the adapters'."""
        return sum(_inspect(self))

    def trained_params(self) -> int:
        """The adapters' (and whatever PEFT trains beside them: a classifier's head)."""
        return _inspect(self)[0]

    def frozen_params(self) -> int:
        """The base's weights PEFT froze: held whole on every rank, weights only."""
        return _inspect(self)[1]

    def cache_dict(self) -> dict:
        return {**self.base.cache_dict(), "lora": self.lora.model_key()}

    def identity(self) -> dict:
        return {"lora": self.lora.model_key(), "base": self.base.identity()}


_INSPECTED: dict[str, tuple[int, int]] = {}


def _inspect(source: LoraSource) -> tuple[int, int]:
    """``(trained, frozen)`` parameters of the wrapped model, built on the meta device (nothing allocated), once a
    process."""
    import torch

    key = json.dumps(source.identity(), sort_keys=True)
    if key not in _INSPECTED:
        with torch.device("meta"):
            model = source.build()
        trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
        _INSPECTED[key] = (trained, sum(p.numel() for p in model.parameters()) - trained)
    return _INSPECTED[key]
