"""Learnable synthetic token streams: quick, deterministic data for demos and tests."""

from __future__ import annotations

import torch


def bigram_batches(n_steps: int, global_batch: int, seq_len: int = 32, vocab_size: int = 256, seed: int = 0):
    """Global batches of ``(inputs, targets)`` drawn from a fixed random bigram chain.

    Each next token is ``table[token]`` with probability 0.9 (else uniform), so a model
    can learn the table and the loss visibly falls. Batch ``i`` is the same on every rank
    and in every run with the same arguments.
    """
    g = torch.Generator().manual_seed(seed)
    table = torch.randperm(vocab_size, generator=g)
    batches = []
    for _ in range(n_steps):
        x = torch.empty(global_batch, seq_len + 1, dtype=torch.long)
        x[:, 0] = torch.randint(0, vocab_size, (global_batch,), generator=g)
        for t in range(seq_len):
            noise = torch.rand(global_batch, generator=g) < 0.1
            x[:, t + 1] = torch.where(noise, torch.randint(0, vocab_size, (global_batch,), generator=g), table[x[:, t]])
        batches.append((x[:, :-1].contiguous(), x[:, 1:].contiguous()))
    return batches
