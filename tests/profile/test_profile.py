import json
import math

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


@pytest.mark.parametrize("seed", range(20))
def test_a_collective_is_read_on_the_pieces_through_every_size_timed(seed):
    """Timed where its line bends (NCCL's tree for small buffers, its ring for large ones: a concave time), a
    collective reads exactly on the pieces through the sizes timed; a profile written before the sizes between
    reads on the one line through the tiny buffer and the model's; beyond the model's size, the last piece's slope."""
    import random

    from poplar.profile.profile import CommProfile, ShapedComm

    rng = random.Random(seed)
    full = rng.randrange(10_000, 10**9)
    bends = sorted(rng.sample(range(1, full), rng.randrange(0, 4)))
    slopes = sorted((rng.uniform(1e-12, 1e-9) for _ in range(len(bends) + 1)), reverse=True)   # concave

    def true_s(n: float) -> float:     # piecewise linear, bending at each of ``bends``
        s, at = rng_latency, 0.0
        for b, slope in zip([*bends, math.inf], slopes):
            s += slope * (min(n, b) - at)
            if n <= b:
                return s
            at = b
        return s

    rng_latency = rng.uniform(1e-6, 1e-3)
    between = [(b, true_s(b)) for b in bends]
    comm = CommProfile(numel=full, all_reduce_s=true_s(full), reduce_scatter_s=1.0, all_gather_s=1.0,
                       latency_s={"all_reduce": rng_latency}, between_s={"all_reduce": between})
    across = ShapedComm(groups=[[0], [1]], numel=full, inside=[comm, comm], reduce_across_s=true_s(full),
                        across_latency_s=rng_latency, across_between_s=between)
    for n in [*bends, *(rng.uniform(0, 2 * full) for _ in range(50)), full, 3 * full]:
        assert comm.seconds("all_reduce", n) == pytest.approx(true_s(n), rel=1e-9, abs=1e-15)
        assert across.across_seconds(n) == pytest.approx(true_s(n), rel=1e-9, abs=1e-15)
    old = comm.model_copy(update={"between_s": None})
    for n in rng.sample(range(full), 20):
        line = rng_latency + (true_s(full) - rng_latency) * n / full
        assert old.seconds("all_reduce", n) == pytest.approx(line, rel=1e-9)
        assert old.seconds("all_reduce", n) <= true_s(n) * (1 + 1e-9)    # the chord of a concave time lies under


def test_the_sizes_between_are_the_engines_distinct_unit_sizes_padded_at_most_three():
    from poplar.profile.timing import between_sizes

    assert between_sizes([20608, 49728, 49728], 120064, 3) == [20610, 49728]
    assert between_sizes([10, 5000, 120064], 120064, 1) == [5000]          # the tiny and the whole left out
    assert between_sizes([7, 9], 1000, 4) == []
    many = between_sizes(list(range(1000, 9000, 1000)), 10**6, 8)
    assert many == [1000, 5000, 8000] and all(n % 8 == 0 for n in many)
