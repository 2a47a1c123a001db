"""Every shape of shard groups, in every ZeRO stage, trains as one device does and issues its stage's collectives.

A crash once hid in one shape (groups of unlike sizes, units that no group size divides:
each group padded a unit to its own size, and the first broadcast sent the padding). So
this walks every partition of 2-5 ranks into shard groups (the set partitions: contiguous
or not, the larger group first or the smaller, singletons, and the one flat group), with
a model whose units (209 and 539 elements) every group size but one pads. What else a
case holds is drawn, seeded, per case: uneven micro-batches, unequal accumulation where
the stage allows it, uneven shares of the states (a rank with none, one with a tiny share)
in stages 1-3, clipping or not.

Every partition trains in every stage (in ``STAGES_AT_5`` of them, drawn, at 5 ranks: lower
it should that launch grow slow). Every partition of two groups or more also trains with a
stage per group (``Plan.group_stages``) that differs between groups: every such assignment
at 2 and 3 ranks (12 for two groups, 60 for three), ``MIXED_DRAWN`` drawn for each partition
at 4 and 5 ranks; accumulation equal only inside a group in stage 2 or 3, shares only in the
sharding groups. Each case's parameters must be single-device training's to 1e-5, and every
group's copy the very same bits (a replicating group's and a sharding one's alike). One case of
each partition, drawn, and one of its mixed-stage cases, drawn, are run again with a counting
comm, and each step must issue exactly the collectives its rank's stage and layout promise
(:func:`tests.helpers.collectives.expected_step`).

One launch per world size runs every case in turn; a case that fails fails its own test,
named by its shape, and the cases before it still report.
"""

import functools
import itertools
import random
import tempfile
from pathlib import Path

import pytest
import torch

from poplar.engine.layout import ShardLayout
from poplar.processes.spawn import spawn
from poplar.plan import Plan
from poplar.stages import STAGES, stage
from tests.engine.workers import shape_cases
from tests.helpers.collectives import expected_step, unit_numels
from tests.helpers.models import ORDER_TOLERANT_OPTIMIZER as OPTIMIZER, make_batches, reference_train

WORLDS = (2, 3, 4, 5)
N_STEPS = 2
# units of 209 elements (the embedding, 17 x 11, and the final norm) and 539 (each block): prime to 2, 3, 4, 5
MODEL = {"vocab": 17, "d": 11, "hidden": 22, "layers": 3}
STAGES_AT_5 = 1               # stages each partition of 5 ranks trains in, drawn (every stage at fewer ranks)
MIXED_WALKED = 3              # up to this many ranks every partition trains in every assignment of a stage a group
MIXED_DRAWN = 1               # that differs between groups; beyond, this many assignments drawn a partition
SHARES = (0, 0.01, 1, 2, 3)   # none, a tiny share, ordinary ones
CLIP = 0.05                   # below every step's gradient norm here, so clipping really acts
KINDS = ("train", "counts")   # what a launch runs, in this order


def partitions(ranks: list[int]):
    """Every partition of ``ranks`` into non-empty groups (Bell(len(ranks)) of them), in no one group order."""
    if not ranks:
        yield []
        return
    first, rest = ranks[0], ranks[1:]
    for part in partitions(rest):
        yield [[first], *part]
        for i, g in enumerate(part):
            yield [*part[:i], [first, *g], *part[i + 1:]]


def _case(rng: random.Random, world: int, groups: list[list[int]], zero_stage: int,
          special: float | None, group_stages: list[int] | None = None) -> tuple[dict, dict]:
    """One (plan, config) of this shape and stage (``group_stages``: one a group, ``zero_stage`` their highest),
    the rest drawn from ``rng``. ``special``: a share one rank of a sharding group of several is given (the
    others' drawn); None: even shares."""
    mbs = [rng.randint(1, 3) for _ in range(world)]
    stages = group_stages or [zero_stage] * len(groups)
    acc = [0] * world
    if group_stages is None and stage(zero_stage).equal_accum_steps:
        acc = [rng.randint(1, 2)] * world
    for g, s in zip(groups, stages):   # a stage-2/3 group's ranks run one count, the others' are free
        one = rng.randint(1, 2)
        for r in g:
            acc[r] = acc[r] or (one if stage(s).equal_accum_steps else rng.randint(1, 3))
    shares = None
    if special is not None:
        shares = [rng.choice(SHARES) for _ in range(world)]
        several = [g for g, s in zip(groups, stages) if len(g) > 1 and s]
        chosen = rng.choice(rng.choice(several)) if several else None
        if chosen is not None:
            shares[chosen] = special
        for g, s in zip(groups, stages):   # a group holds a whole copy: not every share of it may be 0
            if not s:                      # (and one in stage 0 shards nothing: its shares alike)
                for r in g:
                    shares[r] = 1
            elif not any(shares[r] for r in g):
                shares[next(r for r in g if r != chosen)] = 1
    plan = {"zero_stage": zero_stage, "micro_batch_sizes": mbs, "accum_steps": acc, "shard_groups": groups,
            "shard_shares": shares, **({"group_stages": group_stages} if group_stages else {})}
    return plan, {"clip_grad_norm": rng.choice([None, CLIP])}


def mixed_stages(rng: random.Random, world: int, n_groups: int) -> list[list[int]]:
    """The stage assignments a partition of ``world`` ranks into ``n_groups`` groups trains in: every one whose
    stages differ between groups at fewer than 4 ranks (``MIXED_WALKED``), ``MIXED_DRAWN`` drawn (differing)
    beyond."""
    every = [list(a) for a in itertools.product(sorted(STAGES), repeat=n_groups) if len(set(a)) > 1]
    return every if world <= MIXED_WALKED else rng.sample(every, MIXED_DRAWN)


@functools.cache
def cases(world: int) -> tuple[list, list]:
    """The training cases and the counted ones (their configs without clipping) at ``world`` ranks.

    The sharded stages' cases take even shares, a rank with none and a rank with a tiny share in turn."""
    rng = random.Random(world)
    specials = itertools.cycle([None, 0, 0.01])
    train, counted = [], []
    for groups in partitions(list(range(world))):
        stages = sorted(STAGES) if world < 5 else sorted(rng.sample(sorted(STAGES), STAGES_AT_5))
        mine = [_case(rng, world, groups, s, next(specials) if stage(s).shards_optimizer else None) for s in stages]
        counted.append((rng.choice(mine)[0], {}))
        mixed = [_case(rng, world, groups, max(a), next(specials), a)
                 for a in (mixed_stages(rng, world, len(groups)) if len(groups) > 1 else [])]
        counted += [(rng.choice(mixed)[0], {})] if mixed else []
        train += mine + mixed
    return train, counted


def case_id(world: int, plan: dict, config: dict) -> str:
    groups = "".join("[" + ",".join(map(str, g)) + "]" for g in plan["shard_groups"])
    join = lambda values: ",".join(f"{v:g}" for v in values)   # noqa: E731
    shares = f"-shares{join(plan['shard_shares'])}" if plan["shard_shares"] else ""
    clip = f"-clip{config['clip_grad_norm']}" if config.get("clip_grad_norm") else ""
    stages = (f"stages{''.join(map(str, plan['group_stages']))}" if plan.get("group_stages")
              else f"stage{plan['zero_stage']}")
    return (f"w{world}-{groups}-{stages}-mbs{join(plan['micro_batch_sizes'])}"
            f"-acc{join(plan['accum_steps'])}{shares}{clip}")


@functools.cache
def launched(world: int):
    """Every rank's ``{"train": (results, failure), "counts": ...}`` and None; or, kept so that every case
    reports it without launching again, the launch's own error and the case it failed in, ``(kind, index)``
    (a rank gloo aborted returns nothing)."""
    train, counted = cases(world)
    with tempfile.TemporaryDirectory(prefix="poplar-shapes-") as progress:
        try:
            return spawn(shape_cases, world, [(p, c, MODEL) for p, c in train], counted, N_STEPS, OPTIMIZER, MODEL,
                         progress, timeout_s=280, collective_timeout_s=60), None
        except Exception as e:
            return e, _failed_in(Path(progress), getattr(e, "rank", None))


def _failed_in(progress: Path, rank: int | None) -> tuple[str, int] | None:
    """The case under way on the rank that failed (unknown: on the rank furthest behind), ``(kind, index)``."""
    at: dict[int, tuple[int, int]] = {}
    for f in progress.iterdir():
        kind, r = f.name.split("-")
        text = f.read_text()
        if text:   # (empty: the rank died writing it)
            at[int(r)] = max(at.get(int(r), (0, 0)), (KINDS.index(kind), int(text)))
    if not at:
        return None
    kind, index = at[rank] if rank in at else min(at.values())
    return KINDS[kind], index


def outcome(world: int, kind: str, index: int) -> list:
    """Every rank's result of case ``index`` of ``kind`` ('train' or 'counts'); the test fails where it did."""
    runs, failed_in = launched(world)
    if isinstance(runs, Exception):   # (a new error each time: one raised again grows its traceback)
        if failed_in == (kind, index):
            pytest.fail(f"the launch of {world} ranks failed in this case: {type(runs).__name__}: {runs}")
        where = _name(world, *failed_in) if failed_in else "an unknown case"
        pytest.fail(f"no result: the launch of {world} ranks failed in {where}: {getattr(runs, 'line', runs)}")
    failures = sorted((r[kind][1][0], rank, r[kind][1][1]) for rank, r in enumerate(runs) if r[kind][1])
    if failures:
        first, rank, trace = failures[0]   # the others may only have lost their peer
        if index == first:
            pytest.fail(f"rank {rank} raised in this case:\n{trace}")
        if index > first:
            pytest.fail(f"not run: {_name(world, kind, first)} failed before it")
    return [r[kind][0][index] for r in runs]


def _name(world: int, kind: str, index: int) -> str:
    return f"the {kind} case {case_id(world, *cases(world)[KINDS.index(kind)][index])}"


TRAIN = [(w, i) for w in WORLDS for i in range(len(cases(w)[0]))]
COUNTED = [(w, i) for w in WORLDS for i in range(len(cases(w)[1]))]


@pytest.mark.slow
@pytest.mark.parametrize("world, index", TRAIN, ids=[case_id(w, *cases(w)[0][i]) for w, i in TRAIN])
def test_every_shape_trains_as_one_device_and_every_group_holds_the_same_copy(world, index):
    plan_dict, config = cases(world)[0][index]
    plan = Plan.from_dict(plan_dict)
    ranks = outcome(world, "train", index)
    clip = config["clip_grad_norm"]
    batches = make_batches(N_STEPS, plan.global_batch_size, vocab=MODEL["vocab"])
    ref_state, ref_losses = reference_train(batches, clip=clip, optimizer=OPTIMIZER, model_kw=MODEL)
    groups = plan.shard_groups or [tuple(range(world))]   # sorted: rank 0's group first
    first = ranks[groups[0][0]]["state"]
    for key, ref in ref_state.items():
        torch.testing.assert_close(first[key], ref, atol=1e-5, rtol=0, msg=lambda m, key=key: f"{key}: {m}")
    for g in groups[1:]:   # every other group's copy: the very same bits
        for key, value in ranks[g[0]]["state"].items():
            assert torch.equal(value, first[key]), (g, key)
    for r in ranks:   # the returned loss is the global mean, the same on every rank
        assert r["losses"] == pytest.approx(ref_losses, abs=1e-5)
    if clip is not None:
        assert all(n > clip for n in ranks[0]["norms"]), "clipping must have acted in every step"


@pytest.mark.slow
@pytest.mark.parametrize("world, index", COUNTED, ids=[case_id(w, *cases(w)[1][i]) for w, i in COUNTED])
def test_every_shape_issues_exactly_its_stages_collectives(world, index):
    plan = Plan.from_dict(cases(world)[1][index][0])
    for rank, run in enumerate(outcome(world, "counts", index)):
        assert run["padded_numels"] == [ShardLayout(world, plan.shard_groups, rank).padded(n)
                                        for n in unit_numels(MODEL)]
        layout = ShardLayout(world, plan.shard_groups, rank, plan.shard_shares)
        expected = expected_step(plan.stage_of(rank), plan.accum_steps[rank], 4, layout, MODEL,
                                 every_rank_norm=plan.group_stages is not None)
        for step in run["steps"]:   # the first step (forward order not yet known) and a later one alike
            assert [tuple(c) for c in step] == expected, rank


def test_the_cases_cover_what_they_promise():
    """No group size divides a unit; every partition in every stage (STAGES_AT_5 at 5 ranks), and counted; at
    every world size unequal accumulation, a rank with no share and one with a tiny share in a group of several,
    even shares in a hybrid sharded stage, clipping and none; every plan valid."""
    assert all(n % k for n in unit_numels(MODEL) for k in (2, 3, 4, 5))
    for world, bell in zip(WORLDS, (2, 5, 15, 52)):
        train, counted = cases(world)
        shapes, mixed = {}, {}
        for plan, _ in train:
            Plan.from_dict(plan)
            shape = frozenset(frozenset(g) for g in plan["shard_groups"])
            if plan.get("group_stages"):
                assert len(set(plan["group_stages"])) > 1 and Plan.from_dict(plan).group_stages
                mixed.setdefault(shape, []).append(tuple(plan["group_stages"]))
            else:
                shapes.setdefault(shape, set()).add(plan["zero_stage"])
        assert len(shapes) == bell
        assert all(len(s) == (4 if world < 5 else STAGES_AT_5) for s in shapes.values())
        assert len({frozenset(frozenset(g) for g in p["shard_groups"]) for p, _ in counted}) == bell
        several = [s for s in shapes if len(s) > 1]   # every shape of two groups or more, in mixed stages too
        assert set(mixed) == set(several) and len(counted) == bell + len(several)
        for shape, assigned in mixed.items():
            walked = 4 ** len(shape) - 4 if world <= MIXED_WALKED else MIXED_DRAWN
            assert len(set(assigned)) == len(assigned) == walked, (world, shape)

        def beside_others(p, share):   # a rank with this share in a group of several
            return any(p["shard_shares"] and len(g) > 1 and share in [p["shard_shares"][r] for r in g]
                       for g in p["shard_groups"])
        plans = [p for p, _ in train]
        assert any(len(set(p["accum_steps"])) > 1 for p in plans), world
        assert any(beside_others(p, 0) for p in plans), world
        assert any(beside_others(p, 0.01) for p in plans), world
        assert any(p["zero_stage"] and not p["shard_shares"] and len(p["shard_groups"]) > 1 for p in plans), world
        assert any(c["clip_grad_norm"] for _, c in train) and any(not c["clip_grad_norm"] for _, c in train)
