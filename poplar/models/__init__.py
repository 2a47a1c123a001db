"""Models by name, for the command line, the profiler and benchmarks."""

from __future__ import annotations

import torch

from poplar.models.tiny import TinyCausalLM, causal_lm_loss

# name: TinyCausalLM arguments. max_seq_len is the sequence length trained on.
MODEL_PRESETS: dict[str, dict] = {
    "tiny": dict(vocab_size=256, d_model=64, n_layers=2, n_heads=4, max_seq_len=64),
    "small": dict(vocab_size=2000, d_model=256, n_layers=4, n_heads=4, max_seq_len=128),
    "base": dict(vocab_size=8000, d_model=512, n_layers=8, n_heads=8, max_seq_len=256),
}


def build_model(name: str, seed: int = 0) -> TinyCausalLM:
    if name not in MODEL_PRESETS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODEL_PRESETS)}")
    torch.manual_seed(seed)
    return TinyCausalLM(**MODEL_PRESETS[name])


def random_token_batch(name: str, batch: int, seed: int = 0):
    """Random ``(inputs, targets)`` of the preset's shape: enough to time and size a step."""
    cfg = MODEL_PRESETS[name]
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, cfg["vocab_size"], (batch, cfg["max_seq_len"] + 1), generator=g)
    return x[:, :-1], x[:, 1:]


__all__ = ["MODEL_PRESETS", "TinyCausalLM", "build_model", "causal_lm_loss", "random_token_batch"]
