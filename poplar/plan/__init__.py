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
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from poplar.plan.fields import (check_accum_steps, check_unsharded_shares, checked_group_stages, checked_shard_groups,
                                checked_shard_shares, positive_ints)
from poplar.split import near_equal
from poplar.stages import stage


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

    ``group_stages`` (optional, with ``shard_groups``) gives each group its own ZeRO stage, in
    the groups' order (``[0, 3]``: the first group replicates, the second shards everything);
    ``zero_stage`` is then the highest of them. Each group shards its copy as its stage says,
    and the sum across groups is the same whatever the stages. ``None`` (or all alike): every
    group in ``zero_stage``.

    ``accum_steps`` may be a single integer, meaning the same count on every rank.
    Stages 2 and 3 reduce-scatter gradients on every micro-step, so they require the
    same ``accum_steps`` on every rank (balance them with ``micro_batch_sizes``); with
    ``group_stages``, on every rank of a group in stage 2 or 3 (its collectives are the group's).
    """

    zero_stage: int
    micro_batch_sizes: tuple[int, ...]
    accum_steps: tuple[int, ...]

    local_batch_sizes: tuple[int, ...]
    shard_groups: tuple[tuple[int, ...], ...] | None
    shard_shares: tuple[float, ...] | None
    group_stages: tuple[int, ...] | None

    def __init__(self, zero_stage: int, micro_batch_sizes: Sequence[int], accum_steps: Sequence[int] | int = 1,
                 local_batch_sizes: Sequence[int] | None = None,
                 shard_groups: Sequence[Sequence[int]] | None = None,
                 shard_shares: Sequence[float] | None = None, group_stages: Sequence[int] | None = None):
        zs = stage(zero_stage)
        mbs = positive_ints("micro_batch_sizes", micro_batch_sizes)
        if isinstance(accum_steps, int) and not isinstance(accum_steps, bool):
            accum_steps = [accum_steps] * len(mbs)
        acc = positive_ints("accum_steps", accum_steps)
        if len(acc) != len(mbs):
            raise ValueError(
                f"micro_batch_sizes has {len(mbs)} entries but accum_steps has {len(acc)}: "
                "give exactly one of each per rank"
            )
        groups = checked_shard_groups(shard_groups, len(mbs))
        stages = checked_group_stages(group_stages, zs.number, shard_groups, groups)
        check_accum_steps(acc, zs.number, groups, stages)
        if local_batch_sizes is None:
            local = tuple(m * a for m, a in zip(mbs, acc))
        else:
            local = positive_ints("local_batch_sizes", local_batch_sizes)
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
        object.__setattr__(self, "shard_groups", groups)
        object.__setattr__(self, "shard_shares", checked_shard_shares(shard_shares, len(mbs), zs.number, groups))
        check_unsharded_shares(self.shard_shares, groups, stages)
        object.__setattr__(self, "group_stages", stages)

    @classmethod
    def from_local_batches(cls, zero_stage: int, local_batch_sizes: Sequence[int],
                           accum_steps: Sequence[int] | int = 1,
                           shard_groups: Sequence[Sequence[int]] | None = None,
                           shard_shares: Sequence[float] | None = None,
                           group_stages: Sequence[int] | None = None) -> "Plan":
        """``local_batch_sizes[i]`` samples on rank ``i`` in ``accum_steps[i]`` near-equal micro-batches.

        >>> Plan.from_local_batches(0, [37, 5], [2, 1]).micro_batches(0)
        [19, 18]
        """
        local = positive_ints("local_batch_sizes", local_batch_sizes)
        if isinstance(accum_steps, int) and not isinstance(accum_steps, bool):
            accum_steps = [accum_steps] * len(local)
        acc = positive_ints("accum_steps", accum_steps)
        if len(acc) != len(local):
            raise ValueError(f"local_batch_sizes has {len(local)} entries but accum_steps has {len(acc)}: "
                             "give exactly one of each per rank")
        return cls(zero_stage, [-(-b // a) for b, a in zip(local, acc)], acc, local, shard_groups, shard_shares,
                   group_stages)

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
        alike = self._equal_accum_ranks(rank)
        if alike is not None:
            a = max(acc[r] for r in alike)
            if sum(local) < a * len(alike) + sum(acc[r] for r in range(len(local)) if r not in alike):
                who = "every rank" if len(alike) == len(local) else f"ranks {alike}"
                raise ValueError(f"ZeRO stage {self.stage_of(rank)} needs {a} micro-batches on {who}, and "
                                 f"{self.global_batch_size} samples cannot give each of {len(alike)} ranks {a}: "
                                 "use ZeRO stage 0 or 1, or a larger global batch")
            for r in alike:
                acc[r] = a
            for short in (i for i in alike if local[i] < a):
                while local[short] < a:    # one sample at a time from the rank with the most to spare
                    donor = max((i for i in range(len(local)) if local[i] > acc[i]), key=lambda i: local[i] - acc[i])
                    local[donor] -= 1
                    local[short] += 1
        return Plan.from_local_batches(self.zero_stage, local, acc, self.shard_groups, self.shard_shares,
                                       self.group_stages)

    def _equal_accum_ranks(self, rank: int) -> list[int] | None:
        """The ranks that must run as many micro-steps as ``rank`` (its stage reduce-scatters every micro-step with
        them): every rank in a plan of one stage, its group's in a plan of a stage per group; None if free."""
        if not stage(self.stage_of(rank)).equal_accum_steps:
            return None
        if self.group_stages is None:
            return list(range(self.world_size))
        return list(next(g for g in self.shard_groups if rank in g))

    def with_shard_groups(self, shard_groups, group_stages=None) -> "Plan":
        """This plan with other shard groups (None: flat), and even shares; ``group_stages``: one stage per group
        (None: ``zero_stage`` in every group)."""
        return Plan(self.zero_stage, self.micro_batch_sizes, self.accum_steps, self.local_batch_sizes, shard_groups,
                    group_stages=group_stages)

    def with_shard_shares(self, shard_shares) -> "Plan":
        """This plan with other shares of the states (None: even)."""
        return Plan(self.zero_stage, self.micro_batch_sizes, self.accum_steps, self.local_batch_sizes,
                    self.shard_groups, shard_shares, self.group_stages)

    # -- derived figures ---------------------------------------------------------------
    def stage_of(self, rank: int) -> int:
        """The ZeRO stage ``rank`` runs in: its group's where the groups have their own, else the plan's.

        >>> plan = Plan(3, [2, 2, 2], 1, shard_groups=[[0], [1, 2]], group_stages=[0, 3])
        >>> [plan.stage_of(r) for r in range(3)], plan.shape
        ([0, 3, 3], 'hybrid [0]z0 [1,2]z3')
        """
        rank = self._check_rank(rank)
        if self.group_stages is None:
            return self.zero_stage
        return next(s for g, s in zip(self.shard_groups, self.group_stages) if rank in g)

    def same_shape(self, other: "Plan") -> bool:
        """Whether ``other`` has this plan's ZeRO stage, shard groups and stage per group (one engine runs both:
        only the split of the batch or the shares differ)."""
        return (self.zero_stage, self.shard_groups, self.group_stages) == (
            other.zero_stage, other.shard_groups, other.group_stages)

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
            **({"group_stages": list(self.group_stages)} if self.group_stages else {}),
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: dict) -> "Plan":
        if not isinstance(data, dict):
            raise ValueError(f"a plan is a JSON object with zero_stage, micro_batch_sizes, accum_steps; got {data!r}")
        expected = {"zero_stage", "micro_batch_sizes", "accum_steps"}
        optional = {"local_batch_sizes", "shard_groups", "shard_shares", "group_stages"}
        unknown = set(data) - expected - optional - {"predicted", "meta"}
        missing = expected - set(data)
        if missing or unknown:
            raise ValueError(
                f"plan fields: missing {sorted(missing) or 'none'}, unknown {sorted(unknown) or 'none'}; "
                f"a plan has {sorted(expected)} and optionally local_batch_sizes, shard_groups, shard_shares, "
                "group_stages"
            )
        return cls(data["zero_stage"], data["micro_batch_sizes"], data["accum_steps"], data.get("local_batch_sizes"),
                   data.get("shard_groups"), data.get("shard_shares"), data.get("group_stages"))

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
        if self.group_stages:
            shape += f" in stages {','.join(map(str, self.group_stages))}"
        if self.shard_shares:
            shape += f", uneven shares {spread([round(v, 3) for v in self.share_fractions])}"
        return (f"stage {self.zero_stage} {shape}, global batch {self.global_batch_size} on {self.world_size} ranks: "
                f"micro-batch {spread(self.micro_batch_sizes)}, accumulation {spread(self.accum_steps)}")

    @property
    def shape(self) -> str:
        """How the collectives are shaped: 'flat', or 'hybrid' over its groups ('two-level' in stage 0); each group's
        stage after it (``z0``) where the groups have their own (:meth:`stage_of`).

        >>> Plan(1, [2, 2, 2], shard_groups=[[0, 1], [2]]).shape
        'hybrid [0,1][2]'
        """
        if not self.shard_groups:
            return "flat"
        if self.group_stages:   # each group named with its stage
            groups = " ".join("[" + ",".join(map(str, g)) + f"]z{s}" for g, s in zip(self.shard_groups,
                                                                                      self.group_stages))
        else:
            groups = "".join("[" + ",".join(map(str, g)) + "]" for g in self.shard_groups)
        return f"{shaped_name(self.zero_stage)} {groups}"
