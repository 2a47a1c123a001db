"""Each kind alone, in worker processes beside this one: the same answers as here, and nothing waits on a
worker that is gone."""

from pathlib import Path

import pytest

from poplar.alone import AloneRuns, _Worker, jobs_of, plan_alone
from poplar.cluster.spec import load_cluster
from poplar.profile.options import ProfileOptions
from poplar.workload import Workload

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "clusters"
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


def test_a_worker_answers_what_this_process_would():
    here = [plan_alone(ARGS[0], SPEC, k, *ARGS[3:]) for k in KINDS]
    with AloneRuns(*ARGS, workers=1) as runs:
        worker = runs.workers[0]
        while not worker.begun:          # let the worker begin its first job, so that it answers that one
            runs._take(timeout=None)
        answers = runs.results()
        assert worker.begun and set(worker.jobs) <= set(runs.done)
    assert _figures(answers) == _figures(here)
    assert worker.process.poll() is not None      # ended with the runs


def test_a_worker_that_dies_is_warned_of_and_its_jobs_run_here():
    here = [plan_alone(ARGS[0], SPEC, k, *ARGS[3:]) for k in KINDS]
    with AloneRuns(*ARGS, workers=2) as runs:
        assert len(runs.workers) == 2
        for w in runs.workers:
            w.process.kill()
            w.process.wait()
        with pytest.warns(RuntimeWarning, match="ended without its answers"):
            answers = runs.results()
        assert not runs.workers
    assert _figures(answers) == _figures(here)


def test_an_error_in_a_worker_is_raised_here_as_itself():
    worker = _Worker({0: ["a100-80gb"]}, (ARGS[0], SPEC, "sixty-four", ARGS[4]))   # a batch that is no number
    try:
        with pytest.raises(TypeError, match="not supported between"):
            while True:
                worker.receive()
    finally:
        worker.close()


def test_a_kind_that_cannot_hold_the_model_alone_has_no_plan_and_says_why_at_once():
    """An A100-80GB beside a T4-16GB, Llama-1B: the T4 alone cannot hold its states (a row of the comparison, not an
    error that ends it), said before anything is simulated."""
    import time

    from poplar.cluster.spec import parse_cluster

    spec = parse_cluster({"devices": [{"kind": "a", "gpu": "A100-80GB"}, {"kind": "t", "gpu": "T4-16GB"}]})
    start = time.perf_counter()
    alone, result = plan_alone(Workload(model="llama-1b", seq_len=2048), spec, "t", 64,
                               ProfileOptions(stages=(3,), precision="fp16"))
    assert result is None and alone.samples_per_s is None and "more than the 1 device" in alone.why_not
    assert time.perf_counter() - start < 5
