"""A user's own model: a Hugging Face model directory (or its ``config.json``), with its weights where present.

:class:`ModelDirectory` is the :class:`~poplar.models.workload.ModelSource` of a directory that
``save_pretrained`` wrote (or of a ``config.json`` alone): any causal-LM, masked-LM or
sequence-classification architecture the installed ``transformers`` builds (Llama, Qwen2,
Mistral, GPT-2, GPT-NeoX, BERT, ...; :mod:`poplar.models.classify` for the last). Built
for real, it is the pretrained model: ``from_pretrained`` reads the directory's
safetensors (one file or a sharded index), in fp32 whatever the checkpoint's dtype (the
engine keeps fp32 master weights; the precision option decides what it computes in).
For training, :meth:`ModelDirectory.build_empty` gives it with its parameters on the meta
device and a reader the engine fills each rank's shards from (:mod:`poplar.models.weights`).
Built on the meta device or fake tensors (the simulator, the
profiler's sizes) no weight is read.

Everything that can be wrong with a directory is said in one line when the source is
made, before any profiling: no config, an architecture transformers cannot build or
Poplar cannot train, weights whose names or shapes do not match the config, a sequence
longer than the model's positions. The weights are checked by transformers' own loading
on the meta device: their names and shapes, not their tensors.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from poplar.models import checkpointing
from poplar.models.weights import WEIGHTS, WEIGHTS_INDEX

DEFAULT_SEQ_LEN = 128
TASK_SUFFIXES = {"ForCausalLM": "causal-lm", "LMHeadModel": "causal-lm", "ForMaskedLM": "masked-lm",
                 "ForSequenceClassification": "sequence-classification"}
Task = Literal["causal-lm", "masked-lm", "sequence-classification"]


def looks_like_directory(model: str) -> bool:
    """Whether ``--model`` names a path (a model directory or its config.json) rather than a preset (a preset's
    name is one even where a directory of that name is here: ``./tiny`` is the directory)."""
    from poplar.models import MODEL_PRESETS
    from poplar.models.hf import HF_PRESETS

    if "/" in model or model.endswith(".json") or model.startswith("."):
        return True
    return model not in MODEL_PRESETS and model not in HF_PRESETS and Path(model).is_dir()


class ModelDirectory(BaseModel):
    """A Hugging Face model directory as a :class:`~poplar.models.workload.ModelSource` (see the module)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    directory: str = Field(description="the model's directory (config.json, safetensors, tokenizer files)")
    seq_len: int | None = Field(None, gt=1, description="tokens per sample (default: 128, or the model's positions)")
    activation_checkpointing: bool = False
    pretrained: bool = Field(True, description="start from the directory's weights (False: a fresh initialisation)")
    config_digest: str = Field("", description="the config's content (filled in): a changed config is another model")

    def model_post_init(self, _context) -> None:
        path = Path(self.directory)
        if path.is_file() or path.name == "config.json":
            if path.name != "config.json":
                raise ValueError(f"--model {self.directory}: not a model directory or its config.json")
            path = path.parent
        if not path.exists():
            raise ValueError(f"--model {self.directory}: no such directory (a preset is named without a path)")
        if not (path / "config.json").is_file():
            raise ValueError(f"--model {self.directory}: the directory has no config.json (what save_pretrained "
                             "writes): give a Hugging Face model directory")
        object.__setattr__(self, "directory", str(path.resolve()))
        text = (path / "config.json").read_text()
        digest = hashlib.sha256(text.encode()).hexdigest()[:16]
        if self.config_digest and self.config_digest != digest:
            raise ValueError(f"{path / 'config.json'} changed since this model was recorded: it is another model")
        object.__setattr__(self, "config_digest", digest)
        info = _inspect(self.directory, digest)
        positions = info["positions"]
        object.__setattr__(self, "seq_len", self.seq_len or min(DEFAULT_SEQ_LEN, positions or DEFAULT_SEQ_LEN))
        if positions and self.seq_len > positions:
            raise ValueError(f"seq_len = {self.seq_len}: {self.name} has {positions} positions "
                             "(max_position_embeddings): use a shorter sequence")
        if self.pretrained and info["weights"]:
            _check_weights(self.directory, digest)
        if info["task"] == "sequence-classification":
            self.pad_id()

    @property
    def name(self) -> str:
        return Path(self.directory).name

    @property
    def task(self) -> Task:
        return _inspect(self.directory, self.config_digest)["task"]

    @property
    def vocab_size(self) -> int:
        return _inspect(self.directory, self.config_digest)["vocab_size"]

    @property
    def positions(self) -> int | None:
        return _inspect(self.directory, self.config_digest)["positions"]

    @property
    def has_weights(self) -> bool:
        return bool(_inspect(self.directory, self.config_digest)["weights"])

    def identity(self) -> dict:
        return self.model_dump(mode="json")

    def build(self, seed: int = 0) -> torch.nn.Module:
        """The pretrained model (fp32), or initialised from ``seed`` where there are no weights, or no real tensors."""
        from torch._guards import detect_fake_mode

        auto = _auto_class(self.task)
        allocates = detect_fake_mode() is None and torch.get_default_device().type != "meta"
        if allocates and self.pretrained and self.has_weights:
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()    # a run's output is its own lines
            model = auto.from_pretrained(self.directory, dtype=torch.float32, local_files_only=True)
        else:
            torch.manual_seed(seed)
            model = auto.from_config(self.config, dtype=torch.float32)
        self._configure(model)
        return checkpointing.enable(model) if self.activation_checkpointing else model

    @property
    def layers(self) -> int | None:
        """The model's alike layers, where it can be built with fewer (:meth:`build_layers`; the simulator draws a
        deep model's step from shallow ones, :mod:`poplar.simulate.layers`): its config's ``num_hidden_layers``,
        unless a setting of one value a layer tells its layers apart (alternating attention, say)."""
        n, per_layer = self._per_layer()
        if n is None or any(len({json.dumps(x, sort_keys=True, default=str) for x in values}) > 1
                            for values in per_layer.values()):
            return None
        return n

    def _per_layer(self) -> tuple[int | None, dict[str, list]]:
        """The config's layers (None: no count of them), and its settings of one value a layer."""
        n = getattr(self.config, "num_hidden_layers", None)
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            return None, {}
        return n, {k: v for k, v in self.config.to_dict().items() if isinstance(v, list) and len(v) == n}

    def build_layers(self, layers: int, seed: int = 0) -> torch.nn.Module:
        """The model with ``layers`` of its alike layers (:attr:`layers`), initialised from ``seed``: never its
        weights (a shallow model is only counted)."""
        config = copy.deepcopy(self.config)
        for key, values in self._per_layer()[1].items():     # as many settings of one value a layer as built
            setattr(config, key, values[:layers])
        config.num_hidden_layers = layers
        torch.manual_seed(seed)
        model = _auto_class(self.task).from_config(config, dtype=torch.float32)
        self._configure(model)
        return checkpointing.enable(model) if self.activation_checkpointing else model

    def build_empty(self, device: torch.device | str = "cpu"):
        """``(model, weights)``: the model with its parameters on the meta device and its buffers on ``device``,
        and the reader of its weights (:mod:`poplar.models.weights`), for the engine to read each rank's shards
        alone; None where the model starts from no weights, or the checkpoint names a parameter otherwise than
        the model does (transformers' renamings: :meth:`build` loads it whole)."""
        from poplar.models.weights import SafetensorsWeights, names_of, parameters_on_meta

        if not (self.pretrained and self.has_weights):
            return None
        with parameters_on_meta(), torch.device(device):
            model = _auto_class(self.task).from_config(self.config, dtype=torch.float32)
        self._configure(model)
        weights = SafetensorsWeights(self.directory, getattr(model, "base_model_prefix", ""))
        if any(weights.key(n) is None for n in names_of(model).values()):
            return None
        with torch.no_grad():   # saved buffers as saved (the rest as the model computes them)
            for name, buf in model.named_buffers():
                key = weights.key((name,))
                saved = weights.read_whole(key) if key is not None else None
                if saved is not None and saved.shape == buf.shape:
                    buf.copy_(saved)
        model = checkpointing.enable(model) if self.activation_checkpointing else model
        return model, weights

    def _configure(self, model) -> None:
        model.config.use_cache = False     # a generation cache is of no use in training
        if self.task == "sequence-classification":   # its head finds each sample's last token by the padding
            model.config.pad_token_id = self.pad_id()

    @property
    def loss(self):
        from poplar.models.classify import ClassifierLoss
        from poplar.models.hf import causal_lm_loss, masked_lm_loss_fn

        if self.task == "sequence-classification":
            return ClassifierLoss(self.pad_id())
        return causal_lm_loss if self.task == "causal-lm" else masked_lm_loss_fn(self.mask_id())

    @property
    def config(self):
        """The directory's transformers config (read once)."""
        return _config(self.directory, self.config_digest)

    @property
    def num_labels(self) -> int:
        return self.config.num_labels

    def pad_id(self) -> int:
        """The padding id a classifier's samples are padded with and its head skips: the config's, else its
        tokenizer's (one line where there is neither: the head could not tell a sample's last token)."""
        config = self.config
        pad = config.pad_token_id
        if pad is None and self.has_tokenizer():
            pad = auto_tokenizer(self.directory).pad_token_id
        if pad is None:
            raise ValueError(f"--model {self.directory}: a sequence classifier needs a padding token (its head reads "
                             "each sample's last one): set pad_token_id in config.json or a pad_token in its "
                             "tokenizer")
        return int(pad)

    def mask_id(self) -> int:
        """The mask token a masked LM is trained with: its tokenizer's, else a trained tokenizer's (id 1)."""
        tok = auto_tokenizer(self.directory) if self.has_tokenizer() else None
        return tok.mask_token_id if tok is not None and tok.mask_token_id is not None else 1

    def has_tokenizer(self) -> bool:
        return any((Path(self.directory) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))

    def random_batch(self, n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Random ``(inputs, targets)`` of ``n`` samples: enough to time and size a step (a classifier's targets
        are a label a sample)."""
        g = torch.Generator().manual_seed(seed)
        x = torch.randint(0, self.vocab_size, (n, self.seq_len + 1), generator=g)
        if self.task == "sequence-classification":
            from poplar.models.classify import random_labels

            return x[:, :-1], random_labels(n, self.num_labels, self.config, g)
        return x[:, :-1], x[:, 1:]

    def n_params(self) -> int:
        return _inspect(self.directory, self.config_digest)["n_params"]

    def cache_dict(self) -> dict:
        """What changes a device's profile: the architecture and its sizes, not the weights' values."""
        info = _inspect(self.directory, self.config_digest)
        return {"model": "directory", "config": info["config"], "seq_len": self.seq_len,
                "activation_checkpointing": self.activation_checkpointing, "shapes": info["shapes"]}


@functools.lru_cache(maxsize=4)
def auto_tokenizer(directory: str):
    """The tokenizer saved in a model directory, read offline (one line where it cannot be, or is not a fast one)."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except Exception as e:
        line = next((x for x in str(e).splitlines() if x.strip()), type(e).__name__)
        raise ValueError(f"--model {directory}: its tokenizer cannot be read ({line[:200]}): save it with "
                         "tokenizer.save_pretrained, or remove the tokenizer files to train one on the data") from None
    if not getattr(tok, "is_fast", False):
        raise ValueError(f"--model {directory}: its tokenizer is not a fast one (no tokenizer.json): save a fast "
                         "tokenizer (PreTrainedTokenizerFast) in the directory")
    return tok


def _auto_class(task: Task):
    import transformers

    from poplar.models.hf import runs_as_on_real_tensors

    runs_as_on_real_tensors()

    return getattr(transformers, {"causal-lm": "AutoModelForCausalLM", "masked-lm": "AutoModelForMaskedLM",
                                  "sequence-classification": "AutoModelForSequenceClassification"}[task])


@functools.lru_cache(maxsize=8)
def _config(directory: str, digest: str):
    """The directory's config, read once per process (``digest``: a changed file is read again)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(directory, local_files_only=True)
    except Exception as e:   # not JSON, an unknown model_type, values its validators refuse
        line = next((x for x in str(e).splitlines() if x.strip()), type(e).__name__)
        raise ValueError(f"--model {directory}: transformers cannot read its config.json ({line[:200]}): give a "
                         "config of an architecture the installed transformers knows") from None


def _task(config) -> Task:
    names = list(getattr(config, "architectures", None) or [])
    for name in names:
        for suffix, task in TASK_SUFFIXES.items():
            if name.endswith(suffix):
                return task
    if names:
        raise ValueError(f"architecture {names[0]}: Poplar trains causal-LM (...ForCausalLM), masked-LM "
                         "(...ForMaskedLM) and sequence-classification (...ForSequenceClassification) models: save "
                         "the model with such a head")
    return "causal-lm"


@functools.lru_cache(maxsize=8)
def _inspect(directory: str, digest: str) -> dict:
    """The facts of a directory Poplar needs, from its config and a build on the meta device (nothing allocated)."""
    config = _config(directory, digest)
    task = _task(config)
    try:
        with torch.device("meta"):
            model = _auto_class(task).from_config(config, dtype=torch.float32)
    except Exception as e:   # an architecture this transformers cannot build: one line, not its traceback
        line = next((x for x in str(e).splitlines() if x.strip()), type(e).__name__)
        raise ValueError(f"--model {directory}: transformers cannot build {type(config).__name__} as a "
                         f"{task} model ({line[:200]})") from None
    params = dict(model.named_parameters())
    path = Path(directory)
    weights = [path / WEIGHTS] if (path / WEIGHTS).is_file() else []
    if (path / WEIGHTS_INDEX).is_file():
        index = json.loads((path / WEIGHTS_INDEX).read_text())
        weights = sorted({path / f for f in index.get("weight_map", {}).values()})
    if not weights and any(path.glob("pytorch_model*.bin")):
        raise ValueError(f"--model {directory}: the weights are pickles (pytorch_model.bin), which Poplar does not "
                         "unpickle: save the model again with save_pretrained (safetensors)")
    vocab = model.get_input_embeddings().weight.shape[0]
    return {"config": _config_dict(config), "task": task, "vocab_size": int(vocab),
            "positions": getattr(config, "max_position_embeddings", None),
            "n_params": sum(p.numel() for p in params.values()),
            "shapes": {n: list(p.shape) for n, p in model.state_dict().items()},
            "weights": [str(w) for w in weights]}


def _config_dict(config) -> dict:
    """The config's values that make the model what it is (not where it was saved or by which version)."""
    out = config.to_dict()
    for volatile in ("_name_or_path", "transformers_version", "dtype", "torch_dtype", "use_cache"):
        out.pop(volatile, None)
    return out


@functools.lru_cache(maxsize=8)
def _check_weights(directory: str, digest: str) -> None:
    """The weights' names and shapes against the config's model: transformers' own loading (its renamings of old
    names, its tied weights) on the meta device, where no tensor is read."""
    from transformers.utils import logging as hf_logging

    info = _inspect(directory, digest)
    for file in info["weights"]:
        if not Path(file).is_file():
            raise ValueError(f"--model {directory}: the weights' index names {Path(file).name}, which is not there")
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()    # its load report is said here, in one line
    hf_logging.disable_progress_bar()
    try:
        _, found = _auto_class(info["task"]).from_pretrained(
            directory, device_map="meta", output_loading_info=True, ignore_mismatched_sizes=True, local_files_only=True)
    except Exception as e:
        line = next((x for x in str(e).splitlines() if x.strip()), type(e).__name__)
        raise ValueError(f"--model {directory}: its weights cannot be read ({line[:200]}): save the model again "
                         "with save_pretrained") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    if found["mismatched_keys"]:
        name, saved, wanted = sorted(found["mismatched_keys"])[0]
        raise ValueError(f"--model {directory}: {name} is {list(saved)} in the weights and {list(wanted)} in the "
                         "config's model: the weights are of another size of model")
    for what, keys, fix in (("hold {} tensor(s) the config's model has not", found["unexpected_keys"],
                             "the weights are of another model"),
                            ("lack {} tensor(s) of the config's model", found["missing_keys"],
                             "save the whole model, or train from scratch with pretrained: false")):
        if keys:
            raise ValueError(f"--model {directory}: the weights {what.format(len(keys))} (e.g. {sorted(keys)[0]}): "
                             f"{fix}")
