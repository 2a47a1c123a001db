"""The tokenizer a run's text is cut with: the model directory's own, or one trained here on the text.

:class:`TextTokenizer` is what data preparation needs of either: ids of many texts at
once (Hugging Face ``tokenizers``, on every core), the end-of-text id that joins packed
documents and ends a completion, the padding id, the mask id of a masked LM, and the
vocabulary size to check against the model's. A model directory's tokenizer is read with
``AutoTokenizer`` (offline) and must be a fast one (a ``tokenizer.json``, or one
transformers converts).
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass


@dataclass(frozen=True)
class TextTokenizer:
    backend: object               # a tokenizers.Tokenizer
    eos_id: int
    pad_id: int
    vocab_size: int               # every id it can give (added tokens included)
    mask_id: int | None
    digest: str                   # its content: a cache of prepared data is keyed on it

    def encode(self, texts: list[str], special: bool = True) -> list[list[int]]:
        """Ids of each text (``special``: with the tokens the tokenizer adds around a text, e.g. a BOS)."""
        return [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=special)]


def trained_tokenizer(docs: list[str], vocab_size: int) -> TextTokenizer:
    """A byte-level BPE tokenizer trained on ``docs`` (:func:`poplar.data.text.train_tokenizer`, cached)."""
    from poplar.data.text import EOT, MASK, train_tokenizer

    tok = train_tokenizer(docs, vocab_size)
    eos = tok.token_to_id(EOT)
    return TextTokenizer(tok, eos, eos, tok.get_vocab_size(), tok.token_to_id(MASK), _digest(tok))


@functools.lru_cache(maxsize=4)
def model_tokenizer(directory: str) -> TextTokenizer:
    """The tokenizer saved in a model directory (:func:`poplar.models.pretrained.auto_tokenizer`)."""
    from poplar.models.pretrained import auto_tokenizer

    tok = auto_tokenizer(directory)
    eos = tok.eos_token_id if tok.eos_token_id is not None else tok.sep_token_id
    if eos is None:
        raise ValueError(f"--model {directory}: its tokenizer has no end-of-text (eos) token to end a sample with: "
                         "set eos_token and save it again")
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos
    backend = tok.backend_tokenizer
    return TextTokenizer(backend, eos, pad, len(tok), tok.mask_token_id, _digest(backend))


def tokenizer_of(model_source, docs: list[str] | None, vocab_size: int) -> TextTokenizer:
    """The model's own tokenizer where its directory has one; else one trained on ``docs``, checked against the
    model's vocabulary."""
    directory = getattr(model_source, "directory", None)
    model_vocab = getattr(model_source, "vocab_size", None) if model_source is not None else None
    if directory is not None and model_source.has_tokenizer():
        tok = model_tokenizer(directory)
    else:
        if docs is None:
            raise ValueError("the data is already token ids, and the model has no tokenizer to read text with")
        tok = trained_tokenizer(docs, min(vocab_size, model_vocab) if model_vocab else vocab_size)
    if model_vocab is not None and tok.vocab_size > model_vocab:
        raise ValueError(f"the tokenizer gives {tok.vocab_size} ids and {model_source.name} embeds "
                         f"{model_vocab}: give the model's own tokenizer, or resize its embeddings")
    return tok


def _digest(backend) -> str:
    return hashlib.sha256(backend.to_str().encode()).hexdigest()[:16]
