"""Each kind alone, in worker processes beside this one: the same answers as here (how the workers share the jobs
with this process, and what happens to those of a worker that dies: tests/processes/test_pool.py)."""

from pathlib import Path

import pytest

from poplar.cluster.spec import load_cluster
from poplar.compare.alone import AloneRuns, jobs_of, plan_alone
from poplar.models.workload import Workload
from poplar.profile.options import ProfileOptions

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "clusters"
SPEC = load_cluster("two-node-10gbe")      # 2 A100s and 3 RTX 4090s: two jobs, alone worlds of 2 and 3
KINDS = ["a100-80gb", "rtx-4090"]
ARGS = (Workload(model="tiny"), SPEC, KINDS, 64, ProfileOptions(stages=(0,), n_points=2))


def test_kinds_of_one_world_size_are_next_to_each_other_the_larger_groups_first():
    spec = load_cluster(str(EXAMPLES / "six-kinds-4096.yaml"))
    sizes = {k: sum(d.count for d in spec.devices if d.kind == k) for k in dict.fromkeys(d.kind for d in spec.devices)}
    order = [sizes[k] for k in jobs_of(spec, list(sizes))]
    assert sorted(jobs_of(spec, list(sizes))) == sorted(sizes)
    runs = [n for i, n in enumerate(order) if i == 0 or order[i - 1] != n]
    assert len(runs) == len(set(runs))      # each world size in one run of jobs
    assert [order.count(n) for n in runs] == sorted((order.count(n) for n in runs), reverse=True)


@pytest.mark.slow
@pytest.mark.parametrize("fork", [True, False])
def test_a_worker_answers_what_this_process_would(fork):
    """Forked from this process or a fresh interpreter; the worker takes the first kind at once, this process
    the other."""
    here = [plan_alone(k, ARGS[0], SPEC, *ARGS[3:]) for k in KINDS]
    with AloneRuns(*ARGS, workers=1, fork=fork) as runs:
        answers = runs.results()
    assert [a for a, _ in answers] == [a for a, _ in here]
    assert [r.plan for _, r in answers] == [r.plan for _, r in here]
    assert [a.name for a, _ in answers] == ["a100-80gb alone", "rtx-4090 alone"]


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
    assert (alone.kind, alone.ranks) == ("t", 1)
    assert time.perf_counter() - start < 5
