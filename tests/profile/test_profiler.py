"""The profiler on emulated clusters: declared devices' times, real memory limits, a cache."""

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import poplar
from poplar.cluster.spec import Network
from poplar.emulate import NetworkModel
from poplar.processes.spawn import spawn
from poplar.profile import CommProfile, Profile
from poplar.profile.profiler import cache_key, point_sizes, profile_cluster
from tests.profile.workers import train_at

ROOT = Path(__file__).resolve().parents[2]
# HALF: half FAST's TFLOP/s and bandwidth, twice its kernel launch cost: every operator takes twice as long
FAST = {"kind": "fast", "memory_gb": 0.03, "tflops": 20.0, "memory_bandwidth_gbs": 1000.0}
HALF = {"kind": "half", "memory_gb": 0.03, "tflops": 10.0, "memory_bandwidth_gbs": 500.0, "kernel_overhead_us": 10.0}
HALF_SPEED = {"devices": [FAST, HALF]}
# 40 and 20 MiB of memory: for the tiny model (a few MiB of model states, ~0.6 MiB of activations a sample)
BIG = {"kind": "big", "gpu": "A100-80GB"}
SMALL = {"kind": "small", "gpu": "A100-40GB"}
MEMORY_SCALE = 0.0005
STATES_SCALE = 0.0000575  # 2.4 MiB on the small card: ZeRO-0's parameters and gradients beside a sample, not AdamW's too
DILATION = "40"
HALF_SPEED_CAP = 8     # the pace: profiles are in declared seconds whatever it is


def _stage0(cluster: dict, cache_dir, **kwargs):
    return profile_cluster("tiny", cluster, stages=(0,), cache_dir=cache_dir, timeout_s=240, **kwargs)


@pytest.fixture(scope="module")
def half_speed(starts_processes, tmp_path_factory):
    cache_dir = tmp_path_factory.mktemp("profile-cache")
    with pytest.MonkeyPatch.context() as mp:   # the pace chosen from the host: the ratio below depends on it
        mp.delenv("POPLAR_DILATION", raising=False)
        # the search capped: what is compared is the two kinds' times at the same sizes
        prof, summary = _stage0(HALF_SPEED, cache_dir, n_points=2, max_micro_batch=HALF_SPEED_CAP)
    return prof, summary, cache_dir


@pytest.fixture(autouse=True)
def fixed_pace(monkeypatch):
    monkeypatch.setenv("POPLAR_DILATION", DILATION)


@pytest.mark.paced
def test_a_device_of_half_the_figures_profiles_at_twice_the_time(half_speed):
    prof, summary, _ = half_speed
    fast, half = prof.stage("fast", 0), prof.stage("half", 0)
    assert fast.max_micro_batch == half.max_micro_batch > 1   # same memory: the same sizes were timed
    assert [m for m, _ in fast.points] == [m for m, _ in half.points] == point_sizes(fast.max_micro_batch, 2)
    # declared seconds, not the host's: every operator costs twice as long on the half device
    for (_, f), (_, h) in zip(fast.points, half.points):
        assert h / f == pytest.approx(2.0, rel=0.05), (fast.points, half.points)
    assert fast.points[-1][1] > fast.points[0][1]               # more samples take longer
    # what the planner needs besides the points: the update's share of a step, the units (gradient buckets)
    for sp in (fast, half):
        assert 0 < sp.per_step_s < min(t for _, t in sp.points)
    assert sum(prof.model.unit_numels) == prof.model.n_params
    # the Whale-style rating is the declared peak
    assert (prof.devices["fast"].rated_tflops, prof.devices["half"].rated_tflops) == (20.0, 10.0)
    assert prof.devices["fast"].memory_gb == pytest.approx(0.03)
    # the collectives at the model's size and at a tiny one (the latency every call pays): never faster
    # than the declared network (the defaults: 25 GB/s, 10 us); a rank late for its pace only adds
    network = NetworkModel(Network(), nodes=[0, 0])
    for op in ("all_reduce", "reduce_scatter", "all_gather"):
        assert getattr(prof.comm, f"{op}_s") >= network.seconds(op, 4 * prof.comm.numel) * (1 - 1e-9)
        assert prof.comm.latency_s[op] >= network.seconds(op, 4 * 2 * 64) * (1 - 1e-9)
    assert summary["dilation"] > 1 and isinstance(summary["overruns"], int)
    assert summary["overruns"] >= 0


@pytest.mark.paced
def test_second_run_reads_the_cache_and_a_changed_device_does_not(half_speed):
    first, _, cache_dir = half_speed
    again, summary = _stage0(HALF_SPEED, cache_dir, n_points=2, max_micro_batch=HALF_SPEED_CAP)
    assert summary["measured"] == [] and len(summary["from_cache"]) == 2 and summary["dilation"] is None
    assert again == first
    changed = dict(HALF, memory_gb=0.02)
    assert cache_key("tiny", changed, 0, 2) != cache_key("tiny", HALF, 0, 2)
    assert cache_key("tiny", HALF, 1, 2) != cache_key("tiny", HALF, 0, 2)
    assert cache_key("small", HALF, 0, 2) != cache_key("tiny", HALF, 0, 2)
    # the same devices with less memory (memory_scale) are measured again
    _, summary = _stage0(dict(HALF_SPEED, memory_scale=0.5), cache_dir, n_points=2, repeats=1,
                         max_micro_batch=HALF_SPEED_CAP)
    assert summary["measured"] == [("fast", 0), ("half", 0)] and summary["from_cache"] == []


@pytest.mark.paced
def test_a_profile_is_in_declared_seconds_whatever_the_pace(half_speed, tmp_path, monkeypatch):
    first, first_summary, _ = half_speed
    for pace in (60, 240):   # a run the host made late (overruns) measures the host: again, at a slower pace
        monkeypatch.setenv("POPLAR_DILATION", str(pace))
        again, summary = _stage0(HALF_SPEED, tmp_path / str(pace), n_points=2, max_micro_batch=HALF_SPEED_CAP)
        assert summary["dilation"] == pace
        if summary["overruns"] == 0:
            break
    late = summary["overruns"] or first_summary["overruns"]
    if late:   # a host late at every pace: its own time is in the figures, the comparison is looser
        warnings.warn(f"the host ran late at every pace tried ({late} overruns)")
    for kind in ("fast", "half"):
        a, b = first.stage(kind, 0), again.stage(kind, 0)
        assert a.max_micro_batch == b.max_micro_batch
        assert [m for m, _ in a.points] == [m for m, _ in b.points]
        for (_, t1), (_, t2) in zip(a.points, b.points):
            assert t2 == pytest.approx(t1, rel=0.25 if late else 0.05), (a.points, b.points)


@pytest.mark.slow
def test_max_micro_batch_grows_with_memory_and_one_more_runs_out(tmp_path):
    cluster = {"devices": [BIG, SMALL], "memory_scale": MEMORY_SCALE}
    prof, _ = _stage0(cluster, tmp_path, n_points=2, repeats=1)
    big, small = prof.stage("big", 0).max_micro_batch, prof.stage("small", 0).max_micro_batch
    assert big > small > 0
    assert prof.devices["big"].memory_gb == pytest.approx(2 * prof.devices["small"].memory_gb)
    # the limit is real: the engine trains at it, accumulating too, and past it the device runs
    # out. The limit keeps 1% of the memory free for the local batch's inputs, which stay on the
    # device for the whole step (0.2 MiB here; a sample's activations take 0.6 MiB), so one
    # sample more may still squeeze into that headroom; two never do.
    alone = {"devices": [SMALL], "memory_scale": MEMORY_SCALE}
    assert spawn(train_at, 1, alone, small, 0, 2, timeout_s=60) == [None]
    error = spawn(train_at, 1, alone, small + 2, timeout_s=60)[0]
    assert error is not None and "out of memory" in error


@pytest.mark.slow
def test_a_device_that_cannot_hold_a_stage_s_states_is_profiled_as_not_fitting_there(tmp_path):
    """At this scale the small card holds ZeRO-0's parameters and gradients beside a sample, but not AdamW's two
    moments too (they come with the first step), and ZeRO-1's share of them it does. Stage 0 is recorded as not
    fitting on it (no rank left out of memory inside a step while the others wait in a collective) and timed on
    the big card alone, stage 1 profiled, and ZeRO-1 planned."""
    from poplar.planner import make_plan

    cluster = {"devices": [BIG, SMALL], "memory_scale": STATES_SCALE}
    prof, _ = profile_cluster("tiny", cluster, stages=(0, 1), cache_dir=tmp_path, timeout_s=240, n_points=2,
                              repeats=1)
    small0, big0 = prof.stage("small", 0), prof.stage("big", 0)
    assert small0.max_micro_batch == 0 and small0.points == []
    assert small0.state_bytes >= 16 * prof.model.n_params     # fp32 parameters, gradients and the two moments
    assert big0.points and big0.max_micro_batch > 0              # its neighbour did not fit: timed alone
    assert prof.stage("small", 1).max_micro_batch > 0 and prof.stage("big", 1).points
    result = make_plan(prof, 64)    # a batch both cards take part in (at 8 the big card alone is faster)
    assert result.stage == 1, result.reason
    assert "stage 0 left out: small (rank 1) cannot hold the model and one sample in stage 0" in result.reason
    # how the micro-batch grows as a rank holds less: beside none of ZeRO-1's sharded states, and its even share;
    # the simulator finds the same (to one sample)
    from poplar.profile.options import ProfileOptions
    from poplar.simulate import simulate_profile

    simulated = simulate_profile("tiny", cluster, ProfileOptions(stages=(1,), n_points=2))
    for kind in ("big", "small"):
        sp = prof.stage(kind, 1)
        (fewer, more_samples), (state, samples) = sp.memory_points
        assert (state, samples) == (sp.state_bytes, sp.max_micro_batch) and fewer < state and more_samples >= samples
        assert (state - fewer) % 12 == 0        # fp32 ZeRO-1: AdamW's two moments and the gradient, a parameter held
        sim = simulated.stage(kind, 1).memory_points
        assert [s for s, _ in sim] == [s for s, _ in sp.memory_points], kind
        assert all(abs(a - b) <= 1 for (_, a), (_, b) in zip(sim, sp.memory_points)), kind


def test_sizes_timed_span_one_to_the_limit():
    assert point_sizes(64, 4) == [1, 4, 16, 64]
    assert point_sizes(0, 3) == [0, 0, 0]
    assert point_sizes(3, 4)[0] == 1 and point_sizes(3, 4)[-1] == 3


@pytest.mark.slow
def test_cli_profiles_a_preset_and_rejects_a_bad_cluster_file(tmp_path):
    # what is checked is memory and the plan's shape, not times: a fast pace
    env = {**os.environ, "POPLAR_CACHE_DIR": str(tmp_path / "cache"), "POPLAR_DILATION": "3"}
    run = subprocess.run([sys.executable, "-m", "poplar.cli.main", "profile", "--cluster", "memory-differs",
                          "--stages", "0", "--points", "2", "--repeats", "1", "--out", str(tmp_path / "p.json"),
                          "--plot", str(tmp_path / "p.png")], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert (tmp_path / "p.png").stat().st_size > 10_000
    prof = Profile.load(tmp_path / "p.json")
    assert prof.ranks == ["a100-80gb", "a100-40gb"]
    assert prof.stage("a100-80gb", 0).max_micro_batch > prof.stage("a100-40gb", 0).max_micro_batch
    assert "wrote" in run.stdout
    # the profile is what `poplar plan` reads
    run = subprocess.run([sys.executable, "-m", "poplar.cli.main", "plan", "--profile", str(tmp_path / "p.json"),
                          "--global-batch", "50", "--out", str(tmp_path / "plan.json")], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    plan = poplar.Plan.load(tmp_path / "plan.json")
    assert plan.zero_stage == 0 and plan.global_batch_size == 50
    limits = [prof.stage(kind, 0).max_micro_batch for kind in prof.ranks]
    assert all(m <= limit for m, limit in zip(plan.micro_batch_sizes, limits))
    # a cluster file of the old kind (a speed relative to the host) is refused, saying what to give
    bad = tmp_path / "bad.yaml"
    bad.write_text("devices:\n  - kind: x\n    speed: 0.5\n    memory_gb: 1\n")
    run = subprocess.run([sys.executable, "-m", "poplar.cli.main", "profile", "--cluster", str(bad), "--out",
                          str(tmp_path / "bad.json")], cwd=ROOT, env={**env, "COLUMNS": "200"}, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 2, run.stdout
    assert "devices.0.speed" in run.stdout and "gpu: NAME" in run.stdout, run.stdout
    assert not (tmp_path / "bad.json").exists()


@pytest.mark.paced
@pytest.mark.slow
def test_cli_under_torchrun(tmp_path):
    env = {**os.environ, "POPLAR_CACHE_DIR": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "-m", "poplar.cli.main", "profile", "--cluster", "compute-differs", "--stages", "0",
                          "--points", "2", "--repeats", "3", "--out", str(tmp_path / "p.json")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    # as in tests/engine/test_features.py: gloo may rarely abort in teardown after the work is done
    teardown_abort = "terminate called without an active exception" in run.stderr
    assert run.returncode == 0 or teardown_abort, run.stdout[-2000:] + run.stderr[-3000:]
    prof = Profile.load(tmp_path / "p.json")
    assert prof.ranks == ["v100-16gb", "t4-16gb"]
    v100, t4 = prof.stage("v100-16gb", 0), prof.stage("t4-16gb", 0)
    # the T4 has about half the V100's TFLOP/s and a third of its bandwidth: slower at every size, and
    # (once the micro-batch is large enough that kernel launches no longer dominate) nearly twice as slow
    assert v100.max_micro_batch == t4.max_micro_batch       # the same 16 GB
    assert all(t > v for (_, v), (_, t) in zip(v100.points, t4.points))
    largest = v100.max_micro_batch
    assert t4.time(largest) > 1.5 * v100.time(largest)
    assert (prof.devices["v100-16gb"].rated_tflops, prof.devices["t4-16gb"].rated_tflops) == (15.7, 8.1)


@pytest.mark.slow
def test_a_bf16_profile_is_its_own_and_holds_more_samples(tmp_path):
    # the engine's bf16 mixed precision keeps activations in bf16: half the bytes a sample
    # of fp32, so the same device holds a larger micro-batch, and the profile says which
    # compute it measured (the planner must not read an fp32 profile for a bf16 run)
    cluster = {"devices": [SMALL], "memory_scale": MEMORY_SCALE}
    fp32, _ = _stage0(cluster, tmp_path, n_points=2, repeats=1)
    bf16, summary = _stage0(cluster, tmp_path, n_points=2, repeats=1, precision="bf16")
    assert summary["measured"] == [("small", 0)]              # not the fp32 profile read back
    assert (fp32.model.dtype, bf16.model.dtype) == ("fp32", "bf16")
    assert bf16.stage("small", 0).max_micro_batch > fp32.stage("small", 0).max_micro_batch
    # the rating is the data sheet's peak in the profile's dtype (an A100's tensor cores in bf16)
    assert (fp32.devices["small"].rated_tflops, bf16.devices["small"].rated_tflops) == (19.5, 312.0)
    assert cache_key("tiny", SMALL, 0, 1, precision="bf16") != cache_key("tiny", SMALL, 0, 1)
    with pytest.raises(ValueError, match="fp8.*fp32, bf16, fp16"):
        _stage0(cluster, tmp_path, precision="fp8")


@pytest.mark.paced
@pytest.mark.slow
@pytest.mark.parametrize("nodes", [(2, 1), (1, 1, 1)])
def test_on_several_nodes_the_collectives_are_timed_inside_each_node_and_across(nodes):
    """Nodes of two ranks and one (or three of one: alike, the sum across them an all-reduce among each slice's
    counterparts): each node's own collectives on its link, the sum across the nodes on the slow one; the profiler
    keeps each node's timing by its first rank."""
    from poplar.profile.profiler import merged_comm
    from poplar.profile.rank import RankProfile
    from tests.profile.workers import collectives_on_nodes

    gpus = ["A100-80GB", "T4-16GB", "T4-16GB"]
    cluster = {"network": {"intra_node": {"bandwidth_gbs": 25, "latency_us": 10},
                           "inter_node": {"bandwidth_gbs": 1.25, "latency_us": 50}},
               "devices": [{"kind": f"k{i}", "gpu": gpus[i], "node": i, "count": n} for i, n in enumerate(nodes)]}
    world, firsts = sum(nodes), [sum(nodes[:i]) for i in range(len(nodes))]
    groups = [list(range(a, a + n)) for a, n in zip(firsts, nodes)]
    in_pairs = set(groups[0]) if nodes[0] > 1 else set()   # (a lone rank's gather moves nothing over a link: a copy)

    def on_time(r, rank) -> bool:   # within 10% of the links' declared time (a busy host can delay a run: again)
        shaped = CommProfile.model_validate(r["comm"]).shaped
        return (rank not in in_pairs or shaped.inside[0].all_gather_s == pytest.approx(r["declared_gather"], rel=0.1)) \
            and shaped.reduce_across_s == pytest.approx(r["declared_across"], rel=0.1) \
            and all(s == pytest.approx(d, rel=0.1) for (_, s), (_, d) in zip(shaped.across_between_s,
                                                                            r["declared_between"]))

    for _ in range(3):
        ranks = spawn(collectives_on_nodes, world, cluster, 2**18, timeout_s=240)
        if all(on_time(r, rank) for rank, r in enumerate(ranks)):
            break
    for rank, r in enumerate(ranks):
        shaped = CommProfile.model_validate(r["comm"]).shaped
        assert shaped.groups == groups and len(shaped.inside) == 1
        assert r["alike"] == (len(set(nodes)) == 1 and len(nodes) > 2)
        if rank in in_pairs:
            assert shaped.inside[0].all_gather_s == pytest.approx(r["declared_gather"], rel=0.1)
        assert shaped.reduce_across_s == pytest.approx(r["declared_across"], rel=0.1)   # the links' time only
        assert [n for n, _ in shaped.across_between_s] == [n for n, _ in r["declared_between"]]   # the units' sizes
        for (_, seconds), (_, declared) in zip(shaped.across_between_s, r["declared_between"]):
            assert seconds == pytest.approx(declared, rel=0.1)
        if not r["alike"]:
            assert shaped.sum_s > shaped.sum_latency_s > 0      # adding the parts is compute, after the exchange
    merged = merged_comm([RankProfile(kind="k", stages={}, comm=CommProfile.model_validate(r["comm"]), dilation=1.0,
                                      overruns=0) for r in ranks])
    assert [i.all_gather_s for i in merged.shaped.inside] == [ranks[f]["comm"]["shaped"]["inside"][0]["all_gather_s"]
                                                              for f in firsts]
    if nodes == (2, 1):
        assert merged.shaped.inside[1].all_gather_s < merged.shaped.inside[0].all_gather_s   # a lone rank's: a copy


SHARES_SCALE = 0.00005     # 2 MiB on the small card: no sample in stage 0, one in ZeRO-1 beside less than its share
NOWHERE_SCALE = 0.000035   # 1.4 MiB: no sample in either stage, even beside none of ZeRO-1's sharded states


@pytest.mark.slow
def test_a_card_that_holds_a_sample_only_beside_less_than_its_share_is_timed_there(tmp_path):
    """Where the small card holds no sample beside an even share, the big one is timed alone (stage 0) or holding
    the sharded states (ZeRO-1), the small one beside none of them; both written as at an even share, as the
    simulator finds them (to one sample), and the planner weighs the shares that let the small card in."""
    from poplar.planner import make_plan
    from poplar.profile.options import ProfileOptions
    from poplar.profile.profile import AT_LARGER_SHARE, DOES_NOT_FIT, FITS_WITH_LESS
    from poplar.simulate import simulate_profile

    cluster = {"devices": [BIG, SMALL], "memory_scale": SHARES_SCALE}
    prof, _ = profile_cluster("tiny", cluster, stages=(0, 1), cache_dir=tmp_path, timeout_s=240, n_points=2,
                              repeats=1)
    simulated = simulate_profile("tiny", cluster, ProfileOptions(stages=(0, 1), n_points=2))
    big0, small0, big1, small1 = (prof.stage(k, s) for s in (0, 1) for k in ("big", "small"))
    assert small0.note == DOES_NOT_FIT and not small0.points
    assert big0.points and big0.max_micro_batch == simulated.stage("big", 0).max_micro_batch
    assert small1.note == FITS_WITH_LESS and small1.max_micro_batch == 0 and small1.points
    assert big1.note == AT_LARGER_SHARE and big1.points
    assert big1.state_bytes == small1.state_bytes   # each written as at an even share of the same states
    for kind in ("big", "small"):   # (the big card's second memory point: at the share it was timed at)
        sim, got = simulated.stage(kind, 1), prof.stage(kind, 1)
        assert sim.note == got.note and abs(sim.max_micro_batch - got.max_micro_batch) <= 1, kind
        pairs = list(zip(sim.memory_points, got.memory_points))[:1 if kind == "big" else 2]
        assert all(abs(a - b) <= 1 for (_, a), (_, b) in pairs), kind
    result = make_plan(prof, 8)
    assert result.plan is not None and result.stage in (0, 1)
    assert not big1.share_steps and not small1.share_steps   # already timed at other shares than an even one


@pytest.mark.paced
@pytest.mark.slow
def test_the_once_per_step_part_is_timed_at_unlike_shares_where_every_card_has_room(tmp_path):
    """Stages 1-3: the card with the most memory holds more than an even share and the other less, at two skews
    (the update grows with the share; unlike slices are gathered padded): at the shares the simulator finds."""
    from poplar.profile.options import ProfileOptions
    from poplar.simulate import simulate_profile

    cluster = {"devices": [BIG, SMALL], "memory_scale": MEMORY_SCALE}
    prof, _ = profile_cluster("tiny", cluster, stages=(0, 2), cache_dir=tmp_path, timeout_s=240, n_points=2,
                              repeats=1)
    simulated = simulate_profile("tiny", cluster, ProfileOptions(stages=(0, 2), n_points=2))
    assert not prof.stage("big", 0).share_steps          # ZeRO-0 shards nothing
    for kind, fractions in (("big", [0.6, 2 / 3]), ("small", [1 / 3, 0.4])):
        got, sim = prof.stage(kind, 2), simulated.stage(kind, 2)
        assert [f for f, _ in got.share_steps] == pytest.approx(fractions)
        assert [f for f, _ in sim.share_steps] == pytest.approx(fractions)
        # the padded gathers' copies and the share's update: about the even share's part, not another size
        assert all(0.5 * got.per_step_s < t < 3 * got.per_step_s for _, t in got.share_steps), kind
        # beside each, the gathers' own work after the update: the later slices cast and padded before their
        # launches, every rank's copied out of the padded buffer after each wait
        for measured in (got, sim):
            assert [f for f, *_ in measured.share_gathers] == pytest.approx(fractions)
            assert all(issue > 0 and copy > 0 for _, issue, copy in measured.share_gathers), kind


@pytest.mark.slow
def test_a_card_that_holds_no_sample_with_any_share_is_left_out_and_the_plan_is_for_the_others(tmp_path):
    from poplar.planner import make_plan
    from poplar.profile.profile import DOES_NOT_FIT

    cluster = {"devices": [BIG, SMALL, SMALL], "memory_scale": NOWHERE_SCALE}
    prof, _ = profile_cluster("tiny", cluster, stages=(0, 1), cache_dir=tmp_path, timeout_s=240, n_points=2,
                              repeats=1)
    for stage in (0, 1):
        assert prof.stage("small", stage).note == DOES_NOT_FIT
    # stage 0 timed on the big card alone; ZeRO-1 alone is the whole of the states, which it cannot hold
    assert prof.stage("big", 0).points and prof.stage("big", 0).max_micro_batch >= 1
    assert "not timed" in prof.stage("big", 1).note
    result = make_plan(prof, 8)
    assert result.ranks == [0] and result.excluded_ranks == [1, 2] and result.plan.world_size == 1
    assert "even with no share of the states: this plan is for rank 0" in result.reason
