"""What a user brings, made here without a hub: a small Qwen2 saved with save_pretrained, and a JSONL of pairs.

    python examples/your_model.py --out my-qwen

Writes ``my-qwen/`` (config.json, model.safetensors, a fast tokenizer trained on the
Python Language Reference that ships with Python) and ``my-qwen.jsonl``: prompt/completion
pairs cut from the same text (a paragraph's opening sentence, then the sentence after it).
Stand-ins for your own checkpoint and data: docs/your-model.md trains them.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import torch


def pairs_from_text(limit: int) -> list[dict]:
    """Each paragraph's first sentence as a prompt, its second as the completion."""
    from pydoc_data.topics import topics

    out = []
    for text in (topics[k] for k in sorted(topics)):
        for para in re.split(r"\n\s*\n", text):
            sentences = re.split(r"(?<=[.!?])\s+", " ".join(para.split()))
            if len(sentences) >= 2 and 20 < len(sentences[0]) < 300 and 10 < len(sentences[1]) < 300:
                out.append({"prompt": sentences[0], "completion": " " + sentences[1]})
    return out[:limit]


def save_model(out: Path, hidden: int, layers: int, vocab: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
    from pydoc_data.topics import topics

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(list(topics.values()), trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.save_pretrained(out)
    config = Qwen2Config(vocab_size=len(fast), hidden_size=hidden, intermediate_size=4 * hidden,
                         num_hidden_layers=layers, num_attention_heads=max(1, hidden // 32),
                         num_key_value_heads=max(1, hidden // 64), max_position_embeddings=512)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("my-qwen"))
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--pairs", type=int, default=2000)
    args = ap.parse_args()
    if args.out.exists():
        raise SystemExit(f"{args.out} exists: give another --out (nothing is overwritten)")
    save_model(args.out, args.hidden, args.layers, args.vocab)
    data = args.out.with_suffix(".jsonl")
    rows = pairs_from_text(args.pairs)
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {args.out}/ (a Qwen2 of {args.layers} layers, hidden {args.hidden}) and {data} ({len(rows)} pairs)")


if __name__ == "__main__":
    main()
