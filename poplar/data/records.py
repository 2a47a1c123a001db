"""Data as users have it: JSONL/JSON, CSV, Parquet, Arrow files, or a ``datasets`` saved to disk.

Read with Hugging Face ``datasets`` (cached by it, on every core). What the rows hold is
recognised by the fields' names, as TRL's SFT trainer does, unless named
(:class:`DataFields`):

- ``text``: documents, packed into sequences as plain text is;
- ``prompt`` + ``completion``: one sample each, the loss on the completion's tokens only;
- ``input_ids`` (+ ``labels``): samples already tokenised (``labels`` of -100 not counted);
- ``text`` + ``label``: a sequence classifier's samples (a causal or masked LM reads the text alone);
- conversations (:mod:`poplar.data.chat`): ``messages`` (lists of ``{role, content}``), ``prompt`` +
  ``completion`` holding lists of messages, alpaca's ``instruction`` + ``output`` (+ ``input``, ``system``) and
  ShareGPT's ``conversations`` (``{from, value}``), rendered by a chat template, the loss on the assistant's turns.

Where a table's fields fit more than one of these, ``data_fields.format`` names the one meant.

:func:`read_records` returns a :class:`Records`: the documents, the pairs or the ids,
with nothing tokenised yet (:mod:`poplar.data.prepare` does that).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

FORMATS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet", ".arrow": "arrow"}


class DataFields(BaseModel):
    """The fields a table's rows are read by (None: recognised by name)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    text: str | None = Field(None, description="the field of documents (default: 'text')")
    prompt: str | None = Field(None, description="the field of prompts (default: 'prompt')")
    completion: str | None = Field(None, description="the field of completions (default: 'completion')")
    label: str | None = Field(None, description="the field of a classifier's labels (default: 'label')")
    format: Literal["auto", "messages", "prompt-completion", "alpaca", "sharegpt", "text", "ids"] = Field(
        "auto", description="what the rows are (auto: recognised by their fields; name it where they fit several)")


@dataclass
class Records:
    kind: str                                    # "text", "pairs", "ids", "labelled" or "chat"
    docs: list[str] | None = None                # text
    pairs: list[tuple[str, str]] | None = None   # pairs: (prompt, completion)
    ids: list[list[int]] | None = None           # ids
    labels: list[list[int]] | None = None        # ids, where given
    classes: list | None = None                  # labelled: a label a row (beside docs, every row kept)
    chats: list | None = None                    # chat: the conversations (:class:`poplar.data.chat.Conversation`)

    def texts(self) -> list[str]:
        """The text the rows hold, to train a tokenizer on."""
        if self.chats is not None:
            return [m["content"] for c in self.chats for m in c.messages if m.get("content")]
        return self.docs or [p + c for p, c in self.pairs or []]

    def as_text(self) -> "Records":
        """Labelled rows as documents alone (what a language model trains on)."""
        return Records("text", docs=[d for d in self.docs if d.strip()]) if self.kind == "labelled" else self


def is_table(source: str) -> bool:
    """Whether ``--data`` names a table (a file of a format above, a directory of them, a saved dataset)."""
    path = Path(source)
    if path.suffix.lower() in FORMATS:
        return True
    return path.is_dir() and (_is_saved_dataset(path) or bool(_table_files(path)))


def read_records(source: str, fields: DataFields | None = None) -> Records:
    """The rows of ``source``, read by their fields (see the module); one line where they cannot be."""
    table = _load(source)
    return _records(table, source, fields or DataFields())


def _is_saved_dataset(path: Path) -> bool:
    return (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file() or \
        (path / "state.json").is_file()


def _table_files(path: Path) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for f in sorted(path.rglob("*")):
        if f.is_file() and f.suffix.lower() in FORMATS:
            found.setdefault(FORMATS[f.suffix.lower()], []).append(str(f))
    return found


@contextlib.contextmanager
def _quiet_datasets():
    """``datasets`` without its log and progress bars while it reads (a run's output is its own lines, a refusal
    its one line); as it was after."""
    import datasets

    verbosity, bars = datasets.logging.get_verbosity(), not datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    try:
        yield
    finally:
        datasets.logging.set_verbosity(verbosity)
        if not bars:
            datasets.enable_progress_bars()


def _load(source: str):
    with _quiet_datasets():
        return _load_table(source)


def _load_table(source: str):
    import datasets

    path = Path(source)
    if not path.exists():
        raise FileNotFoundError(f"--data {source!r}: no such file or directory")
    try:
        if path.is_dir() and _is_saved_dataset(path):
            loaded = datasets.load_from_disk(str(path))
            if isinstance(loaded, datasets.DatasetDict):
                if "train" not in loaded:
                    raise ValueError(f"the saved dataset has no 'train' split (it has {', '.join(loaded)})")
                loaded = loaded["train"]
            return loaded
        if path.is_dir():
            files = _table_files(path)
            if len(files) != 1:
                raise ValueError("the directory holds " + ("no table file" if not files else
                                                           "files of several formats: " + ", ".join(files)))
            (builder, names), = files.items()
        else:
            builder, names = FORMATS[path.suffix.lower()], [str(path)]
        return datasets.load_dataset(builder, data_files=names, split="train")
    except Exception as e:   # a file that is not the format its extension says, a bad directory: one line
        line = next((x for x in str(e).splitlines() if x.strip()), type(e).__name__)
        cause = f"{type(e).__name__}: {line[:200]}" if not isinstance(e, ValueError) else line[:300]
        raise ValueError(f"--data {source!r}: cannot be read as {path.suffix or 'a dataset'} ({cause}): give a "
                         "file whose content is its extension's format") from None


CHAT_FORMATS = ("messages", "prompt-completion", "sharegpt", "alpaca")


def _format_fields(fields: DataFields) -> dict[str, tuple[str, ...]]:
    """Each format's fields, as named (alpaca's ``input`` and ``system`` may be absent)."""
    return {"messages": ("messages",),
            "prompt-completion": (fields.prompt or "prompt", fields.completion or "completion"),
            "sharegpt": ("conversations",), "alpaca": ("instruction", "output"), "text": (fields.text or "text",),
            "ids": ("input_ids",)}


def _format(table, source: str, fields: DataFields) -> str:
    """The rows' format: the one named, or the conversational one their fields fit ("auto": none of them, the fields
    are read by name below). Several that fit: the rows of each (mixed: refused) or the name (ambiguous: asked)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    columns = list(table.column_names)
    named = _format_fields(fields)
    fits = [f for f, names in named.items() if all(n in columns for n in names)]
    is_list = {f: all(pa.types.is_list(table.data.column(n).type) or pa.types.is_large_list(table.data.column(n).type)
                      for n in named[f]) for f in fits}
    chat = [f for f in fits if f in CHAT_FORMATS and (f != "prompt-completion" or is_list[f])]
    if fields.format == "auto" and not chat:
        return "auto"
    if fields.format != "auto" and fields.format not in fits:
        missing = next(n for n in named[fields.format] if n not in columns)
        raise ValueError(f"--data {source!r}: data_fields.format={fields.format} reads the field {missing!r}, which "
                         f"the rows lack (they have {', '.join(columns)})")
    present = [pc.and_(*[pc.is_valid(table.data.column(n)) for n in named[f]]) if len(named[f]) > 1 else
               pc.is_valid(table.data.column(named[f][0])) for f in fits]
    rows = [frozenset(f for f, v in zip(fits, held) if v) for held in zip(*(p.to_pylist() for p in present))]
    meant = _meant(rows, fields.format, source)
    return meant if meant in CHAT_FORMATS and (meant != "prompt-completion" or is_list[meant]) else \
        "pairs" if meant == "prompt-completion" else meant


def _meant(rows: list[frozenset], named: str, source: str) -> str:
    """The format of every row (``rows``: the formats each row's fields fit), the one named where they fit several;
    rows of several formats refused, and rows that fit several where none is named."""
    held = [r for r in rows if r]
    if not held:   # no row holds any of them: each row is refused where it is read
        return named if named != "auto" else "auto"
    if named == "auto" and len({f for r in held for f in r}) == 1:
        return next(iter(held[0]))
    if named == "auto" and len(set(held)) == 1:
        raise ValueError(f"--data {source!r}: the rows fit several formats ({', '.join(sorted(held[0]))}): name the "
                         f"one meant with data_fields.format={'|'.join(sorted(held[0]))}")
    other = next((i for i, r in enumerate(rows) if r and (named not in r if named != "auto" else r != held[0])), None)
    if other is not None:
        first = next(i for i, r in enumerate(rows) if r == held[0]) if named == "auto" else None
        against = f"not {named}" if first is None else f"row {first + 1} is {'/'.join(sorted(held[0]))}"
        raise ValueError(f"--data {source!r}: mixed formats (row {other + 1} is {'/'.join(sorted(rows[other]))}, "
                         f"{against}): give rows of one format a file")
    return named


def _records(table, source: str, fields: DataFields) -> Records:
    from poplar.data.chat import read_chats

    columns = list(table.column_names)
    fmt = _format(table, source, fields)
    if fmt in CHAT_FORMATS:
        return Records("chat", chats=read_chats(table, fmt, fields, source))
    if fmt != "auto":   # named: read by its fields alone
        columns = [*_format_fields(fields)["prompt-completion" if fmt == "pairs" else fmt],
                   *(["labels"] if fmt == "ids" and "labels" in columns else [])]
        fields = DataFields(**dict(zip(("prompt", "completion"), columns)) if fmt == "pairs" else
                            {"text": columns[0]} if fmt == "text" else {})

    def pick(named: str | None, default: str) -> str | None:
        if named is not None:
            if named not in columns:
                raise ValueError(f"--data {source!r}: no field {named!r} (it has {', '.join(columns)}): name one "
                                 "of them")
            return named
        return default if default in columns else None

    prompt, completion = pick(fields.prompt, "prompt"), pick(fields.completion, "completion")
    text = pick(fields.text, "text")
    label = pick(fields.label, "label")
    if label is not None and text is not None:
        return Records("labelled", docs=_strings(table, text, source), classes=_column(table, label))
    if fields.label is not None:
        raise ValueError(f"--data {source!r}: a label field needs a text field beside it (it has "
                         f"{', '.join(columns)}): name it with data_fields.text=...")
    if fields.text is None and (fields.prompt or fields.completion or (prompt and completion)):
        if not (prompt and completion):
            raise ValueError(f"--data {source!r}: a prompt field needs a completion field beside it (it has "
                             f"{', '.join(columns)})")
        pairs = list(zip(_strings(table, prompt, source), _strings(table, completion, source)))
        if not any(c for _, c in pairs):
            raise ValueError(f"--data {source!r}: the completion field {completion!r} is empty in every row: "
                             "there is nothing to train on")
        return Records("pairs", pairs=pairs)
    if text is not None:
        docs = [d for d in _strings(table, text, source) if d.strip()]
        if not docs:
            raise ValueError(f"--data {source!r}: the text field {text!r} is empty in every row")
        return Records("text", docs=docs)
    if "input_ids" in columns:
        return Records("ids", ids=_column(table, "input_ids"),
                       labels=_column(table, "labels") if "labels" in columns else None)
    raise ValueError(f"--data {source!r}: no 'text', 'prompt' + 'completion' or 'input_ids' field (it has "
                     f"{', '.join(columns)}): name the text's field with data_fields.text=...")


def _column(table, field: str) -> list:
    """A field's values as Python objects, read from the Arrow column at once (not row by row)."""
    return table.data.column(field).to_pylist()


def _strings(table, field: str, source: str) -> list[str]:
    values = _column(table, field)
    bad = next((v for v in values if v is not None and not isinstance(v, str)), None)
    if bad is not None:
        raise ValueError(f"--data {source!r}: the field {field!r} holds {type(bad).__name__} values, not text")
    return [v or "" for v in values]
