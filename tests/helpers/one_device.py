"""What one device reaches training a `poplar train` config's model on its whole global batch a step: the same
model, data, optimizer, schedule and clipping (the runs on uneven ranks are held to it)."""

from __future__ import annotations

import torch

import poplar
from poplar.train.dataset import prepare_data, workload_of


def reference(cfg, steps: int) -> tuple[dict, list[float]]:
    """The state dict after ``steps`` steps, and each step's loss."""
    wl = workload_of(cfg.model_data)
    _, batches = prepare_data(cfg.model_data)
    model = wl.build(seed=cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    whole = poplar.Plan(0, [cfg.global_batch], 1)
    losses = []
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = cfg.schedule.at(step)
        loss = wl.loss(model, batches.local(step, whole, 0))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.engine.clip_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses
