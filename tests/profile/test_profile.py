import json

import pytest

from poplar.profile import Profile, StageProfile


def test_spline_passes_through_the_measured_points_and_interpolates():
    sp = StageProfile(max_micro_batch=16, state_bytes=10, points=[(1, 0.010), (4, 0.020), (8, 0.035), (16, 0.070)])
    for m, t in sp.points:
        assert sp.time(m) == pytest.approx(t)
    assert 0.020 < sp.time(6) < 0.035
    assert sp.throughput(16) == pytest.approx(16 / 0.070)
    two = StageProfile(max_micro_batch=4, state_bytes=0, points=[(1, 1.0), (4, 4.0)])
    assert two.time(2) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="no measured points: does not fit"):
        StageProfile(max_micro_batch=0, state_bytes=0, note="does not fit").time(1)


def test_profile_json_is_readable_and_round_trips(tmp_path):
    data = {
        "model": {"name": "tiny", "n_params": 10, "seq_len": 8},
        "ranks": ["a", "b", "b"],
        "devices": {k: {"kind": k, "memory_gb": 1.0, "stages": {"0": {"max_micro_batch": 4, "state_bytes": 1,
                                                                      "points": [[1, 0.1], [4, 0.3]]}}}
                    for k in ("a", "b")},
        "comm": {"numel": 12, "all_reduce_s": 0.001, "reduce_scatter_s": 0.001, "all_gather_s": 0.0005},
    }
    prof = Profile.model_validate(data)
    prof.save(tmp_path / "p.json")
    again = Profile.load(tmp_path / "p.json")
    assert again == prof and again.world_size == 3
    assert json.loads((tmp_path / "p.json").read_text())["devices"]["b"]["stages"]["0"]["max_micro_batch"] == 4
    assert again.stage("b", 0).time(4) == pytest.approx(0.3)
