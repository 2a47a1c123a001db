"""The next-token loss, as one device weights it over a whole global batch.

A micro-batch is ``(inputs, targets)`` of packed text, every target counted: its mean
cross-entropy, which the engine weights by the micro-batch's samples. Or it is
``(inputs, targets, weight)`` where some targets are :data:`IGNORE` (a prompt, padding):
one device's loss is then the mean over the *global batch's* counted tokens, so a
micro-batch's share is its summed loss over that count. ``weight`` (one value per
sample, all alike) is the global batch's samples over its counted tokens
(:class:`poplar.data.text.GlobalBatches` computes it from the whole batch, which every
rank holds): the summed loss times ``weight / n`` is what the engine's per-sample
weighting (``n / global_batch``) turns into exactly that share.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE = -100   # a target not counted (PyTorch's and Hugging Face's ignore_index)


def next_token_loss(logits: torch.Tensor, batch) -> torch.Tensor:
    """The loss of ``logits`` ``[n, seq, vocab]`` against the micro-batch's targets (see the module)."""
    _, targets, *weight = batch
    flat, goal = logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1)
    if not weight:
        return F.cross_entropy(flat, goal)
    total = F.cross_entropy(flat, goal, ignore_index=IGNORE, reduction="sum")
    return total * weight[0][0].to(total.dtype) / targets.shape[0]
