"""Models the project has no preset of, saved as users save them (``save_pretrained``), for the tests."""

from __future__ import annotations

from pathlib import Path

import torch


def save_tokenizer(directory: Path, vocab_size: int = 300):
    """A byte-level BPE tokenizer trained on the embedded text, saved as a fast tokenizer (with eos and pad)."""
    from transformers import PreTrainedTokenizerFast

    from poplar.data.text import EOT, embedded_text, train_tokenizer

    tok = PreTrainedTokenizerFast(tokenizer_object=train_tokenizer(embedded_text()[:40], vocab_size),
                                  eos_token=EOT, pad_token=EOT)
    tok.save_pretrained(directory)
    return tok


def save_qwen2(directory: Path, seed: int = 7, tokenizer: bool = True, layers: int = 2, tie: bool = False,
               max_shard_size: str | None = None, dtype=torch.float32) -> Path:
    """A small Qwen2 causal LM with random (seeded) weights and, if asked, a tokenizer, as save_pretrained writes it."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    directory = Path(directory)
    vocab = len(save_tokenizer(directory)) if tokenizer else 320
    config = Qwen2Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=tie)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(dtype)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, **kwargs)
    return directory
