"""Hugging Face transformers models built from a configuration: no download needed.

Llama (causal LM) and BERT (masked LM) presets from tiny (a CPU test) upward. Their
decoder and encoder layers live in ``nn.ModuleList``s, so the engine makes each layer a
unit (one bucket, one ZeRO-3 gather) without being told.

Losses take ``(inputs, targets)`` of packed text (:mod:`poplar.data.text`):

- causal LM: the mean next-token cross-entropy over the micro-batch;
- masked LM: a fixed number of positions per sequence (15%, chosen from a hash of the
  tokens themselves, so every rank and every run masks the same ones) is
  replaced by the mask token, and the loss is the mean cross-entropy over those
  positions. With the same count in every sequence, the mean over a micro-batch's masked
  positions is the mean of per-sequence means, which the engine's per-sample weighting
  turns into exactly the global batch's mean.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from poplar.models.loss import next_token_loss

# name: (family, config). vocab_size is set from the tokenizer when the model is built.
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
MASK_FRACTION = 0.15


def runs_as_on_real_tensors() -> None:
    """transformers' masks take the path a real step takes on fake tensors too (the simulator's, the FLOP count's).

    Before it builds a causal mask, transformers reads the position ids' values to tell
    whether a row packs several sequences; a fake tensor has no values, so it assumes one
    does and builds a mask (a dozen operators a step) that a real step, whose ids it made
    itself (0, 1, ... in every row), never builds. The check's own operators still run on a
    fake tensor (a real step runs them too); its answer is a real step's: not packed. Real
    tensors are answered as before. Idempotent; where transformers has no such check,
    nothing changes.
    """
    import transformers.masking_utils as masking

    find = getattr(masking, "find_packed_sequence_indices", None)
    if find is None or getattr(find, "poplar_real_path", False):
        return

    def find_packed(position_ids):
        from torch._subclasses.fake_tensor import FakeTensor

        packed = find(position_ids)
        if isinstance(packed, FakeTensor):
            (packed[:, -1] == 0).all()
            return None
        return packed

    find_packed.poplar_real_path = True
    masking.find_packed_sequence_indices = find_packed


def build_hf_model(name: str, vocab_size: int, seed: int = 0, **overrides) -> torch.nn.Module:
    """A freshly initialised model of preset ``name`` (any field of its config can be overridden)."""
    if name not in HF_PRESETS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(HF_PRESETS)}")
    runs_as_on_real_tensors()
    family, cfg = HF_PRESETS[name]
    cfg = {**cfg, **overrides, "vocab_size": vocab_size}
    torch.manual_seed(seed)
    if family == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(LlamaConfig(**cfg, tie_word_embeddings=False))
    from transformers import BertConfig, BertForMaskedLM

    return BertForMaskedLM(BertConfig(**cfg))


def family(name: str) -> str:
    return HF_PRESETS[name][0]


def causal_lm_loss(model, batch) -> torch.Tensor:
    """Next-token cross-entropy (:func:`poplar.models.loss.next_token_loss`)."""
    return next_token_loss(model(input_ids=batch[0]).logits, batch)


def masked_positions(tokens: torch.Tensor, fraction: float = MASK_FRACTION) -> torch.Tensor:
    """The same number of positions in every sequence, chosen from a hash of its tokens (no Python loop).

    The choice depends only on the sequence itself, so every rank and every split of a
    batch into micro-batches masks the same positions.
    """
    n, length = tokens.shape
    k = max(1, int(round(fraction * length)))
    seed = tokens.sum(1, dtype=torch.int64) * 31 + tokens[:, 0].long()
    pos = torch.arange(1, length + 1, device=tokens.device, dtype=torch.int64)
    scores = seed[:, None] * 6364136223846793005 + pos[None, :] * 1442695040888963407   # wraps: fine for a hash
    scores = scores ^ (scores >> 29)
    return torch.argsort(scores, dim=1, stable=True)[:, :k]


def masked_lm_loss_fn(mask_token_id: int):
    """The masked-LM loss for ``(inputs, targets)`` of packed text (``targets`` is unused)."""

    def loss(model, batch) -> torch.Tensor:
        inputs, _ = batch
        pos = masked_positions(inputs)
        corrupted = inputs.clone()
        corrupted.scatter_(1, pos, mask_token_id)
        logits = model(input_ids=corrupted).logits
        picked = logits.gather(1, pos.unsqueeze(-1).expand(-1, -1, logits.size(-1)))
        return F.cross_entropy(picked.reshape(-1, logits.size(-1)).float(), inputs.gather(1, pos).reshape(-1))

    return loss
