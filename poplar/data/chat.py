"""Conversations as the fine-tuning tools take them, read into one form: a list of ``{role, content}`` messages.

The formats (recognised by :mod:`poplar.data.records`, as TRL's ``is_conversational`` and
``is_conversational_from_value`` recognise them; ``data_fields.format`` names one):

- ``messages``: TRL's conversational language modelling, ``{"messages": [{"role": ..., "content": ...}, ...]}``,
  roles ``system``, ``user``, ``assistant``, ``tool``, any number of turns;
- ``prompt-completion``: TRL's conversational prompt-completion, ``prompt`` and ``completion`` both lists of
  messages: the conversation is the prompt then the completion, the assistant's turns of the completion counted;
- ``alpaca``: ``instruction``, ``input`` (optional, may be empty), ``output``, ``system`` (optional): a user turn of
  the instruction and the input (joined by a new line, as LLaMA-Factory joins them) and an assistant turn of the
  output, after the system turn where there is one;
- ``sharegpt``: ``conversations`` of ``{from, value}`` as axolotl and LLaMA-Factory read them, ``from`` one of
  ``human``/``user``, ``gpt``/``assistant``, ``system``, ``tool``/``observation`` (LLaMA-Factory's name), and a
  ``system`` field beside them where given.

A ``tools`` field beside the conversations (a list of tool definitions, or its JSON text, as TRL reads it) is handed
to the template with its row's conversation.

Every row needs an assistant turn to learn from; an unknown role, a row with none, a message that is not text: one
line naming the row (counted from 1: a JSONL's line). The conversations are then rendered by the model's chat
template and counted on the assistant's tokens (:mod:`poplar.data.chat_template`).
"""

from __future__ import annotations

from dataclasses import dataclass

ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system",
                  "tool": "tool", "observation": "tool"}


@dataclass(frozen=True)
class Conversation:
    """One sample: its messages, and the first of them whose assistant turns are counted (a prompt's are not)."""

    messages: list[dict]
    counted_from: int = 0
    tools: list | None = None     # the tools the template describes to the model (a ``tools`` field, as TRL's)

    def counted(self) -> list[int]:
        """The indices of the assistant messages the loss is on."""
        return [i for i, m in enumerate(self.messages) if i >= self.counted_from and m["role"] == "assistant"]


def read_chats(table, fmt: str, fields, source: str) -> list[Conversation]:
    """The rows of ``table`` in format ``fmt`` as conversations (see the module); one line where a row is wrong."""
    # decoded by ``datasets`` (messages of unlike fields are stored as JSON text: its ``Json`` feature)
    column = (lambda name: table[name][:] if name in table.column_names else [None] * table.num_rows)
    if fmt == "messages":
        chats = [Conversation(_messages(m, ROLES, "messages", i, source)) for i, m in enumerate(column("messages"))]
    elif fmt == "sharegpt":
        chats = [Conversation(_system(s) + _messages(m, SHAREGPT_ROLES, "conversations", i, source))
                 for i, (m, s) in enumerate(zip(column("conversations"), column("system")))]
    elif fmt == "alpaca":
        rows = zip(column("instruction"), column("input"), column("output"), column("system"))
        chats = [_alpaca(*row, i, source) for i, row in enumerate(rows)]
    else:
        prompt, completion = fields.prompt or "prompt", fields.completion or "completion"
        chats = []
        for i, (p, c) in enumerate(zip(column(prompt), column(completion))):
            p = _messages(p, ROLES, prompt, i, source)
            chats.append(Conversation(p + _messages(c, ROLES, completion, i, source), len(p)))
    if "tools" in table.column_names:
        chats = [Conversation(c.messages, c.counted_from, _tools(t, i, source))
                 for i, (c, t) in enumerate(zip(chats, column("tools")))]
    for i, chat in enumerate(chats):
        if not chat.counted():
            where = "its completion has" if chat.counted_from else "it has"
            raise ValueError(f"--data {source!r}: row {i + 1} has no assistant turn ({where} "
                             f"{', '.join(m['role'] for m in chat.messages[chat.counted_from:]) or 'no message'}): "
                             "every conversation needs an assistant's reply to learn from")
    return chats


def _messages(value, roles: dict | tuple, field: str, row: int, source: str) -> list[dict]:
    """A row's list of messages, each ``{role, content}`` (ShareGPT's ``{from, value}`` mapped), other fields kept."""
    where = f"--data {source!r}: row {row + 1}"
    if value is None:
        raise ValueError(f"{where} has no {field!r}: give every row its conversation")
    if not isinstance(value, list) or not all(isinstance(m, dict) for m in value):
        raise ValueError(f"{where}: {field!r} holds {type(value).__name__}, not a list of messages")
    out = []
    for m in value:
        m = {k: v for k, v in m.items() if v is not None}   # a field other rows have (tool_calls) is None here
        sharegpt = isinstance(roles, dict)
        role, content = (m.pop("from", None), m.pop("value", None)) if sharegpt else (m.pop("role", None),
                                                                                      m.pop("content", None))
        if role not in roles:
            known = ", ".join(roles)
            name = "from" if sharegpt else "role"
            raise ValueError(f"{where}: unknown {name} {role!r} in {field!r} (known: {known})" if role is not None else
                             f"{where}: a message in {field!r} has no {name!r} (known: {known})")
        if content is not None and not isinstance(content, str):
            raise ValueError(f"{where}: a {role} message's content is {type(content).__name__}, not text")
        out.append({"role": roles[role] if sharegpt else role, "content": content or "", **m})
    return out


def _tools(value, row: int, source: str) -> list | None:
    """A row's tool definitions (JSON text, as TRL takes it, or a list), None where it has none."""
    import json

    try:
        value = json.loads(value) if isinstance(value, str) else value
    except ValueError:
        value = "text that is not JSON"
    if value is not None and not (isinstance(value, list) and all(isinstance(t, dict) for t in value)):
        what = value if isinstance(value, str) else type(value).__name__
        raise ValueError(f"--data {source!r}: row {row + 1}: 'tools' is {what}, not a list of tool definitions "
                         "(JSON schemas)")
    return value or None


def _system(text: str | None) -> list[dict]:
    return [{"role": "system", "content": text}] if text else []


def _alpaca(instruction, given, output, system, row: int, source: str) -> Conversation:
    for name, value in (("instruction", instruction), ("input", given), ("output", output), ("system", system)):
        if value is not None and not isinstance(value, str):
            raise ValueError(f"--data {source!r}: row {row + 1}: {name!r} is {type(value).__name__}, not text")
    if output is None:
        raise ValueError(f"--data {source!r}: row {row + 1} has no 'output': every row needs an answer to learn from")
    user = "\n".join(t for t in (instruction, given) if t)
    return Conversation(_system(system) + [{"role": "user", "content": user},
                                           {"role": "assistant", "content": output}])
