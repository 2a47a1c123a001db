"""Flat against shaped collectives, measured side by side on an emulated multi-node cluster.

Profiles the model on the cluster (or reads the cache) and plans it: every ZeRO stage
flat (each collective one ring over all ranks) and shaped to the nodes (hybrid sharding
in stages 1-3, the two-level all-reduce in stage 0), each with its own allocation. Then
trains Poplar's plan of every stage and shape in one launch of the cluster, in
alternating rounds, and prints each one's predicted and measured step time, and the
planner's choice against flat ZeRO-0 and flat ZeRO-3.

    python bench/bench_shape.py --cluster two-node-10gbe --model llama-tiny --global-batch 256
    python bench/bench_shape.py --cluster two-node-100g --model llama-tiny --global-batch 256
"""

from __future__ import annotations

import argparse
import json
import time

from rich.console import Console
from rich.table import Table

from poplar.compare.bench import plan_and_measure
from poplar.cluster.spec import load_cluster
from poplar.stages import parse_stages
from poplar.models.workload import as_workload


def bench(cluster: str, model: str, global_batch: int, steps: int, rounds: int, warmup: int,
          timeout_s: float, stages) -> tuple[str, list[dict]]:
    if len(load_cluster(cluster).node_groups()) < 2:
        raise SystemExit(f"{cluster} has one node: nothing to shape")

    def pick(result):
        return [(sp, "poplar") for sp in [*result.stages.values(), *result.shaped.values()] if not sp.excluded]

    result, measured = plan_and_measure(cluster, as_workload(model), global_batch, pick, steps, rounds,
                                        warmup=warmup, timeout_s=timeout_s, stages=stages)
    rows = [{"cluster": cluster, "stage": sp.stage, "shape": alloc.plan.shape, "chosen": sp is result.chosen,
             "plan": str(alloc.plan), "predicted_step_s": alloc.predicted.step_s, "step_s": m["step_s"],
             "samples_per_s": m["samples_per_s"], "error": alloc.predicted.step_s / m["step_s"] - 1,
             "overruns": m["overruns"]} for sp, alloc, m in measured]
    flat = {r["stage"]: r["step_s"] for r in rows if r["shape"] == "flat"}
    for r in rows:
        r["vs_flat_zero0"] = flat[0] / r["step_s"] if 0 in flat else None
        r["vs_flat_zero3"] = flat[3] / r["step_s"] if 3 in flat else None
    return result.reason, rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cluster", default="two-node-10gbe", help="a multi-node preset or YAML file")
    p.add_argument("--model", default="llama-tiny")
    p.add_argument("--global-batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=4, help="measured steps per plan")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--warmup", type=int, default=1, help="unmeasured steps per plan")
    p.add_argument("--stages", default="0,1,2,3", help="ZeRO stages to profile and plan")
    p.add_argument("--timeout", type=float, default=1800, help="seconds the measuring launch may take")
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args()
    start = time.perf_counter()
    reason, rows = bench(args.cluster, args.model, args.global_batch, args.steps, args.rounds, args.warmup,
                         args.timeout, parse_stages(args.stages))
    table = Table(title=f"{args.cluster}, {args.model}, global batch {args.global_batch}: Poplar's plan of each "
                        "stage and shape")
    for col in ("stage", "shape", "predicted ms", "measured ms", "error", "samples/s", "vs flat ZeRO-0",
                "vs flat ZeRO-3", "overruns"):
        table.add_column(col, justify="right")
    ratio = lambda x: "-" if x is None else f"{x:.2f}x"   # noqa: E731
    for r in rows:
        table.add_row(f"{r['stage']}{'*' if r['chosen'] else ''}", r["shape"], f"{1e3 * r['predicted_step_s']:.2f}",
                      f"{1e3 * r['step_s']:.2f}", f"{100 * r['error']:+.1f}%", f"{r['samples_per_s']:.1f}",
                      ratio(r["vs_flat_zero0"]), ratio(r["vs_flat_zero3"]), str(r["overruns"]))
    console = Console(width=max(Console().width, 150))
    console.print(table)
    console.print(f"planner's choice (*): {reason}", markup=False, highlight=False)
    best = min(rows, key=lambda r: r["step_s"])
    console.print(f"measured best: stage {best['stage']} {best['shape']}; {time.perf_counter() - start:.0f} s",
                  markup=False, highlight=False)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
