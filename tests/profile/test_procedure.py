"""The profiling procedure, written once: its sequence, and the profiler and the simulator both following it."""

import pytest

from poplar.processes.spawn import spawn
from poplar.profile import procedure
from poplar.profile.procedure import States, at_even_share, timed_stage, with_less
from poplar.profile.profile import AT_LARGER_SHARE, FITS_WITH_LESS, NOT_TIMED, StageProfile, StepAnatomy
from tests.profile.workers import profiled_anatomy_sizes

CLUSTER = {"devices": [{"kind": "a100", "gpu": "A100-80GB"}]}
KB = 1000
PER_SAMPLE = 100 * KB     # bytes a sample takes, in the recording measure below


class Recorded:
    """A measure of a device of 2 MB whose samples take 100 kB each, writing down what it is asked."""

    def __init__(self, everyone=True):
        self.asked, self.headroom, self._everyone = [], 50 * KB, everyone

    def largest(self, held, limit):
        self.asked.append(("largest", held, limit))
        return max(0, min(limit, (2000 * KB - held) // PER_SAMPLE))

    def everyone(self, flag):
        return flag and self._everyone

    def agree_sizes(self, mine):
        self.asked.append(("sizes", mine))
        return [[m, 1] for m in mine]

    def time_points(self, rows):
        self.asked.append(("time", [r[0] for r in rows]))
        return [(r[0], 0.001 + 0.01 * r[0]) for r in rows], 0.001

    def share_steps(self, row, micro_step):
        self.asked.append(("shares", row, micro_step))
        return [(0.6, 0.002), (2 / 3, 0.0021)], [(0.6, 0.0001, 0.0002), (2 / 3, 0.0001, 0.0002)]

    def anatomy(self, row):
        self.asked.append(("anatomy", row[0]))
        return StepAnatomy(micro_batch=row[0], forward=[1 / 3], backward=[2 / 3], root_middle=0.0, before_loss_s=0.0,
                           before_norm_s=0.0)

    def note(self, what):
        pass


def test_a_stage_is_probed_timed_and_dissected_in_one_order():
    m = Recorded()
    sp = timed_stage(m, States(True, 900 * KB, 1000 * KB, 400 * KB), n_points=4, max_micro_batch=64)
    # the limit beside the states and the headroom (9), beside none of the sharded ones (13), then the sizes
    # up to the limit, their times, the share steps at the smallest, the anatomy at a middle size and the largest
    assert m.asked == [("largest", 1050 * KB, 64), ("largest", 650 * KB, 64), ("sizes", [1, 2, 4, 9]), ("time", [1, 2, 4, 9]),
                       ("shares", [1, 1], pytest.approx(0.01)), ("anatomy", 4), ("anatomy", 9)]
    assert (sp.max_micro_batch, sp.state_bytes, sp.memory_points) == (9, 1000 * KB, [(600 * KB, 13), (1000 * KB, 9)])
    assert sp.per_step_s == 0.001 and [a.micro_batch for a in sp.anatomy] == [4, 9]
    assert sp.share_steps and sp.share_gathers


def test_a_device_without_room_for_a_sample_somewhere_is_not_timed():
    m = Recorded(everyone=False)
    sp = timed_stage(m, States(True, 900 * KB, 1000 * KB, 0), n_points=4, max_micro_batch=64)
    assert sp.note == NOT_TIMED and not sp.points and [a[0] for a in m.asked] == ["largest"]


def test_a_device_timed_beside_none_of_the_sharded_states_is_written_as_at_an_even_share():
    m = Recorded()
    sp = with_less(m, timed_stage(m, States(True, 500 * KB, 600 * KB, 0), n_points=2, max_micro_batch=64),
                   capacity=2000 * KB)
    # one sample (100 kB) and the headroom (50 kB) fit beside up to 1,850 kB of states, found in steps of 1/1024
    # of the free memory (1,367 bytes)
    assert sp.note == FITS_WITH_LESS and sp.memory_points[0] == (600 * KB, 13)
    assert 1850 * KB - 1367 < sp.memory_points[1][0] <= 1850 * KB
    even = at_even_share(sp, 0, 1300 * KB, capacity=2000 * KB)
    assert (even.state_bytes, even.max_micro_batch, even.note) == (1900 * KB, 0, FITS_WITH_LESS)
    timed = StageProfile(max_micro_batch=4, state_bytes=1000 * KB, points=[(1, 1.0)],
                         memory_points=[(600 * KB, 13), (1000 * KB, 9)])
    assert at_even_share(timed, 400 * KB, 200 * KB, capacity=2000 * KB).model_dump() == timed.model_copy(update={
        "state_bytes": 800 * KB, "max_micro_batch": 11, "note": AT_LARGER_SHARE}).model_dump()


@pytest.mark.slow
@pytest.mark.parametrize("patched", [False, True])
def test_the_profiler_and_the_simulator_follow_the_one_procedure(patched, monkeypatch):
    """Changing the procedure's sequence (where the anatomy is measured) changes the profiler's ranks and the
    simulator alike."""
    from poplar.profile.options import ProfileOptions
    from poplar.simulate.profile import simulate_stages

    monkeypatch.setenv("POPLAR_DILATION", "3")     # what is checked is which sizes are dissected: a fast pace
    if patched:
        monkeypatch.setattr(procedure, "anatomy_rows", lambda n: [0])
    measured = spawn(profiled_anatomy_sizes, 1, CLUSTER, patched, timeout_s=240)[0]
    simulated = simulate_stages("tiny", CLUSTER, ProfileOptions(stages=(0,), n_points=3, max_micro_batch=8))
    sizes = [a.micro_batch for a in simulated[("a100", 0)].anatomy]
    assert measured == sizes == ([1] if patched else [3, 8])
