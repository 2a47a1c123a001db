"""`poplar bench`: Poplar's allocation against the baselines, measured side by side in one run.

Per cluster: profile the model (or reuse the cache), plan the global batch, then train
Poplar's plan and the ``uniform`` and ``proportional`` allocations of the same stage in
one launch of the cluster, in alternating rounds (so a drift of the shared host falls
on all three alike), and report measured samples/s and tokens/s, the ratios, and the
share of the planner's ideal bound (every device at its own best, nobody waiting).
"""

from __future__ import annotations

from poplar.emulate import load_cluster, presets
from poplar.measure import measure_plans
from poplar.planner import make_plan
from poplar.profile.profiler import profile_cluster
from poplar.workload import Workload

ALLOCATIONS = ("poplar", "uniform", "proportional")


def plan_and_measure(cluster: str, workload: Workload, global_batch: int, pick, steps: int = 12, rounds: int = 3,
                     use_cache: bool = True):
    """Profile (or read the cache), plan, and measure the ``(stage, allocation)`` pairs ``pick(result)`` names.

    All of them in one launch of the cluster, in alternating rounds. Returns the
    planning result and ``(stage, allocation, measured)`` per pair that has a plan.
    """
    spec = load_cluster(cluster)
    profile, _ = profile_cluster(workload, spec.model_dump(), use_cache=use_cache,
                                 max_micro_batch=min(256, global_batch))
    result = make_plan(profile, global_batch)
    pairs = [(s, result.stages[s].allocations[n]) for s, n in pick(result)
             if result.stages[s].allocations[n].plan is not None]
    measured = measure_plans(workload, spec.model_dump(), [a.plan for _, a in pairs], steps=steps, rounds=rounds)
    return result, [(s, a, m) for (s, a), m in zip(pairs, measured)]


def bench_cluster(cluster: str, workload: Workload, global_batch: int, steps: int = 12, rounds: int = 3,
                  use_cache: bool = True) -> dict:
    result, measured = plan_and_measure(cluster, workload, global_batch,
                                        lambda r: [(r.stage, n) for n in ALLOCATIONS], steps, rounds, use_cache)
    stage = result.stages[result.stage]
    rows = {}
    for _, alloc, m in measured:
        rows[alloc.name] = {"plan": alloc.plan.to_dict(), "predicted_samples_per_s": alloc.predicted.samples_per_s,
                            "samples_per_s": m["samples_per_s"],
                            "tokens_per_s": m["samples_per_s"] * workload.seq_len,
                            "step_s": m["step_s"], "busy_s": m["busy_s"]}
    ideal = stage.ideal_samples_per_s
    out = {"cluster": cluster, "model": workload.model, "seq_len": workload.seq_len, "global_batch": global_batch,
           "zero_stage": result.stage, "reason": result.reason, "ideal_samples_per_s": ideal,
           "ideal_tokens_per_s": ideal * workload.seq_len, "allocations": rows}
    pop = rows["poplar"]["samples_per_s"]
    out["poplar_vs_uniform"] = pop / rows["uniform"]["samples_per_s"] if "uniform" in rows else None
    out["poplar_vs_proportional"] = pop / rows["proportional"]["samples_per_s"] if "proportional" in rows else None
    out["poplar_of_ideal"] = pop / ideal
    return out


def clusters(arg: str) -> list[str]:
    """``all``: every preset; otherwise comma-separated presets or YAML files."""
    return presets() if arg == "all" else [c.strip() for c in arg.split(",") if c.strip()]
