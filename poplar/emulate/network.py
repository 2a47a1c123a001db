"""The declared network: how long a collective takes over the cluster's links.

Ranks sit on nodes; a link inside a node and one between nodes each have a bandwidth
and a latency (:class:`poplar.cluster.spec.Network`). Collectives run as rings, as
NCCL's do for these sizes: over ``n`` ranks an all-reduce sends ``2 (n-1)`` messages
of ``1/n`` of the buffer per rank, a reduce-scatter or all-gather ``n-1``. A ring that
spans nodes moves every chunk over the slowest link it crosses, so its time is

    all-reduce:             2 (n-1) * latency + 2 (n-1)/n * bytes / bandwidth
    reduce-scatter, gather:   (n-1) * latency +   (n-1)/n * bytes / bandwidth
    broadcast:                (n-1) * latency +             bytes / bandwidth
    barrier:                2 (n-1) * latency

with ``bytes`` the full buffer and the bottleneck link's figures. A collective on a
sub-group (a node's ranks) runs over the links among its own ranks. The hybrid engine's
sum across ``k`` groups (:mod:`poplar.engine.layout`) is one exchange in which every
group's ranks send the parts of their copy that the other groups own, so each group's
link carries ``k-1`` copies of the buffer:

    reduce_across:            (k-1) * latency + (k-1) * bytes / bandwidth

>>> from poplar.cluster.spec import Network, Link
>>> net = NetworkModel(Network(intra_node=Link(bandwidth_gbs=100, latency_us=5)), nodes=[0, 0])
>>> round(net.seconds("all_reduce", 100e6) * 1e3, 3)   # 2 * 1/2 * 100 MB at 100 GB/s, plus 2 latencies
1.01
"""

from __future__ import annotations

from poplar.cluster.spec import Link, Network

# messages per rank and the share of the buffer each rank sends, by collective
_RING = {"all_reduce": (2, 2.0), "reduce_scatter": (1, 1.0), "all_gather": (1, 1.0), "broadcast": (1, None),
         "barrier": (2, 0.0)}


class NetworkModel:
    """Collective times of one cluster's ranks (``nodes[r]``: the node rank ``r`` sits on)."""

    def __init__(self, network: Network, nodes: list[int], intra: dict[int, Link] | None = None):
        """``intra``: each node's own link inside it (default: the network's ``intra_node``)."""
        self.network, self.nodes, self.intra = network, list(nodes), intra or {}
        self._links: dict = {}   # (ranks or None, exchange) -> (ranks, bottleneck link): a group's, once

    @classmethod
    def of(cls, spec) -> NetworkModel:
        """The network of a :class:`~poplar.cluster.spec.ClusterSpec`: its ranks' nodes, each node's own link."""
        return cls(spec.network, spec.rank_nodes(), spec.intra_links())

    @property
    def link(self) -> Link:
        """The bottleneck link of a ring over every rank."""
        return self.link_among(self.nodes)

    def link_among(self, nodes: list[int], exchange: bool = False) -> Link:
        """The bottleneck link of a ring over ranks on ``nodes``, or of an ``exchange`` among them.

        A ring visits the nodes in order and crosses the link between each node and the
        next (the last back to the first); an exchange crosses every pair's. Its figures:
        the slowest link's bandwidth, the largest latency (the links inside a node count).
        """
        net = self.network
        distinct = sorted(set(nodes))
        inside = [self.intra.get(n, net.intra_node) for n in distinct]
        if len(distinct) <= 1:
            return inside[0] if inside else net.intra_node
        pairs = ([(a, b) for i, a in enumerate(distinct) for b in distinct[i + 1:]] if exchange
                 else list(zip(distinct, distinct[1:] + distinct[:1])))
        links = [*inside, *(net.link(a, b) for a, b in pairs)]
        return Link(bandwidth_gbs=min(k.bandwidth_gbs for k in links), latency_us=max(k.latency_us for k in links))

    def seconds(self, op: str, nbytes: float, ranks: list[int] | None = None, groups: int = 1) -> float:
        """Time of ``op`` on a buffer of ``nbytes`` (the full, unsharded size) over ``ranks`` (None: every rank).

        ``groups``: the groups a ``reduce_across`` sums across.
        """
        n, link = self._group_link(ranks, op == "reduce_across")
        if op == "reduce_across":
            return (groups - 1) * (link.latency_us * 1e-6 + nbytes / (link.bandwidth_gbs * 1e9))
        if n <= 1:
            return 0.0
        if op not in _RING:
            raise ValueError(f"no network model for collective {op!r}; known: {', '.join(_RING)}, reduce_across")
        rounds, share = _RING[op]
        messages = rounds * (n - 1)
        moved = nbytes if share is None else share * (n - 1) / n * nbytes
        return messages * link.latency_us * 1e-6 + moved / (link.bandwidth_gbs * 1e9)

    def _group_link(self, ranks: list[int] | None, exchange: bool) -> tuple[int, Link]:
        key = (None if ranks is None else tuple(ranks), exchange)
        if key not in self._links:
            nodes = self.nodes if ranks is None else [self.nodes[r] for r in ranks]
            self._links[key] = (len(nodes), self.link_among(nodes, exchange))
        return self._links[key]
