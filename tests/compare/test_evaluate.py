"""The simulator's comparison: Poplar's plan, the baselines, each kind alone, and when to leave a kind out."""

from poplar.compare.alone import alone_cluster
from poplar.cluster.spec import load_cluster
from poplar.profile.options import ProfileOptions
from poplar.compare.evaluate import evaluate
from poplar.models.workload import Workload


def test_where_one_node_alone_is_faster_poplar_says_to_leave_the_other_out():
    """two-node-10gbe: 2 A100s and 3 RTX 4090s over 10 GbE. For a 0.1M-parameter model every plan of the whole
    cluster waits on the slow link; the A100s' node alone goes faster, and the evaluation says so."""
    spec = load_cluster("two-node-10gbe")
    assert [d.kind for d in alone_cluster(spec, "rtx-4090").devices] == ["rtx-4090"]
    # each kind alone in this process (workers=0): the workers beside it are tests/compare/test_alone.py's
    ev, result = evaluate(Workload(model="tiny"), spec, 256, ProfileOptions(stages=(0,), n_points=2), workers=0)
    alone = {a.kind: a for a in ev.alone}
    assert ev.label.startswith("a100-80gb only") and "leaving rtx-4090 out" in ev.reason
    assert ev.samples_per_s == alone["a100-80gb"].samples_per_s > alone["rtx-4090"].samples_per_s
    assert ev.samples_per_s > max(v for v in ev.baselines.values() if v)    # every plan of the whole cluster
    assert result.plan.world_size == 2 and [k.kind for k in ev.kinds] == ["a100-80gb"]
