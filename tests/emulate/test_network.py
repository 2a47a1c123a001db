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
    assert net.seconds("all_gather", mb) == pytest.approx(2 * 50e-6 + 2 / 3 * mb / 1.25e9)
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
    assert net.seconds("all_gather", mb, [0, 1, 2, 3]) == pytest.approx(3 * 5e-6 + 0.75 * mb / 12.5e9)
    assert net.seconds("all_gather", mb) == pytest.approx(5 * 10e-6 + 5 / 6 * mb / 12.5e9)   # T4's latency
