"""A profile as a person reads it: a table of every device kind and stage, a line on the collectives."""

from __future__ import annotations

from rich.table import Table

from poplar.cluster.spec import ClusterSpec
from poplar.profile.profile import Profile


def cluster_line(spec: ClusterSpec) -> str:
    """The ranks a profile runs on, in a few words."""
    if spec.is_real:
        return f"{spec.world_size} CUDA ranks: " + ", ".join(f"{d.count} x {d.kind}" for d in spec.devices)
    return f"{spec.world_size} emulated ranks: {spec.describe()}"


def profile_table(prof: Profile, summary: dict, title: str) -> Table:
    """Per kind and stage: the largest micro-batch, the states, the time at 1 and at the limit, where it came from."""
    table = Table(title=title)
    for col in ("device", "stage", "max mbs", "state MiB", "ms@1", "ms@max", "samples/s", "source"):
        table.add_column(col, justify="right", no_wrap=True)
    for kind, dev in prof.devices.items():
        for stage, sp in sorted(dev.stages.items()):
            source = "cache" if (kind, stage) in summary["from_cache"] else "measured"
            state = f"{sp.state_bytes / 2**20:.2f}"
            if sp.points:   # (a kind timed only beside a smaller share: up to what it held there)
                top = sp.max_micro_batch or max(m for m, _ in sp.points)
                note = source if sp.max_micro_batch else f"{source}: {sp.note}"
                table.add_row(kind, str(stage), str(sp.max_micro_batch), state, f"{1000 * sp.time(1):.1f}",
                              f"{1000 * sp.time(top):.1f}", f"{sp.throughput(top):.1f}", note)
            else:
                table.add_row(kind, str(stage), str(sp.max_micro_batch), state, "-", "-", "-", sp.note or source)
    return table


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
