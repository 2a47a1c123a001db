"""Cluster files: the presets resolve to their GPUs' figures, and a wrong file gets one line naming the field."""

import pytest
import yaml

from poplar.cluster.catalogue import CATALOGUE, gpu
from poplar.cluster.kinds import CudaProperties
from poplar.cluster.spec import ClusterSpec, Link, load_cluster, parse_cluster, presets
from poplar.emulate import NetworkModel

PRESETS = ["both-differ", "compute-differs", "memory-bound", "memory-bound-a100", "memory-differs", "memory-differs-small",
           "memory-skewed",
           "three-node", "two-node", "two-node-100g", "two-node-10gbe", "uneven-quantity"]
DECLARED = {"kind": "custom", "memory_gb": 24.0, "tflops": {"fp32": 20.0, "bf16": 80.0}, "memory_bandwidth_gbs": 900.0}


def kinds(name: str):
    return load_cluster(name).devices


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_loads_resolves_and_round_trips(name):
    assert name in presets()
    spec = load_cluster(name)
    assert spec.world_size >= 2 and not spec.is_real and 0 < spec.memory_scale < 1
    for d in spec.devices:
        catalogue = gpu(d.gpu)                                  # every preset names catalogue GPUs
        assert d.memory_gib == catalogue.memory_gb and d.bandwidth_gbs == catalogue.memory_bandwidth_gbs
        assert d.peak_tflops("fp32") == catalogue.peak_tflops["fp32"]
        assert spec.memory_bytes(d) == int(catalogue.memory_gb * spec.memory_scale * 2**30)
    # what the profiler and the ranks receive is the same cluster
    assert parse_cluster(spec.model_dump()) == spec
    assert parse_cluster(yaml.safe_load(spec.to_yaml())) == spec
    assert spec.describe().startswith(f"{spec.devices[0].count} x {spec.devices[0].kind}")


def test_the_presets_differ_where_their_names_say():
    big, small = kinds("both-differ")
    assert big.memory_gib > small.memory_gib and big.bandwidth_gbs > small.bandwidth_gbs
    assert big.peak_tflops("fp32") > small.peak_tflops("fp32")
    big, small = kinds("memory-differs")
    assert big.memory_gib == 2 * small.memory_gib
    assert all(big.peak_tflops(dt) == small.peak_tflops(dt) for dt in ("fp32", "bf16"))
    fast, slow = kinds("compute-differs")
    assert fast.memory_gib == slow.memory_gib and fast.peak_tflops("fp32") > 1.5 * slow.peak_tflops("fp32")
    spec = load_cluster("uneven-quantity")
    assert [d.count for d in spec.devices] == [1, 3] and spec.world_size == 4
    assert [d.kind for d in spec.rank_devices()] == ["a100-80gb"] + ["t4-16gb"] * 3


def test_two_nodes_are_joined_by_a_slower_link():
    spec = load_cluster("two-node")
    assert spec.rank_nodes() == [0, 1]
    net = spec.network
    assert net.inter_node.bandwidth_gbs < net.intra_node.bandwidth_gbs
    assert net.inter_node.latency_us > net.intra_node.latency_us
    # a ring over both nodes moves every chunk over the slow link
    across, within = NetworkModel(net, spec.rank_nodes()), NetworkModel(net, [0, 0])
    assert across.link.bandwidth_gbs == net.inter_node.bandwidth_gbs
    assert across.seconds("all_reduce", 100e6) > 10 * within.seconds("all_reduce", 100e6)
    assert "inter-node 1.25 GB/s" in spec.describe() and "on node 1" in spec.describe()


def test_declared_figures_stand_alone_or_override_the_catalogues():
    spec = parse_cluster({"devices": [DECLARED, {"kind": "smaller-a100", "gpu": "A100-80GB", "memory_gb": 40}],
                          "memory_scale": 0.5})
    custom, a100 = spec.devices
    assert (custom.memory_gib, custom.bandwidth_gbs) == (24.0, 900.0)
    assert (custom.peak_tflops("fp32"), custom.peak_tflops("bf16")) == (20.0, 80.0)
    assert not custom.computes("fp16")                          # a dtype it lacks: refused, never its fp32 rate
    with pytest.raises(ValueError, match="kind 'custom' \\(declared\\) has no fp16 hardware: .*tflops.fp16"):
        custom.peak_tflops("fp16")
    assert spec.memory_bytes(custom) == 12 * 2**30
    assert a100.memory_gib == 40 and a100.bandwidth_gbs == 2039 and a100.peak_tflops("bf16") == 312.0
    one = parse_cluster({"devices": [dict(DECLARED, tflops=50)]}).devices[0]
    assert one.peak_tflops("fp32") == one.peak_tflops("bf16") == 50.0
    # a dumped file reads like the one written: only what was given
    assert spec.model_dump()["devices"] == [DECLARED, {"kind": "smaller-a100", "gpu": "A100-80GB", "memory_gb": 40.0}]
    # the same kind may appear twice (on two nodes, say) when its figures are the same
    twice = parse_cluster({"devices": [DECLARED, dict(DECLARED, count=2, node=1)]})
    assert twice.world_size == 3 and twice.rank_nodes() == [0, 1, 1]


def test_each_kind_computes_the_dtypes_it_has_hardware_for_and_a_cluster_is_refused_the_others():
    v100 = {"kind": "v100", "gpu": "V100-16GB"}
    t4 = {"kind": "t4", "gpu": "T4-16GB", "count": 2}
    a100 = {"kind": "a100", "gpu": "A100-80GB"}
    spec = parse_cluster({"devices": [a100, v100, t4]})
    assert [(g.computes("fp16"), g.computes("bf16")) for g in spec.devices] == [(True, True), (True, False),
                                                                                 (True, False)]
    spec.check_precision("fp16")
    spec.check_precision("fp32")
    with pytest.raises(ValueError) as e:
        spec.check_precision("bf16")
    assert str(e.value).startswith("mixed precision bf16: v100 (V100-16GB), t4 (T4-16GB) have no bf16 hardware: "
                                   "train in fp16")
    parse_cluster({"devices": [a100, dict(DECLARED, tflops=40)]}).check_precision("bf16")   # one figure: all
    volta = CudaProperties(name="Tesla V100-SXM2-16GB", total_memory=16 * 2**30, major=7, minor=0)
    real = ClusterSpec(devices=[{"kind": volta.kind, "cuda": volta}])
    assert real.devices[0].computes("fp16") and not real.devices[0].computes("bf16")


def test_a_real_devices_memory_is_its_own():
    props = CudaProperties(name="Tesla T4", total_memory=15 * 2**30, major=7, minor=5)
    spec = ClusterSpec(devices=[{"kind": props.kind, "cuda": props}], memory_scale=0.001)
    assert spec.is_real and spec.memory_bytes(spec.devices[0]) == 15 * 2**30   # not scaled


def error(data) -> str:
    with pytest.raises(ValueError) as e:
        parse_cluster(data)
    message = str(e.value)
    assert "\n" not in message, message                          # one line
    return message


def test_an_unknown_gpu_names_the_ones_the_catalogue_knows():
    message = error({"devices": [{"kind": "x", "gpu": "Z100"}]})
    assert message.startswith("cluster: devices.0: unknown GPU 'Z100'")
    assert all(name in message for name in CATALOGUE)


@pytest.mark.parametrize("nodes", [1, 3, 4, 512])
def test_a_mistake_repeated_on_every_node_is_said_once(nodes):
    """A file of one entry a node repeats an entry's mistake on each node it lists: one message, its entries
    named (past three: the first two, the last and how many), whatever the count."""
    good = {"kind": "a", "gpu": "A100-80GB", "count": 8, "gpus_per_node": 8}
    devices = [dict(good, kind="b", gpu="L40S-48GB") if n % 2 else good for n in range(2 * nodes)]
    message = error({"devices": devices})
    assert message.count("unknown GPU 'L40S-48GB'") == 1, message
    wrong = [f"devices.{n}" for n in range(1, 2 * nodes, 2)]
    places = ", ".join(wrong) if nodes <= 3 else f"{wrong[0]}, {wrong[1]}, ..., {wrong[-1]} ({nodes} entries)"
    assert message.startswith(f"cluster: {places}: unknown GPU 'L40S-48GB': did you mean L40S?"), message


@pytest.mark.parametrize("name, close", [
    ("A100-80G", "did you mean A100-80GB, "),             # a letter short: the close names, nearest first
    ("rtx4090", "did you mean RTX-4090, RTX-3090?"),
    ("T4", "did you mean T4-16GB?"),
    ("NVIDIA A100-SXM4-80GB", "did you mean A100-80GB"),   # what a real GPU reports is not a catalogue name
    ("A999", "the catalogue knows A100-80GB, A100-40GB, "),   # nothing close: every name
])
def test_a_cluster_file_names_catalogue_gpus_exactly(name, close):
    message = error({"devices": [{"kind": "x", "gpu": name}]})
    assert message.startswith(f"cluster: devices.0: unknown GPU '{name}': {close}"), message


def test_catalogue_names_are_taken_in_any_case():
    spec = parse_cluster({"devices": [{"kind": "x", "gpu": "a100-80gb"}, {"kind": "y", "gpu": " H100-PCIE "}]})
    assert [d.memory_gib for d in spec.devices] == [80.0, 80.0]
    assert spec.devices[1].peak_tflops("fp32") == CATALOGUE["H100-PCIe"].peak_tflops["fp32"]


def test_a_speed_is_refused_saying_to_give_a_gpu():
    message = error({"devices": [{"kind": "x", "speed": 0.5, "memory_gb": 1}]})
    assert "devices.0.speed" in message and "gpu: NAME" in message and "tflops" in message


@pytest.mark.parametrize("device, missing", [
    ({"kind": "x"}, "memory_gb, tflops, memory_bandwidth_gbs"),
    ({"kind": "x", "memory_gb": 1, "tflops": 10}, "memory_bandwidth_gbs"),
])
def test_a_kind_without_a_gpu_names_the_figures_it_lacks(device, missing):
    message = error({"devices": [device]})
    assert "devices.0: kind 'x': give gpu: NAME" in message and message.endswith(f"declare {missing}")


@pytest.mark.parametrize("data, words", [
    ({"devices": [{"kind": "x", "gpu": "T4-16GB", "count": 0}]}, "devices.0.count: Input should be greater than 0"),
    ({"devices": [{"kind": "x", "gpu": "T4-16GB"}], "memory_scale": 0}, "memory_scale: Input should be greater than 0"),
    ({"devices": [{"kind": "x", "gpu": "T4-16GB"}], "memory_scale": -1}, "memory_scale: Input should be greater"),
    ({"devices": [{"kind": "x", "gpu": "T4-16GB"}, {"kind": "x", "gpu": "A10"}]},
     "kind 'x' is declared twice with different figures: give the second another name"),
    ({"devices": [{"kind": "x", "gpu": "T4-16GB", "colour": "red"}]}, "devices.0.colour: unknown field"),
    ({"devices": []}, "devices: List should have at least 1 item"),
    ({"devices": [{"kind": "x", "gpu": "T4-16GB"}], "network": {"intra_node": {"bandwidth_gbs": 0, "latency_us": 1}}},
     "network.intra_node.bandwidth_gbs: Input should be greater than 0"),
    ([{"kind": "x"}], "expected a mapping with a 'devices' list, got list"),
])
def test_errors_are_one_line_naming_the_field(data, words):
    assert words in error(data)


def test_the_world_size_must_match_the_devices():
    spec = load_cluster("uneven-quantity")
    spec.check_world_size(4)
    with pytest.raises(ValueError) as e:
        spec.check_world_size(2)
    assert str(e.value) == ("the cluster file describes 4 devices (1 x a100-80gb, 3 x t4-16gb) but 2 ranks were "
                            "launched: launch 4 ranks or change the devices' counts")
    with pytest.raises(ValueError, match="rank 4 is outside this cluster's 4 devices"):
        spec.device(4)


def test_files_that_are_not_there_or_not_yaml(tmp_path):
    with pytest.raises(FileNotFoundError, match="one of the presets: " + ", ".join(PRESETS)):
        load_cluster(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("devices: [\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        load_cluster(bad)
    with pytest.raises(ValueError) as e:
        load_cluster(bad)
    assert str(e.value) == f"{bad}: not valid YAML at line 2, column 1: expected the node content, but found " \
                           "'<stream end>'"
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"devices: \xff\xfe\n")
    with pytest.raises(ValueError, match="binary.yaml: not UTF-8 text"):
        load_cluster(binary)
    speed = tmp_path / "old.yaml"
    speed.write_text("devices:\n  - kind: x\n    speed: 1.0\n    memory_gb: 1\n")
    with pytest.raises(ValueError, match=f"{speed}: devices.0.speed"):   # the error names the file too
        load_cluster(speed)


def test_kinds_spread_over_nodes_of_their_own_with_their_own_link_inside():
    """``gpus_per_node``: a kind fills nodes of that many ranks, after the previous kinds' unless ``node`` says."""
    spec = parse_cluster({"devices": [
        {"kind": "a", "gpu": "A100-80GB", "count": 10, "gpus_per_node": 4, "intra_node": {"bandwidth_gbs": 300,
                                                                                            "latency_us": 3}},
        {"kind": "b", "gpu": "T4-16GB", "count": 3},                     # node 0 (the default), beside a's first
        {"kind": "c", "gpu": "V100-16GB", "count": 4, "gpus_per_node": 2},
        {"kind": "d", "gpu": "V100-16GB", "count": 2, "gpus_per_node": 8, "node": 9}]})
    assert spec.rank_nodes() == [0] * 4 + [1] * 4 + [2] * 2 + [0] * 3 + [3, 3, 4, 4] + [9, 9]
    links = spec.intra_links()
    assert links[1] == links[2] == Link(bandwidth_gbs=300, latency_us=3)
    assert links[0] == spec.network.intra_node      # a's NVLink does not join a T4: the slowest
    assert links[3] == links[9] == spec.network.intra_node
    assert parse_cluster(spec.model_dump()) == spec   # written back as given


@pytest.mark.parametrize("path", sorted((__import__("pathlib").Path(__file__).resolve().parents[2] / "examples"
                                         / "clusters").glob("*.yaml")), ids=lambda p: p.name)
def test_every_example_cluster_file_loads_and_places_its_kinds_on_nodes(path):
    spec = load_cluster(str(path))
    assert spec.world_size >= 2 and len(spec.node_groups()) >= 2 and parse_cluster(spec.model_dump()) == spec


@pytest.mark.parametrize("name", presets())
def test_a_kind_slowed_takes_every_operator_the_factor_longer_and_keeps_its_memory(name):
    """What ``POPLAR_FAULT=slow@step`` does to an emulated device, and what a cluster file declaring the slowed card
    says: every operator (compute-, memory- or launch-bound) ``1 / factor`` as long, in every dtype it has."""
    import torch

    from poplar.emulate.model import GpuModel

    spec = load_cluster(name)
    for group in spec.devices:
        slowed = group.slowed(0.6, kind="slowed")
        assert slowed.kind == "slowed" and slowed.memory_gib == group.memory_gib
        fast, slow = GpuModel.of(group), GpuModel.of(slowed)
        for dtype in [d for d in (torch.float32, torch.bfloat16, torch.float16)
                      if group.computes({torch.float32: "fp32", torch.bfloat16: "bf16"}.get(d, "fp16"))]:
            for flops, nbytes in ((0.0, 0.0), (1e12, 1e3), (1e3, 1e10)):
                assert slow.op_seconds(flops, nbytes, dtype) == pytest.approx(fast.op_seconds(flops, nbytes, dtype) / 0.6)
        assert parse_cluster(yaml.safe_load(spec.model_copy(update={"devices": [slowed]}).to_yaml())).devices[0] == slowed


@pytest.mark.parametrize("name", ["compute-differs", "three-node", "uneven-quantity"])
def test_a_cluster_with_one_card_slowed_keeps_every_other_rank_and_every_node(name):
    spec = load_cluster(name)
    for rank in range(spec.world_size):
        slowed = parse_cluster(yaml.safe_load(spec.slowed(rank, 0.5).to_yaml()))
        card = spec.device(rank)
        assert slowed.rank_nodes() == spec.rank_nodes()
        assert [d.kind for d in slowed.rank_devices()] == [
            f"{d.kind}-slowed" if r == rank else d.kind for r, d in enumerate(spec.rank_devices())]
        assert slowed.device(rank).bandwidth_gbs == card.bandwidth_gbs * 0.5
