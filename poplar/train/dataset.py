"""A run's model and data: the model source its config names, and the global batches of its data.

``model`` is a preset's name, a Hugging Face model directory
(:class:`~poplar.models.pretrained.ModelDirectory`) or a factory
(:mod:`poplar.models.factory`); the data is prepared once
(:func:`poplar.data.prepare.prepare`: the model's tokenizer, or one trained on the text;
cached, so the ranks read back the launcher's). Each function takes the config's model and
data section (``cfg.model_data``, :class:`~poplar.train.config.ModelData`).

Evaluation data (``eval_data``, :func:`prepare_eval`) are read by the same call: a file as
``data`` is read (its fields, its format) and cut with the training's tokenizer, or a
fraction of the training data's samples held out (:mod:`poplar.train.eval_data`).
"""

from __future__ import annotations

import functools

from poplar.train.config import ModelData
from poplar.models.workload import ModelSource, Workload


SHOWN_AFTER_S = 2.0   # data tokenised quicker than this are not shown


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


def prepare_data(cfg: ModelData, progress=None):
    """The tokenizer (None: the data is ids and the model has none) and the run's :class:`GlobalBatches` (the
    samples held out for evaluation left out).

    ``progress``: a factory of a progress display (``progress(title, after_s=...)``, as the CLI's), shown only
    while the data are tokenised (a first run; later ones read them back from the cache), and only once that has
    taken ``SHOWN_AFTER_S`` (a refusal of a small file stays its one line)."""
    from poplar.data.text import GlobalBatches
    from poplar.train.eval_data import held_out, subset

    prepared = _prepared(cfg, cfg.data, own_model(cfg), progress)
    if isinstance(cfg.eval_data, float):    # the samples held out never train
        prepared = subset(prepared, held_out(len(prepared.tokens), cfg.eval_data, cfg.seed, cfg.global_batch)[0])
    return prepared.tokenizer, GlobalBatches(prepared.tokens, cfg.global_batch, seed=cfg.seed,
                                             targets=prepared.targets, labels=prepared.labels)


def prepare_eval(cfg: ModelData, tokenizer):
    """The evaluation samples (a :class:`~poplar.data.prepare.Prepared`; None without ``eval_data``), in a fixed
    order: the fraction held out of the training data, or ``eval_data``'s file read as ``data`` is and cut with
    the training's ``tokenizer`` (what :func:`prepare_data` gave)."""
    from poplar.data.text import data_cache_dir
    from poplar.train.eval_data import held_out, subset, with_training_tokenizer

    if cfg.eval_data is None:
        return None
    if isinstance(cfg.eval_data, float):
        whole = _prepared(cfg, cfg.data, own_model(cfg))
        return subset(whole, held_out(len(whole.tokens), cfg.eval_data, cfg.seed, cfg.global_batch)[1])
    try:
        return _prepared(cfg, cfg.eval_data, with_training_tokenizer(own_model(cfg), tokenizer, data_cache_dir()))
    except (ValueError, FileNotFoundError, RuntimeError) as e:   # prepare's words name --data: here, eval_data
        raise type(e)(str(e).replace("--data ", "eval_data ", 1)) from None


def _prepared(cfg: ModelData, source: str, model_source, progress=None):
    """``source`` prepared for the run (:func:`poplar.data.prepare.prepare`), shown as :func:`prepare_data` says."""
    import contextlib

    from poplar.data.prepare import prepare

    with contextlib.ExitStack() as shown:
        def phase(what: str) -> None:
            if progress is not None:
                shown.enter_context(progress(f"data: {source}", after_s=SHOWN_AFTER_S)).phase(what)
        return prepare(source, cfg.data_fields, model_source, cfg.seq_len, cfg.vocab_size, phase=phase,
                       chat_template=cfg.chat_template)


def named_model(cfg: ModelData) -> ModelSource:
    """The model the run trains as far as its name and sample length go, without reading the data (a preset's
    vocabulary is the tokenizer's, known only after): what a given plan is checked against, first (LoRA's
    targets too)."""
    return with_lora(cfg, own_model(cfg) or Workload(model=cfg.model, seq_len=cfg.seq_len,
                                                     activation_checkpointing=cfg.activation_checkpointing))


def with_lora(cfg: ModelData, source: ModelSource) -> ModelSource:
    """``source`` with the run's LoRA adapters (:class:`~poplar.models.lora.LoraSource`), where it has some."""
    if cfg.lora is None:
        return source
    from poplar.models.lora import LoraSource

    return LoraSource(source, cfg.lora)


def workload_of(cfg: ModelData, prepared: tuple | None = None) -> ModelSource:
    """The model the run trains: its own (a directory, a factory), or a preset of the tokenizer's vocabulary; with
    its LoRA adapters, where the run has some.
    ``prepared``: what :func:`prepare_data` gave, where the caller has it (else the data are prepared here)."""
    own = own_model(cfg)
    tok, _ = prepared or prepare_data(cfg)
    if own is not None:
        return with_lora(cfg, own)
    return with_lora(cfg, Workload(model=cfg.model, seq_len=cfg.seq_len,
                                   vocab_size=tok.vocab_size if tok else cfg.vocab_size,
                                   activation_checkpointing=cfg.activation_checkpointing))
