"""The model presets' shapes, and their parameter counts from arithmetic alone (no torch, no model built).

A command refuses a model too large for its cluster before it imports torch (seconds) or
builds anything: :func:`param_count` is each family's count, checked against the built
models' (tests/models/test_workload.py).
"""

from __future__ import annotations

# the built-in TinyCausalLM presets (:mod:`poplar.models.tiny`)
MODEL_PRESETS: dict[str, dict] = {
    "tiny": dict(vocab_size=256, d_model=64, n_layers=2, n_heads=4, max_seq_len=64),
    "small": dict(vocab_size=2000, d_model=256, n_layers=4, n_heads=4, max_seq_len=128),
    "base": dict(vocab_size=8000, d_model=512, n_layers=8, n_heads=8, max_seq_len=256),
}

# Hugging Face presets (:mod:`poplar.models.hf`): family, config
HF_PRESETS: dict[str, tuple[str, dict]] = {
    "llama-tiny": ("llama", dict(hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, max_position_embeddings=256)),
    "llama-small": ("llama", dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                                  num_key_value_heads=4, max_position_embeddings=512)),
    "llama-125m": ("llama", dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                                 num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=2048)),
    "llama-350m": ("llama", dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=24,
                                 num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=2048)),
    # real sizes (Llama-2's 7B, 13B, 70B; a 1B in Llama-3's shape; a 20B), for `poplar simulate`: too large to run here
    "llama-1b": ("llama", dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                               num_key_value_heads=8, max_position_embeddings=8192, vocab_size=128256)),
    "llama-7b": ("llama", dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                               num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
                               vocab_size=32000)),
    "llama-13b": ("llama", dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
                                num_attention_heads=40, num_key_value_heads=40, max_position_embeddings=4096,
                                vocab_size=32000)),
    # GPT-NeoX-20B's size in Llama-2's shape: between 13B and 70B, where memory decides who can train it
    "llama-20b": ("llama", dict(hidden_size=6144, intermediate_size=16384, num_hidden_layers=44,
                                num_attention_heads=48, num_key_value_heads=48, max_position_embeddings=4096,
                                vocab_size=32000)),
    "llama-70b": ("llama", dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=4096,
                                vocab_size=32000)),
    "bert-tiny": ("bert", dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                               max_position_embeddings=256)),
    "bert-small": ("bert", dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
                                max_position_embeddings=512)),
    "bert-base": ("bert", dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                               num_attention_heads=12, max_position_embeddings=512)),
    "bert-large": ("bert", dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                                num_attention_heads=16, max_position_embeddings=512, vocab_size=30522)),
}

HF_DEFAULT_VOCAB = 2048    # a Hugging Face preset's vocabulary where its config gives none (the tokenizer's, trained)


def default_vocab(name: str) -> int:
    """Preset ``name``'s vocabulary where none is asked for."""
    if name in MODEL_PRESETS:
        return MODEL_PRESETS[name]["vocab_size"]
    return HF_PRESETS[name][1].get("vocab_size", HF_DEFAULT_VOCAB)


def param_count(name: str, vocab_size: int) -> int:
    """The parameters of preset ``name`` with a vocabulary of ``vocab_size`` (a tied head counted once)."""
    if name in MODEL_PRESETS:
        c = MODEL_PRESETS[name]
        d, n = c["d_model"], c["n_layers"]
        block = 2 * 2 * d + 4 * d * d + (d * 4 * d + 4 * d) + (4 * d * d + d)   # norms, attention, MLP
        return vocab_size * d + c["max_seq_len"] * d + n * block + 2 * d     # the head is the embedding
    kind, c = HF_PRESETS[name]
    d, ffn, n = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]
    if kind == "llama":    # no biases, an untied head, RMS norms of one vector
        kv = c["num_key_value_heads"] * d // c["num_attention_heads"]
        block = 2 * d * d + 2 * d * kv + 3 * d * ffn + 2 * d
        return 2 * vocab_size * d + n * block + d
    # BERT for masked LM: embeddings (word, position, two token types, norm), layers, the head's transform; the
    # decoder's weight is the word embedding's, its bias one vector
    block = 4 * (d * d + d) + 2 * d + (d * ffn + ffn) + (ffn * d + d) + 2 * d
    return (vocab_size + c["max_position_embeddings"] + 2) * d + 2 * d + n * block + (d * d + d) + 2 * d + vocab_size
