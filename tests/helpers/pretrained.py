"""Models the project has no preset of, saved as users save them (``save_pretrained``), for the tests."""

from __future__ import annotations

from pathlib import Path

import torch


def save_tokenizer(directory: Path, vocab_size: int = 300):
    """A byte-level BPE tokenizer trained on the embedded text, saved as a fast tokenizer (with eos, pad, mask)."""
    from transformers import PreTrainedTokenizerFast

    from poplar.data.text import EOT, MASK, embedded_text, train_tokenizer

    tok = PreTrainedTokenizerFast(tokenizer_object=train_tokenizer(embedded_text()[:40], vocab_size),
                                  eos_token=EOT, pad_token=EOT, mask_token=MASK)
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


def save_family(directory: Path, family: str, seed: int = 7) -> Path:
    """A small model of another family than Qwen2, with a tokenizer: GPT-2 (tied head, Conv1D layers), Mistral,
    GPT-NeoX, BERT (a masked LM, tied decoder)."""
    import transformers as tf

    directory = Path(directory)
    vocab = len(save_tokenizer(directory))
    small = dict(vocab_size=vocab)
    config, model_class = {
        "gpt2": (tf.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=128, resid_pdrop=0.0, embd_pdrop=0.0,
                               attn_pdrop=0.0, **small), tf.GPT2LMHeadModel),
        "mistral": (tf.MistralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, max_position_embeddings=128, **small),
                    tf.MistralForCausalLM),
        "gpt-neox": (tf.GPTNeoXConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      max_position_embeddings=128, **small), tf.GPTNeoXForCausalLM),
        "bert": (tf.BertConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                               max_position_embeddings=128, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                               **small), tf.BertForMaskedLM),
    }[family]
    torch.manual_seed(seed)
    model_class(config).save_pretrained(directory)
    return directory


def save_classifier(directory: Path, family: str = "qwen2", num_labels: int = 3, seed: int = 7) -> Path:
    """A small sequence classifier (Qwen2: its last token's head; BERT: its first's, pooled) with a tokenizer."""
    import transformers as tf

    directory = Path(directory)
    tok = save_tokenizer(directory)
    small = dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, max_position_embeddings=128, num_labels=num_labels)
    config, model_class = {
        "qwen2": (tf.Qwen2Config(num_key_value_heads=2, pad_token_id=tok.pad_token_id, **small),
                  tf.Qwen2ForSequenceClassification),
        "bert": (tf.BertConfig(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **small),
                 tf.BertForSequenceClassification),
    }[family]
    torch.manual_seed(seed)
    model_class(config).save_pretrained(directory)
    return directory


def factory_lm():
    """A user's own causal LM, for ``--model tests.helpers.pretrained:factory_lm``: token ids to logits, 320 ids."""
    from tests.helpers.models import TinyLM

    return TinyLM(vocab=320, d=16, layers=2)


def factory_not_a_module():
    return "a string"


class _Pooled(torch.nn.Module):
    """Token ids to one vector a sample: no logits a position."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(320, 8)

    def forward(self, ids):
        return self.embed(ids).mean(1)


def factory_no_logits():
    return _Pooled()
