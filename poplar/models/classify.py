"""A sequence classifier's loss: a Hugging Face ``...ForSequenceClassification`` model on padded samples.

A micro-batch is ``(inputs, labels)``: ``inputs`` ``[n, seq_len]`` ids padded on the
right with the model's padding id (the attention mask is where they are not padding; the
head reads each sample's last real token, or its first for BERT-like models), ``labels``
one a sample. The problem is the config's ``problem_type`` as transformers reads it:
regression where there is one label (mean squared error), multi-label where the config
says so (binary cross-entropy a label), else single-label (cross-entropy). Every loss is
the micro-batch's mean over its samples, which the engine weights by its samples: one
device's mean over the global batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def problem_type(config) -> str:
    if config.problem_type:
        return config.problem_type
    return "regression" if config.num_labels == 1 else "single_label_classification"


class ClassifierLoss:
    """``loss(model, (inputs, labels))`` of a sequence classifier padded with ``pad_id`` (see the module)."""

    def __init__(self, pad_id: int):
        self.pad_id = pad_id

    def __call__(self, model, batch) -> torch.Tensor:
        inputs, labels = batch[0], batch[1]
        logits = model(input_ids=inputs, attention_mask=(inputs != self.pad_id).long()).logits.float()
        kind = problem_type(model.config)
        if kind == "regression":
            return F.mse_loss(logits.reshape(labels.shape), labels.float())
        if kind == "multi_label_classification":
            return F.binary_cross_entropy_with_logits(logits, labels.float())
        return F.cross_entropy(logits, labels.long())


def random_labels(n: int, num_labels: int, config, generator: torch.Generator) -> torch.Tensor:
    """Labels of ``n`` samples of the config's problem (to time and size a step)."""
    kind = problem_type(config)
    if kind == "regression":
        return torch.randn(n, generator=generator)
    if kind == "multi_label_classification":
        return torch.randint(0, 2, (n, num_labels), generator=generator).float()
    return torch.randint(0, num_labels, (n,), generator=generator)


def label_tensor(values: list, config, source: str) -> torch.Tensor:
    """A table's label field as the problem's labels, one line where a value does not fit it."""
    kind, k = problem_type(config), config.num_labels
    try:
        if kind == "regression":
            return torch.tensor([float(v) for v in values], dtype=torch.float32)
        if kind == "multi_label_classification":
            out = torch.tensor(values, dtype=torch.float32)
            if out.dim() != 2 or out.shape[1] != k:
                raise ValueError(f"a row's labels are not {k} values")
            return out
        out = torch.tensor(values, dtype=torch.long)
    except (TypeError, ValueError) as e:
        raise ValueError(f"--data {source!r}: the label field does not hold {kind.replace('_', ' ')} labels "
                         f"({e}): give {_wanted(kind, k)}") from None
    bad = out[(out < 0) | (out >= k)]
    if out.dim() != 1 or bad.numel():
        raise ValueError(f"--data {source!r}: a label is {bad[0].item() if bad.numel() else 'not one number'}, the "
                         f"model has {k} labels (num_labels): give {_wanted(kind, k)}")
    return out


def _wanted(kind: str, k: int) -> str:
    return {"regression": "a number a row", "multi_label_classification": f"{k} 0/1 values a row"}.get(
        kind, f"a class id in 0..{k - 1} a row")
