"""The simulated profile against the profiler's on an emulated cluster: the same device model, counted."""

import pytest

from poplar.profile.profiler import profile_cluster
from poplar.simulate import simulate_profile
from poplar.simulate.fake import fake_tensors

BIG = {"kind": "big", "gpu": "A100-80GB"}
SMALL = {"kind": "small", "gpu": "V100-16GB"}
CLUSTER = {"devices": [BIG, SMALL], "memory_scale": 0.0005}
LIMIT = 32   # the largest micro-batch searched: the small card holds fewer, the big one more
STATES_SCALE = 0.0000575   # the small card (an A100-40GB) holds ZeRO-1's states beside a sample, not ZeRO-0's


@pytest.fixture(scope="module")
def both(starts_processes, tmp_path_factory):
    """The profiler's profile of stage 0 (ranks on emulated devices) and the simulator's of stages 0 and 2
    (every stage of four clusters against the profiler: bench/bench_simulate.py, docs/simulate.md)."""
    from poplar.profile.options import ProfileOptions

    with pytest.MonkeyPatch.context() as mp:   # a fixed pace: what is compared below is memory, not time
        mp.setenv("POPLAR_DILATION", "40")
        measured, _ = profile_cluster("tiny", CLUSTER, cache_dir=tmp_path_factory.mktemp("cache"), timeout_s=300,
                                      stages=(0,), n_points=2, max_micro_batch=LIMIT)
    return measured, simulate_profile("tiny", CLUSTER, ProfileOptions(stages=(0, 2), n_points=2,
                                                                      max_micro_batch=LIMIT))


def test_the_largest_micro_batch_and_the_states_are_the_profilers(both):
    measured, simulated = both
    for kind in ("big", "small"):
        m, s = measured.stage(kind, 0), simulated.stage(kind, 0)
        assert abs(m.max_micro_batch - s.max_micro_batch) <= 1, kind
        assert s.state_bytes == m.state_bytes
        # ZeRO-2 holds a shard of the optimizer's states and gradients: less state, more room for samples
        assert simulated.stage(kind, 2).state_bytes < s.state_bytes
        assert simulated.stage(kind, 2).max_micro_batch >= s.max_micro_batch
    assert simulated.stage("big", 0).max_micro_batch == LIMIT > simulated.stage("small", 0).max_micro_batch > 1


@pytest.mark.parametrize("stage, within", [(0, 0.002), (2, 0.03)])
def test_the_time_curve_is_the_declared_models(both, stage, within):
    """Against each size's step counted by the declared model on real ranks (unpaced: no host in it). In ZeRO-2
    the emulated rank also counts a copy gloo makes inside each reduce-scatter (16 us a step here)."""
    from poplar.processes.spawn import spawn
    from tests.profile.workers import declared_step_times

    _, simulated = both
    sizes = [[m for m, _ in simulated.stage(kind, stage).points] for kind in ("big", "small")]
    declared = spawn(declared_step_times, 2, CLUSTER, stage, [list(row) for row in zip(*sizes)], timeout_s=300)
    for rank, kind in enumerate(("big", "small")):
        sp = simulated.stage(kind, stage)
        for size, seconds in declared[rank]:
            assert sp.time(size) == pytest.approx(seconds, rel=within), (kind, size)
        assert sp.anatomy and sp.per_step_s > 0


def test_the_collectives_are_the_network_models(both):
    """Exactly the declared network's time (the profiler's measure of it at these sizes, tens of microseconds,
    holds the skew of ranks meeting at a barrier and gloo's own copies: docs/simulate.md compares them)."""
    from poplar.cluster.spec import parse_cluster
    from poplar.emulate import NetworkModel
    from poplar.profile.timing import between_sizes

    measured, simulated = both
    spec = parse_cluster(CLUSTER)
    net, comm = NetworkModel(spec.network, spec.rank_nodes()), simulated.comm
    for op in ("all_reduce", "reduce_scatter", "all_gather"):
        assert getattr(comm, f"{op}_s") == pytest.approx(net.seconds(op, 4 * comm.numel), rel=1e-9)
        assert comm.latency_s[op] == pytest.approx(net.seconds(op, 4 * 2 * 64), rel=1e-9)
        between = between_sizes(simulated.model.unit_numels, simulated.model.n_params, 2)
        assert [n for n, _ in comm.between_s[op]] == between and between      # the engine's buckets, timed
        for n, seconds in comm.between_s[op]:
            assert seconds == pytest.approx(net.seconds(op, 4 * n), rel=1e-9)
    assert simulated.model == measured.model and simulated.ranks == measured.ranks
    sizes = {op: [n for n, _ in points] for op, points in comm.between_s.items()}
    assert sizes == {op: [n for n, _ in points] for op, points in measured.comm.between_s.items()}   # the profiler's


def test_a_stage_whose_states_do_not_fit_is_simulated_as_not_fitting_and_planned_around():
    """Stage 0 does not fit the small card (as the profiler records it: tests/profile/test_profiler.py); the big
    one is timed there among its own ranks, as the profiler times it: as on the cluster without the small card;
    stage 1 fits both. Planned on stage 0 only, the small card is left out."""
    from poplar.planner import make_plan
    from poplar.profile.options import ProfileOptions

    cluster = {"devices": [BIG, {"kind": "small", "gpu": "A100-40GB"}], "memory_scale": STATES_SCALE}
    prof = simulate_profile("tiny", cluster, ProfileOptions(stages=(0, 1), n_points=2))
    small0, big0 = prof.stage("small", 0), prof.stage("big", 0)
    assert small0.max_micro_batch == 0 and small0.points == [] and "does not fit" in small0.note
    assert big0.max_micro_batch > 0 and big0.points
    alone = simulate_profile("tiny", {"devices": [BIG], "memory_scale": STATES_SCALE},
                             ProfileOptions(stages=(0,), n_points=2))
    assert big0 == alone.stage("big", 0)
    assert prof.stage("small", 1).max_micro_batch > 0 and prof.stage("big", 1).points
    result = make_plan(prof, 8, [0])
    assert result.excluded_ranks == [1] and result.plan.world_size == 1


def test_values_read_from_fake_tensors_are_a_finite_step():
    import torch

    with fake_tensors():
        loss = torch.randn(4).mean()
        assert float(loss) == 1.0 and bool(torch.isfinite(loss)) and int(torch.ones(3, dtype=torch.int64).sum()) == 0


def test_the_process_keeps_only_the_last_few_counted_steps():
    from poplar.simulate.recording import Kept

    kept, made = Kept(most=2), []
    for key in ["a", "b", "a", "c", "b"]:
        kept.get_or(key, lambda k=key: made.append(k) or k.upper())
    assert made == ["a", "b", "c", "b"]          # "a" was reused; "b", the least recently used, made again
    assert list(kept) == ["c", "b"]


def test_a_kind_that_fits_only_beside_a_smaller_share_is_timed_and_planned_with_uneven_shares():
    """At this scale the small card holds no sample beside an even share of ZeRO-1's states, one beside none of
    them: it is timed all the same, with the most states it holds a sample beside, and planned with shares."""
    from poplar.cluster.spec import parse_cluster
    from poplar.planner import make_plan
    from poplar.planner.planner import plan_stage
    from poplar.planner.shares import stage_at_share
    from poplar.profile.options import ProfileOptions
    from poplar.profile.profile import FITS_WITH_LESS

    cluster = {"devices": [BIG, {"kind": "small", "gpu": "A100-40GB"}], "memory_scale": 0.000045}
    prof = simulate_profile("tiny", cluster, ProfileOptions(stages=(1,), n_points=2))
    small = prof.stage("small", 1)
    assert small.max_micro_batch == 0 and small.points and small.note == FITS_WITH_LESS
    (none, m0), (most, m1) = small.memory_points
    assert m0 >= 1 and m1 == 1 and none < most < small.state_bytes
    capacity = parse_cluster(cluster).memory_bytes(parse_cluster(cluster).device(1))
    whole = small.state_bytes - none       # the sharded states at an even share of two
    at = lambda f: stage_at_share(small, stage=1, precision="fp32", n_params=prof.model.n_params, world=2,  # noqa
                                  fraction=f, capacity=capacity).max_micro_batch
    assert at(0.0) == m0 and at((most - none) / (2 * whole) * 0.99) == 1 and at(0.5) == 0
    both = plan_stage(prof, 1, 64, [0, 1])       # on both cards: the small one's share is one it holds a sample at
    assert not both.excluded and both.poplar.plan.share_fractions[1] * 2 * whole <= most - none
    # faster than the big card alone, which then holds the whole of the states (not its even share of two)
    result, alone = make_plan(prof, 64, [1]), plan_stage(prof, 1, 64, [0])
    assert result.excluded_ranks == [] and result.plan.shard_shares is not None
    assert alone.poplar.plan.micro_batch_sizes[0] < prof.stage("big", 1).max_micro_batch
    assert result.predicted.samples_per_s > alone.poplar.predicted.samples_per_s


def test_beside_a_kind_that_holds_a_sample_only_with_less_the_others_are_timed_holding_more_as_the_profiler_does():
    """The profiler times the big card holding every sharded state where the small one holds none
    (:data:`~poplar.profile.profile.AT_LARGER_SHARE`): so does the simulator, on the step recorded at those shares
    (its update on the whole of them, not an even half), written as at an even share."""
    from poplar.profile.options import ProfileOptions
    from poplar.profile.profile import AT_LARGER_SHARE

    from poplar.simulate import recording

    options = ProfileOptions(stages=(1,), n_points=2)
    recording.COUNTED.clear()
    tight = simulate_profile("tiny", {"devices": [BIG, {"kind": "small", "gpu": "A100-40GB"}],
                                      "memory_scale": 0.000045}, options)
    # no step is run at the even share, on which no kind is timed: its engine tells the states before a step
    (even_share,) = [rec for key, (_, rec) in recording.COUNTED.items() if key[-1] is None]
    assert not even_share.recorded and len(recording.COUNTED) == 3
    roomy = simulate_profile("tiny", {"devices": [BIG, {"kind": "small", "gpu": "A100-40GB"}]}, options)
    big, even = tight.stage("big", 1), roomy.stage("big", 1)
    assert big.note == AT_LARGER_SHARE and not even.note
    assert big.state_bytes == even.state_bytes == tight.stage("small", 1).state_bytes   # as at an even share
    # each step longer by the other half's update
    assert all(t > even.time(m) for m, t in big.points) and big.per_step_s > even.per_step_s, (big, even)


@pytest.mark.parametrize("scale", [0.00003, 0.000035, 0.00004, 0.000045, 0.00005, 0.00006, 0.0005])
def test_every_stage_at_every_memory_regime_is_timed_as_the_profiler_would(scale):
    """From no room for either card to room for both, every stage: where the small card holds no sample even
    beside none of the states, the big one is timed on the cluster without it; where it holds one only beside less
    than an even share, the big one holding more; where it holds one at an even share, both at an even share."""
    from poplar.profile.options import ProfileOptions
    from poplar.profile.profile import AT_LARGER_SHARE, DOES_NOT_FIT, FITS_WITH_LESS

    small_card = {"kind": "small", "gpu": "A100-40GB"}
    options = ProfileOptions(n_points=2)
    both = simulate_profile("tiny", {"devices": [BIG, small_card], "memory_scale": scale}, options)
    alone = simulate_profile("tiny", {"devices": [BIG], "memory_scale": scale}, options)
    for stage in range(4):
        big, small = both.stage("big", stage), both.stage("small", stage)
        if small.note == DOES_NOT_FIT and big.points:
            assert big.points == alone.stage("big", stage).points, stage
        elif small.note == FITS_WITH_LESS:
            # (the small card untimed where the probe's headroom leaves it no sample: the big one timed all the
            # same, where the profiler's ranks, agreeing, would time neither)
            assert stage > 0 and big.note == AT_LARGER_SHARE and big.points, stage
        elif not small.note:
            assert not big.note and big.points and small.points, stage


@pytest.mark.slow
def test_simulating_joins_no_process_group():
    """A user's process that simulates (a notebook planning before it trains) is left as it was: no group of its own
    made, which a trainer started after would find in its way. In a process of its own: the suite's may hold one."""
    import subprocess
    import sys

    code = ("import torch.distributed as dist\nfrom poplar.simulate import simulate_profile\n"
            "from poplar.profile.options import ProfileOptions\n"
            f"simulate_profile('tiny', {CLUSTER!r}, ProfileOptions(stages=(0, 3), n_points=2, max_micro_batch=4))\n"
            "print('group', dist.is_initialized())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "group False"


@pytest.mark.parametrize("gpus", [("A100-80GB", "H100-80GB"), ("A100-80GB", "A100-40GB")])
def test_the_steps_at_unlike_shares_are_recorded_only_where_memories_differ(gpus):
    """Uneven shares are planned only where the ranks' memories differ (memory binds alike ranks alike): the
    steps at unlike shares are simulated there only, as the profiler times them; the plan is the same."""
    from poplar.planner import make_plan
    from poplar.profile.options import ProfileOptions

    cluster = {"devices": [{"kind": f"k{i}", "gpu": g} for i, g in enumerate(gpus)], "memory_scale": 0.002}
    prof = simulate_profile("tiny", cluster, ProfileOptions(stages=(2,), n_points=2))
    unlike = gpus[1] == "A100-40GB"
    for kind in ("k0", "k1"):
        sp = prof.stage(kind, 2)
        assert bool(sp.share_steps) == bool(sp.share_gathers) == unlike, kind
    if not unlike:     # had they been recorded, the plan would not read them
        fake = {k: prof.stage(k, 2).model_copy(update={"share_steps": [(0.4, 1.0), (0.6, 9.0)]}) for k in ("k0", "k1")}
        other = prof.model_copy(update={"devices": {k: d.model_copy(update={"stages": {2: fake[k]}})
                                                    for k, d in prof.devices.items()}})
        assert make_plan(other, 64, [2]).predicted == make_plan(prof, 64, [2]).predicted
