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

with ``bytes`` the full buffer and the bottleneck link's figures.

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

    def __init__(self, network: Network, nodes: list[int]):
        self.network, self.nodes = network, list(nodes)

    @property
    def link(self) -> Link:
        """The bottleneck link of a ring over every rank."""
        net = self.network
        if len(set(self.nodes)) <= 1:
            return net.intra_node
        slow = min((net.intra_node, net.inter_node), key=lambda k: k.bandwidth_gbs)
        return Link(bandwidth_gbs=slow.bandwidth_gbs,
                    latency_us=max(net.intra_node.latency_us, net.inter_node.latency_us))

    def seconds(self, op: str, nbytes: float) -> float:
        """Time of ``op`` on a buffer of ``nbytes`` (the full, unsharded size) over every rank."""
        n = len(self.nodes)
        if n <= 1:
            return 0.0
        if op not in _RING:
            raise ValueError(f"no network model for collective {op!r}; known: {', '.join(_RING)}")
        rounds, share = _RING[op]
        link = self.link
        messages = rounds * (n - 1)
        moved = nbytes if share is None else share * (n - 1) / n * nbytes
        return messages * link.latency_us * 1e-6 + moved / (link.bandwidth_gbs * 1e9)
