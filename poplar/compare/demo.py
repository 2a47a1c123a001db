"""`poplar demo`: the whole system on an emulated heterogeneous cluster, no set-up, no network.

1. Profiles a small Llama (``llama-tiny``, 64-token samples of the Python Language
   Reference text that ships with Python, a tokenizer trained on it) on the cluster, in
   every ZeRO stage (cached after the first run).
2. Plans the global batch: the best stage, and Poplar's allocation beside the
   ``uniform`` (DeepSpeed-style) and ``proportional`` (Whale-style) ones, and each kind
   of card alone (the same profile, the other cards left out).
3. Trains with each of them for a few steps and prints the measured throughput side by
   side, with the planner's prediction and ideal bound, and where the plots are. Every
   row trains the same global batch, so every row's loss is the same.
4. Says what the same kinds of GPU do at full memory with a real model (:data:`REAL_MODEL`:
   Llama-1B, 2,048-token samples, activation checkpointing, their fastest precision; or
   another preset, or none), simulated (:mod:`poplar.simulate`): Poplar's plan against
   uniform, proportional and each card alone, in model TFLOP/s and MFU.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Callable
from typing import Any, NamedTuple
from pathlib import Path

from rich.console import Console
from rich.table import Table

from poplar.cluster.spec import load_cluster
from poplar.train.config import load_config
from poplar.train.report import plot_runs, read_log, summarize
from poplar.train.run import run_training

ALLOCATIONS = ("poplar", "uniform", "proportional")
WORKLOAD = {"model": "llama-tiny", "seq_len": 64, "vocab_size": 1024}   # the tokenizer's vocabulary, as trained
REAL_MODEL = "llama-1b"
REAL_SEQ_LEN = 2048      # a Hugging Face preset's samples at real size, where it has the positions (a built-in
                         # preset keeps its own length)
REAL_BATCH = 64          # samples a step: 128K tokens of 2,048


def real_workload(model: str):
    """The real-size table's workload: ``model`` (a preset), checkpointed, its samples at real length."""
    from poplar.models.hf import HF_PRESETS
    from poplar.models.workload import Workload

    seq = min(REAL_SEQ_LEN, HF_PRESETS[model][1]["max_position_embeddings"]) if model in HF_PRESETS else None
    return Workload(model=model, seq_len=seq, activation_checkpointing=True)


def check_demo(cluster: str, out: str | Path, global_batch: int, real_model: str | None = REAL_MODEL) -> None:
    """Everything the demo can be refused for, found before anything is profiled or written."""
    load_cluster(cluster).check_global_batch(global_batch)
    if Path(out).is_file():
        raise ValueError(f"--out {out} is a file: give a directory for the demo's runs")
    if real_model is not None:
        from pydantic import ValidationError

        try:
            real_workload(real_model)
        except ValidationError as e:   # an unknown preset
            raise ValueError(f"--real-model: {e.errors()[0]['msg'].removeprefix('Value error, ')}") from None


class Row(NamedTuple):
    """One row of the demo's table: an allocation (or a kind of card alone), its plan, what the planner predicted
    and what its training measured (the summary of its log; None where it has no plan, ``why_not`` says why)."""

    name: str
    plan: Any
    predicted_samples_per_s: float | None
    summary: dict | None
    why_not: str = ""


def run_demo(steps: int, cluster: str, out: str | Path, global_batch: int,
             console: Console | None = None, progress: Callable[[str], object] | None = None,
             real_model: str | None = REAL_MODEL) -> dict:
    """Profile, plan and train each allocation and each kind alone; print the table; then ``real_model`` at full
    memory, simulated (None: not). ``progress(title)``: a context reporting a wait."""
    console = console or Console()
    check_demo(cluster, out, global_batch, real_model)
    out = Path(out)
    if out.exists():
        shutil.rmtree(out)       # the demo's own directory: each run starts afresh
    out.mkdir(parents=True)
    base = {**WORKLOAD, "global_batch": global_batch, "steps": steps, "lr": 2e-3, "warmup_steps": 2}
    rows, logs, result = [], {}, None
    for name in ALLOCATIONS:
        console.print(f"[bold]{name}[/]: " + ("profiling and planning, then " if result is None else "")
                      + f"training {steps} steps")
        run = run_training(load_config(None, {**base, "cluster": cluster, "baseline": name, "out": str(out / name)}),
                           progress=progress)   # the first profiles; the others read the cache
        result = result or run["planning"]
        logs[name] = read_log(out / name / "log.jsonl")
        rows.append(Row(name, run["plan"], result.allocations()[name].predicted.samples_per_s, _summary(logs[name])))
        console.print(f"  {run['plan']}", markup=False, highlight=False)
    for kind, ranks, stage_plan in alone_plans(result, global_batch):
        name = f"{kind} alone"
        if stage_plan.excluded:
            rows.append(Row(name, None, None, None, stage_plan.excluded))
            continue
        plan = stage_plan.poplar.plan
        console.print(f"[bold]{name}[/]: training {steps} steps on {plan}", highlight=False)
        logs[name] = read_log(_train_alone(base, cluster, ranks, plan, out / f"{kind}-alone"))
        rows.append(Row(name, plan, stage_plan.poplar.predicted.samples_per_s, _summary(logs[name])))
    ideal = result.ideal_samples_per_s
    console.print(demo_table(rows, ideal, f"llama-tiny on {cluster}: ZeRO-{result.stage}"
                             f"{'' if result.plan.shape == 'flat' else ' ' + result.plan.shape}, global batch "
                             f"{global_batch}, medians of steps 2-{steps}"))
    console.print("samples/s in the emulated GPUs' declared time; Poplar's speedup: its samples/s over the row's; "
                  "ideal: the batch shared so that every device finishes together, only the communication no plan "
                  "hides; predicted: the planner's figure against the measured one", highlight=False)
    plot = plot_runs(logs, out / "comparison.png", title=f"llama-tiny on {cluster}")
    (out / "demo.json").write_text(json.dumps(demo_record(rows, ideal, result), indent=2) + "\n")
    for line in (f"planner's choice: {result.reason}",
                 f"plots: {plot} (every row), {out}/<row>/report.png; logs: {out}/<row>/log.jsonl; "
                 f"the table: {out}/demo.json"):
        console.print(line, markup=False, highlight=False, soft_wrap=True)
    real = _real_size_shown(console, progress, cluster, real_model) if real_model is not None else None
    return {"rows": rows, "ideal_samples_per_s": ideal, "planning": result, "plot": plot, "real": real}


def _real_size_shown(console: Console, progress, cluster: str, real_model: str):
    """The closing table: ``real_model`` on ``cluster``'s GPUs at full memory, simulated; where these GPUs cannot
    hold it in any stage, a line saying so (the demo's own table stands): the RealSize, or None."""
    with (progress(f"simulating {real_model} on the same GPUs at full memory") if progress
          else contextlib.nullcontext()):
        try:
            real = real_size(cluster, real_model)
        except ValueError as e:   # the planner's (PlanningError) or the arithmetic's: no stage holds the model
            real, why = None, str(e)
    if real is None:
        console.print(f"{real_model} at full memory on these GPUs: no plan ({why}); the closing table is left "
                      "out: give --real-model a smaller preset, or none", markup=False, highlight=False,
                      soft_wrap=True)
        return None
    console.print(real_size_table(real))
    console.print(f"the planner's choice there: {real.evaluation.reason}", markup=False, highlight=False,
                  soft_wrap=True)
    return real


def _summary(log: list[dict]) -> dict:
    """A run's summary (:func:`~poplar.train.report.summarize`) and its emulated devices' overruns."""
    return {**summarize(log), "overruns": sum(r.get("overruns", 0) for r in log)}


def alone_plans(result, global_batch: int) -> list[tuple[str, list[int], Any]]:
    """Each kind of card alone, planned on the same profile without the others: ``(kind, its ranks, its stage
    plan)``. In ZeRO-0, the one stage whose profile holds for any number of its ranks (each holds the whole
    states, as one card alone does in every stage)."""
    from poplar.planner import plan_stage

    profile = result.profile
    out = []
    for kind in dict.fromkeys(profile.ranks):
        ranks = [r for r, k in enumerate(profile.ranks) if k == kind]
        out.append((kind, ranks, plan_stage(profile, 0, global_batch, ranks)))
    return out


def _train_alone(base: dict, cluster: str, ranks: list[int], plan, out: Path) -> Path:
    """Train ``plan`` on ``ranks`` of ``cluster`` only (their own cluster file and plan, written beside the run);
    the run's log."""
    given = out.with_name(out.name + "-given")
    given.mkdir(parents=True)
    (given / "cluster.yaml").write_text(load_cluster(cluster).subset(ranks).to_yaml())
    plan.save(given / "plan.json")
    run_training(load_config(None, {**base, "cluster": str(given / "cluster.yaml"), "plan": str(given / "plan.json"),
                                    "out": str(out)}))
    return out / "log.jsonl"


def demo_record(rows: list[Row], ideal: float, result) -> dict:
    """The table as a value to save and read back: each row's plan, prediction and measured figures."""
    return {"zero_stage": result.stage, "ideal_samples_per_s": ideal, "reason": result.reason,
            "rows": [{"name": r.name, "plan": None if r.plan is None else r.plan.to_dict(),
                      "predicted_samples_per_s": r.predicted_samples_per_s, "why_not": r.why_not,
                      **({} if r.summary is None else {k: r.summary[k] for k in (
                          "samples_per_s", "step_s", "first_loss", "last_loss", "busy_s", "idle_s", "overruns")})}
                     for r in rows]}


def demo_table(rows: list[Row], ideal: float, title: str) -> Table:
    """The measured rows beside Poplar's, the prediction's error, and the ideal bound."""
    table = Table(title=title)
    for col in ("allocation", "stage", "samples a rank", "samples/s", "Poplar's speedup", "of ideal", "predicted",
                "loss"):
        table.add_column(col, justify="right", overflow="fold")
    poplar = rows[0].summary["samples_per_s"]
    for row in rows:
        if row.summary is None:
            table.add_row(row.name, "-", "no plan", "-", "-", "-", "-", "-")
            continue
        measured = row.summary["samples_per_s"]
        table.add_row(row.name, str(row.plan.zero_stage), plan_cell(row.plan), f"{measured:,.0f}", f"{poplar / measured:.2f}x",
                      f"{100 * measured / ideal:.0f}%", f"{100 * (row.predicted_samples_per_s / measured - 1):+.1f}%",
                      f"{row.summary['first_loss']:.2f} -> {row.summary['last_loss']:.2f}")
    table.add_row("ideal", "-", "-", f"{ideal:,.0f}", "-", "100%", "-", "-")
    return table


def plan_cell(plan) -> str:
    """Each rank's micro-batch x accumulation steps (its samples first where fewer), as the table shows a plan.

    >>> from poplar.plan import Plan
    >>> plan_cell(Plan(0, [16, 8], 1)), plan_cell(Plan.from_local_batches(1, [17, 7], [2, 1]))
    ('16x1, 8x1', '17<=9x2, 7x1')
    """
    return ", ".join(f"{m}x{a}" if b == m * a else f"{b}<={m}x{a}"
                     for b, m, a in zip(plan.local_batch_sizes, plan.micro_batch_sizes, plan.accum_steps))


class RealSize(NamedTuple):
    """The real-size comparison, and each kind's peak TFLOP/s and count (for MFU)."""

    evaluation: Any
    peaks: dict[str, float]
    counts: dict[str, int]
    seq_len: int


def real_size(cluster: str, model: str = REAL_MODEL) -> RealSize:
    """``model`` (:func:`real_workload`) on ``cluster``'s GPUs at full memory, simulated and planned
    (:func:`poplar.compare.evaluate.evaluate`)."""
    from poplar.compare.evaluate import evaluate
    from poplar.precision import fastest
    from poplar.profile.options import ProfileOptions

    spec = load_cluster(cluster)
    spec = spec.model_copy(update={"memory_scale": 1.0})
    precision = fastest(lambda p: all(g.computes(p) for g in spec.devices))
    workload = real_workload(model)
    evaluation, result = evaluate(workload, spec, REAL_BATCH, ProfileOptions(precision=precision))
    peaks = {k: d.rated_tflops or 0.0 for k, d in result.profile.devices.items()}
    counts = {k: result.profile.ranks.count(k) for k in peaks}
    return RealSize(evaluation.model_copy(update={"cluster": f"{spec.describe()}; {precision}"}), peaks, counts,
                    result.profile.model.seq_len)


def real_size_table(real: RealSize) -> Table:
    """Each plan's model TFLOP/s (three times a sample's forward FLOPs a sample) and MFU (of the peaks of the GPUs
    it runs on)."""
    evaluation, peaks, counts, seq_len = real
    per_sample = evaluation.tflops / evaluation.samples_per_s     # model TFLOP a sample
    table = Table(title=f"{evaluation.model} ({seq_len}-token samples, checkpointed), global batch "
                        f"{REAL_BATCH}, on {evaluation.cluster} at full memory: simulated")
    for col in ("plan", "samples/s", "model TFLOP/s", "MFU", "Poplar's speedup"):
        table.add_column(col, justify="right", overflow="fold")
    everyone = sum(peaks[k] * counts[k] for k in peaks)
    rows = [(f"Poplar ({evaluation.label})", evaluation.samples_per_s,
             sum(peaks[k.kind] * k.ranks for k in evaluation.kinds))]     # the GPUs its plan runs on
    rows += [(name, evaluation.baselines.get(name), everyone) for name in ("uniform", "proportional")]
    rows += [(f"{a.kind} alone", a.samples_per_s, peaks[a.kind] * counts[a.kind]) for a in evaluation.alone]
    for name, samples, peak in rows:
        if not samples:
            table.add_row(name, "no plan", "-", "-", "-")
            continue
        tflops = samples * per_sample
        table.add_row(name, f"{samples:,.2f}", f"{tflops:,.1f}", f"{100 * tflops / peak:.0f}%" if peak else "-",
                      f"{evaluation.samples_per_s / samples:.2f}x")
    return table

