"""A run's data prepared once: text, pairs or ids, cut by the tokenizer into fixed-length samples, cached by content.

:func:`prepare` reads ``--data`` (:func:`poplar.data.text.load_text` for plain text,
:func:`poplar.data.records.read_records` for tables), takes the model's tokenizer or trains
one (:func:`poplar.data.tokenizer.tokenizer_of`) and gives :class:`Prepared`:

- documents are packed (joined by end-of-text, cut into ``seq_len + 1`` tokens), every
  next token counted;
- a prompt/completion pair is one sample: prompt, completion, end-of-text, cut to
  ``seq_len + 1`` and padded; only the completion's tokens (and its end) are counted;
- ids are samples as they are (their ``labels`` where given), cut and padded alike;
- a text with a label is one sample of a sequence classifier: its ids cut to ``seq_len``
  and padded with the model's padding id, and its label (:mod:`poplar.models.classify`);
- a conversation (:mod:`poplar.data.chat`) is one sample: rendered by the chat template, cut and
  padded as a pair is; only the assistant's tokens are counted (:mod:`poplar.data.chat_template`).

The launcher prepares; the ranks read the same tensors back from the cache (keyed by
the data's bytes, the tokenizer, the chat template, the sequence length and the fields, its
format among them), so tokenising a large file happens once.
"""

from __future__ import annotations

import functools
import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from poplar.data.records import DataFields, Records, is_table, read_records
from poplar.models.loss import IGNORE

VERSION = 2   # of the cached format: a change of how samples are cut is another cache


@dataclass
class Prepared:
    tokens: torch.Tensor             # [n, seq_len + 1] ids
    targets: torch.Tensor | None     # [n, seq_len] next-token targets, IGNORE where not counted; None: all counted
    tokenizer: object | None         # the TextTokenizer (None: ids given, and the model has none)
    labels: torch.Tensor | None = None   # a classifier's: a label a sample (``tokens`` are then [n, seq_len])


def prepare(source: str, fields: DataFields, model_source, seq_len: int, vocab_size: int,
            phase: Callable[[str], None] | None = None, chat_template: str | None = None) -> Prepared:
    """``source``'s samples for ``model_source`` (a preset's Workload-to-be or a ModelDirectory); see the module.
    ``phase(what)`` is told when the long part begins (tokenising, on a first run): a progress display's.
    ``chat_template``: the config's (a file or the template), rendering conversations in place of the model's."""
    from poplar.data.chat_template import chat_tokenizer
    from poplar.data.text import data_cache_dir, load_text
    from poplar.data.tokenizer import tokenizer_of

    phase = phase or (lambda what: None)

    def read() -> Records:
        return read_records(source, fields) if is_table(source) else Records("text", docs=load_text(source))

    has_own = getattr(model_source, "directory", None) is not None and model_source.has_tokenizer()
    records = None if has_own else read()    # the model's own tokenizer: the cache is looked up before reading
    if has_own or records.kind != "ids":
        tok = tokenizer_of(model_source, None if records is None else records.texts(), vocab_size)
    else:
        tok = None
    rendering = chat_tokenizer(model_source, tok, chat_template) if tok is not None else None
    key = _key(source, fields, tok, seq_len, rendering[1] if rendering else None)
    cached = _read_cache(data_cache_dir() / f"prepared-{key}.pt", tok)
    if cached is not None:
        return cached
    records = _for_task(records or read(), getattr(model_source, "task", "causal-lm"), source)
    phase(f"tokenising {_rows(records):,} rows of {source} into samples of {seq_len} tokens (once: cached)")
    prepared = _cut(records, tok, seq_len, model_source, source, rendering)
    path = data_cache_dir() / f"prepared-{key}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    torch.save({"tokens": prepared.tokens, "targets": prepared.targets, "labels": prepared.labels}, tmp)
    tmp.replace(path)
    _LOADED.clear()
    _LOADED[path] = prepared
    return prepared


_LOADED: dict[Path, Prepared] = {}   # what this process prepared or read back, by cache file: read once


def _read_cache(path: Path, tok) -> Prepared | None:
    if path in _LOADED and path.exists():
        return _LOADED[path]
    if not path.exists():
        return None
    try:
        saved = torch.load(path, weights_only=True)
    except Exception:   # a damaged cache file: it is only a cache
        path.unlink(missing_ok=True)
        return None
    _LOADED.clear()     # (one run's data at a time: the tensors may be large)
    _LOADED[path] = Prepared(saved["tokens"], saved.get("targets"), tok, saved.get("labels"))
    return _LOADED[path]


def _rows(records: Records) -> int:
    return len(records.docs or records.pairs or records.ids or records.chats or [])


def _for_task(records: Records, task: str, source: str) -> Records:
    """The records as the model's task reads them (one line where it cannot)."""
    if task == "sequence-classification":
        if records.kind != "labelled":
            raise ValueError(f"--data {source!r}: a sequence classifier trains on rows of a text and a label: give "
                             "a table with 'text' and 'label' fields (or name them: data_fields.text, .label)")
        return records
    records = records.as_text()
    if records.kind != "text" and task != "causal-lm":
        what = "conversations" if records.kind == "chat" else records.kind
        raise ValueError(f"--data {source!r}: {what} train a causal LM; a masked LM trains on text")
    return records


def _cut(records: Records, tok, seq_len: int, model_source, source: str, rendering=None) -> Prepared:
    from poplar.data.chat_template import chat_samples, no_template
    from poplar.data.text import pack

    if records.kind == "chat":
        if rendering is None:
            raise no_template(model_source, source)
        return _padded(chat_samples(records.chats, rendering, source), seq_len, tok.pad_id, tok, source)
    if records.kind == "labelled":
        return _classified(records, tok, seq_len, model_source, source)
    if records.kind == "text":
        return Prepared(pack(records.docs, tok.backend, seq_len, eos_id=tok.eos_id), None, tok)
    if records.kind == "pairs":
        prompts = tok.encode([p for p, _ in records.pairs], special=True)
        completions = tok.encode([c for _, c in records.pairs], special=False)
        samples = [(p + c + [tok.eos_id], [IGNORE] * len(p) + c + [tok.eos_id]) for p, c in zip(prompts, completions)]
        pad = tok.pad_id
    else:
        labels = records.labels or records.ids
        samples = list(zip(records.ids, labels))
        pad = tok.pad_id if tok is not None else 0
        _check_ids(records, model_source, source)
    return _padded(samples, seq_len, pad, tok, source)


def _padded(samples: list[tuple[list[int], list[int]]], seq_len: int, pad: int, tok, source: str) -> Prepared:
    """Each (ids, labels) cut to ``seq_len + 1`` and padded (pads not counted); samples with nothing counted dropped."""
    n = seq_len + 1
    tokens = torch.full((len(samples), n), pad, dtype=torch.long)
    labels = torch.full((len(samples), n), IGNORE, dtype=torch.long)
    for i, (ids, lab) in enumerate(samples):
        ids, lab = ids[:n], lab[:n]
        tokens[i, :len(ids)] = torch.tensor(ids, dtype=torch.long)
        labels[i, :len(lab)] = torch.tensor(lab, dtype=torch.long)
    targets = labels[:, 1:]
    kept = (targets != IGNORE).any(1)
    if not bool(kept.any()):
        raise ValueError(f"--data {source!r}: no sample has a counted token within {seq_len} tokens (every "
                         "completion is past the sequence's end): use a longer seq_len or shorter prompts")
    return Prepared(tokens[kept].contiguous(), targets[kept].contiguous(), tok)


def _classified(records: Records, tok, seq_len: int, model_source, source: str) -> Prepared:
    """Each text's ids cut to ``seq_len`` and padded with the model's padding id, and its label."""
    from poplar.models.classify import label_tensor

    labels = label_tensor(records.classes, model_source.config, source)
    pad = model_source.pad_id()
    tokens = torch.full((len(records.docs), seq_len), pad, dtype=torch.long)
    for i, ids in enumerate(tok.encode(records.docs, special=True)):
        ids = ids[:seq_len]
        tokens[i, :len(ids)] = torch.tensor(ids, dtype=torch.long)
    return Prepared(tokens, None, tok, labels)


def _check_ids(records: Records, model_source, source: str) -> None:
    vocab = getattr(model_source, "vocab_size", None)
    positions = getattr(model_source, "positions", None)
    top = max((max(r) for r in records.ids if r), default=-1)
    if vocab is not None and top >= vocab:
        raise ValueError(f"--data {source!r}: input_ids reach {top}, past the model's {vocab} embeddings: "
                         "tokenise with the model's own tokenizer")
    longest = max(len(r) for r in records.ids)
    if positions and longest > positions:
        raise ValueError(f"--data {source!r}: a sample of {longest} tokens is longer than the model's "
                         f"{positions} positions: cut the samples to at most {positions}")
    if records.labels is not None and any(len(a) != len(b) for a, b in zip(records.ids, records.labels)):
        raise ValueError(f"--data {source!r}: a row's labels and input_ids differ in length")


def _key(source: str, fields: DataFields, tok, seq_len: int, template: str | None = None) -> str:
    """The prepared samples' identity: the data's bytes, how they are read (the fields, the format), rendered (the
    chat template) and cut."""
    h = hashlib.sha256(f"{VERSION}|{fields.model_dump_json()}|{tok.digest if tok else None}|{seq_len}".encode())
    h.update(b"" if template is None else b"|template|" + template.encode())
    path = Path(source)
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path] if path.exists() else []
    h.update(source.encode() if not files else b"")
    for f in files:
        h.update(str(f.relative_to(path) if path.is_dir() else f.name).encode())
        stat = f.stat()
        h.update(_file_digest(str(f.resolve()), stat.st_size, stat.st_mtime_ns))
    return h.hexdigest()[:20]


@functools.lru_cache(maxsize=256)
def _file_digest(path: str, size: int, mtime_ns: int) -> bytes:
    """A file's bytes hashed, once a process while its size and time stay (a run looks its data up often)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            h.update(chunk)
    return h.digest()
