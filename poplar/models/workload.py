"""A workload: what Poplar needs of a model to profile, plan and train it (:class:`ModelSource`).

The profiler, the simulator, the planner, the measurements and training all need the
same things of a model, and nothing else: build it (seeded; on real, meta or fake
tensors), a batch of ``n`` samples, the loss of a micro-batch, its parameter count, a
stable identity for the caches, and a name to say. A :class:`ModelSource` is that
interface; a value that implements it and pickles crosses into spawned ranks as it is.

:class:`Workload` is the presets' implementation: the built-in ``TinyCausalLM`` presets
(``tiny``, ``small``, ``base``) and the Hugging Face presets of :mod:`poplar.models.hf`
(``llama-tiny`` ... ``bert-base``), named in a small, frozen value.
"""

from __future__ import annotations

import functools
import os

import torch

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from poplar.models import checkpointing
from poplar.models.source import ModelSource
from poplar.models import MODEL_PRESETS, build_model
from poplar.models import causal_lm_loss as tiny_loss
from poplar.models.hf import HF_PRESETS, build_hf_model, causal_lm_loss, family, masked_lm_loss_fn
from poplar.models.presets import default_vocab

HF_DEFAULT_SEQ_LEN = 128
MASK_ID = 1     # the tokenizer's second special token (poplar.data.text.MASK)


class Workload(BaseModel):
    """The presets' :class:`ModelSource`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field("tiny", description="model preset: " + ", ".join([*MODEL_PRESETS, *HF_PRESETS]))
    seq_len: int | None = Field(None, gt=0, description="tokens per sample (default: the preset's)")
    vocab_size: int | None = Field(None, gt=2, description="vocabulary (default: the preset's, or the tokenizer's)")
    activation_checkpointing: bool = Field(False, description="each block keeps only its input in the forward and "
                                           "computes again in the backward (poplar.models.checkpointing)")

    def model_post_init(self, _context) -> None:
        if self.model not in MODEL_PRESETS and self.model not in HF_PRESETS:
            raise ValueError(f"model {self.model!r}: choose one of {', '.join([*MODEL_PRESETS, *HF_PRESETS])}")
        if self.model in MODEL_PRESETS:
            preset = MODEL_PRESETS[self.model]
            for field, default in (("seq_len", preset["max_seq_len"]), ("vocab_size", preset["vocab_size"])):
                value = getattr(self, field)
                if value is not None and value != default:
                    raise ValueError(f"{field} = {value}: the built-in {self.model!r} model has {default}; "
                                     "use a Hugging Face preset for other shapes")
                object.__setattr__(self, field, default)
        else:   # a real-size preset carries its own vocabulary
            object.__setattr__(self, "seq_len", self.seq_len or HF_DEFAULT_SEQ_LEN)
            object.__setattr__(self, "vocab_size", self.vocab_size or default_vocab(self.model))
            limit = HF_PRESETS[self.model][1]["max_position_embeddings"]
            if self.seq_len > limit:
                raise ValueError(f"seq_len = {self.seq_len}: {self.model} has {limit} positions")

    @property
    def name(self) -> str:
        return self.model

    def identity(self) -> dict:
        return self.model_dump(mode="json")

    @property
    def family(self) -> str:
        return "tiny" if self.model in MODEL_PRESETS else family(self.model)

    def build(self, seed: int = 0) -> torch.nn.Module:
        """The model, initialised from ``seed``; on fake tensors or the meta device, of any size."""
        _check_buildable(self)
        if self.model in MODEL_PRESETS:
            model = build_model(self.model, seed=seed)
            return checkpointing.enable(model) if self.activation_checkpointing else model
        return self.build_layers(self.layers, seed)

    @property
    def layers(self) -> int | None:
        """The model's alike layers, where it can be built with fewer (:meth:`build_layers`): a Hugging Face
        preset's."""
        return None if self.model in MODEL_PRESETS else HF_PRESETS[self.model][1]["num_hidden_layers"]

    def build_layers(self, layers: int, seed: int = 0) -> torch.nn.Module:
        """The model with ``layers`` of its layers (the simulator runs a deep model's step from shallow ones:
        :mod:`poplar.simulate.layers`)."""
        overrides = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0} if self.family == "bert" else {}
        model = build_hf_model(self.model, self.vocab_size, seed=seed, num_hidden_layers=layers, **overrides)
        return checkpointing.enable(model) if self.activation_checkpointing else model

    @property
    def loss(self):
        if self.family == "tiny":
            return tiny_loss
        return causal_lm_loss if self.family == "llama" else masked_lm_loss_fn(MASK_ID)

    def random_batch(self, n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Random ``(inputs, targets)`` of ``n`` samples: enough to time and size a step."""
        g = torch.Generator().manual_seed(seed)
        x = torch.randint(2, self.vocab_size, (n, self.seq_len + 1), generator=g)
        return x[:, :-1], x[:, 1:]

    def param_shapes(self) -> list[list[int]]:
        return _param_shapes(self.model, self.vocab_size)

    def n_params(self) -> int:
        return _param_count(self.model, self.vocab_size)

    def cache_dict(self) -> dict:
        """Everything about the workload that changes a device's profile."""
        config = MODEL_PRESETS.get(self.model) or HF_PRESETS[self.model][1]
        return {"model": self.model, "config": config, "seq_len": self.seq_len, "vocab_size": self.vocab_size,
                "shapes": self.param_shapes()}


@functools.lru_cache(maxsize=16)
def _param_shapes(model: str, vocab_size: int) -> list[list[int]]:
    """Built once per process, on the meta device (shapes only: a model of any size); not on seq_len."""
    with torch.device("meta"):
        return [list(p.shape) for p in Workload(model=model, vocab_size=vocab_size).build().parameters()]


def _param_count(model: str, vocab_size: int) -> int:
    """The parameters of a preset, from its shapes' arithmetic (:func:`poplar.models.presets.param_count`)."""
    from poplar.models.presets import param_count

    return param_count(model, vocab_size)


def _check_buildable(wl: Workload) -> None:
    """A model whose fp32 parameters alone would take half this host's memory is refused before it is built."""
    from torch._guards import detect_fake_mode

    if detect_fake_mode() is not None or torch.get_default_device().type == "meta":
        return     # nothing is allocated
    limit = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2
    if 4 * wl.n_params() > limit:
        raise ValueError(f"{wl.model} has {wl.n_params() / 1e9:.1f}B parameters ({4 * wl.n_params() / 2**30:.0f} GiB "
                         f"in fp32), more than this host can build ({limit / 2**30:.0f} GiB is half its memory): "
                         f"plan it with `poplar simulate`, which does not build it")


def model_source(model: str, **fields) -> ModelSource:
    """``--model``'s source: a Hugging Face model directory (a path, :mod:`poplar.models.pretrained`), a factory
    (``package.module:name``, :mod:`poplar.models.factory`) or a preset;
    ``fields`` (``seq_len``, ``vocab_size``, ``activation_checkpointing``; None: the default) as each takes them."""
    from poplar.models.factory import as_source, looks_like_factory
    from poplar.models.pretrained import ModelDirectory, looks_like_directory

    fields = {k: v for k, v in fields.items() if v is not None}
    if looks_like_factory(model):
        try:
            return as_source(model, fields.get("seq_len"), fields.get("activation_checkpointing", False))
        except ValidationError as e:
            raise ValueError(e.errors()[0]["msg"].removeprefix("Value error, ")) from None
    if looks_like_directory(model):
        fields.pop("vocab_size", None)    # a directory's vocabulary is its config's
        try:
            return ModelDirectory(directory=model, **fields)
        except ValidationError as e:     # what is wrong with the directory, in its own words
            raise ValueError(e.errors()[0]["msg"].removeprefix("Value error, ")) from None
    return Workload(model=model, **fields)


def as_workload(x: str | dict | ModelSource) -> ModelSource:
    """A model source: itself, a preset's or a directory's from its name or path, or from its fields (an
    :meth:`~ModelSource.identity`: a LoRA source's holds its base's)."""
    if isinstance(x, dict):
        if "lora" in x:
            from poplar.models.lora import LoraSettings, LoraSource

            return LoraSource(as_workload(x["base"]), LoraSettings(**x["lora"]))
        if "directory" in x:
            from poplar.models.pretrained import ModelDirectory

            return ModelDirectory(**x)
        if "factory" in x:
            from poplar.models.factory import FactorySource

            return FactorySource(**x)
        return Workload(**x)
    if isinstance(x, str):
        return model_source(x)
    if isinstance(x, ModelSource):
        return x
    raise TypeError(f"a workload is a preset's name, its fields or a poplar.models.workload.ModelSource, got "
                    f"{type(x).__name__}")
