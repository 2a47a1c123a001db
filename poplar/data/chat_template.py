"""Conversations to samples: rendered by a chat template, the loss on the assistant's tokens and nothing else.

The template is the config's ``chat_template`` (a ``.jinja`` file or the template's text) where given, else the
model's tokenizer's own; rendered with the tokenizer's ``apply_chat_template`` (Hugging Face ``transformers``), so a
conversation's tokens are exactly those the model's tokenizer gives it at inference. A model with no tokenizer (a
preset, which trains its own BPE) or a tokenizer with no template: one line naming the option; no template is
guessed.

Which tokens are the assistant's, by one of two methods:

- the template marks them (``{% generation %}`` ... ``{% endgeneration %}``): the tokens it marks, from
  ``apply_chat_template(..., return_assistant_tokens_mask=True)``, exactly as TRL's ``assistant_only_loss`` takes
  them;
- otherwise (most templates): the conversation rendered prefix by prefix. For each assistant message ``i``, the
  text of messages ``0..i-1`` with the generation prompt (what the model is given at inference) and the text of
  messages ``0..i``: the assistant's span is what the second adds to the first (its content and its end-of-turn
  marks), as far as the second begins the whole conversation's text (a template that ends a conversation with an
  end-of-text, Phi-3's, counts it after the last reply only, as TRL's marked variant does). The spans are
  characters of the whole text, which is tokenised once; a token overlapping a span is counted (as
  ``transformers`` builds its mask from the generation marks). A template that renders an assistant's turn
  otherwise once later turns follow (Qwen3's drops an earlier turn's thinking) is refused in one line: give a
  template with ``{% generation %}`` marks (TRL ships such variants of common models' templates).

In both, a conversation's prompt (TRL's conversational prompt-completion) is not counted: the completion begins
where the prompt rendered with the generation prompt stops being a prefix of the whole text (as TRL finds it).
Every counted assistant's content must appear in the counted text: a template that drops it (renders only the
last message, or no assistant text) is refused in one line, not trained on its headers. No end-of-text is added:
the template's own end-of-turn marks end a turn, as with TRL.
"""

from __future__ import annotations

import re
from pathlib import Path

from poplar.data.chat import Conversation
from poplar.models.loss import IGNORE

FIX = "--set chat_template=path/to/template.jinja"


def template_text(given: str | None) -> str | None:
    """The config's ``chat_template``: a file's text, or the template itself (one line where it is neither)."""
    if given is None:
        return None
    if "{{" in given or "{%" in given:
        return given
    path = Path(given).expanduser()
    if not path.is_file():
        raise ValueError(f"chat_template {given!r}: no such file, and not a Jinja template: give a .jinja file or the "
                         "template's text")
    return path.read_text()


def chat_tokenizer(model_source, tok, given: str | None):
    """A ``transformers`` tokenizer to render with (the model directory's, else the trained BPE's), its template the
    config's where given; None where there is no template at all."""
    from poplar.models.pretrained import auto_tokenizer

    directory = getattr(model_source, "directory", None)
    template = template_text(given)
    if directory is not None and model_source.has_tokenizer():
        hf = auto_tokenizer(directory)
        template = template or hf.chat_template
    else:
        if template is None:
            return None
        from transformers import PreTrainedTokenizerFast

        from poplar.data.text import EOT
        hf = PreTrainedTokenizerFast(tokenizer_object=tok.backend, eos_token=EOT, pad_token=EOT)
    if isinstance(template, dict):   # a tokenizer of named templates: the default one
        template = template.get("default")
    return None if template is None else (hf, template)


def no_template(model_source, source: str) -> ValueError:
    name = getattr(model_source, "directory", None) or getattr(model_source, "name", "the model")
    has = getattr(model_source, "directory", None) is not None and model_source.has_tokenizer()
    what = "its tokenizer has no chat template" if has else \
        "it has no tokenizer of its own (one is trained on the data)"
    return ValueError(f"--data {source!r} holds conversations, rendered by a chat template, and --model {name}: "
                      f"{what}: give one with {FIX}")


def chat_samples(chats: list[Conversation], rendering, source: str) -> list[tuple[list[int], list[int]]]:
    """Each conversation's ``(ids, labels)``: labels the ids on the assistant's counted tokens, IGNORE elsewhere."""
    hf, template = rendering
    whole = _render(hf, [c.messages for c in chats], [c.tools for c in chats], template, False, source)
    for i, (chat, text) in enumerate(zip(chats, whole)):
        _check_content(chat, text, i, source)
    if re.search(r"\{%-?\s*generation\s*-?%\}", template):
        out = _apply(hf, [c.messages for c in chats], [c.tools for c in chats], chat_template=template,
                     tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
                     tokenizer_kwargs={"return_offsets_mapping": True})
        ids, offsets = [o["input_ids"] for o in out], [o["offset_mapping"] for o in out]
        ends = _prompt_ends(hf, chats, whole, template, source)
        masks = [[m if start >= end else 0 for m, (start, _) in zip(o["assistant_masks"], offs)]
                 for o, offs, end in zip(out, offsets, ends)]
    else:
        out = hf(whole, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = out["input_ids"], out["offset_mapping"]
        masks = [_overlapping(o, spans) for o, spans in zip(offsets, _spans(hf, chats, whole, template, source))]
    samples = []
    for i, (chat, text, row_ids, row_offsets, mask) in enumerate(zip(chats, whole, ids, offsets, masks)):
        _check_content(chat, _counted_text(text, row_offsets, mask), i, source, counted=True)
        samples.append((list(row_ids), [t if m else IGNORE for t, m in zip(row_ids, mask)]))
    return samples


def _apply(hf, conversations: list[list[dict]], tools: list, **kwargs) -> list:
    """``apply_chat_template`` of each conversation with its tools (those of like tools at once): each one's text,
    or (``return_dict``) its fields."""
    import json

    groups: dict[str, list[int]] = {}
    for k, t in enumerate(tools):
        groups.setdefault(json.dumps(t, sort_keys=True) if t else "", []).append(k)
    out: list = [None] * len(conversations)
    for ks in groups.values():
        got = hf.apply_chat_template([conversations[k] for k in ks], tools=tools[ks[0]], **kwargs)
        for j, k in enumerate(ks):
            out[k] = {name: values[j] for name, values in got.items()} if kwargs.get("return_dict") else got[j]
    return out


def _render(hf, conversations: list[list[dict]], tools: list, template: str, prompt: bool, source: str,
            rows: list[int] | None = None) -> list[str]:
    """The texts of ``conversations`` (``prompt``: with the generation prompt; ``rows``: the rows they are of, where
    not each its own); a template that refuses one: a line naming the row."""
    if not any(conversations):   # none to render (no prompts), or only empty ones (a reply first): nothing before
        return [""] * len(conversations)
    render = (lambda chats, tools: _apply(hf, chats, tools, chat_template=template, tokenize=False,
                                          add_generation_prompt=prompt))
    try:
        return render(conversations, tools)
    except Exception as e:
        line = next((x for x in str(e).splitlines() if x.strip()), type(e).__name__)
    for k, chat in enumerate(conversations):   # which row: one at a time, now that one is refused
        try:
            render([chat], [tools[k]])
        except Exception:
            row = rows[k] if rows is not None else k
            raise ValueError(f"--data {source!r}: row {row + 1}: the chat template refuses it ({line[:200]}): "
                             f"give rows it takes, or another template ({FIX})") from None
    raise ValueError(f"--data {source!r}: the chat template cannot render the rows ({line[:200]}): give another "
                     f"template ({FIX})")


def _spans(hf, chats: list[Conversation], whole: list[str], template: str, source: str) -> list[list[tuple]]:
    """Each conversation's counted assistant spans, in characters of its text, prefix by prefix (see the module)."""
    where = [(r, i) for r, chat in enumerate(chats) for i in chat.counted()]
    first = [(r, i) for r, i in where if i > 0]   # a reply that opens the conversation: counted from its start
    before = dict(zip(first, _render(hf, [chats[r].messages[:i] for r, i in first],
                                     [chats[r].tools for r, _ in first], template, True, source,
                                     [r for r, _ in first])))
    inner = [(r, i) for r, i in where if i + 1 < len(chats[r].messages)]   # a last message's: the whole text
    through = dict(zip(inner, _render(hf, [chats[r].messages[:i + 1] for r, i in inner],
                                      [chats[r].tools for r, _ in inner], template, False, source,
                                      [r for r, _ in inner])))
    spans: list[list[tuple]] = [[] for _ in chats]
    for r, i in where:
        head, upto = before.get((r, i), ""), through.get((r, i), whole[r])
        start, end = _common_prefix(head, upto), _common_prefix(upto, whole[r])
        if chats[r].messages[i]["content"].strip() not in whole[r][start:end]:
            raise ValueError(f"--data {source!r}: row {r + 1}: the chat template renders message {i + 1} (the "
                             "assistant's) otherwise once later turns follow, so its tokens cannot be found by "
                             f"rendering prefixes: give a template with {{% generation %}} marks ({FIX})")
        spans[r].append((start, end, end < len(upto)))
    return spans


def _overlapping(offsets: list[tuple[int, int]], spans: list[tuple[int, int, bool]]) -> list[int]:
    """1 for each token whose characters overlap a span (``spans`` in order: start, end, and whether the text past
    the end differs from what the span's turn rendered alone, so a token across the end is not the turn's)."""
    mask, k = [0] * len(offsets), 0
    for t, (start, end) in enumerate(offsets):
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        begin, stop, diverges = spans[k]
        mask[t] = int(end > begin and not (diverges and end > stop))
    return mask


def _prompt_ends(hf, chats: list[Conversation], whole: list[str], template: str, source: str) -> list[int]:
    """Where each conversation's completion begins, in characters (0: no prompt): where its prompt rendered for
    generation stops being a prefix of its text (the template's marks counted only past it)."""
    prompted = [r for r, chat in enumerate(chats) if chat.counted_from]
    heads = _render(hf, [chats[r].messages[:chats[r].counted_from] for r in prompted],
                    [chats[r].tools for r in prompted], template, True, source, prompted)
    ends = [0] * len(chats)
    for r, head in zip(prompted, heads):
        ends[r] = _common_prefix(head, whole[r])
    return ends


def _counted_text(text: str, offsets, mask: list[int]) -> str:
    """The characters of the counted tokens, separate runs apart."""
    out, last = [], None
    for (start, end), m in zip(offsets, mask):
        if m:
            out.append(text[start:end] if last == start else "\0" + text[start:end])
            last = end
    return "".join(out)


def _check_content(chat: Conversation, text: str, row: int, source: str, counted: bool = False) -> None:
    """Each counted assistant's content within ``text``: the conversation's rendering, or (``counted``) the text of
    the tokens counted."""
    for i in chat.counted():
        content = chat.messages[i]["content"].strip()
        if content and content not in text:
            shown = content if len(content) <= 40 else content[:37] + "..."
            where = "the tokens counted as the assistant's" if counted else "its rendering"
            raise ValueError(f"--data {source!r}: row {row + 1}: the chat template drops the assistant's content "
                             f"({shown!r} is not in {where}): give a template that renders every message ({FIX})")
    if counted and not text:
        raise ValueError(f"--data {source!r}: row {row + 1}: the chat template marks none of the assistant's tokens: "
                         f"give a template whose {{% generation %}} marks enclose the assistant's replies ({FIX})")


def _common_prefix(a: str, b: str) -> int:
    if b.startswith(a):
        return len(a)
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
