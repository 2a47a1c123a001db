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

Each is a :class:`~poplar.compare.comparison.Comparison`, saved in the demo's ``demo.json`` (:func:`write_record`);
the command (:mod:`poplar.cli.demo`) draws the tables.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from poplar.cluster.spec import load_cluster
from poplar.compare.comparison import Comparison, Contender, Measured, planned
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


def run_demo(steps: int, cluster: str, out: str | Path, global_batch: int, console,
             progress: Callable[[str], object] | None = None) -> tuple[Comparison, Path]:
    """Profile, plan and train each allocation and each kind alone, saying each on ``console`` (a rich console,
    or anything with its ``print``); ``progress(title)``: a context reporting a wait. The comparison (measured
    figures, written to ``out``/demo.json) and the plot of every run."""
    check_demo(cluster, out, global_batch, None)
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
        rows.append(planned(result.allocations()[name], plan=run["plan"], measured=_measured(logs[name])))
        console.print(f"  {run['plan']}", markup=False, highlight=False)
    for kind, ranks, stage_plan in alone_plans(result, global_batch):
        name = f"{kind} alone"
        if stage_plan.excluded:
            rows.append(Contender(name, kind=kind, ranks=len(ranks), label=stage_plan.label, why_not=stage_plan.excluded))
            continue
        plan = stage_plan.poplar.plan
        console.print(f"[bold]{name}[/]: training {steps} steps on {plan}", highlight=False)
        logs[name] = read_log(_train_alone(base, cluster, ranks, plan, out / f"{kind}-alone"))
        rows.append(planned(stage_plan.poplar, name=name, kind=kind, ranks=len(ranks), label=stage_plan.label,
                            measured=_measured(logs[name])))
    spec = load_cluster(cluster)
    comparison = Comparison(model=WORKLOAD["model"], cluster=cluster, world_size=spec.world_size,
                            seq_len=WORKLOAD["seq_len"], global_batch=global_batch, zero_stage=result.stage,
                            shape=result.plan.shape, label=result.chosen.label, reason=result.reason,
                            ideal_samples_per_s=result.ideal_samples_per_s, allocations=tuple(rows))
    plot = plot_runs(logs, out / "comparison.png", title=f"llama-tiny on {cluster}")
    write_record(out, comparison)
    return comparison, plot


def _measured(log: list[dict]) -> Measured:
    """A run's figures (:func:`~poplar.train.report.summarize`) and its emulated devices' overruns."""
    summary = summarize(log)
    return Measured(summary["samples_per_s"], summary["step_s"], summary["busy_s"],
                    sum(r.get("overruns", 0) for r in log), idle_s=summary["idle_s"],
                    first_loss=summary["first_loss"], last_loss=summary["last_loss"])


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


def write_record(out: str | Path, comparison: Comparison, real: Comparison | None = None) -> Path:
    """``out``/demo.json: the comparison (:meth:`~poplar.compare.comparison.Comparison.to_dict`), its contenders
    also as the list of rows the demo has always written, and the real-size one where there is one."""
    record = comparison.to_dict()
    record["rows"] = [{"name": name, **row} for name, row in record["allocations"].items()]
    if real is not None:
        record["real"] = real.to_dict()
    path = Path(out) / "demo.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path


def real_size(cluster: str, model: str = REAL_MODEL) -> Comparison:
    """``model`` (:func:`real_workload`) on ``cluster``'s GPUs at full memory, simulated and planned
    (:func:`poplar.compare.evaluate.evaluate`; each contender's ``peak_tflops`` gives its MFU)."""
    from poplar.compare.evaluate import evaluate
    from poplar.precision import fastest
    from poplar.profile.options import ProfileOptions

    spec = load_cluster(cluster)
    spec = spec.model_copy(update={"memory_scale": 1.0})
    precision = fastest(lambda p: all(g.computes(p) for g in spec.devices))
    comparison, _ = evaluate(real_workload(model), spec, REAL_BATCH, ProfileOptions(precision=precision))
    return dataclasses.replace(comparison, cluster=f"{spec.describe()}; {precision}")
