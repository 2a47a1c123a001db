"""The declared network: how long a collective takes over the cluster's links, as NCCL runs it.

Ranks sit on nodes; a link inside a node and one between nodes each have a bandwidth
and a latency (:class:`poplar.cluster.spec.Network`). A collective over ``n`` ranks on
``N`` nodes (at most ``m`` of them on one node) runs as NCCL runs it, with the terms of
NCCL's own cost model (its ``tuning.cc``): a latency for every hop a chunk takes, each
hop at its link's latency, and the bytes each rank moves over the slowest link crossed.

- **Ring** (every collective): the ranks in node order, a node's ranks one after
  another. An all-reduce takes ``2 (n-1)`` steps, a reduce-scatter, all-gather or
  broadcast ``n-1``; of those steps, ``2 N`` (all-reduce) or ``N-1`` cross a node
  boundary (at most all of them), the rest stay inside one::

      latency = inter_steps * inter_latency + (steps - inter_steps) * intra_latency
      all-reduce:              latency + 2 (n-1)/n * bytes / bandwidth
      reduce-scatter, gather:  latency +   (n-1)/n * bytes / bandwidth
      broadcast:               latency +             bytes / bandwidth

- **Tree** (all-reduce across nodes): NCCL's double binary tree, a chain inside each
  node and a binary tree of depth ``floor(log2 N)`` across them, reduced up and
  broadcast down; every rank moves the whole buffer each way::

      all-reduce:  2 ((m-1) * intra_latency + floor(log2 N) * inter_latency) + 2 * bytes / bandwidth

  An all-reduce takes whichever of the two is faster for its size, as NCCL chooses: the
  tree for small buffers over many nodes (a ring's latency grows with every rank, a
  tree's with the log of the nodes), the ring for large ones (it moves ``(n-1)/n`` of
  the tree's bytes).

``bytes`` is the full buffer; ``bandwidth`` the slowest link the collective crosses (the
links among the nodes it visits, and the link inside every node where it holds two ranks
or more); the latencies the largest of those links'. A barrier is an all-reduce of
nothing. A collective on a sub-group (a node's ranks) runs over its own ranks' links.
The hybrid engine's sum across ``k`` groups (:mod:`poplar.engine.layout`): where the groups
are alike, an all-reduce of each slice among its counterparts (one rank a group: priced as
any all-reduce over those ranks); otherwise one exchange in which every group's ranks send
the parts of their copy that the other groups own, so each group's link carries ``k-1``
copies of the buffer::

    reduce_across:  (k-1) * latency + (k-1) * bytes / bandwidth

>>> from poplar.cluster.spec import Network, Link
>>> net = NetworkModel(Network(intra_node=Link(bandwidth_gbs=100, latency_us=5)), nodes=[0, 0])
>>> round(net.seconds("all_reduce", 100e6) * 1e3, 3)   # 2 * 1/2 * 100 MB at 100 GB/s, plus 2 latencies
1.01
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from poplar.cluster.spec import Link, Network

# ring steps, as multiples of (n-1), and the share of the buffer each rank sends (None: the whole buffer)
_RING = {"all_reduce": (2, 2.0), "reduce_scatter": (1, 1.0), "all_gather": (1, 1.0), "broadcast": (1, None),
         "barrier": (2, 0.0)}
_TREE = ("all_reduce", "barrier")    # NCCL's tree runs all-reduces only


@dataclass(frozen=True)
class Span:
    """Where a collective's ranks sit: ``n`` ranks on ``nodes`` nodes, at most ``per_node`` on one; the links a
    ring over them crosses (``intra``: the slowest inside a node holding two or more, None where none does;
    ``ring``: the slowest between consecutive nodes) and those a tree may cross (``tree``: between any two)."""

    n: int
    nodes: int
    per_node: int
    intra: Link | None
    ring: Link | None
    tree: Link | None

    def bottleneck(self, across: Link | None) -> Link:
        return _slowest([k for k in (self.intra, across) if k is not None])


def ring_seconds(span: Span, op: str, nbytes: float) -> float:
    """NCCL's ring: each step a hop, at its link's latency; the bytes at the slowest link's bandwidth."""
    rounds, share = _RING[op]
    steps = rounds * (span.n - 1)
    crossing = 0 if span.nodes < 2 else min(steps, 2 * span.nodes if rounds == 2 else span.nodes - 1)
    link = span.bottleneck(span.ring)
    inter = span.ring.latency_us if crossing else 0.0
    intra = span.intra.latency_us if span.intra is not None else link.latency_us
    latency = (crossing * inter + (steps - crossing) * intra) * 1e-6
    moved = nbytes if share is None else share * (span.n - 1) / span.n * nbytes
    return latency + moved / (link.bandwidth_gbs * 1e9)


def tree_seconds(span: Span, nbytes: float) -> float:
    """NCCL's double binary tree all-reduce across ``span.nodes`` nodes (a chain inside each)."""
    depth = max(1, span.nodes.bit_length() - 1)
    intra = span.intra.latency_us if span.intra is not None else 0.0
    link = span.bottleneck(span.tree)
    latency = 2 * ((span.per_node - 1) * intra + depth * span.tree.latency_us) * 1e-6
    return latency + 2 * nbytes / (link.bandwidth_gbs * 1e9)


class NetworkModel:
    """Collective times of one cluster's ranks (``nodes[r]``: the node rank ``r`` sits on)."""

    def __init__(self, network: Network, nodes: list[int], intra: dict[int, Link] | None = None):
        """``intra``: each node's own link inside it (default: the network's ``intra_node``)."""
        self.network, self.nodes, self.intra = network, list(nodes), intra or {}
        self._spans: dict = {}   # ranks or None -> Span: a group's, once

    @classmethod
    def of(cls, spec) -> NetworkModel:
        """The network of a :class:`~poplar.cluster.spec.ClusterSpec`: its ranks' nodes, each node's own link."""
        return cls(spec.network, spec.rank_nodes(), spec.intra_links())

    @property
    def link(self) -> Link:
        """The bottleneck link of a ring over every rank."""
        return self.link_among(self.nodes)

    def link_among(self, nodes: list[int], exchange: bool = False) -> Link:
        """The bottleneck link of a ring over ranks on ``nodes`` (a rank's node each), or of an ``exchange`` among
        them: the slowest bandwidth, the largest latency, of the links crossed."""
        span = self.span(nodes)
        return span.bottleneck(span.tree if exchange else span.ring)

    def span(self, nodes: list[int]) -> Span:
        """Where ranks on ``nodes`` (a rank's node each) sit, and the links among them."""
        held = Counter(nodes)
        distinct = sorted(held)
        counts = [held[d] for d in distinct]
        inside = [self.intra.get(d, self.network.intra_node) for d, c in zip(distinct, counts) if c > 1]
        if len(distinct) == 1 and not inside:
            inside = [self.intra.get(distinct[0], self.network.intra_node)]
        ring = list(zip(distinct, distinct[1:] + distinct[:1])) if len(distinct) > 1 else []
        return Span(len(nodes), len(distinct), max(counts, default=0), _slowest(inside),
                    _slowest([self.network.link(a, b) for a, b in ring]), self._between_any(distinct))

    def _between_any(self, distinct: list[int]) -> Link | None:
        """The slowest link between any two of ``distinct`` nodes (every pair's only where some pair has its own)."""
        if len(distinct) < 2:
            return None
        if not self.network.between:
            return self.network.inter_node
        return _slowest([self.network.link(a, b) for i, a in enumerate(distinct) for b in distinct[i + 1:]])

    def seconds(self, op: str, nbytes: float, ranks: list[int] | None = None, groups: int = 1) -> float:
        """Time of ``op`` on a buffer of ``nbytes`` (the full, unsharded size) over ``ranks`` (None: every rank).

        ``groups``: the groups a ``reduce_across`` sums across.
        """
        span = self._span_of(ranks)
        if op == "reduce_across":
            link = span.bottleneck(span.tree)
            return (groups - 1) * (link.latency_us * 1e-6 + nbytes / (link.bandwidth_gbs * 1e9))
        if op not in _RING:
            raise ValueError(f"no network model for collective {op!r}; known: {', '.join(_RING)}, reduce_across")
        if span.n <= 1:
            return 0.0
        ring = ring_seconds(span, op, nbytes)
        if op in _TREE and span.nodes > 1:
            return min(ring, tree_seconds(span, 0.0 if op == "barrier" else nbytes))
        return ring

    def _span_of(self, ranks: list[int] | None) -> Span:
        key = None if ranks is None else tuple(ranks)
        if key not in self._spans:
            self._spans[key] = self.span(self.nodes if ranks is None else [self.nodes[r] for r in ranks])
        return self._spans[key]


def _slowest(links: list[Link]) -> Link | None:
    """One link with the slowest bandwidth and the largest latency of ``links`` (None where there are none)."""
    if not links:
        return None
    return Link(bandwidth_gbs=min(k.bandwidth_gbs for k in links), latency_us=max(k.latency_us for k in links))
