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
from poplar.models.presets import HF_PRESETS   # name: (family, config); vocab_size is set when the model is built

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
        if isinstance(packed, FakeTensor) or (isinstance(packed, torch.Tensor) and packed.is_meta):
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
