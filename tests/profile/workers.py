"""Ranks for tests/profile (importable by spawned processes)."""

import torch

import poplar
from poplar.emulate import EmulatedDevice, parse_cluster
from poplar.models import build_model, causal_lm_loss, random_token_batch


def train_at(rank, world_size, device: dict, micro_batch: int, stage: int = 0, accum: int = 1):
    """Two steps at ``micro_batch`` on one emulated device: None, or the out-of-memory message."""
    dev = EmulatedDevice(parse_cluster({"devices": [device]}).device(0))
    engine = poplar.initialize(build_model("tiny"), lambda p: torch.optim.AdamW(p, lr=1e-4),
                               poplar.Plan(stage, [micro_batch], accum), device=dev)
    try:
        for _ in range(2):
            engine.train_batch(random_token_batch("tiny", micro_batch * accum), causal_lm_loss)
    except torch.OutOfMemoryError as e:
        return str(e)
    return None
