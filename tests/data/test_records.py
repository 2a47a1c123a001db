"""Tables as users have them: every format gives the same rows, the fields recognised by name or named."""

import json

import pytest

from poplar.data.prepare import prepare
from poplar.data.records import DataFields, is_table, read_records
from poplar.models.loss import IGNORE

ROWS = [{"prompt": f"question {i}?", "completion": f"answer {i}.", "text": f"document {i} " * (i + 1),
         "body": f"other {i}"} for i in range(12)]


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("POPLAR_DATA_CACHE", str(tmp_path / "data-cache"))


def write(tmp_path, fmt: str, rows=ROWS):
    """``rows`` in format ``fmt``: a file, a directory of files, or a dataset saved to disk."""
    import datasets

    table = datasets.Dataset.from_list(rows)
    path = tmp_path / f"rows.{fmt}"
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif fmt == "json":
        path.write_text(json.dumps(rows))
    elif fmt == "csv":
        table.to_csv(str(path), index=False)
    elif fmt == "parquet":
        table.to_parquet(str(path))
    elif fmt == "saved":
        path = tmp_path / "saved"
        datasets.DatasetDict({"train": table}).save_to_disk(str(path))
    elif fmt == "dir":
        path = tmp_path / "shards"
        path.mkdir()
        for i in range(0, len(rows), 5):
            (path / f"part-{i:03d}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[i:i + 5]))
    return str(path)


@pytest.mark.parametrize("fmt", ["jsonl", "json", "csv", "parquet", "saved", "dir"])
def test_every_format_gives_the_same_rows_by_their_field_names(tmp_path, fmt):
    source = write(tmp_path, fmt)
    assert is_table(source)
    pairs = read_records(source)
    assert pairs.kind == "pairs" and pairs.pairs == [(r["prompt"], r["completion"]) for r in ROWS]
    text = read_records(source, DataFields(text="text"))
    assert text.kind == "text" and text.docs == [r["text"] for r in ROWS]
    other = read_records(source, DataFields(text="body"))
    assert other.docs == [r["body"] for r in ROWS]


def test_text_alone_is_packed_and_ids_are_samples_with_their_labels(tmp_path):
    docs = write(tmp_path, "jsonl", [{"text": r["text"]} for r in ROWS])
    assert read_records(docs).kind == "text"
    ids = [[5, 6, 7, 8, 9, 10][:n] for n in (6, 4, 3)]
    labels = [[IGNORE, IGNORE, 7, 8, 9, 10], [IGNORE, 6, 7, 8], [1, 2, 3]]
    path = tmp_path / "ids.jsonl"
    path.write_text("".join(json.dumps({"input_ids": i, "labels": lab}) + "\n" for i, lab in zip(ids, labels)))
    prepared = prepare(str(path), DataFields(), None, 4, 1024)
    assert prepared.tokenizer is None and prepared.tokens.shape == (3, 5)
    assert prepared.tokens[0].tolist() == [5, 6, 7, 8, 9] and prepared.tokens[2].tolist() == [5, 6, 7, 0, 0]
    # the labels as given, the first dropped (its target is the next position's token), the cut and the pad not
    # counted
    assert prepared.targets.tolist() == [[IGNORE, 7, 8, 9], [6, 7, 8, IGNORE], [2, 3, IGNORE, IGNORE]]


def test_a_prompt_without_a_completion_or_no_known_field_is_one_line(tmp_path):
    source = write(tmp_path, "jsonl", [{"prompt": "p", "answer": "a"}])
    with pytest.raises(ValueError, match="needs a completion field"):
        read_records(source, DataFields(prompt="prompt"))
    with pytest.raises(ValueError, match="no 'text', 'prompt' \\+ 'completion' or 'input_ids' field"):
        read_records(source)
    assert read_records(source, DataFields(prompt="prompt", completion="answer")).pairs == [("p", "a")]
    with pytest.raises(ValueError, match="holds int values, not text"):
        read_records(write(tmp_path, "jsonl", [{"text": 3}]))


def test_the_tokenising_is_shown_on_a_first_run_and_the_cache_read_after_without_a_word(tmp_path):
    """``poplar train``'s progress display: a line (a bar in a terminal) while the rows are tokenised (shown at
    once here; the CLI's waits ``SHOWN_AFTER_S``); a run whose data are in the cache (or in this process already)
    shows nothing."""
    import io

    from rich.console import Console

    from poplar.cli.output import Progress
    from poplar.train.config import load_config
    from poplar.train.dataset import prepare_data

    log = Console(file=io.StringIO(), width=200)
    cfg = load_config(None, {"model": "tiny", "data": write(tmp_path, "jsonl"), "seq_len": 8, "global_batch": 2,
                             "cluster": "none"})
    first = prepare_data(cfg.model_data, lambda title, **kw: Progress(log, title))[1]
    shown = log.file.getvalue()
    assert f"data: {cfg.data}" in shown and "tokenising 12 rows" in shown
    again = prepare_data(cfg.model_data, lambda title, **kw: Progress(log, title))[1]
    assert log.file.getvalue() == shown and again.sequences.equal(first.sequences)
