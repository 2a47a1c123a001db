"""Shard groups sized to each kind: whole nodes of one kind, as few as hold a copy of the states.

Hybrid sharding by node (:func:`~poplar.planner.shape.node_shape`) needs every node to hold
one copy of the sharded states over its own ranks: a node of 16 GB cards cannot hold
Llama-7B's, so that shape is refused wherever such a node takes part. A shard group of
*several* nodes of one kind holds it: the states sharded over 16 ranks take half the
memory of 8. :func:`kind_shapes` makes, for one stage and the ranks a plan is for, the
shapes worth weighing:

- ``alike``: every group of the same number of nodes, the fewest that let the kind that
  needs the most hold its copy (the sum across groups stays the all-reduce of alike
  groups, as cheap as by node for the bytes it moves);
- ``sized``: each kind's groups of the fewest of its nodes that hold the copy, so the
  large cards keep one node a group (the sum across groups of unlike sizes is one
  exchange in which each group's link carries every other group's part, so it pays only
  for a few groups).

The profile times the collectives inside each node and the sum across nodes; a group of
several nodes is estimated from those figures (:func:`spanning_comm`, :class:`AcrossGroups`):
its collectives cross the same slow link as the flat ones do, over fewer ranks (a ring's
bytes ``(g-1)/g`` of the buffer against ``(N-1)/N``, its latency by the ranks it visits);
the sum across groups moves each rank's part of the copy, ``1/g`` of it.

>>> [list(map(len, run)) for run in node_runs([[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]], 2)]
[[2, 2], [2, 2, 2]]
"""

from __future__ import annotations

from dataclasses import dataclass

from poplar.planner.schedule import Shape
from poplar.planner.shape import node_shape, shaped_stage
from poplar.profile.profile import CommProfile, Profile, ShapedComm

OPS = ("all_reduce", "reduce_scatter", "all_gather")


def fewest_nodes(profile: Profile, stage: int, kind: str, node_ranks: int, nodes: int) -> int | None:
    """The fewest of ``nodes`` nodes of ``node_ranks`` ranks of ``kind`` whose ranks hold a copy of ``stage``'s
    states and a sample each (None: not even all of them)."""
    sp, dev, model = profile.stage(kind, stage), profile.devices[kind], profile.model
    full = dev.stages.get(0) if 0 in dev.stages and dev.stages[0].points else None
    for k in range(1, nodes + 1):
        at = shaped_stage(sp, stage=stage, n_params=model.trained_params, world=profile.world_size,
                          group=k * node_ranks, capacity=dev.memory_gb * 2**30, precision=model.dtype, full=full,
                          bandwidth_gbs=dev.memory_bandwidth_gbs)
        if at.max_micro_batch > 0:
            return k
    return None


def node_runs(nodes: list, k: int) -> list[list]:
    """``nodes`` in runs of ``k`` (a remainder joins the last run; fewer than ``k``: one run of them all)."""
    whole = max(len(nodes) // k, 1)
    runs = [nodes[i * k:(i + 1) * k] for i in range(whole)]
    runs[-1] = nodes[(whole - 1) * k:]
    return runs


@dataclass(frozen=True)
class AcrossGroups:
    """The sum across shard groups, estimated from the sum across nodes (:class:`ShapedComm`): each rank sums its
    part of the copy, ``scale`` times a node rank's; groups of unlike sizes exchange their parts in one step whose
    link carries ``spread`` times the bytes of the alike groups' all-reduce."""

    nodes: ShapedComm
    scale: float
    spread: float = 1.0

    def across_seconds(self, numel: float) -> float:
        return self.spread * self.nodes.across_seconds(numel * self.scale)

    def sum_seconds(self, numel: float) -> float:
        return self.nodes.sum_seconds(numel * self.scale)


def spanning_comm(flat: CommProfile, ranks: int, world: int) -> CommProfile:
    """A group of ``ranks`` over several nodes, from the flat collectives of all ``world`` ranks (the same slow
    link): each one's bytes ``(g-1)/g`` of the buffer against ``(N-1)/N``, its latency by the ranks it visits."""
    if ranks >= world:
        return flat
    hops, share = (ranks - 1) / (world - 1), ((ranks - 1) / ranks) / ((world - 1) / world)

    def scaled(total: float, latency: float) -> float:
        return latency * hops + max(total - latency, 0.0) * share

    latency = {op: flat.latency_s.get(op, 0.0) for op in OPS}
    between = {op: [(n, scaled(s, latency[op])) for n, s in points] for op, points in (flat.between_s or {}).items()}
    return CommProfile(numel=flat.numel, **{f"{op}_s": scaled(getattr(flat, f"{op}_s"), latency[op]) for op in OPS},
                       latency_s={op: v * hops for op, v in latency.items()}, between_s=between or None)


LARGER = (1, 2, 4)   # groups of these times the fewest nodes: room for larger micro-batches, fewer groups to sum


def _kind_nodes(profile: Profile, ranks: list[int]) -> tuple[Shape, dict[str, list[int]]] | None:
    """The node shape of ``ranks`` and each kind's nodes in it (indices); None on one node, or where a node mixes
    kinds."""
    nodes = node_shape(profile, ranks)
    if nodes is None:
        return None
    kinds = [{profile.ranks[ranks[i]] for i in g} for g in nodes.groups]
    if any(len(k) > 1 for k in kinds):
        return None
    by_kind: dict[str, list[int]] = {}
    for j, (kind,) in enumerate(kinds):
        by_kind.setdefault(kind, []).append(j)
    return nodes, by_kind


def kind_shapes(profile: Profile, ranks: list[int], stage: int) -> dict[str, Shape]:
    """The shapes of several nodes a group worth weighing for ``ranks`` (profile ranks, in the plan's order) in
    ``stage``, by label (``2 nodes a group``; ``1-2 nodes a group``: sized to each kind): alike groups of the fewest
    nodes that hold every kind's copy and each kind's fewest, each also :data:`LARGER`; none where one node a group
    holds every kind (:func:`~poplar.planner.shape.node_shape`), on one node, where a node mixes kinds, or where
    some kind holds no copy on all of its nodes."""
    found = _kind_nodes(profile, ranks) if stage else None
    if found is None:
        return {}
    nodes, by_kind = found
    need = {}
    for kind, js in by_kind.items():
        k = fewest_nodes(profile, stage, kind, min(len(nodes.groups[j]) for j in js), len(js))
        if k is None:
            return {}
        need[kind] = k
    nodes_of = {k: len(js) for k, js in by_kind.items()}
    return {label: _shape(profile, nodes, by_kind, per_kind)
            for label, per_kind in group_sizes(need, nodes_of).items()}


def sized_shape(profile: Profile, ranks: list[int], per_kind: dict[str, int]) -> Shape | None:
    """``ranks`` in shard groups of ``per_kind[kind]`` of each kind's nodes (any sizes: a search's or a person's);
    None where :func:`kind_shapes` makes none (one node, nodes that mix kinds)."""
    found = _kind_nodes(profile, ranks)
    return None if found is None else _shape(profile, *found, per_kind)


def group_sizes(need: dict[str, int], nodes_of: dict[str, int]) -> dict[str, dict[str, int]]:
    """The nodes a group of each kind (by label) worth weighing where each kind needs ``need[kind]`` of its
    ``nodes_of[kind]`` nodes to hold a copy: alike groups of the most any kind needs and each kind's own fewest,
    each also :data:`LARGER` (within its nodes; alike ones the same); none where every kind holds it in one node.

    >>> group_sizes({"big": 1, "small": 2}, {"big": 4, "small": 4})
    {'2 nodes a group': {'big': 2, 'small': 2}, '1-2 nodes a group': {'big': 1, 'small': 2}, '4 nodes a group': {'big': 4, 'small': 4}, '2-4 nodes a group': {'big': 2, 'small': 4}}
    """
    if max(need.values()) == 1:
        return {}
    out: dict[str, dict[str, int]] = {}
    for times in LARGER:
        for per_kind in ({k: min(max(need.values()) * times, nodes_of[k]) for k in need},
                         {k: min(n * times, nodes_of[k]) for k, n in need.items()}):
            if per_kind in out.values() or sum(max(nodes_of[k] // n, 1) for k, n in per_kind.items()) < 2:
                continue    # seen, or one group of them all: flat
            low, high = min(per_kind.values()), max(per_kind.values())
            out.setdefault(f"{low}{'' if low == high else f'-{high}'} node{'s' if high > 1 else ''} a group",
                           per_kind)
    return out


def _shape(profile: Profile, nodes: Shape, by_kind: dict[str, list[int]], per_kind: dict[str, int]) -> Shape:
    """Groups of ``per_kind[kind]`` of each kind's nodes, their collectives estimated."""
    runs = [run for kind, js in by_kind.items() for run in node_runs(js, per_kind[kind])]
    groups = sorted((sorted(r for j in run for r in nodes.groups[j]) for run in runs), key=lambda g: g[0])
    return _of_nodes(profile, nodes, groups)


def _of_nodes(profile: Profile, nodes: Shape, groups: list[list[int]]) -> Shape:
    """``groups`` (plan ranks, each one node's or several whole nodes'), their collectives: a node's as timed,
    several nodes' estimated (:func:`spanning_comm`), the sum across them from the sum across nodes."""
    inside = {tuple(g): c for g, c in zip(nodes.groups, nodes.inside)}
    comms = [inside.get(tuple(g)) or spanning_comm(profile.comm, len(g), profile.world_size) for g in groups]
    return Shape(groups, comms, across_groups(nodes.across, min(len(g) for g in nodes.groups), list(map(len, groups))))


def groups_shape(profile: Profile, ranks: list[int], groups) -> Shape | None:
    """A plan's shard ``groups`` (plan ranks; ``ranks``: the profile ranks of the plan's) as the cost model prices
    them, where each is one node's ranks or several whole nodes' (a plan the planner made, or a person's of whole
    nodes); None where a group splits a node, or on one node."""
    nodes = node_shape(profile, ranks)
    if nodes is None:
        return None
    groups = [sorted(g) for g in groups]
    if groups == [list(g) for g in nodes.groups]:
        return nodes
    node_of = {r: j for j, g in enumerate(nodes.groups) for r in g}
    for g in groups:
        covered = {node_of[r] for r in g}
        if sum(len(nodes.groups[j]) for j in covered) != len(g):
            return None
    return _of_nodes(profile, nodes, groups)


def across_groups(nodes: ShapedComm, node_ranks: int, sizes: list[int]) -> AcrossGroups:
    """The sum across groups of ``sizes`` ranks, from the sum across nodes of ``node_ranks`` ranks."""
    spread = 1.0 if len(set(sizes)) == 1 else max(len(sizes) / 2, 1.0)
    return AcrossGroups(nodes, node_ranks / min(sizes), spread)
