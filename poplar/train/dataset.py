"""A run's model and data: the model source its config names, and the global batches of its data.

``model`` is a preset's name, a Hugging Face model directory
(:class:`~poplar.models.pretrained.ModelDirectory`) or a factory
(:mod:`poplar.models.factory`): :func:`own_model` resolves it once (None: a preset, whose vocabulary is the
tokenizer's, known only once the data are read). :func:`prepare_run_data` prepares the data once
(:func:`poplar.data.prepare.prepare`: the model's tokenizer, or one trained on the text; cached) into a
:class:`RunData`, which the launcher (or rank 0) hands to every rank. Each function takes the config's model and
data section (``cfg.model_data``, :class:`~poplar.train.config.ModelData`).

Evaluation data (``eval_data``) are read by the same call: a file as ``data`` is read (its fields, its format) and
cut with the training's tokenizer, or a fraction of the training data's samples held out
(:mod:`poplar.train.eval_data`).
"""

from __future__ import annotations

import functools
import pickle
from dataclasses import dataclass
from typing import TYPE_CHECKING

from poplar.train.config import ModelData
from poplar.models.workload import ModelSource, Workload

if TYPE_CHECKING:
    from poplar.data.prepare import Prepared
    from poplar.data.text import GlobalBatches


SHOWN_AFTER_S = 2.0   # data tokenised quicker than this are not shown


@dataclass(frozen=True)
class RunData:
    """A run's model and data, prepared once (by the launcher, or rank 0) and read by every rank: the model trained
    (its own, or a preset of the tokenizer's vocabulary; with its LoRA adapters), the tokenizer (None: the data are
    ids and the model has none), the training's global batches (the samples held out left out) and the evaluation
    samples (None: no ``eval_data``), in a fixed order.

    It pickles its tensors by copy: a spawned rank receives them whole, as it would read them from the cache,
    where shared memory (what ``torch.multiprocessing`` would hand over) is bounded by ``/dev/shm`` (64 MB in a
    container by default)."""

    model: ModelSource
    tokenizer: object | None
    batches: GlobalBatches
    eval_samples: Prepared | None

    def __reduce__(self):
        return _unpickled, (pickle.dumps((self.model, self.tokenizer, self.batches, self.eval_samples)),)


def _unpickled(fields: bytes) -> RunData:
    return RunData(*pickle.loads(fields))


def own_model(cfg: ModelData):
    """The config's own model, a directory or a factory (None: a preset), checked in one line before anything
    runs."""
    from poplar.models.factory import looks_like_factory
    from poplar.models.pretrained import looks_like_directory

    if looks_like_factory(cfg.model):
        return _own(cfg.model, cfg.seq_len, cfg.activation_checkpointing)
    if looks_like_directory(cfg.model):
        return _own(cfg.model, cfg.seq_len, cfg.activation_checkpointing, pretrained=cfg.pretrained)
    return None


@functools.lru_cache(maxsize=4)
def _own(model: str, seq_len: int, checkpointing: bool, **fields):
    from poplar.models.workload import model_source

    return model_source(model, seq_len=seq_len, activation_checkpointing=checkpointing, **fields)


def named_model(cfg: ModelData, own) -> ModelSource:
    """The model the run trains as far as its name and sample length go, without reading the data (a preset's
    vocabulary is the tokenizer's, known only after): what a given plan is checked against, first (LoRA's
    targets too). ``own``: :func:`own_model`'s."""
    return _model(cfg, own, named=True)


def prepare_run_data(cfg: ModelData, own, progress=None) -> RunData:
    """The run's :class:`RunData`, prepared once. ``own``: :func:`own_model`'s.

    ``progress``: a factory of a progress display (``progress(title, after_s=...)``, as the CLI's), shown only
    while the data are tokenised (a first run; later ones read them back from the cache), and only once that has
    taken ``SHOWN_AFTER_S`` (a refusal of a small file stays its one line)."""
    trained, held = _split(cfg, _prepared(cfg, cfg.data, own, progress))
    tokenizer = trained.tokenizer
    return RunData(_model(cfg, own, tokenizer), tokenizer, _batches(cfg, trained),
                   held if held is not None else _eval_file(cfg, own, tokenizer))


def prepare_data(cfg: ModelData, progress=None):
    """The tokenizer and the :class:`~poplar.data.text.GlobalBatches` alone (:func:`prepare_run_data`'s first half,
    for those that read the training data only)."""
    trained, _ = _split(cfg, _prepared(cfg, cfg.data, own_model(cfg), progress))
    return trained.tokenizer, _batches(cfg, trained)


def workload_of(cfg: ModelData, prepared: tuple | None = None) -> ModelSource:
    """The model the run trains (:attr:`RunData.model`). ``prepared``: what :func:`prepare_data` gave, where the
    caller has it (else the data are prepared here)."""
    tokenizer, _ = prepared or prepare_data(cfg)
    return _model(cfg, own_model(cfg), tokenizer)


def _model(cfg: ModelData, own, tokenizer=None, named: bool = False) -> ModelSource:
    """``own``, or the preset of ``tokenizer``'s vocabulary (of none yet: ``named``), with its LoRA adapters."""
    if own is None:
        vocab = {} if named else {"vocab_size": tokenizer.vocab_size if tokenizer else cfg.vocab_size}
        own = Workload(model=cfg.model, seq_len=cfg.seq_len, activation_checkpointing=cfg.activation_checkpointing,
                       **vocab)
    if cfg.lora is None:
        return own
    from poplar.models.lora import LoraSource

    return LoraSource(own, cfg.lora)


def _split(cfg: ModelData, whole: Prepared) -> tuple[Prepared, Prepared | None]:
    """The samples that train and those held out for evaluation (None: no fraction is held out)."""
    if not isinstance(cfg.eval_data, float):
        return whole, None
    from poplar.train.eval_data import held_out, subset

    train, held = held_out(len(whole.tokens), cfg.eval_data, cfg.seed, cfg.global_batch)
    return subset(whole, train), subset(whole, held)


def _batches(cfg: ModelData, trained: Prepared) -> GlobalBatches:
    from poplar.data.text import GlobalBatches

    return GlobalBatches(trained.tokens, cfg.global_batch, seed=cfg.seed, targets=trained.targets,
                         labels=trained.labels)


def _eval_file(cfg: ModelData, own, tokenizer) -> Prepared | None:
    """``eval_data``'s file read as ``data`` is and cut with the training's ``tokenizer`` (None: no file)."""
    if not isinstance(cfg.eval_data, str):
        return None
    from poplar.data.text import data_cache_dir
    from poplar.train.eval_data import with_training_tokenizer

    try:
        return _prepared(cfg, cfg.eval_data, with_training_tokenizer(own, tokenizer, data_cache_dir()))
    except (ValueError, FileNotFoundError, RuntimeError) as e:   # prepare's words name --data: here, eval_data
        raise type(e)(str(e).replace("--data ", "eval_data ", 1)) from None


def _prepared(cfg: ModelData, source: str, model_source, progress=None) -> Prepared:
    """``source`` prepared for the run (:func:`poplar.data.prepare.prepare`), shown as :func:`prepare_run_data`
    says."""
    import contextlib

    from poplar.data.prepare import prepare

    with contextlib.ExitStack() as shown:
        def phase(what: str) -> None:
            if progress is not None:
                shown.enter_context(progress(f"data: {source}", after_s=SHOWN_AFTER_S)).phase(what)
        return prepare(source, cfg.data_fields, model_source, cfg.seq_len, cfg.vocab_size, phase=phase,
                       chat_template=cfg.chat_template)
