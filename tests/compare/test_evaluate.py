"""The simulator's comparison: Poplar's plan, the baselines, each kind alone, and when to leave a kind out."""

import json

import pytest

from poplar.cluster.spec import load_cluster
from poplar.compare.alone import alone_cluster
from poplar.compare.comparison import Comparison
from poplar.compare.evaluate import evaluate
from poplar.models.workload import Workload
from poplar.profile.options import ProfileOptions


def test_where_one_node_alone_is_faster_poplar_says_to_leave_the_other_out():
    """two-node-10gbe: 2 A100s and 3 RTX 4090s over 10 GbE. For a 0.1M-parameter model every plan of the whole
    cluster waits on the slow link; the A100s' node alone goes faster, and the evaluation says so."""
    spec = load_cluster("two-node-10gbe")
    assert [d.kind for d in alone_cluster(spec, "rtx-4090").devices] == ["rtx-4090"]
    # each kind alone in this process (workers=0): the workers beside it are tests/compare/test_alone.py's
    ev, result = evaluate(Workload(model="tiny"), spec, 256, ProfileOptions(stages=(0,), n_points=2), workers=0)
    alone = {a.kind: a for a in ev.alone}
    assert ev.label.startswith("a100-80gb only") and "(rtx-4090)" in ev.reason and "without them" in ev.reason
    # the planner's weighing of the A100s alone (their node's own collectives) is their own profile's
    assert ev.poplar.samples_per_s == pytest.approx(alone["a100-80gb"].samples_per_s, rel=1e-6)
    assert ev.poplar.samples_per_s > alone["rtx-4090"].samples_per_s
    assert ev.poplar.samples_per_s > max(b.samples_per_s for b in ev.baselines if b.samples_per_s)
    assert result.plan.world_size == 2 and [k.kind for k in ev.kinds] == ["a100-80gb"]
    assert ev.poplar.plan == result.plan and [b.name for b in ev.baselines] == ["uniform", "proportional",
                                                                                "measured-peak"]
    # the GPUs each runs on: Poplar's two A100s, the baselines' whole cluster, each kind's own
    assert ev.baselines[0].peak_tflops == alone["a100-80gb"].peak_tflops + alone["rtx-4090"].peak_tflops
    assert ev.poplar.peak_tflops == alone["a100-80gb"].peak_tflops
    # saved and read back whole, through JSON
    assert Comparison.from_dict(json.loads(json.dumps(ev.to_dict()))) == ev
