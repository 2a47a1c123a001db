"""Does the cost model match reality? Predicted vs measured step time on the emulated presets.

For each cluster preset: profile the model (or reuse the cache), plan the global batch,
then train with the chosen plan, with Poplar's plan of every other stage (on several
nodes: flat and shaped to the nodes), and with the baselines, all in one launch of the
cluster, and print predicted and measured step times side by side.

    python bench/bench_plan.py                       # all four presets, global batch 128
    python bench/bench_plan.py --presets both-differ --global-batch 256 --json out.json
"""

from __future__ import annotations

import argparse
import json
import time

from rich.console import Console
from rich.table import Table

from poplar.compare.bench import plan_and_measure
from poplar.cluster.spec import presets
from poplar.stages import parse_stages
from poplar.models.workload import as_workload


def bench_preset(name: str, model: str, global_batch: int, steps: int, rounds: int, use_cache: bool,
                 all_stages: bool, every_allocation: bool = False, warmup: int = 2, timeout_s: float = 900,
                 stages=(0, 1, 2, 3)) -> list[dict]:
    def pick(result):   # every allocation of the chosen stage plan, and Poplar's plan of the others (or all of theirs)
        return [(sp, n) for sp in [*result.stages.values(), *result.shaped.values()] if not sp.excluded
                for n in sp.allocations
                if sp is result.chosen or (all_stages and (every_allocation or n == "poplar"))]

    result, measured = plan_and_measure(name, as_workload(model), global_batch, pick, steps, rounds, use_cache,
                                        warmup, timeout_s, stages)
    return [{"preset": name, "stage": sp.label.removeprefix("stage "), "allocation": alloc.name,
             "chosen": sp is result.chosen and alloc.name == "poplar",
             "plan": str(alloc.plan), "predicted_step_s": alloc.predicted.step_s,
             "predicted_samples_per_s": alloc.predicted.samples_per_s,
             "ideal_samples_per_s": sp.ideal_samples_per_s,
             "measured_step_s": m["step_s"], "measured_samples_per_s": m["samples_per_s"],
             "error": alloc.predicted.step_s / m["step_s"] - 1, "overruns": m["overruns"]} for sp, alloc, m in measured]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", default=",".join(presets()), help="comma-separated cluster presets or YAML files")
    p.add_argument("--model", default="tiny")
    p.add_argument("--global-batch", type=int, default=128)
    p.add_argument("--steps", type=int, default=12, help="measured steps per plan")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds the steps are spread over")
    p.add_argument("--no-cache", action="store_true", help="profile again")
    p.add_argument("--chosen-stage-only", action="store_true", help="skip Poplar's plans of the other stages")
    p.add_argument("--every-allocation", action="store_true", help="every allocation of every stage, not only "
                   "Poplar's plan of the stages not chosen")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured steps per plan")
    p.add_argument("--timeout", type=float, default=900, help="seconds the measuring launch may take")
    p.add_argument("--stages", default="0,1,2,3", help="ZeRO stages to profile and plan")
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args()
    console = Console(width=max(Console().width, 150))
    rows = []
    start = time.perf_counter()
    for name in [s.strip() for s in args.presets.split(",") if s.strip()]:
        rows += bench_preset(name, args.model, args.global_batch, args.steps, args.rounds, not args.no_cache,
                             not args.chosen_stage_only, args.every_allocation, args.warmup, args.timeout,
                             parse_stages(args.stages))
    table = Table(title=f"predicted vs measured step time, {args.model}, global batch {args.global_batch} "
                        f"({time.perf_counter() - start:.0f} s)")
    for col in ("preset", "stage", "allocation", "plan", "predicted ms", "measured ms", "error", "measured samples/s"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["preset"], f"{r['stage']}{'*' if r['chosen'] else ''}", r["allocation"],
                      r["plan"].split(": ", 1)[1].rstrip(")"), f"{1000 * r['predicted_step_s']:.1f}",
                      f"{1000 * r['measured_step_s']:.1f}", f"{100 * r['error']:+.1f}%",
                      f"{r['measured_samples_per_s']:.1f}")
    console.print(table)
    worst = max(abs(r["error"]) for r in rows)
    console.print(f"largest |error|: {100 * worst:.1f}% over {len(rows)} plans (* = the stage the planner chose); "
                  f"{sum(r['overruns'] for r in rows)} overruns (spans whose real work ran past their declared time)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
