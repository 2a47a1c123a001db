import pytest

from poplar.emulate import load_cluster, parse_cluster, presets

GOOD = {"devices": [{"kind": "big-fast", "count": 1, "speed": 1.0, "memory_gb": 1.0},
                    {"kind": "small-slow", "count": 2, "speed": 0.35, "memory_gb": 0.3}]}


def test_ranks_take_devices_in_file_order():
    cluster = parse_cluster(GOOD)
    assert cluster.world_size == 3
    assert [d.kind for d in cluster.rank_devices()] == ["big-fast", "small-slow", "small-slow"]
    assert cluster.device(2).memory_bytes == int(0.3 * 2**30)
    cluster.check_world_size(3)


def test_presets_cover_the_papers_cluster_shapes():
    assert set(presets()) == {"memory-differs", "compute-differs", "both-differ", "uneven-quantity"}
    mem, comp, both, uneven = (load_cluster(n).devices for n in
                               ("memory-differs", "compute-differs", "both-differ", "uneven-quantity"))
    assert mem[0].speed == mem[1].speed and mem[0].memory_gb > mem[1].memory_gb
    assert comp[0].speed > comp[1].speed and comp[0].memory_gb == comp[1].memory_gb
    assert both[0].speed > both[1].speed and both[0].memory_gb > both[1].memory_gb
    assert [d.count for d in uneven] == [1, 3]


def test_round_trip_through_a_file(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text(parse_cluster(GOOD).to_yaml())
    assert load_cluster(path) == parse_cluster(GOOD)


def _with(**changes):
    bad = {"devices": [dict(GOOD["devices"][0], **changes)]}
    return bad


@pytest.mark.parametrize("data, words", [
    (_with(speed=0), "devices.0.speed: Input should be greater than 0"),
    (_with(speed=-1.5), "devices.0.speed"),
    (_with(memory_gb=0), "devices.0.memory_gb: Input should be greater than 0"),
    (_with(count=0), "devices.0.count"),
    (_with(colour="red"), "devices.0.colour: unknown field"),
    ({"devices": []}, "devices: List should have at least 1 item"),
    ({"devices": GOOD["devices"], "network": "fast"}, "network: unknown field"),
    ({"devices": [{"kind": "x", "count": 1, "memory_gb": 1}]}, "devices.0.speed: Field required"),
    ([1, 2], "expected a mapping"),
])
def test_bad_cluster_files_name_the_field(data, words):
    with pytest.raises(ValueError) as e:
        parse_cluster(data)
    assert words in str(e.value)


def test_world_size_mismatch_and_missing_or_broken_files(tmp_path):
    with pytest.raises(ValueError, match="describes 3 devices .* but 2 ranks were launched"):
        parse_cluster(GOOD).check_world_size(2)
    with pytest.raises(FileNotFoundError, match="presets: both-differ"):
        load_cluster(tmp_path / "nope.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("devices: [kind: x\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        load_cluster(broken)


def test_the_common_slowdown_grows_with_ranks_sharing_cores():
    def spec(*speeds):
        return parse_cluster({"devices": [{"kind": f"d{i}", "speed": s, "memory_gb": 1.0} for i, s in enumerate(speeds)]})

    assert spec(1.0, 0.5).host_slowdown(cores=2) == 2.0            # a core each: the floor
    assert spec(1.0, 0.4, 0.4).host_slowdown(cores=2) == 2.0       # not a whole host's worth more
    assert spec(1.0, 0.4, 0.4, 0.4, 0.4, 0.4).host_slowdown(cores=2) == 4.0
    assert spec(1.0, 0.35, 0.35, 0.35).host_slowdown(cores=2) == 3.0
    assert spec(1.0, 0.35, 0.35, 0.35).host_slowdown(cores=4) == 2.0
    assert spec(1.0, 1.0, 1.0).host_slowdown(cores=1) == 5.0       # demand: 3 speeds on 60% of one core
