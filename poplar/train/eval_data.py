"""Where a run's evaluation samples come from: a seeded fraction held out of the training data, or a file cut
with the training's tokenizer.

:func:`held_out` splits the training data's samples once, by a permutation seeded by the
run's seed: the same split in every run, and the held-out samples never train.
:func:`with_training_tokenizer` hands :func:`poplar.data.prepare.prepare` the training's
tokenizer for an evaluation file, so that it is cut with the tokenizer the model learnt
on (not one trained on the evaluation text). :func:`poplar.train.dataset.prepare_run_data`
uses both.
"""

from __future__ import annotations

import os
import shutil

import torch

HELD_OUT_SALT = 0x6576616C   # the held-out split's generator differs from the batches' order of any epoch


def held_out(samples: int, fraction: float, seed: int, global_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(train, held)``: the sample indices (sorted) that train and those held out, ``round(fraction *
    samples)`` of them, chosen by a permutation seeded by ``seed`` (the same in every run); one line where
    nothing is held out or the training samples fill no global batch.

    >>> train, held = held_out(10, 0.2, 0, 4)
    >>> len(train), len(held), sorted(train.tolist() + held.tolist()) == list(range(10))
    (8, 2, True)
    """
    held = int(fraction * samples + 0.5)
    if held == 0:
        raise ValueError(f"eval_data {fraction}: holds out none of the {samples} samples; give at least "
                         f"{1 / samples:.2g} (one sample), or a file of evaluation data")
    if samples - held < global_batch:
        raise ValueError(f"eval_data {fraction}: holds out {held} of the {samples} samples and leaves "
                         f"{samples - held} to train on, fewer than a global batch of {global_batch}: hold out "
                         "less, or give a file of evaluation data")
    order = torch.randperm(samples, generator=torch.Generator().manual_seed(seed * 1_000_003 + HELD_OUT_SALT))
    return order[held:].sort().values, order[:held].sort().values


def subset(prepared, index: torch.Tensor):
    """The samples ``index`` of ``prepared`` (a :class:`~poplar.data.prepare.Prepared`), as one."""
    from poplar.data.prepare import Prepared

    pick = lambda t: None if t is None else t[index].contiguous()   # noqa: E731
    return Prepared(pick(prepared.tokens), pick(prepared.targets), prepared.tokenizer, pick(prepared.labels))


def with_training_tokenizer(source, tokenizer, cache_dir):
    """``source`` (a model source, or None for a preset) as :func:`~poplar.data.prepare.prepare` reads it for
    evaluation data: with the training's ``tokenizer``. A model directory's own is the training's already; one
    trained on the training data is saved as a directory's own under ``cache_dir`` (by its content, once)."""
    if tokenizer is None or (getattr(source, "directory", None) is not None and source.has_tokenizer()):
        return source
    from poplar.data.text import EOT, MASK

    directory = cache_dir / f"tokenizer-{tokenizer.digest}"
    if not (directory / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast

        tmp = directory.with_name(f"{directory.name}.tmp{os.getpid()}")
        PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend, eos_token=EOT,
                                mask_token=MASK if tokenizer.mask_id is not None else None).save_pretrained(tmp)
        try:
            tmp.rename(directory)
        except OSError:    # another process saved it first: the same content
            shutil.rmtree(tmp, ignore_errors=True)
    return TrainingTokenizer(source, str(directory))


class TrainingTokenizer:
    """A model source whose tokenizer is the one saved in ``directory``; everything else is ``source``'s (None: a
    preset's, of which prepare reads nothing else)."""

    def __init__(self, source, directory: str):
        self._source, self.directory = source, directory

    def has_tokenizer(self) -> bool:
        return True

    def __getattr__(self, name: str):
        source = self.__dict__.get("_source")
        if name.startswith("__") or source is None:
            raise AttributeError(name)
        return getattr(source, name)
