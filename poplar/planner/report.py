"""A planning result as rows to read (plain values; the commands draw them as tables, :mod:`poplar.cli.tables`):
per stage, every rank's work; the allocations of every stage side by side."""

from __future__ import annotations

from typing import NamedTuple

from poplar.planner.planner import PlanResult, StagePlan


class RankRow(NamedTuple):
    """Ranks of one kind with the same work, together (``label``: ``0-511``)."""

    label: str
    kind: str
    samples: int
    micro_batch: int
    accum: int
    busy_s: float
    idle_s: float


class AllocationRow(NamedTuple):
    """One allocation of one stage (or the stage's ideal bound, ``name`` ``ideal``; a stage left out: ``name``
    ``-``), predicted; ``note``: why it has no figures."""

    stage: str            # the stage's label without "stage "
    name: str
    chosen: bool          # the planner's choice
    step_s: float | None = None
    samples_per_s: float | None = None
    tokens_per_s: float | None = None
    vs_uniform: float | None = None
    of_ideal: float | None = None
    note: str = ""


def rank_rows(result: PlanResult, sp: StagePlan) -> list[RankRow]:
    """Each rank's work in ``sp``'s plan, with what the planner predicts it is busy and idle a step."""
    alloc = sp.poplar
    plan, pred = alloc.plan, alloc.predicted
    groups: list[list] = []
    for i, r in enumerate(sp.ranks):
        key = (result.profile.ranks[r], plan.local_batch_sizes[i], plan.micro_batch_sizes[i], plan.accum_steps[i])
        if groups and groups[-1][1] == key and groups[-1][0][-1] == r - 1:
            groups[-1][0].append(r)
            groups[-1][2].append(i)
        else:
            groups.append([[r], key, [i]])
    rows = []
    for ranks, (kind, samples, mbs, accum), idx in groups:
        label = str(ranks[0]) if len(ranks) == 1 else f"{ranks[0]}-{ranks[-1]}"
        busy = max(pred.busy_s[i] for i in idx)
        rows.append(RankRow(label, kind, samples, mbs, accum, busy, pred.step_s - busy))
    return rows


def allocation_rows(result: PlanResult) -> list[AllocationRow]:
    """Every stage's (and shaped stage's) allocations, predicted, each stage's ideal bound after them."""
    seq = result.profile.model.seq_len if result.profile else 1
    rows = []
    for sp in [*result.stages.values(), *result.shaped.values()]:
        s = sp.label.removeprefix("stage ")
        if sp.excluded:
            rows.append(AllocationRow(s, "-", False, note=sp.excluded))
            continue
        base = sp.allocations["uniform"].predicted
        for name, alloc in sp.allocations.items():
            if alloc.plan is None:
                rows.append(AllocationRow(s, name, False, note=alloc.why_not))
                continue
            p = alloc.predicted
            rows.append(AllocationRow(s, name, sp is result.chosen and name == "poplar", p.step_s, p.samples_per_s,
                                      p.tokens_per_s, p.samples_per_s / base.samples_per_s if base else None,
                                      p.samples_per_s / sp.ideal_samples_per_s))
        rows.append(AllocationRow(s, "ideal", False, samples_per_s=sp.ideal_samples_per_s,
                                  tokens_per_s=sp.ideal_samples_per_s * seq, of_ideal=1.0))
    return rows
