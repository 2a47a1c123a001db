"""A profile as a person reads it: a row for every device kind and stage (plain values; the commands draw them
as a table, :mod:`poplar.cli.tables`), a line on the ranks, a line on the collectives."""

from __future__ import annotations

from typing import NamedTuple

from poplar.cluster.spec import ClusterSpec
from poplar.profile.profile import Profile


class ProfileRow(NamedTuple):
    """One kind in one stage: the largest micro-batch, the states, the time at 1 and at the largest timed, where
    it came from (``note``: measured or cache, and what is missing where it was not timed)."""

    kind: str
    stage: int
    max_micro_batch: int
    state_bytes: int
    step_s_at_1: float | None
    step_s_at_max: float | None
    samples_per_s: float | None
    note: str


def cluster_line(spec: ClusterSpec) -> str:
    """The ranks a profile runs on, in a few words."""
    if spec.is_real:
        return f"{spec.world_size} CUDA ranks: " + ", ".join(f"{d.count} x {d.kind}" for d in spec.devices)
    return f"{spec.world_size} emulated ranks: {spec.describe()}"


def profile_rows(prof: Profile, summary: dict) -> list[ProfileRow]:
    """Per kind and stage (``summary``: the profiling's, which says what came from the cache)."""
    rows = []
    for kind, dev in prof.devices.items():
        for stage, sp in sorted(dev.stages.items()):
            source = "cache" if (kind, stage) in summary["from_cache"] else "measured"
            if sp.points:   # (a kind timed only beside a smaller share: up to what it held there)
                top = sp.max_micro_batch or max(m for m, _ in sp.points)
                note = source if sp.max_micro_batch else f"{source}: {sp.note}"
                rows.append(ProfileRow(kind, stage, sp.max_micro_batch, sp.state_bytes, sp.time(1), sp.time(top),
                                       sp.throughput(top), note))
            else:
                rows.append(ProfileRow(kind, stage, sp.max_micro_batch, sp.state_bytes, None, None, None,
                                       sp.note or source))
    return rows


def comm_line(prof: Profile) -> str | None:
    """The collectives' times at the model's size, or None if the profile has none."""
    c = prof.comm
    if c is None:
        return None
    line = (f"collectives at {c.numel:,} fp32 elements: all-reduce {1000 * c.all_reduce_s:.1f} ms, "
            f"reduce-scatter {1000 * c.reduce_scatter_s:.1f} ms, all-gather {1000 * c.all_gather_s:.1f} ms")
    if c.shaped is not None:
        nodes = ", ".join(f"node {j} ({len(g)} ranks) all-gather {1000 * i.all_gather_s:.1f} ms"
                          for j, (g, i) in enumerate(zip(c.shaped.groups, c.shaped.inside)))
        line += f"; inside {nodes}; the sum across nodes {1000 * c.shaped.reduce_across_s:.1f} ms"
    return line
