"""Every table the commands print, drawn from the values the modules below return (rich tables are drawn here
and nowhere else but the progress display): a profile's, a plan's, and each comparison's."""

from __future__ import annotations

from rich.table import Table

from poplar.compare.comparison import Comparison, Contender
from poplar.planner.report import allocation_rows, candidate_rows, rank_rows


def _table(title: str, columns: tuple[str, ...], **style) -> Table:
    table = Table(title=title)
    for col in columns:
        table.add_column(col, justify="right", **style)
    return table


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1000 * seconds:.1f}"


def profile_table(rows, title: str) -> Table:
    """A profile's rows (:func:`poplar.profile.report.profile_rows`): per kind and stage, what was timed."""
    table = _table(title, ("device", "stage", "max mbs", "state MiB", "ms@1", "ms@max", "samples/s", "source"),
                   no_wrap=True)
    for r in rows:
        table.add_row(r.kind, str(r.stage), str(r.max_micro_batch), f"{r.state_bytes / 2**20:.2f}", _ms(r.step_s_at_1),
                      _ms(r.step_s_at_max), "-" if r.samples_per_s is None else f"{r.samples_per_s:.1f}", r.note)
    return table


def stage_table(result, sp) -> Table:
    """A stage's plan (``sp``, of the planning ``result``), each rank's work (:func:`poplar.planner.report.rank_rows`)."""
    table = _table(f"ZeRO {sp.label}{' (chosen)' if sp is result.chosen else ''}: Poplar's plan",
                   ("rank", "device", "samples", "micro-batch", "accum", "busy ms", "idle ms"))
    for r in rank_rows(result, sp):
        table.add_row(r.label, r.kind, str(r.samples), str(r.micro_batch), str(r.accum), _ms(r.busy_s), _ms(r.idle_s))
    return table


def allocations_table(result) -> Table:
    """Every stage's allocations of the planning ``result``, predicted (:func:`poplar.planner.report.allocation_rows`)."""
    table = _table(f"predicted throughput, global batch {result.plan.global_batch_size}",
                   ("stage", "allocation", "step ms", "samples/s", "tokens/s", "vs uniform", "of ideal"))
    for r in allocation_rows(result):
        if r.samples_per_s is None:    # no plan, or the stage left out: why, in the last column
            table.add_row(r.stage, r.name, "-", "-", "-", "-", r.note)
            continue
        table.add_row(f"{r.stage}{'*' if r.chosen else ''}", r.name, _ms(r.step_s), f"{r.samples_per_s:.1f}",
                      f"{r.tokens_per_s:,.0f}", "-" if r.vs_uniform is None else f"{r.vs_uniform:.2f}x",
                      "-" if r.of_ideal is None else f"{100 * r.of_ideal:.0f}%")
    return table


def candidates_table(result) -> Table:
    """What each subset of the kinds, stage and shape the planner weighed was predicted to give, the fastest first
    (:func:`poplar.planner.report.candidate_rows`)."""
    rows, weighed = candidate_rows(result)
    table = _table(f"the kinds, stages and shapes weighed: the fastest {len(rows)} of {weighed}",
                   ("kinds", "stage and shape", "samples/s", "at most"), overflow="fold")
    for r in rows:
        table.add_row(r.kinds, f"{r.plan}{' *' if r.chosen else ''}",
                      "-" if r.samples_per_s is None else f"{r.samples_per_s:,.1f}", f"{r.floor_samples_per_s:,.1f}")
    return table


def verify_table(rows: list[dict]) -> Table:
    """`poplar verify`'s rows (:func:`poplar.compare.verify.run_verify`): each stage against one device."""
    table = _table("each rank its own micro-batch; same update as one device",
                   ("stage", "rank: mbs x accum", "loss", "|Δ| vs 1 GPU", "ms/step", "bytes/rank"))
    for r in rows:
        plan = r["plan"]
        per_rank = "  ".join(f"{m}x{a}" for m, a in zip(plan["micro_batch_sizes"], plan["accum_steps"]))
        table.add_row(str(plan["zero_stage"]), per_rank, f"{r['losses'][0]:.2f}→{r['losses'][-1]:.2f}",
                      f"{r['max_param_error']:.1e}", _ms(r["step_s"]), f"{r['state_bytes'] / 2**20:.2f} MiB")
    return table


BENCH_LEGEND = ("samples/s: on an emulated cluster, in its devices' declared time; predicted: the plan's predicted "
                "step time against the measured one; overruns: spans whose real work ran past their declared time "
                "(0: the figures are the declared devices')")


def bench_table(results: list[Comparison], title: str) -> tuple[Table, list[str]]:
    """`poplar bench`'s table, and the lines to print under it (legend, peers left out, allocations that failed)."""
    table = _table(title, ("cluster", "stage", "allocation", "samples/s", "vs uniform", "vs proportional",
                           "vs measured-peak", "vs deepspeed", "of ideal", "predicted", "overruns"),
                   overflow="fold")   # a narrow terminal: folded, not cut
    notes = [BENCH_LEGEND]
    if any(a.same_plan_as for r in results for a in r.allocations):
        notes.append("(= name): the same plan as that allocation's, measured once")
    for r in results:
        rows = {a.name: a for a in r.allocations}
        for name, peer in r.peers.items():
            if isinstance(peer, Contender):
                rows[name] = peer
            else:
                notes.append(f"{r.cluster}: {name}: {peer}")

        def vs(a: Contender, name: str) -> str:
            theirs = rows[name].samples_per_s if name in rows else None
            return f"{a.samples_per_s / theirs:.2f}x" if theirs else "-"

        for name, a in rows.items():
            label = f"{name} (= {a.same_plan_as})" if a.same_plan_as else name
            if a.failed:   # reported beside the others, with its reason
                notes.append(f"{r.cluster}: {name} could not run: {a.failed}")
                table.add_row(r.cluster, str(r.zero_stage), label, "failed", *["-"] * 7)
                continue
            error = "-" if a.prediction_error is None else f"{100 * a.prediction_error:+.1f}%"
            table.add_row(r.cluster, str(r.zero_stage), label, f"{a.samples_per_s:.1f}",
                          vs(a, "uniform"), vs(a, "proportional"), vs(a, "measured-peak"), vs(a, "deepspeed"),
                          f"{100 * a.samples_per_s / r.ideal_samples_per_s:.0f}%", error,
                          "-" if a.measured is None else str(a.measured.overruns))
        table.add_row(r.cluster, str(r.zero_stage), "ideal", f"{r.ideal_samples_per_s:.1f}",
                      "-", "-", "-", "-", "100%", "-", "-")
    return table, notes


def demo_table(c: Comparison, title: str) -> Table:
    """The demo's measured rows beside Poplar's, the prediction's error, and the ideal bound."""
    table = _table(title, ("allocation", "stage", "samples a rank", "samples/s", "Poplar's speedup", "of ideal",
                           "predicted", "loss"), overflow="fold")
    ideal, poplar = c.ideal_samples_per_s, c.poplar.samples_per_s
    for a in c.allocations:
        if a.measured is None:
            table.add_row(a.name, "-", "no plan", "-", "-", "-", "-", "-")
            continue
        m = a.measured
        table.add_row(a.name, str(a.plan.zero_stage), plan_cell(a.plan), f"{m.samples_per_s:,.0f}",
                      f"{poplar / m.samples_per_s:.2f}x", f"{100 * m.samples_per_s / ideal:.0f}%",
                      f"{100 * (a.predicted_samples_per_s / m.samples_per_s - 1):+.1f}%",
                      f"{m.first_loss:.2f} -> {m.last_loss:.2f}")
    table.add_row("ideal", "-", "-", f"{ideal:,.0f}", "-", "100%", "-", "-")
    return table


def plan_cell(plan) -> str:
    """Each rank's micro-batch x accumulation steps (its samples first where fewer), as the demo's table shows a plan.

    >>> from poplar.plan import Plan
    >>> plan_cell(Plan(0, [16, 8], 1)), plan_cell(Plan.from_local_batches(1, [17, 7], [2, 1]))
    ('16x1, 8x1', '17<=9x2, 7x1')
    """
    return ", ".join(f"{m}x{a}" if b == m * a else f"{b}<={m}x{a}"
                     for b, m, a in zip(plan.local_batch_sizes, plan.micro_batch_sizes, plan.accum_steps))


def real_size_table(c: Comparison) -> Table:
    """The demo's closing table, a simulated comparison: each plan's model TFLOP/s (three times a sample's
    forward FLOPs a sample) and MFU (of the peaks of the GPUs it runs on)."""
    per_sample = c.tflops / c.poplar.samples_per_s     # model TFLOP a sample
    table = _table(f"{c.model} ({c.seq_len}-token samples, checkpointed), global batch {c.global_batch}, on "
                   f"{c.cluster} at full memory: simulated",
                   ("plan", "samples/s", "model TFLOP/s", "MFU", "Poplar's speedup"), overflow="fold")
    rows = [(f"Poplar ({c.label})", c.poplar), *((n, c.allocation(n)) for n in ("uniform", "proportional")),
            *((a.name, a) for a in c.alone)]
    for name, a in rows:
        samples, peak = (a.samples_per_s, a.peak_tflops) if a is not None else (None, None)
        if not samples:
            table.add_row(name, "no plan", "-", "-", "-")
            continue
        tflops = samples * per_sample
        table.add_row(name, f"{samples:,.2f}", f"{tflops:,.1f}", f"{100 * tflops / peak:.0f}%" if peak else "-",
                      f"{c.poplar.samples_per_s / samples:.2f}x")
    return table


def summary_table(c: Comparison) -> Table:
    """`poplar simulate`'s comparison: Poplar's plan, the baselines (each at its best stage), each kind alone."""
    table = _table(f"{c.model}, global batch {c.global_batch} x {c.seq_len} tokens: Poplar against the baselines "
                   "(each at its best stage)", ("plan", "samples/s", "tokens/s", "Poplar's speedup"))
    mine = c.poplar.samples_per_s
    table.add_row(f"Poplar ({c.label})", f"{mine:,.1f}", f"{mine * c.seq_len:,.0f}", "1.00x")
    rows = [(a.name, a.samples_per_s) for a in c.baselines]
    rows += [(f"{a.kind} alone ({a.ranks}{', ' + a.label if a.label else ''})", a.samples_per_s) for a in c.alone]
    for name, s in rows:
        table.add_row(name, f"{s:,.1f}" if s else "-", f"{s * c.seq_len:,.0f}" if s else "-",
                      f"{c.speedup(s):.2f}x" if s else "no plan")
    ideal = c.ideal_samples_per_s
    table.add_row("ideal bound", f"{ideal:,.1f}", f"{ideal * c.seq_len:,.0f}", f"{100 * mine / ideal:.0f}% of it")
    return table


def kinds_table(c: Comparison) -> Table:
    """Each kind's part of Poplar's plan (simulated): its work, its model TFLOP/s and MFU."""
    table = _table(f"each kind in Poplar's plan ({c.tflops:,.1f} model TFLOP/s in all)",
                   ("kind", "ranks", "samples", "micro-batch", "accum", "TFLOP/s a device", "MFU"))
    for k in c.kinds:
        table.add_row(k.kind, str(k.ranks), str(k.samples), str(k.micro_batch), str(k.accum), f"{k.tflops:,.1f}",
                      f"{100 * k.mfu:.0f}%")
    return table
