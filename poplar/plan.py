"""The plan: how much of each global batch every rank computes, and in which ZeRO stage.

A :class:`Plan` is the value that flows from the planner to the engine. It is small,
printable and serialisable, so a person can save it, read it, edit it and load it.

>>> plan = Plan(zero_stage=1, micro_batch_sizes=[4, 2, 1], accum_steps=[2, 2, 4])
>>> plan.global_batch_size
16
>>> plan.sample_range(1)
(8, 12)
>>> Plan.from_json(plan.to_json()) == plan
True
"""

from __future__ import annotations

import json
import math
import numbers
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from poplar.split import near_equal
from poplar.stages import STAGES, stage


def _positive_ints(name: str, values: Sequence[int]) -> tuple[int, ...]:
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


def _shard_groups(groups, world: int) -> tuple[tuple[int, ...], ...] | None:
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


def _shard_shares(shares, world: int, zero_stage: int, groups) -> tuple[float, ...] | None:
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


def shaped_name(zero_stage: int) -> str:
    """What shard groups make of a stage: the two-level all-reduce in stage 0 (nothing sharded), else hybrid."""
    return "two-level" if zero_stage == 0 else "hybrid"


MAX_GLOBAL_BATCH = 2**22   # samples a step (a 2M-token batch of 1-token samples would still fit)


def check_global_batch(global_batch: int, world_size: int) -> None:
    """Every rank takes at least one sample of every global batch: known before anything is profiled."""
    if global_batch < world_size:
        raise ValueError(f"global batch {global_batch} is smaller than the {world_size} ranks (every rank takes "
                         f"at least one sample): give --global-batch {world_size} or more")
    if global_batch > MAX_GLOBAL_BATCH:
        raise ValueError(f"global batch {global_batch:,}: the planner weighs every sample count up to it, so at "
                         f"most {MAX_GLOBAL_BATCH:,} samples a step: give a smaller --global-batch")


@dataclass(frozen=True)
class Plan:
    """Per-rank micro-batch sizes and accumulation steps for one ZeRO stage.

    Rank ``i`` computes ``accum_steps[i]`` micro-batches of ``micro_batch_sizes[i]``
    samples per optimizer step. The global batch is the sum of ``mbs * accum`` over
    ranks; rank ``i`` takes the consecutive slice :meth:`sample_range` of it.

    ``local_batch_sizes`` (optional) lets a rank take any number of samples ``b`` in
    ``accum`` micro-batches that differ by at most one sample (the larger ones first):
    ``micro_batch_sizes[i]`` is then the largest, ``ceil(b / accum)``, which is what
    must fit the device. So every global batch can be met exactly with the fewest
    accumulation steps memory allows (37 samples = 19 + 18). See :meth:`from_local_batches`.

    ``shard_groups`` (optional) shapes the collectives to the nodes: a partition of the
    ranks (usually one group per node). Each group holds one copy of the model states,
    sharded among its ranks as the stage says, and the copies are replicated across
    groups (hybrid sharding): parameters are gathered and gradients reduce-scattered
    inside a group, and the groups' gradients are summed across groups once per step.
    In stage 0 nothing is sharded, and the gradient all-reduce runs in two levels (inside
    each group, then across groups on each rank's share, then inside again). ``None``:
    one flat group of every rank.

    ``shard_shares`` (optional, stages 1-3) gives each rank its part of the model states it
    shards: weights, one per rank, normalised within each shard group (``[3, 1]``: the
    first rank holds three quarters of every unit's master weights, optimizer states and
    gradient shard, and in stage 3 of its parameters). A share may be 0 (the rank holds
    none, and steps nothing). ``None``, or equal shares: every rank an equal slice.

    ``accum_steps`` may be a single integer, meaning the same count on every rank.
    Stages 2 and 3 reduce-scatter gradients on every micro-step, so they require the
    same ``accum_steps`` on every rank (balance them with ``micro_batch_sizes``).
    """

    zero_stage: int
    micro_batch_sizes: tuple[int, ...]
    accum_steps: tuple[int, ...]

    local_batch_sizes: tuple[int, ...]
    shard_groups: tuple[tuple[int, ...], ...] | None
    shard_shares: tuple[float, ...] | None

    def __init__(self, zero_stage: int, micro_batch_sizes: Sequence[int], accum_steps: Sequence[int] | int = 1,
                 local_batch_sizes: Sequence[int] | None = None,
                 shard_groups: Sequence[Sequence[int]] | None = None,
                 shard_shares: Sequence[float] | None = None):
        zs = stage(zero_stage)
        mbs = _positive_ints("micro_batch_sizes", micro_batch_sizes)
        if isinstance(accum_steps, int) and not isinstance(accum_steps, bool):
            accum_steps = [accum_steps] * len(mbs)
        acc = _positive_ints("accum_steps", accum_steps)
        if len(acc) != len(mbs):
            raise ValueError(
                f"micro_batch_sizes has {len(mbs)} entries but accum_steps has {len(acc)}: "
                "give exactly one of each per rank"
            )
        if zs.equal_accum_steps and len(set(acc)) > 1:
            # the collectives of a rank's extra micro-steps would have no partner
            free = " or ".join(str(n) for n, s in STAGES.items() if not s.equal_accum_steps)
            raise ValueError(
                f"ZeRO stage {zs.number} reduce-scatters gradients on every micro-step, so every rank "
                f"must run the same number of accumulation steps; got accum_steps={list(acc)}. "
                "Give every rank the same accum_steps and balance the work with micro_batch_sizes, "
                f"or use zero_stage {free}, which synchronise once per step and allow unequal counts."
            )
        if local_batch_sizes is None:
            local = tuple(m * a for m, a in zip(mbs, acc))
        else:
            local = _positive_ints("local_batch_sizes", local_batch_sizes)
            if len(local) != len(mbs):
                raise ValueError(f"local_batch_sizes has {len(local)} entries but micro_batch_sizes has "
                                 f"{len(mbs)}: give exactly one of each per rank")
            consistent = [-(-b // a) for b, a in zip(local, acc)] == list(mbs) and all(map(int.__ge__, local, acc))
            for rank, (b, m, a) in enumerate(() if consistent else zip(local, mbs, acc)):   # to name the rank
                if b < a or -(-b // a) != m:
                    fix = (f"give at least {a} samples or fewer accumulation steps" if b < a else
                           f"set micro_batch_sizes[{rank}] = {-(-b // a)}, the largest of {a} near-equal "
                           f"micro-batches of {b} samples")
                    raise ValueError(f"rank {rank}: {b} samples in {a} micro-batches of at most {m}: {fix}")
        object.__setattr__(self, "zero_stage", zs.number)
        object.__setattr__(self, "micro_batch_sizes", mbs)
        object.__setattr__(self, "accum_steps", acc)
        object.__setattr__(self, "local_batch_sizes", local)
        object.__setattr__(self, "shard_groups", _shard_groups(shard_groups, len(mbs)))
        object.__setattr__(self, "shard_shares", _shard_shares(shard_shares, len(mbs), zs.number, self.shard_groups))

    @classmethod
    def from_local_batches(cls, zero_stage: int, local_batch_sizes: Sequence[int],
                           accum_steps: Sequence[int] | int = 1,
                           shard_groups: Sequence[Sequence[int]] | None = None,
                           shard_shares: Sequence[float] | None = None) -> "Plan":
        """``local_batch_sizes[i]`` samples on rank ``i`` in ``accum_steps[i]`` near-equal micro-batches.

        >>> Plan.from_local_batches(0, [37, 5], [2, 1]).micro_batches(0)
        [19, 18]
        """
        local = _positive_ints("local_batch_sizes", local_batch_sizes)
        if isinstance(accum_steps, int) and not isinstance(accum_steps, bool):
            accum_steps = [accum_steps] * len(local)
        acc = _positive_ints("accum_steps", accum_steps)
        if len(acc) != len(local):
            raise ValueError(f"local_batch_sizes has {len(local)} entries but accum_steps has {len(acc)}: "
                             "give exactly one of each per rank")
        return cls(zero_stage, [-(-b // a) for b, a in zip(local, acc)], acc, local, shard_groups, shard_shares)

    def lower_micro_batch(self, rank: int, largest: int) -> "Plan":
        """This plan with rank ``rank``'s micro-batches at most ``largest`` samples (more of them).

        Every rank keeps its samples where it can, so the step's work moves as little as
        possible; the update is the same whatever the split. Where the stage needs equal
        accumulation counts, every rank takes the new, larger count, and a rank with
        fewer samples than that count is given some from the ranks with the most.

        >>> print(Plan.from_local_batches(2, [8, 4], 1).lower_micro_batch(0, 3))
        Plan(stage 2, global batch 12: r0:8<=3x3, r1:4<=2x3)
        >>> print(Plan.from_local_batches(2, [6, 4, 2], 2).lower_micro_batch(1, 1))
        Plan(stage 2, global batch 12: r0:1x4, r1:1x4, r2:1x4)
        """
        if largest < 1:
            raise ValueError(f"rank {rank}: no micro-batch smaller than one sample")
        local, acc = list(self.local_batch_sizes), list(self.accum_steps)
        acc[rank] = max(acc[rank], -(-local[rank] // largest))
        if stage(self.zero_stage).equal_accum_steps:
            a = max(acc)
            if self.global_batch_size < a * len(local):
                raise ValueError(f"ZeRO stage {self.zero_stage} needs {a} micro-batches on every rank, and "
                                 f"{self.global_batch_size} samples cannot give each of {len(local)} ranks {a}: "
                                 "use ZeRO stage 0 or 1, or a larger global batch")
            acc = [a] * len(local)
            for short in (i for i in range(len(local)) if local[i] < a):
                while local[short] < a:    # one sample at a time from the rank with the most to spare
                    donor = max((i for i in range(len(local)) if local[i] > a), key=lambda i: local[i])
                    local[donor] -= 1
                    local[short] += 1
        return Plan.from_local_batches(self.zero_stage, local, acc, self.shard_groups, self.shard_shares)

    def with_shard_groups(self, shard_groups) -> "Plan":
        """This plan with other shard groups (None: flat), and even shares."""
        return Plan(self.zero_stage, self.micro_batch_sizes, self.accum_steps, self.local_batch_sizes, shard_groups)

    def with_shard_shares(self, shard_shares) -> "Plan":
        """This plan with other shares of the states (None: even)."""
        return Plan(self.zero_stage, self.micro_batch_sizes, self.accum_steps, self.local_batch_sizes,
                    self.shard_groups, shard_shares)

    # -- derived figures ---------------------------------------------------------------
    @property
    def share_fractions(self) -> tuple[float, ...]:
        """Each rank's fraction of its group's copy of the states (1/n of a group of n where even).

        >>> Plan(1, [1, 1, 1], shard_shares=[2, 1, 1]).share_fractions
        (0.5, 0.25, 0.25)
        """
        out = [0.0] * self.world_size
        for g in self.shard_groups or [range(self.world_size)]:
            total = sum(self.shard_shares[r] for r in g) if self.shard_shares else len(g)
            for r in g:
                out[r] = (self.shard_shares[r] if self.shard_shares else 1) / total
        return tuple(out)

    @property
    def world_size(self) -> int:
        return len(self.micro_batch_sizes)

    @property
    def global_batch_size(self) -> int:
        return sum(self.local_batch_sizes)

    def micro_batches(self, rank: int) -> list[int]:
        """Sizes of ``rank``'s micro-batches in the order it runs them (the larger first)."""
        rank = self._check_rank(rank)
        return near_equal(self.local_batch_sizes[rank], self.accum_steps[rank])

    @property
    def is_exact(self) -> bool:
        """Every micro-batch of every rank is exactly ``micro_batch_sizes[rank]``."""
        return all(b == m * a for b, m, a in zip(self.local_batch_sizes, self.micro_batch_sizes, self.accum_steps))

    def local_batch_size(self, rank: int) -> int:
        return self.local_batch_sizes[self._check_rank(rank)]

    def sample_range(self, rank: int) -> tuple[int, int]:
        """``[start, stop)`` of each global batch that belongs to ``rank``."""
        rank = self._check_rank(rank)
        start = sum(self.local_batch_sizes[:rank])
        return start, start + self.local_batch_sizes[rank]

    def check_world_size(self, world_size: int) -> None:
        if world_size != self.world_size:
            raise ValueError(
                f"the plan is for {self.world_size} ranks (one micro_batch_sizes entry per rank) "
                f"but {world_size} were launched: launch {self.world_size} processes or make a plan "
                f"for {world_size}"
            )

    def _check_rank(self, rank: int) -> int:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside this plan's {self.world_size} ranks")
        return rank

    # -- serialisation -----------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "zero_stage": self.zero_stage,
            "micro_batch_sizes": list(self.micro_batch_sizes),
            "accum_steps": list(self.accum_steps),
            "local_batch_sizes": list(self.local_batch_sizes),
            **({"shard_groups": [list(g) for g in self.shard_groups]} if self.shard_groups else {}),
            **({"shard_shares": list(self.shard_shares)} if self.shard_shares else {}),
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: dict) -> "Plan":
        if not isinstance(data, dict):
            raise ValueError(f"a plan is a JSON object with zero_stage, micro_batch_sizes, accum_steps; got {data!r}")
        expected = {"zero_stage", "micro_batch_sizes", "accum_steps"}
        unknown = set(data) - expected - {"local_batch_sizes", "shard_groups", "shard_shares", "predicted", "meta"}
        missing = expected - set(data)
        if missing or unknown:
            raise ValueError(
                f"plan fields: missing {sorted(missing) or 'none'}, unknown {sorted(unknown) or 'none'}; "
                f"a plan has {sorted(expected)} and optionally local_batch_sizes, shard_groups, shard_shares"
            )
        return cls(data["zero_stage"], data["micro_batch_sizes"], data["accum_steps"], data.get("local_batch_sizes"),
                   data.get("shard_groups"), data.get("shard_shares"))

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"plan is not valid JSON: {e}") from e
        return cls.from_dict(data)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        return cls.from_json(Path(path).read_text())

    def __str__(self) -> str:
        rows = ", ".join(f"r{i}:{m}x{a}" if b == m * a else f"r{i}:{b}<={m}x{a}"
                         for i, (b, m, a) in enumerate(zip(self.local_batch_sizes, self.micro_batch_sizes,
                                                           self.accum_steps)))
        shape = f", {self.shape}" if self.shard_groups else ""
        shares = f", shares {':'.join(f'{v:g}' for v in self.shard_shares)}" if self.shard_shares else ""
        return f"Plan(stage {self.zero_stage}{shape}{shares}, global batch {self.global_batch_size}: {rows})"

    def summary(self) -> str:
        """One short line at any scale: the stage, the shape, the batch, and the spread of micro-batches and counts.

        >>> Plan.from_local_batches(1, [8, 6, 2], [1, 2, 1]).summary()
        'stage 1 flat, global batch 16 on 3 ranks: micro-batch 2-8, accumulation 1-2'
        """
        def spread(values) -> str:
            return str(min(values)) if min(values) == max(values) else f"{min(values)}-{max(values)}"

        shape = "flat" if not self.shard_groups else f"{shaped_name(self.zero_stage)} over {len(self.shard_groups)} groups"
        if self.shard_shares:
            shape += f", uneven shares {spread([round(v, 3) for v in self.share_fractions])}"
        return (f"stage {self.zero_stage} {shape}, global batch {self.global_batch_size} on {self.world_size} ranks: "
                f"micro-batch {spread(self.micro_batch_sizes)}, accumulation {spread(self.accum_steps)}")

    @property
    def shape(self) -> str:
        """How the collectives are shaped: 'flat', or 'hybrid' over its groups ('two-level' in stage 0).

        >>> Plan(1, [2, 2, 2], shard_groups=[[0, 1], [2]]).shape
        'hybrid [0,1][2]'
        """
        if not self.shard_groups:
            return "flat"
        groups = "".join("[" + ",".join(map(str, g)) + "]" for g in self.shard_groups)
        return f"{shaped_name(self.zero_stage)} {groups}"
