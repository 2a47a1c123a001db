"""Functions run inside spawned ranks for tests/train/test_checkpoint.py."""

from __future__ import annotations

import torch

import poplar
from poplar.runtime.checkpoint import find_resumable, load_checkpoint, save_checkpoint
from tests.helpers.models import OPTIMIZER, lm_loss, make_batches, make_model

META = {"workload": "tiny-lm", "global_batch": 12}


def train_span(rank, world_size, plan_dict, root, first, last, save_every, clip=1.0):
    """Resume from ``root``'s newest checkpoint if ``first`` > 0, train steps ``first``..``last - 1``, save."""
    plan = poplar.Plan.from_dict(plan_dict)
    engine = poplar.initialize(make_model(), OPTIMIZER, plan, clip_grad_norm=clip)
    if first:
        path = find_resumable(root)
        assert load_checkpoint(engine, path, META)["step"] == first
    lo, hi = plan.sample_range(rank)
    batches = make_batches(last, plan.global_batch_size, seed=3)
    for step in range(first, last):
        tokens, targets = batches[step]
        engine.train_batch((tokens[lo:hi], targets[lo:hi]), lm_loss)
        if save_every and (step + 1) % save_every == 0:
            save_checkpoint(engine, root, step + 1, META)
    state = engine.full_state_dict()
    engine.close()
    return state if rank == 0 else None


def save_nonfinite(rank, world_size, root):
    plan = poplar.Plan.from_local_batches(0, [4] * world_size, [1] * world_size)
    engine = poplar.initialize(make_model(), OPTIMIZER, plan)
    with torch.no_grad():
        engine.units[0].master[0] = float("nan") if rank == world_size - 1 else engine.units[0].master[0]
    try:
        save_checkpoint(engine, root, 1, META)
    except ValueError as e:
        return str(e)
    return None


def write_checkpoint(rank, world_size, root, meta, step=2):
    """A checkpoint of the tests' small model under ``root``, with ``meta`` as its run's description."""
    engine = poplar.initialize(make_model(), OPTIMIZER, poplar.Plan(0, [2] * world_size, 1))
    save_checkpoint(engine, root, step, meta)
    engine.close()


def fp16_span(rank, world_size, plan_dict, root, first, last, save_every):
    """:func:`train_span` in fp16, the scale growing after two good steps and a step at 2^16 made to overflow:
    the final state, and the scale each step ran at."""
    plan = poplar.Plan.from_dict(plan_dict)
    engine = poplar.initialize(make_model(), OPTIMIZER, plan, mixed_precision="fp16",
                               loss_scale={"growth_interval": 2})
    if first:
        assert load_checkpoint(engine, find_resumable(root), META)["step"] == first
    lo, hi = plan.sample_range(rank)
    batches, scales = make_batches(last, plan.global_batch_size, seed=3), []

    def loss_fn(model, batch):
        return lm_loss(model, batch) * (float("inf") if engine.loss_scale >= 2 ** 16 else 1.0)

    for step in range(first, last):
        tokens, targets = batches[step]
        scales.append(engine.loss_scale)
        engine.train_batch((tokens[lo:hi], targets[lo:hi]), loss_fn)
        if save_every and (step + 1) % save_every == 0:
            save_checkpoint(engine, root, step + 1, META)
    state = engine.full_state_dict()
    engine.close()
    return (state, scales) if rank == 0 else None
