"""Chat data and models for the tests: a Qwen2 directory whose tokenizer has a chat template (TRL's copies of real
models' templates: Qwen2.5's, Llama 3's, their training variants with ``{% generation %}`` marks), and seeded rows
of every conversational format."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from tests.helpers.user_data import WORDS

SPECIAL = ["<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
           "<|eot_id|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]


def trl_template(name: str) -> str:
    """A chat template as TRL ships it (``trl/chat_templates/NAME.jinja``: real models' templates, byte for byte)."""
    import importlib.resources

    return (importlib.resources.files("trl") / "chat_templates" / f"{name}.jinja").read_text()


CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# ChatML with the assistant's reply marked, as TRL's training templates mark it
CHATML_MARKED = ("{% for message in messages %}{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}"
                 "{% generation %}{{ message['content'] + '<|im_end|>\n' }}{% endgeneration %}{% else %}"
                 "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endif %}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def save_chat_model(directory: Path, template: str | None = CHATML, seed: int = 7, positions: int = 128) -> Path:
    """A small Qwen2 causal LM (random, seeded) whose tokenizer (a BPE trained on the embedded text, the chat
    templates' special tokens added) has ``template`` (None: no template), as save_pretrained writes them."""
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    from poplar.data.text import EOT, MASK, embedded_text, train_tokenizer

    directory = Path(directory)
    tok = PreTrainedTokenizerFast(tokenizer_object=train_tokenizer(embedded_text()[:40], 300), eos_token=EOT,
                                  pad_token=EOT, mask_token=MASK, bos_token="<|begin_of_text|>",
                                  additional_special_tokens=SPECIAL)
    tok.add_special_tokens({"additional_special_tokens": SPECIAL})
    if template is not None:
        tok.chat_template = template
    tok.save_pretrained(directory)
    config = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=positions)
    torch.manual_seed(seed)
    Qwen2ForCausalLM(config).save_pretrained(directory)
    return directory


def _say(r: random.Random, lo: int = 1, hi: int = 8) -> str:
    return " ".join(r.choices(WORDS, k=r.randint(lo, hi)))


def conversation(r: random.Random, tools: bool = True) -> list[dict]:
    """A conversation of 1-3 exchanges, a system turn first at times, a tool's turn between at times."""
    messages = [{"role": "system", "content": _say(r)}] if r.random() < 0.5 else []
    for _ in range(r.randint(1, 3)):
        messages.append({"role": "user", "content": _say(r)})
        if tools and r.random() < 0.3:
            messages += [{"role": "assistant", "content": _say(r)}, {"role": "tool", "content": _say(r)}]
        messages.append({"role": "assistant", "content": _say(r)})
    return messages


def rows(fmt: str, n: int, seed: int = 0) -> list[dict]:
    """``n`` seeded rows of ``fmt``: messages, prompt-completion, alpaca or sharegpt."""
    r = random.Random(seed)
    out = []
    for _ in range(n):
        chat = conversation(r, tools=fmt != "sharegpt" or r.random() < 0.5)
        if fmt == "messages":
            out.append({"messages": chat})
        elif fmt == "prompt-completion":
            out.append({"prompt": chat[:-1], "completion": chat[-1:]})
        elif fmt == "sharegpt":
            back = {"user": "human", "assistant": "gpt", "system": "system", "tool": "tool"}
            out.append({"conversations": [{"from": back[m["role"]], "value": m["content"]} for m in chat]})
        else:
            row = {"instruction": _say(r), "input": _say(r) if r.random() < 0.5 else "", "output": _say(r)}
            out.append({**row, **({"system": _say(r)} if r.random() < 0.3 else {})})
    return out


def write_rows(path: Path, rows_: list[dict]) -> str:
    Path(path).write_text("".join(json.dumps(row) + "\n" for row in rows_))
    return str(path)
