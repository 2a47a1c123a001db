"""A plan's fields checked at its edge: each function takes what a person wrote and returns the value the
:class:`~poplar.plan.Plan` holds, or refuses it in one line that says what to change."""

from __future__ import annotations

import math
import numbers
from typing import Sequence

from poplar.stages import STAGES, stage


def positive_ints(name: str, values: Sequence[int]) -> tuple[int, ...]:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise ValueError(f"{name} must be a list of positive integers, one per rank; got {values!r}")
    if len(values) == 0:
        raise ValueError(f"{name} is empty: give one positive integer per rank")
    if set(map(type, values)) == {int} and min(values) > 0:    # the common case, checked at C speed
        return tuple(values)
    out = []
    for rank, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(
                f"{name}[{rank}] = {v!r}: every entry must be a positive integer "
                f"(rank {rank} needs at least one sample per micro-batch and one micro-step)"
            )
        out.append(int(v))
    return tuple(out)


def checked_shard_groups(groups, world: int) -> tuple[tuple[int, ...], ...] | None:
    """``groups`` checked to be a partition of the ``world`` ranks, each sorted; None when flat (one group)."""
    if groups is None:
        return None
    example = f"e.g. {[list(range(world // 2)), list(range(world // 2, world))]}" if world > 1 else "or none"
    try:
        if all(set(map(type, g)) <= {int} for g in groups):    # the common case, at C speed
            parts, lengths_ok = tuple(tuple(sorted(g)) for g in groups), True
        else:
            parts = tuple(tuple(sorted(int(r) for r in g if not isinstance(r, bool) and int(r) == r)) for g in groups)
            lengths_ok = all(len(p) == len(g) for p, g in zip(parts, groups))
    except (TypeError, ValueError):
        parts, lengths_ok = (), False
    flat = sorted(r for p in parts for r in p)
    if not lengths_ok or not all(parts) or flat != list(range(world)):
        raise ValueError(f"shard_groups {groups!r} must split the ranks 0..{world - 1} into non-empty groups, "
                         f"each rank in exactly one ({example})")
    return None if len(parts) == 1 else tuple(sorted(parts))


def checked_shard_shares(shares, world: int, zero_stage: int, groups) -> tuple[float, ...] | None:
    """Each rank's share of the states its group shards (weights, normalised within each group); None where
    every group's are equal (the even layout)."""
    if shares is None:
        return None
    if isinstance(shares, (str, bytes)) or not isinstance(shares, Sequence) or len(shares) != world:
        raise ValueError(f"shard_shares must be a list of {world} numbers >= 0, one per rank; got {shares!r}")
    simple = set(map(type, shares)) <= {int, float} and min(shares) >= 0 and math.isfinite(max(shares))
    for rank, v in enumerate(() if simple else shares):    # the common case above, checked at C speed
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) or v < 0:
            raise ValueError(f"shard_shares[{rank}] = {v!r}: a share is a finite number >= 0 (the part of each "
                             "unit's states the rank holds, relative to its group's; 0: none)")
    if not stage(zero_stage).shards_optimizer:
        raise ValueError("ZeRO stage 0 shards nothing, so it takes no shard_shares: drop them or use stage 1, 2 or 3")
    values = tuple(float(v) for v in shares)
    for g in groups or [range(world)]:
        if sum(values[r] for r in g) <= 0:
            raise ValueError(f"shard_shares: ranks {list(g)} hold one copy of the states together and all their "
                             "shares are 0: give at least one of them a share")
    if all(len({values[r] for r in g}) == 1 for g in groups or [range(world)]):
        return None
    return values


def checked_group_stages(stages, zero_stage: int, given, groups) -> tuple[int, ...] | None:
    """``stages`` (one ZeRO stage per group of ``given``, as the caller listed them) checked and put in the order of
    ``groups`` (the plan's, sorted); None where they are all alike (a plain plan)."""
    if stages is None:
        return None
    if given is None:
        raise ValueError("group_stages gives each shard group its own ZeRO stage: give shard_groups too, "
                         "or drop group_stages")
    if isinstance(stages, (str, bytes)) or not isinstance(stages, Sequence) or len(stages) != len(given):
        raise ValueError(f"group_stages {stages!r}: give one ZeRO stage per shard group ({len(given)} of them)")
    for j, s in enumerate(stages):
        if isinstance(s, bool) or s not in STAGES:
            raise ValueError(f"group_stages[{j}] = {s!r}: choose one of {', '.join(map(str, STAGES))}")
    if max(stages) != zero_stage:
        raise ValueError(f"group_stages {list(stages)}: zero_stage is the highest of them (the plan's own): "
                         f"set zero_stage to {max(stages)}")
    if len(set(stages)) == 1 or groups is None:
        return None
    of = {tuple(sorted(int(r) for r in g)): int(s) for g, s in zip(given, stages)}
    return tuple(of[g] for g in groups)


def check_accum_steps(acc: tuple[int, ...], zero_stage: int, groups, group_stages) -> None:
    """Stages 2 and 3 reduce-scatter every micro-step: the ranks of one collective run as many micro-steps. A plan
    of one stage asks it of every rank (as it always has); one with a stage per group, of each such group."""
    free = " or ".join(str(n) for n, s in STAGES.items() if not s.equal_accum_steps)
    zs = stage(zero_stage)
    if group_stages is None and zs.equal_accum_steps and len(set(acc)) > 1:
        # the collectives of a rank's extra micro-steps would have no partner
        raise ValueError(
            f"ZeRO stage {zs.number} reduce-scatters gradients on every micro-step, so every rank "
            f"must run the same number of accumulation steps; got accum_steps={list(acc)}. "
            "Give every rank the same accum_steps and balance the work with micro_batch_sizes, "
            f"or use zero_stage {free}, which synchronise once per step and allow unequal counts."
        )
    for g, s in zip(groups or (), group_stages or ()):
        if stage(s).equal_accum_steps and len({acc[r] for r in g}) > 1:
            raise ValueError(f"shard group {list(g)} is in ZeRO stage {s}, which reduce-scatters gradients on every "
                             f"micro-step inside the group, so its ranks must run the same number of accumulation "
                             f"steps; got {[acc[r] for r in g]}: give them the same, or put the group in stage {free}")


def check_unsharded_shares(shares, groups, group_stages) -> None:
    """A group in stage 0 shards nothing: its ranks' shares (where the plan has any) must be alike."""
    for g, s in zip(groups or (), group_stages or ()):
        if shares is not None and not stage(s).shards_optimizer and len({shares[r] for r in g}) > 1:
            raise ValueError(f"shard group {list(g)} is in ZeRO stage 0, which shards nothing: give its ranks equal "
                             f"shard_shares (got {[shares[r] for r in g]})")
