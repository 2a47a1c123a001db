"""Tables of a planning result: per stage, every rank's work, and the allocations side by side."""

from __future__ import annotations

from rich.table import Table

from poplar.planner.planner import PlanResult, StagePlan


def _rank_rows(result: PlanResult, sp: StagePlan):
    """Ranks with the same kind and the same work are shown as one row (``0-511``)."""
    alloc = sp.poplar
    plan, pred = alloc.plan, alloc.predicted
    rows: list[list] = []
    for i, r in enumerate(sp.ranks):
        key = (result.profile.ranks[r], plan.local_batch_sizes[i], plan.micro_batch_sizes[i], plan.accum_steps[i])
        if rows and rows[-1][1] == key and rows[-1][0][-1] == r - 1:
            rows[-1][0].append(r)
            rows[-1][2].append(i)
        else:
            rows.append([[r], key, [i]])
    for ranks, (kind, samples, mbs, accum), idx in rows:
        label = str(ranks[0]) if len(ranks) == 1 else f"{ranks[0]}-{ranks[-1]}"
        busy = max(pred.busy_s[i] for i in idx)
        yield label, kind, samples, mbs, accum, busy, pred.step_s - busy


def stage_table(result: PlanResult, sp: StagePlan) -> Table:
    title = f"ZeRO {sp.label}{' (chosen)' if sp is result.chosen else ''}: Poplar's plan"
    table = Table(title=title)
    for col in ("rank", "device", "samples", "micro-batch", "accum", "busy ms", "idle ms"):
        table.add_column(col, justify="right")
    for label, kind, samples, mbs, accum, busy, idle in _rank_rows(result, sp):
        table.add_row(label, kind, str(samples), str(mbs), str(accum), f"{1000 * busy:.1f}", f"{1000 * idle:.1f}")
    return table


def comparison_table(result: PlanResult) -> Table:
    seq = result.profile.model.seq_len if result.profile else 1
    table = Table(title=f"predicted throughput, global batch {result.plan.global_batch_size}")
    for col in ("stage", "allocation", "step ms", "samples/s", "tokens/s", "vs uniform", "of ideal"):
        table.add_column(col, justify="right")
    for sp in [*result.stages.values(), *result.shaped.values()]:
        s = sp.label.removeprefix("stage ")
        if sp.excluded:
            table.add_row(s, "-", "-", "-", "-", "-", sp.excluded)
            continue
        base = sp.allocations["uniform"].predicted
        for name, alloc in sp.allocations.items():
            if alloc.plan is None:
                table.add_row(s, name, "-", "-", "-", "-", alloc.why_not)
                continue
            p = alloc.predicted
            table.add_row(f"{s}{'*' if sp is result.chosen and name == 'poplar' else ''}", name,
                          f"{1000 * p.step_s:.1f}", f"{p.samples_per_s:.1f}", f"{p.tokens_per_s:,.0f}",
                          f"{p.samples_per_s / base.samples_per_s:.2f}x" if base else "-",
                          f"{100 * p.samples_per_s / sp.ideal_samples_per_s:.0f}%")
        table.add_row(s, "ideal", "-", f"{sp.ideal_samples_per_s:.1f}", f"{sp.ideal_samples_per_s * seq:,.0f}",
                      "-", "100%")
    return table
