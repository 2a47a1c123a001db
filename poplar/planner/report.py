"""A planning result as rows to read (plain values; the commands draw them as tables, :mod:`poplar.cli.tables`):
per stage, every rank's work; the allocations of every stage side by side."""

from __future__ import annotations

from typing import NamedTuple

from poplar.planner.planner import PlanResult, StagePlan


class RankRow(NamedTuple):
    """Ranks of one kind with the same work, together wherever they stand (``label``: ``0-511``, or the runs of
    ranks, :func:`ranks_label`; ``count``: how many ranks)."""

    label: str
    count: int
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
    """Each rank's work in ``sp``'s plan, with what the planner predicts it is busy and idle a step: one row for
    every kind and work (samples, micro-batch, accumulation), whatever order the cluster file lists the ranks in,
    in the order of their first rank."""
    alloc = sp.poplar
    plan, pred = alloc.plan, alloc.predicted
    groups: dict[tuple, list[tuple[int, int]]] = {}
    for i, r in enumerate(sp.ranks):
        key = (result.profile.ranks[r], plan.local_batch_sizes[i], plan.micro_batch_sizes[i], plan.accum_steps[i])
        groups.setdefault(key, []).append((r, i))
    rows = []
    for (kind, samples, mbs, accum), members in groups.items():
        busy = max(pred.busy_s[i] for _, i in members)
        rows.append(RankRow(ranks_label([r for r, _ in members]), len(members), kind, samples, mbs, accum, busy,
                            pred.step_s - busy))
    return rows


def ranks_label(ranks: list[int], shown: int = 3) -> str:
    """Ranks (ascending) as their runs: ``0-7``, ``0-7, 48-55``; past ``shown`` runs the first two, the last and
    how many ranks in how many runs.

    >>> ranks_label([0, 1, 2, 3]), ranks_label([0, 1, 8, 9]), ranks_label([0, 8, 16, 24, 32])
    ('0-3', '0-1, 8-9', '0, 8, ..., 32 (5 ranks in 5 runs)')
    """
    runs: list[list[int]] = []
    for r in ranks:
        if runs and runs[-1][1] == r - 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    text = [str(a) if a == b else f"{a}-{b}" for a, b in runs]
    if len(text) <= shown:
        return ", ".join(text)
    return f"{text[0]}, {text[1]}, ..., {text[-1]} ({len(ranks)} ranks in {len(runs)} runs)"


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
                                      p.samples_per_s / sp.ideal_samples_per_s if sp.ideal_samples_per_s else None))
        if sp.ideal_samples_per_s:    # (not bounded: a stage beside the chosen one at scale, poplar.planner)
            rows.append(AllocationRow(s, "ideal", False, samples_per_s=sp.ideal_samples_per_s,
                                      tokens_per_s=sp.ideal_samples_per_s * seq, of_ideal=1.0))
    return rows


class CandidateRow(NamedTuple):
    """One subset of the kinds in one stage and shape that the planner weighed (:mod:`poplar.planner.subsets`)."""

    kinds: str            # "every kind", or the kinds in it
    plan: str             # "stage 3 one node a group"
    samples_per_s: float | None     # followed through the schedule (None: its floor was below the fastest)
    floor_samples_per_s: float
    chosen: bool


def candidate_rows(result: PlanResult, shown: int = 8) -> tuple[list[CandidateRow], int]:
    """The fastest ``shown`` candidates the planner weighed, and how many it weighed in all (its floors and
    predictions: the table of what each subset, stage and shape was predicted to give)."""
    every = list(dict.fromkeys(result.profile.ranks)) if result.profile else []
    chosen = set(result.ranks)
    rows = []
    for c in result.candidates[:shown]:
        kinds = "every kind" if len(c.kinds) == len(every) else ", ".join(c.kinds)
        mine = bool(c.samples_per_s) and c.plan == result.plan and set(_ranks_of(result, c.kinds)) == chosen
        rows.append(CandidateRow(kinds, c.label, c.samples_per_s or None, c.floor_samples_per_s, mine))
    return rows, result.weighed


def _ranks_of(result: PlanResult, kinds) -> list[int]:
    return [r for r, k in enumerate(result.profile.ranks) if k in kinds]
