"""Each kind alone, in worker processes beside this one: the same answers as here, and nothing waits on a
worker that is gone."""

from pathlib import Path

import pytest

from poplar.compare.alone import AloneRuns, jobs_of, plan_alone
from poplar.cluster.spec import load_cluster
from poplar.profile.options import ProfileOptions
from poplar.models.workload import Workload

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "clusters"
SPEC = load_cluster("two-node-10gbe")      # 2 A100s and 3 RTX 4090s: two jobs, alone worlds of 2 and 3
KINDS = ["a100-80gb", "rtx-4090"]
ARGS = (Workload(model="tiny"), SPEC, KINDS, 64, ProfileOptions(stages=(0,), n_points=2))


def _figures(answers):
    return [(a.model_dump(), r.plan.to_dict() if r else None) for a, r in answers]


def test_each_kind_is_a_job_and_kinds_of_one_world_size_are_next_to_each_other():
    spec = load_cluster(str(EXAMPLES / "six-kinds-4096.yaml"))
    sizes = {k: sum(d.count for d in spec.devices if d.kind == k) for k in dict.fromkeys(d.kind for d in spec.devices)}
    jobs = jobs_of(spec, list(sizes))
    assert sorted(k for job in jobs for k in job) == sorted(sizes) and all(len(job) == 1 for job in jobs)
    order = [sizes[job[0]] for job in jobs]
    runs = [n for i, n in enumerate(order) if i == 0 or order[i - 1] != n]
    assert len(runs) == len(set(runs))      # each world size in one run of jobs
    assert [order.count(n) for n in runs] == sorted((order.count(n) for n in runs), reverse=True)


def test_a_worker_s_next_kind_of_the_world_it_is_on_is_left_to_it():
    """Its steps for that world are counted: the kind costs it a plan, this process a count of them."""
    from types import SimpleNamespace

    from poplar.cluster.spec import parse_cluster

    spec = parse_cluster({"devices": [{"kind": "a", "gpu": "A100-80GB", "count": 2},
                                      {"kind": "b", "gpu": "A100-40GB", "count": 2},
                                      {"kind": "c", "gpu": "RTX-4090", "count": 3}]})
    with AloneRuns(ARGS[0], spec, ["a", "b", "c"], 64, ARGS[4], workers=0) as runs:
        assert runs.worlds == [2, 2, 3]
        worker = SimpleNamespace(jobs={0: ["a"], 1: ["b"], 2: ["c"]}, begun={0}, skipped=set())
        runs.workers.append(worker)
        assert runs._left_to_workers() == {1}          # b after a, both of 2 ranks
        worker.begun, runs.done = {0, 1}, {0: []}
        assert runs._left_to_workers() == set()        # c, of 3 ranks: the first to count its steps may take it
        runs.workers.clear()


def test_a_worker_is_waited_for_while_it_has_a_job_to_hand_back():
    """A job not done here: begun there (told to skip it too late, it still answers it), or not told to skip."""
    from types import SimpleNamespace

    with AloneRuns(*ARGS, workers=0) as runs:
        worker = SimpleNamespace(jobs={0: ["a100-80gb"], 1: ["rtx-4090"]}, begun=set(), skipped={0, 1})
        runs.workers.append(worker)
        assert runs._waiting() == []                   # told to skip both, begun neither: it may end
        worker.begun = {1}
        assert runs._waiting() == [worker]             # it began one before it was told
        runs.done = {1: []}
        assert runs._waiting() == []
        worker.skipped = {1}
        assert runs._waiting() == [worker]             # job 0 is its to hand back
        runs.workers.clear()


@pytest.mark.slow
@pytest.mark.parametrize("fork", [True, False])
def test_a_worker_answers_what_this_process_would(fork):
    """Forked from this process or a fresh interpreter."""
    here = [plan_alone(k, ARGS[0], SPEC, *ARGS[3:]) for k in KINDS]
    with AloneRuns(*ARGS, workers=1, fork=fork) as runs:
        worker = runs.workers[0]
        while not worker.begun:          # let the worker begin its first job, so that it answers that one
            runs._take(timeout=None)
        answers = runs.results()
        assert worker.begun and set(worker.jobs) <= set(runs.done)
    assert _figures(answers) == _figures(here)
    assert worker.process.poll() is not None      # ended with the runs


@pytest.mark.slow
@pytest.mark.parametrize("fork", [True, False])
def test_a_worker_that_dies_is_warned_of_and_its_jobs_run_here(fork):
    here = [plan_alone(k, ARGS[0], SPEC, *ARGS[3:]) for k in KINDS]
    with AloneRuns(*ARGS, workers=2, fork=fork) as runs:
        assert len(runs.workers) == 2
        for w in runs.workers:
            w.process.kill()
            w.process.wait()
        with pytest.warns(RuntimeWarning, match="ended without its answers"):
            answers = runs.results()
        # a dead worker is dropped; one whose answers had all come before it was killed may stay, none owed
        assert len(runs.workers) < 2 and all(j in runs.done for w in runs.workers for j in w.jobs)
    assert _figures(answers) == _figures(here)


@pytest.mark.slow
def test_a_worker_told_to_skip_all_its_jobs_may_end_unwarned():
    """This process took every job (told the worker so before it began one): the worker ends, and that is no
    death to warn of."""
    import warnings

    here = [plan_alone(k, ARGS[0], SPEC, *ARGS[3:]) for k in KINDS]
    with AloneRuns(*ARGS, workers=1, fork=True) as runs:
        worker = runs.workers[0]
        for job in worker.jobs:
            worker.skip(job)
        assert worker.process.wait() == 0 and not worker.begun     # it ended, having begun nothing
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            answers = runs.results()
    assert _figures(answers) == _figures(here)


def test_a_kind_that_cannot_hold_the_model_alone_has_no_plan_and_says_why_at_once():
    """An A100-80GB beside a T4-16GB, Llama-1B: the T4 alone cannot hold its states (a row of the comparison, not an
    error that ends it), said before anything is simulated."""
    import time

    from poplar.cluster.spec import parse_cluster

    spec = parse_cluster({"devices": [{"kind": "a", "gpu": "A100-80GB"}, {"kind": "t", "gpu": "T4-16GB"}]})
    start = time.perf_counter()
    alone, result = plan_alone("t", Workload(model="llama-1b", seq_len=2048), spec, 64,
                               ProfileOptions(stages=(3,), precision="fp16"))
    assert result is None and alone.samples_per_s is None and "more than the 1 device" in alone.why_not
    assert time.perf_counter() - start < 5
