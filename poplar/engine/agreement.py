"""What every rank must agree on before the first collective over the units, checked once at set-up.

- the same model and the same plan on every rank: one small all-reduce of their figures
  (a rank holding another plan would otherwise issue collectives of other sizes);
- a shape whose collectives every rank sizes alike: :func:`~poplar.engine.layout.check_collective_sizes`,
  arithmetic on the layout alone, the same on every rank, so all refuse together (and
  :func:`check_plans_before_launch` runs it before any process starts);
- the plan this rank runs, noted in its flight record (:mod:`poplar.engine.flight`), so a
  rank that dies in a collective is reported with it.
"""

from __future__ import annotations

import zlib

import torch
from torch import nn

from poplar.engine import flight
from poplar.engine.collectives import Comm
from poplar.engine.config import EngineConfig
from poplar.engine.layout import check_collective_sizes
from poplar.engine.units import build_units
from poplar.plan import Plan


def check_same_everywhere(comm: Comm, plan: Plan, model: nn.Module, device: torch.device) -> None:
    """Every rank must hold the same plan and the same model: fail everywhere if not."""
    record = flight.recorder()
    if record is not None:
        record.note(f"plan: {plan}")
    world = comm.world_size
    n_params = sum(p.numel() for p in model.parameters())
    # check_world_size passed, so every rank sends the same number of values.
    groups = plan.shard_groups or [range(world)]
    group_of = [next(j for j, g in enumerate(groups) if r in g) for r in range(world)]
    shares = zlib.crc32(repr(plan.shard_shares).encode())   # the same number for the same shares
    values = [n_params, plan.zero_stage, *plan.micro_batch_sizes, *plan.accum_steps, *plan.local_batch_sizes,
              *group_of, shares, *(plan.stage_of(r) for r in range(world))]
    lo, hi = comm.agree(values, device)
    if lo[0] != hi[0]:
        raise ValueError(f"ranks hold different models: parameter counts range from {lo[0]} to {hi[0]}; "
                         "build the same model on every rank")
    if lo[1:] != hi[1:]:
        raise ValueError(f"ranks hold different plans (rank {comm.rank} has {plan}); give every rank the same plan")


def check_shape(plan: Plan, world_size: int, unit_params: list[list[nn.Parameter]]) -> None:
    """The plan's shape against the layout of these units (each a list of parameters), before any of their
    collectives; every rank computes the same, so every rank raises alike."""
    numels = sorted({sum(p.numel() for p in params) for params in unit_params})
    check_collective_sizes(world_size, plan.shard_groups, plan.shard_shares, numels)


def check_plans_before_launch(plans: list[Plan], build_model, config: EngineConfig | None = None) -> None:
    """Each plan's shape against the units the engine will cut ``build_model()`` into (built on the meta device:
    nothing allocated), before any process starts: a shape the engine cannot run is refused here, in one line."""
    if not any(p.shard_groups for p in plans):
        return
    config = config or EngineConfig()
    with torch.device("meta"):
        model = build_model()
    specs = build_units(model, config.unit_classes, config.unit_numel)
    for plan in plans:
        check_shape(plan, plan.world_size, [s.params for s in specs])
