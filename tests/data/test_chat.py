"""Conversations: every format recognised by its fields (or named), rendered by the model's chat template, the loss
on the assistant's tokens alone; the labels against TRL's own masking on the same rows."""

import json
import random

import pytest
import torch

from poplar.data.prepare import prepare
from poplar.data.records import DataFields, read_records
from poplar.models.loss import IGNORE
from poplar.models.pretrained import ModelDirectory
from tests.data.chat_models import CHATML, CHATML_MARKED, conversation, rows, save_chat_model, trl_template, write_rows

SEQ = 127     # the test model's 128 positions


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("POPLAR_DATA_CACHE", str(tmp_path / "data-cache"))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Model directories by their tokenizer's template: ChatML, ChatML marked, none."""
    root = tmp_path_factory.mktemp("chat-models")
    return {name: str(save_chat_model(root / name, template))
            for name, template in (("chatml", CHATML), ("marked", CHATML_MARKED), ("none", None))}


def prepared(path, model: str, fields=DataFields(), seq_len: int = SEQ, template=None):
    return prepare(str(path), fields, ModelDirectory(directory=model, seq_len=seq_len), seq_len, 1024,
                   chat_template=template)


@pytest.mark.parametrize("fmt", ["messages", "prompt-completion", "alpaca", "sharegpt"])
def test_each_format_is_recognised_by_its_fields_and_read_as_the_same_conversation(tmp_path, fmt):
    given = rows(fmt, 30, seed=3)
    records = read_records(write_rows(tmp_path / "rows.jsonl", given))
    named = read_records(write_rows(tmp_path / "rows.jsonl", given), DataFields(format=fmt))
    assert records.kind == "chat" and len(records.chats) == 30 and records.chats == named.chats
    for row, chat in zip(given, records.chats):
        if fmt == "messages":
            assert chat.messages == row["messages"] and chat.counted_from == 0
        elif fmt == "prompt-completion":   # the prompt's turns are context: only the completion's assistant counts
            assert chat.messages == row["prompt"] + row["completion"]
            assert chat.counted() == [len(chat.messages) - 1]
        elif fmt == "sharegpt":
            roles = {"human": "user", "gpt": "assistant", "system": "system", "tool": "tool"}
            assert chat.messages == [{"role": roles[m["from"]], "content": m["value"]} for m in row["conversations"]]
        else:   # alpaca: a user turn of the instruction and the input (where not empty), the output the reply
            user = row["instruction"] + ("\n" + row["input"] if row["input"] else "")
            system = [{"role": "system", "content": row["system"]}] if row.get("system") else []
            assert chat.messages == system + [{"role": "user", "content": user},
                                              {"role": "assistant", "content": row["output"]}]


def expected(chat, tok) -> tuple[list[int], list[int]]:
    """ChatML's tokens and labels built turn by turn (each turn's text between special tokens: tokenised alone),
    the counted assistants' content and end-of-turn counted, nothing else."""
    ids, labels = [], []
    for i, m in enumerate(chat.messages):
        head = tok.encode("<|im_start|>" + m["role"] + "\n", add_special_tokens=False)
        body = tok.encode(m["content"] + "<|im_end|>\n", add_special_tokens=False)
        ids += head + body
        labels += [IGNORE] * len(head) + (body if i in chat.counted() else [IGNORE] * len(body))
    return ids, labels


@pytest.mark.parametrize("template", ["chatml", "marked"])
@pytest.mark.parametrize("seed", range(4))
def test_the_assistant_s_turns_and_nothing_else_are_counted_over_a_space_of_conversations(tmp_path, models,
                                                                                         template, seed):
    """Multi-turn, a system turn first, tool turns, several assistant turns, alpaca's empty inputs, prompts with
    assistant turns in them: by rendering prefixes (ChatML) and by the template's marks (ChatML marked) alike."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(models[template])
    fmt = ["messages", "prompt-completion", "alpaca", "sharegpt"][seed]
    path = write_rows(tmp_path / "rows.jsonl", rows(fmt, 24, seed=seed))
    chats = read_records(path).chats
    got = prepared(path, models[template])
    kept = 0
    for chat in chats:
        ids, labels = expected(chat, tok)
        ids, labels = ids[:SEQ + 1], labels[:SEQ + 1]
        if all(t == IGNORE for t in labels[1:]):
            continue   # every counted token past the cut: the sample is dropped
        n = len(ids)
        assert got.tokens[kept, :n].tolist() == ids and (got.tokens[kept, n:] == tok.pad_token_id).all()
        assert got.targets[kept, :n - 1].tolist() == labels[1:] and (got.targets[kept, n - 1:] == IGNORE).all()
        kept += 1
    assert kept == len(got.tokens) > len(chats) // 2


def test_the_labels_are_those_trl_s_assistant_only_loss_gives(tmp_path):
    """TRL's SFTTrainer (``assistant_only_loss=True``, offline, on the same model directory and rows, cut to the
    same length): its ``input_ids`` and ``labels`` beside ours, shifted as the loss reads them. On Llama 3's
    and Phi-3's templates (TRL swaps in its marked training variant; ours renders prefixes) and on marked
    templates (both take the marks): equal. On Qwen2.5's, TRL's training variant also marks the new line after
    ``<|im_start|>assistant``, which ends the generation prompt (given at inference, not generated): ours leaves
    that one token a turn out, and equals TRL's own completion mask of conversational prompt-completion rows,
    which leaves it out too."""
    pytest.importorskip("trl")
    for name in ("llama3", "llama3_training", "phi3", "qwen2_5_training", "qwen2_5"):
        model = str(save_chat_model(tmp_path / name, trl_template(name)))
        for fmt in ("messages", "prompt-completion"):
            given = rows(fmt, 16, seed=5)
            ours = prepared(write_rows(tmp_path / f"{name}-{fmt}.jsonl", given), model)
            ids, labels = trl_labels(model, given, tmp_path)
            chats = read_records(ours_path(tmp_path, name, fmt)).chats
            # a row with nothing counted within the cut (Qwen2.5's long default system turn): TRL keeps it, all
            # ignored; ours drops it, as a pair whose completion lies past the end
            counted = [k for k, want in enumerate(labels) if any(t != IGNORE for t in want[1:])]
            assert len(ours.tokens) == len(counted) >= 6
            for k, row in enumerate(counted):
                want_ids, want, n = ids[row], labels[row], len(ids[row])
                assert ours.tokens[k, :n].tolist() == want_ids   # both cut to SEQ + 1 tokens
                got = ours.targets[k, :n - 1].tolist()
                if name == "qwen2_5" and fmt == "messages":
                    newlines = [j for j, (a, b) in enumerate(zip(got, want[1:])) if a != b]
                    assert 0 < len(newlines) <= len(chats[row].counted())
                    assert all(got[j] == IGNORE and want_ids[j + 1] == newline(model) for j in newlines)
                else:
                    assert got == want[1:], (name, fmt, k)


def ours_path(tmp_path, name, fmt):
    return str(tmp_path / f"{name}-{fmt}.jsonl")


def newline(model: str) -> int:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model).encode("\n", add_special_tokens=False)[0]


def trl_labels(model: str, given: list[dict], tmp_path, seq_len: int = SEQ) -> tuple[list, list]:
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    trainer = SFTTrainer(model=AutoModelForCausalLM.from_pretrained(model),
                         processing_class=AutoTokenizer.from_pretrained(model),
                         args=SFTConfig(output_dir=str(tmp_path / "trl"), assistant_only_loss=True,
                                        max_length=seq_len + 1, report_to=[], use_cpu=True),
                         train_dataset=datasets.Dataset.from_list(given))
    return trainer.train_dataset["input_ids"], trainer.train_dataset["labels"]


def test_the_config_s_template_renders_in_place_of_the_tokenizer_s_and_is_in_the_cache_key(tmp_path, models):
    path = write_rows(tmp_path / "rows.jsonl", rows("messages", 12, seed=1))
    with pytest.raises(ValueError, match="its tokenizer has no chat template: give one with --set "
                                         "chat_template=path/to/template.jinja"):
        prepared(path, models["none"])
    (tmp_path / "chatml.jinja").write_text(CHATML)
    from_file = prepared(path, models["none"], template=str(tmp_path / "chatml.jinja"))
    as_text = prepared(path, models["none"], template=CHATML)
    own = prepared(path, models["chatml"])
    assert torch.equal(from_file.tokens, own.tokens) and torch.equal(from_file.targets, own.targets)
    assert torch.equal(as_text.targets, own.targets)
    # another template over the same tokenizer: prepared anew, not read from the cache
    other = prepared(path, models["chatml"], template=CHATML.replace("'\n' + message['content']", "':' + "
                                                                     "message['content']"))
    assert other.tokens.shape[0] == own.tokens.shape[0] and not torch.equal(other.tokens, own.tokens)
    with pytest.raises(ValueError, match="no such file, and not a Jinja template"):
        prepared(path, models["none"], template=str(tmp_path / "missing.jinja"))


def test_a_preset_renders_with_the_config_s_template_over_the_tokenizer_it_trains(tmp_path):
    from poplar.models.workload import Workload

    path = write_rows(tmp_path / "rows.jsonl", rows("messages", 40, seed=2))
    preset = Workload(model="llama-tiny", seq_len=48, vocab_size=512)
    with pytest.raises(ValueError, match="it has no tokenizer of its own .*: give one with --set chat_template="):
        prepare(path, DataFields(), preset, 48, 512)
    got = prepare(path, DataFields(), preset, 48, 512, chat_template=CHATML)
    tok = got.tokenizer
    first = read_records(path).chats[0]
    counted = tok.backend.decode([t for t in got.targets[0].tolist() if t != IGNORE], skip_special_tokens=False)
    assert counted == "".join(first.messages[i]["content"] + "<|im_end|>\n" for i in first.counted())[:len(counted)]
    assert len(counted) > 0


def test_the_format_named_where_the_fields_fit_several_and_mixed_rows_refused(tmp_path):
    both = [{"messages": c["messages"], "text": "a document"} for c in rows("messages", 6)]
    path = write_rows(tmp_path / "both.jsonl", both)
    with pytest.raises(ValueError, match=r"fit several formats \(messages, text\): name the one meant with "
                                         r"data_fields.format=messages\|text"):
        read_records(path)
    assert read_records(path, DataFields(format="messages")).kind == "chat"
    assert read_records(path, DataFields(format="text")).docs == ["a document"] * 6
    mixed = rows("messages", 4) + rows("alpaca", 2)
    with pytest.raises(ValueError, match=r"mixed formats \(row 5 is alpaca, row 1 is messages\)"):
        read_records(write_rows(tmp_path / "mixed.jsonl", mixed))
    with pytest.raises(ValueError, match=r"mixed formats \(row 5 is alpaca, not messages\)"):
        read_records(str(tmp_path / "mixed.jsonl"), DataFields(format="messages"))
    with pytest.raises(ValueError, match="data_fields.format=sharegpt reads the field 'conversations'"):
        read_records(path, DataFields(format="sharegpt"))
    # plain prompt/completion text, and text beside them, read as before
    pairs = write_rows(tmp_path / "pairs.jsonl", [{"prompt": "p", "completion": "c", "text": "t"}])
    assert read_records(pairs).kind == "pairs" and read_records(pairs, DataFields(format="text")).docs == ["t"]
    assert read_records(pairs, DataFields(format="prompt-completion")).pairs == [("p", "c")]


@pytest.mark.parametrize("fmt, row, words", [
    ("messages", {"messages": [{"role": "user", "content": "hi"}]}, "row 3 has no assistant turn (it has user)"),
    ("messages", {"messages": [{"role": "bot", "content": "hi"}]}, "row 3: unknown role 'bot' in 'messages' "
                                                                   "(known: system, user, assistant, tool)"),
    ("sharegpt", {"conversations": [{"from": "robot", "value": "hi"}]}, "row 3: unknown from 'robot'"),
    ("prompt-completion", {"prompt": [{"role": "user", "content": "a"}], "completion": [{"role": "tool",
                                                                                           "content": "b"}]},
     "row 3 has no assistant turn (its completion has tool)"),
    ("messages", {"messages": [{"content": "hi"}, {"role": "assistant", "content": "b"}]},
     "row 3: a message in 'messages' has no 'role'"),
])
def test_a_wrong_row_is_named_in_one_line(tmp_path, fmt, row, words):
    path = write_rows(tmp_path / "rows.jsonl", rows(fmt, 2) + [row])
    with pytest.raises(ValueError) as e:
        read_records(path)
    assert words in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("template, words", [
    ("{{ messages[-1]['content'] }}", "the chat template drops the assistant's content"),
    ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' }}{% if m['role'] != 'assistant' %}"
     "{{ m['content'] }}{% endif %}{{ '<|im_end|>' }}{% endfor %}", "the chat template drops the assistant's content"),
    (CHATML_MARKED.replace("{% generation %}{{ message['content'] + '<|im_end|>\n' }}{% endgeneration %}",
                           "{{ message['content'] }}{% generation %}{{ '<|im_end|>\n' }}{% endgeneration %}"),
     "not in the tokens counted as the assistant's"),
])
def test_a_template_that_drops_the_assistant_s_content_is_refused(tmp_path, models, template, words):
    path = write_rows(tmp_path / "rows.jsonl", rows("messages", 4, seed=4))
    with pytest.raises(ValueError, match=words):
        prepared(path, models["chatml"], template=template)


def test_a_conversation_is_one_sample_cut_and_padded_as_pairs_are(tmp_path, models):
    """Longer than a sample: cut to seq_len + 1, the counted tokens within; one whose replies all lie past the cut:
    dropped, as a pair's completion past the end is."""
    r = random.Random(0)
    long = {"messages": [{"role": "user", "content": "words " * 60}, {"role": "assistant", "content": "late"}]}
    rows_ = [{"messages": conversation(r, tools=False)} for _ in range(3)] + [long]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows_))
    got = prepared(tmp_path / "rows.jsonl", models["chatml"], seq_len=32)
    assert got.tokens.shape == (3, 33) and (got.targets != IGNORE).any(1).all()


def test_a_row_the_template_refuses_is_named(tmp_path, models):
    r = random.Random(1)
    refused = {"messages": [{"role": "user", "content": "add 2 and 3"}, {"role": "assistant", "content": "calling"},
                            {"role": "tool", "content": "5"}, {"role": "assistant", "content": "it is 5"}]}
    path = write_rows(tmp_path / "rows.jsonl", [{"messages": conversation(r, tools=False)} for _ in range(3)] +
                      [refused])
    no_tools = ("{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tool turns') }}{% endif %}"
                "{% endfor %}" + CHATML)
    with pytest.raises(ValueError, match=r"row 4: the chat template refuses it \(no tool turns\)"):
        prepared(path, models["chatml"], template=no_tools)


def test_every_rank_s_share_of_the_loss_sums_to_the_mean_over_the_global_batch_s_assistant_tokens(tmp_path, models):
    """The weighting the engine applies (a rank's loss times its samples over the global batch), summed over an
    uneven plan's ranks: the cross-entropy averaged over every counted token of the global batch, as one device
    (and TRL's loss over a batch) takes it, however unlike the conversations' counted lengths."""
    import torch.nn.functional as F

    import poplar
    from poplar.data.text import GlobalBatches
    from poplar.models.loss import next_token_loss

    got = prepared(write_rows(tmp_path / "rows.jsonl", rows("messages", 40, seed=6)), models["chatml"])
    plan = poplar.Plan.from_local_batches(1, [7, 2, 3], 1)
    batches = GlobalBatches(got.tokens, plan.global_batch_size, seed=1, targets=got.targets)
    logits = torch.randn(plan.global_batch_size, SEQ, 314, generator=torch.Generator().manual_seed(0))
    one = poplar.Plan(0, [plan.global_batch_size], 1)
    for step in range(3):
        targets = batches.local(step, one, 0)[1]
        whole = F.cross_entropy(logits.reshape(-1, 314), targets.reshape(-1), ignore_index=IGNORE)
        shares = []
        for rank in range(3):
            lo, hi = plan.sample_range(rank)
            local = batches.local(step, plan, rank)
            assert torch.equal(local[1], targets[lo:hi])
            shares.append(next_token_loss(logits[lo:hi], local) * (hi - lo) / plan.global_batch_size)
        torch.testing.assert_close(sum(shares), whole, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["cohere", "gemma", "gemma3", "lfm2", "lfm2_v2", "phi3_5", "qwen2_5_vl",
                                  "qwen3_instruct_2507", "qwen3_vl"])
def test_on_more_models_templates_the_labels_are_trl_s(tmp_path, name):
    """Templates of other models TRL ships a marked training variant of, on multi-turn user/assistant rows (some of
    these refuse a system or a tool turn): ours by rendering prefixes, TRL's by its variant's marks, equal. (Where
    TRL's variant also marks what the generation prompt gives, DeepSeek's ``<｜Assistant｜>``, Nemotron's
    ``<think>``, ours leaves those tokens out, as on Qwen2.5's above.)"""
    pytest.importorskip("trl")
    r = random.Random(3)
    given = [{"messages": [m for m in conversation(r, tools=False) if m["role"] != "system"]} for _ in range(12)]
    model = str(save_chat_model(tmp_path / name, trl_template(name)))
    ours = prepared(write_rows(tmp_path / "rows.jsonl", given), model)
    ids, labels = trl_labels(model, given, tmp_path)
    counted = [k for k, want in enumerate(labels) if any(t != IGNORE for t in want[1:])]
    assert len(ours.tokens) == len(counted) >= 10
    for k, row in enumerate(counted):
        n = len(ids[row])
        assert ours.tokens[k, :n].tolist() == ids[row] and ours.targets[k, :n - 1].tolist() == labels[row][1:]


def test_a_row_s_tools_are_rendered_with_it_and_not_counted_as_trl_renders_them(tmp_path):
    pytest.importorskip("trl")
    weather = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                                "parameters": {"type": "object", "properties": {
                                                    "city": {"type": "string"}}, "required": ["city"]}}}
    r = random.Random(4)
    given = [{"messages": [m for m in conversation(r, tools=False) if m["role"] != "system"],
              "tools": json.dumps([weather]) if k % 2 else None} for k in range(8)]
    model = str(save_chat_model(tmp_path / "qwen3", trl_template("qwen3_instruct_2507"), positions=1024))
    ours = prepared(write_rows(tmp_path / "rows.jsonl", given), model, seq_len=1023)
    ids, labels = trl_labels(model, given, tmp_path, seq_len=1023)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    for k in range(8):
        n = len(ids[k])
        assert ours.tokens[k, :n].tolist() == ids[k] and ours.targets[k, :n - 1].tolist() == labels[k][1:]
        assert ("get_weather" in tok.decode(ids[k])) == bool(k % 2)
        assert "get_weather" not in tok.decode([t for t in ours.targets[k].tolist() if t != IGNORE])
    with pytest.raises(ValueError, match="row 1: 'tools' is text that is not JSON"):
        read_records(write_rows(tmp_path / "bad.jsonl", [{**given[0], "tools": "[{"}]))
