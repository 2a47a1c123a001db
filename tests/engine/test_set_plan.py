"""A plan changed between steps (``Engine.set_plan``): other micro-batches, accumulation and shares of the states,
the shards cut anew in place. Seeded sequences of plans on real gloo ranks, in stages 1-3, flat and in shard groups,
with and without clipping: every one trains as one device does (1e-5), and every group's copy is the same. And
another ZeRO stage or shape between steps (``RankRuntime.change_plan``: through a checkpoint, the engine rebuilt):
seeded sequences over stages 0-3, flat and shaped, train as one device too."""

import random

import pytest
import torch

from poplar.engine.layout import ShardLayout
from poplar.processes.spawn import spawn
from poplar.plan import Plan
from tests.engine.workers import plans_in_turn, stages_in_turn
from tests.helpers.models import make_batches, reference_train

MODEL = {"vocab": 17, "d": 11, "hidden": 22, "layers": 3}   # units of 209 and 539 elements: no world size divides
STEPS = 4
GLOBAL = 12
SHARES = (None, None, (1, 1, 1), (2, 1, 1), (1, 3, 1), (0, 1, 1), (1, 0.01, 3))


def _plan(rng: random.Random, stage: int, world: int, groups) -> Plan:
    """A seeded split of the global batch (micro-batches of 1-3, accumulation where the stage allows unlike
    counts), with shares of the states drawn (flat; in each group where hybrid)."""
    cuts = sorted(rng.sample(range(1, GLOBAL), world - 1))
    samples = [b - a for a, b in zip([0, *cuts], [*cuts, GLOBAL])]
    accum = [rng.randint(1, 3) for _ in range(world)] if stage < 2 else [rng.randint(1, 3)] * world
    accum = [min(a, b) for a, b in zip(accum, samples)] if stage < 2 else [min(accum[0], min(samples))] * world
    plan = Plan.from_local_batches(stage, samples, accum)
    if groups:
        plan = plan.with_shard_groups(groups)
    shares = rng.choice(SHARES)
    if stage and shares is not None and len(shares) == world and all(
            sum(shares[r] for r in g) > 0 for g in groups or [range(world)]):
        plan = plan.with_shard_shares(list(shares))
    return plan


CASES = [(stage, groups, clip, seed) for stage in (1, 2, 3) for groups in (None, [[0, 1], [2]])
         for clip, seed in ((None, 0), (0.05, 1))]


@pytest.mark.slow
def test_plans_changed_between_steps_train_as_one_device():
    cases, expected = [], []
    for stage, groups, clip, seed in CASES:
        rng = random.Random(f"{stage}-{groups}-{seed}")
        plans = [_plan(rng, stage, 3, groups) for _ in range(STEPS)]
        cases.append(([p.to_dict() for p in plans], {"clip_grad_norm": clip} if clip else {}))
        expected.append(reference_train(make_batches(STEPS, GLOBAL, vocab=MODEL["vocab"]), clip=clip, model_kw=MODEL))
    ranks = spawn(plans_in_turn, 3, cases, MODEL, timeout_s=600)
    for i, (case, (want, _)) in enumerate(zip(CASES, expected)):
        last = Plan.from_dict(cases[i][0][-1])     # each rank holds the slices the last plan's shares cut
        for rank, r in enumerate(ranks):
            layout = ShardLayout(3, last.shard_groups, rank, last.shard_shares)
            assert r[i]["held"] == [b - a for a, b in map(layout.shard_range, r[i]["numels"])], case
        copies = [r[i]["state"] for r in ranks if r[i]["state"] is not None]
        for state in copies:
            for key, value in want.items():
                torch.testing.assert_close(state[key], value, atol=1e-5, rtol=0, msg=lambda m: f"{case}: {key}: {m}")
        for other in copies[1:]:
            assert all(torch.equal(other[k], copies[0][k]) for k in copies[0]), case


@pytest.mark.slow
def test_stages_and_shapes_changed_between_steps_train_as_one_device(tmp_path):
    cases, expected = [], []
    for seed, clip in ((0, None), (1, 0.05), (2, None)):
        rng = random.Random(f"stages-{seed}")
        stages = [rng.randrange(4) for _ in range(STEPS + 1)]
        stages[1] = (stages[0] + 1 + rng.randrange(3)) % 4          # a change of stage at the first step at least
        plans = [_plan(rng, s, 3, rng.choice((None, [[0, 1], [2]], [[0], [1, 2]]))) for s in stages]
        cases.append(([p.to_dict() for p in plans], {"clip_grad_norm": clip} if clip else {}))
        expected.append(reference_train(make_batches(STEPS + 1, GLOBAL, vocab=MODEL["vocab"]), clip=clip,
                                        model_kw=MODEL)[0])
    ranks = spawn(stages_in_turn, 3, cases, MODEL, str(tmp_path), timeout_s=600)
    for (plans, _), want, got in zip(cases, expected, ranks[0]):
        assert got["steps"] == STEPS + 1 and got["stage"] == plans[-1]["zero_stage"]
        for key, value in want.items():
            torch.testing.assert_close(got["state"][key], value, atol=1e-5, rtol=0,
                                       msg=lambda m: f"{[p['zero_stage'] for p in plans]}: {key}: {m}")
    assert not any(tmp_path.iterdir())      # the scratch checkpoints removed


def test_a_recut_sends_and_receives_what_the_two_cuts_overlap_for_any_cuts():
    """The parts a rank sends and receives when its slices are cut again (:meth:`ShardLayout.recut`), found by
    bisection, against every pair of ranges compared (seeded cuts, zero-sized slices included)."""
    import random
    from itertools import accumulate

    from poplar.engine.layout import overlaps

    def compared(mine, theirs, me):
        at, to = list(accumulate(mine, initial=0)), list(accumulate(theirs, initial=0))
        return [max(0, min(at[me + 1], to[j + 1]) - max(at[me], to[j])) for j in range(len(theirs))]

    rng = random.Random(0)
    for _ in range(5000):
        n, total = rng.randint(1, 9), rng.randint(0, 40)

        def cut():
            points = [0, *sorted(rng.randint(0, total) for _ in range(n - 1)), total]
            return [b - a for a, b in zip(points, points[1:])]
        held, wanted, me = cut(), cut(), rng.randrange(n)
        assert overlaps(held, wanted, me) == compared(held, wanted, me)
        assert overlaps(wanted, held, me) == compared(wanted, held, me)
        assert sum(overlaps(held, wanted, me)) == held[me]
