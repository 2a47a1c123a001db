"""Conversations that cannot be trained on, through ``poplar train``: one line naming the row and what to change,
exit 2, nothing written, in under 10 s (before anything is profiled or launched), as tests/test_bad_input.py holds
every other bad input."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.caches import own_caches
from tests.data.chat_models import CHATML, rows, save_chat_model, write_rows
from tests.helpers.refusals import CLUSTER3, refusal


def _setup(tmp: Path) -> None:
    save_chat_model(tmp / "chat")
    save_chat_model(tmp / "no-template", template=None)
    good = rows("messages", 6)
    write_rows(tmp / "good.jsonl", good)
    write_rows(tmp / "no-assistant.jsonl", good + [{"messages": [{"role": "system", "content": "be brief"},
                                                                {"role": "user", "content": "hello"}]}])
    write_rows(tmp / "unknown-role.jsonl", good[:3] + [{"messages": [{"role": "user", "content": "hi"},
                                                                     {"role": "bot", "content": "hello"}]}])
    write_rows(tmp / "sharegpt.jsonl", rows("sharegpt", 4) + [{"conversations": [{"from": "human", "value": "hi"},
                                                                                 {"from": "chatgpt", "value": "yo"}]}])
    write_rows(tmp / "mixed.jsonl", good + rows("alpaca", 3))
    (tmp / "last-only.jinja").write_text("{{ messages[-1]['content'] }}")
    (tmp / "chatml.jinja").write_text(CHATML)


def _chat(model: str, data: str, *args):
    return ["train", "--cluster", CLUSTER3, "--steps", "2", "--model", f"{{tmp}}/{model}", "--set", "seq_len=32",
            "--data", f"{{tmp}}/{data}", *args, "--out", "{tmp}/r"]


CASES = [
    ("a messages row with no assistant turn", _chat("chat", "no-assistant.jsonl"),
     "row 7 has no assistant turn (it has system, user)"),
    ("an unknown role", _chat("chat", "unknown-role.jsonl"), "row 4: unknown role 'bot' in 'messages'"),
    ("a ShareGPT from that is unknown", _chat("chat", "sharegpt.jsonl"), "row 5: unknown from 'chatgpt'"),
    ("mixed formats", _chat("chat", "mixed.jsonl"), "mixed formats (row 7 is alpaca, row 1 is messages)"),
    ("a template that drops the assistant's content",
     _chat("chat", "good.jsonl", "--set", "chat_template={tmp}/last-only.jinja"),
     "the chat template drops the assistant's content"),
    ("a tokenizer without a chat template", _chat("no-template", "good.jsonl"),
     "its tokenizer has no chat template: give one with --set chat_template=path/to/template.jinja"),
    ("a preset, which has no tokenizer", ["train", "--cluster", CLUSTER3, "--steps", "2", "--set", "seq_len=32",
                                          "--data", "{tmp}/good.jsonl", "--out", "{tmp}/r"],
     "it has no tokenizer of its own (one is trained on the data): give one with --set chat_template="),
    ("a chat template file that does not exist", _chat("chat", "good.jsonl", "--set", "chat_template={tmp}/no.jinja"),
     "no such file, and not a Jinja template"),
    ("a format named whose fields the rows lack", _chat("chat", "good.jsonl", "--set", "data_fields.format=alpaca"),
     "data_fields.format=alpaca reads the field 'instruction'"),
]


@pytest.fixture(scope="module")
def cases_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("chat-bad-input")
    _setup(tmp)
    return tmp


@pytest.fixture(autouse=True)
def caches(tmp_path_factory, monkeypatch):
    own_caches(monkeypatch, tmp_path_factory.getbasetemp() / "chat-bad-input-caches")


@pytest.mark.parametrize("what, args, words", CASES, ids=[c[0] for c in CASES])
def test_bad_conversations_get_one_line_and_change_nothing(cases_dir, what, args, words):
    output = refusal(args, cases_dir)
    assert words in output and not (cases_dir / "r").exists(), output


def test_the_good_rows_are_taken(cases_dir):
    """The same command on the good rows and the template file gets past the data (the cases fail for their own
    reason): prepared, the assistant's tokens counted."""
    from poplar.train.config import load_config
    from poplar.train.dataset import prepare_data

    for model, template in (("chat", None), ("no-template", str(cases_dir / "chatml.jinja"))):
        cfg = load_config(None, {"model": str(cases_dir / model), "data": str(cases_dir / "good.jsonl"), "seq_len": 96,
                                 "global_batch": 4, "chat_template": template, "cluster": "none"})
        _, batches = prepare_data(cfg.model_data)
        assert len(batches.sequences) == 6 and (batches.counted > 0).all()
