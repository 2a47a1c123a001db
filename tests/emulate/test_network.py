"""The declared network: which links a collective crosses, and its time over them."""

import pytest

from poplar.cluster.spec import load_cluster, parse_cluster
from poplar.emulate.network import NetworkModel

TWO_NODES = {"network": {"intra_node": {"bandwidth_gbs": 25, "latency_us": 10},
                         "inter_node": {"bandwidth_gbs": 1.25, "latency_us": 50}},
             "devices": [{"kind": "a", "gpu": "A100-80GB", "count": 2, "node": 0},
                         {"kind": "t", "gpu": "T4-16GB", "node": 1}]}


def test_a_collective_on_a_nodes_ranks_takes_that_nodes_link_and_the_world_the_slow_one():
    spec = parse_cluster(TWO_NODES)
    net = NetworkModel(spec.network, spec.rank_nodes())
    mb = 1e6
    assert net.seconds("all_gather", mb, [0, 1]) == pytest.approx(10e-6 + 0.5 * mb / 25e9)
    assert net.seconds("all_gather", mb, [2]) == 0.0                       # a lone rank moves nothing
    # a ring over both nodes: of its 2 steps one crosses between the nodes, one stays inside node 0
    assert net.seconds("all_gather", mb) == pytest.approx(50e-6 + 10e-6 + 2 / 3 * mb / 1.25e9)
    # the hybrid engine's sum across two groups: each group's link carries the buffer once
    assert net.seconds("reduce_across", mb, None, 2) == pytest.approx(50e-6 + mb / 1.25e9)
    assert net.seconds("reduce_across", mb, None, 1) == 0.0


def test_links_between_particular_nodes():
    spec = load_cluster("three-node")   # nodes 0-1 at 12.5 GB/s, node 2 at 1.25 from both
    assert spec.node_groups() == [[0, 1], [2, 3], [4]]
    assert spec.network.link(0, 1).bandwidth_gbs == 12.5 and spec.network.link(2, 0).bandwidth_gbs == 1.25
    assert "nodes 0-2 1.25 GB/s" in spec.describe()
    net = NetworkModel(spec.network, spec.rank_nodes())
    assert net.link_among([0, 1]).bandwidth_gbs == 12.5              # a ring over the two servers: the fast link
    assert net.link_among([0, 1, 2]).bandwidth_gbs == 1.25           # one over all three crosses the slow ones
    assert net.seconds("all_reduce", 1e6, [0, 2]) < net.seconds("all_reduce", 1e6, [0, 4]) / 5


@pytest.mark.parametrize("between, words", [
    ([{"nodes": [1, 1], "bandwidth_gbs": 1, "latency_us": 1}], "joins two different nodes"),
    ([{"nodes": [0, 1], "bandwidth_gbs": 1, "latency_us": 1}, {"nodes": [1, 0], "bandwidth_gbs": 2, "latency_us": 1}],
     "given twice"),
    ([{"nodes": [0, 1], "bandwidth_gbs": 0, "latency_us": 1}], "greater than 0"),
])
def test_a_bad_link_between_nodes_says_what_to_change(between, words):
    with pytest.raises(ValueError, match=words):
        parse_cluster({**TWO_NODES, "network": {"between": between}})


def test_a_kinds_own_link_inside_its_nodes_times_its_collectives_there():
    """NVLink among one kind's ranks on a node; the slow link where a ring crosses nodes; PCIe by default."""
    spec = parse_cluster({"network": {"inter_node": {"bandwidth_gbs": 12.5, "latency_us": 5}},
                          "devices": [{"kind": "a", "gpu": "A100-80GB", "count": 4, "gpus_per_node": 2,
                                       "intra_node": {"bandwidth_gbs": 300, "latency_us": 2}},
                                      {"kind": "t", "gpu": "T4-16GB", "count": 2, "gpus_per_node": 2}]})
    net, mb = NetworkModel.of(spec), 1e6
    assert net.seconds("all_gather", mb, [0, 1]) == pytest.approx(2e-6 + 0.5 * mb / 300e9)
    assert net.seconds("all_gather", mb, [4, 5]) == pytest.approx(10e-6 + 0.5 * mb / 25e9)   # the default PCIe
    # NCCL's ring: of 3 steps 1 crosses between the nodes, 2 stay on NVLink
    assert net.seconds("all_gather", mb, [0, 1, 2, 3]) == pytest.approx(5e-6 + 2 * 2e-6 + 0.75 * mb / 12.5e9)
    # of 5, 2 cross; the 3 inside a node at the slowest latency inside one (the T4s' PCIe)
    assert net.seconds("all_gather", mb) == pytest.approx(2 * 5e-6 + 3 * 10e-6 + 5 / 6 * mb / 12.5e9)


NCCL = {"network": {"intra_node": {"bandwidth_gbs": 100, "latency_us": 2},
                    "inter_node": {"bandwidth_gbs": 25, "latency_us": 6}}}


def _nodes(counts: list[int]) -> NetworkModel:
    return NetworkModel(parse_cluster({**NCCL, "devices": [{"kind": "a", "gpu": "A100-80GB", "count": sum(counts),
                                                            "node": 0}]}).network,
                        [node for node, c in enumerate(counts) for _ in range(c)])


@pytest.mark.parametrize("counts, nbytes, expected", [
    # 512 nodes of 8, 1 MB: the ring's 2*4095 steps (1,024 across) against the tree's 2*(7 + 9) hops
    ([8] * 512, 1e6, 2 * (7 * 2e-6 + 9 * 6e-6) + 2 * 1e6 / 25e9),
    # 512 nodes of 8, 4 GB: the ring's 20 ms of latencies outweigh the tree's 78 us of extra bytes
    ([8] * 512, 4e9, 2 * (7 * 2e-6 + 9 * 6e-6) + 2 * 4e9 / 25e9),
    # 4 nodes of 8, 1 GB: the ring (156 us of latencies, 8 steps across), 2.5 ms fewer bytes than the tree
    ([8] * 4, 1e9, 8 * 6e-6 + 54 * 2e-6 + 2 * 31 / 32 * 1e9 / 25e9),
    # two nodes of 4, 64 KB: ring 14 steps (4 across) = 44 us + 4.6 us; tree 2*(3*2 + 6) = 24 us + 5.2 us
    ([4, 4], 65536, 2 * (3 * 2e-6 + 6e-6) + 2 * 65536 / 25e9),
    # two nodes of 4, 16 MB: the ring
    ([4, 4], 16e6, 4 * 6e-6 + 10 * 2e-6 + 2 * 7 / 8 * 16e6 / 25e9),
    # 3 nodes of one rank: every ring step crosses; the tree's depth is floor(log2 3) = 1
    ([1, 1, 1], 1e3, 2 * 6e-6 + 2 * 1e3 / 25e9),
    ([1, 1, 1], 1e9, 4 * 6e-6 + 4 / 3 * 1e9 / 25e9),
    # one node of 8: a ring on its link, no tree
    ([8], 1e3, 14 * 2e-6 + 2 * 7 / 8 * 1e3 / 100e9),
])
def test_an_all_reduce_takes_nccls_ring_or_tree_whichever_is_faster(counts, nbytes, expected):
    """Hand-computed from NCCL's cost model: ring latency = inter steps * inter latency + the rest * intra latency
    (an all-reduce's 2(n-1) steps, 2N of them across nodes); tree = 2 ((m-1) intra + floor(log2 N) inter); the
    bytes at the slowest link (2(n-1)/n of the buffer for the ring, twice it for the tree)."""
    assert _nodes(counts).seconds("all_reduce", nbytes) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("op, counts, expected", [
    ("all_gather", [8] * 512, 511 * 6e-6 + (4095 - 511) * 2e-6 + 4095 / 4096 * 1e6 / 25e9),
    ("reduce_scatter", [2, 3], 6e-6 + 3 * 2e-6 + 4 / 5 * 1e6 / 25e9),
    ("broadcast", [2, 2, 2], 2 * 6e-6 + 3 * 2e-6 + 1e6 / 25e9),
    ("barrier", [8] * 16, 2 * (7 * 2e-6 + 4 * 6e-6)),     # an all-reduce of nothing: the tree
])
def test_other_collectives_take_nccls_ring(op, counts, expected):
    assert _nodes(counts).seconds(op, 1e6) == pytest.approx(expected, rel=1e-12)


def test_a_space_of_node_shapes_and_sizes_takes_the_faster_algorithm_and_grows_with_the_buffer():
    """Seeded walk over node shapes (1-64 nodes of 1-8 ranks, unlike counts) and buffer sizes: the all-reduce is the
    lesser of ring and tree; on one node the ring; over many nodes the tree below some size and the ring above it
    (never back); the time never shrinks as the buffer grows."""
    import random

    from poplar.emulate.network import ring_seconds, tree_seconds
    rng = random.Random(40)
    sizes = [2.0 ** k for k in range(0, 36, 2)]
    for _ in range(200):
        counts = [rng.randint(1, 8) for _ in range(rng.choice([1, 2, 3, 5, 16, 64]))]
        net = _nodes(counts)
        span = net.span(net.nodes)
        times = [net.seconds("all_reduce", b) for b in sizes]
        assert times == sorted(times)
        rings = [ring_seconds(span, "all_reduce", b) for b in sizes]
        if len(counts) == 1:
            assert times == rings
            continue
        trees = [tree_seconds(span, b) for b in sizes]
        assert times == [min(r, t) for r, t in zip(rings, trees)]
        tree_won = [t < r for r, t in zip(rings, trees)]
        assert tree_won == sorted(tree_won, reverse=True)     # the tree for small buffers only
        if sum(counts) > 8:
            assert tree_won[0]
        if sum(counts) <= 64:      # beyond, the ring's latencies outweigh the tree's bytes up to terabytes
            assert not tree_won[-1]
