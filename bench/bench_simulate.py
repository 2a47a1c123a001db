"""The simulator against the emulator: the simulated profile beside the profiler's, and the plan it chooses measured.

For each cluster: profile the model on the emulated ranks (or read the cache), simulate
the same profile (poplar.simulate: fake tensors, no ranks), and compare per device kind
and stage the largest micro-batch, the state bytes, the time curve at every measured
size and the once-per-step part; then plan the global batch on the simulated profile
and train that plan on the emulated cluster: its simulated throughput against the
measured one.

    python bench/bench_simulate.py --clusters two-node-10gbe --model tiny --global-batch 256
    python bench/bench_simulate.py --clusters memory-bound --model llama-tiny --seq-len 64 --vocab-size 1024 --global-batch 32
"""

from __future__ import annotations

import argparse
import time

from poplar.cluster.spec import load_cluster, presets
from poplar.compare.measure import measure_plans
from poplar.planner import make_plan
from poplar.profile.options import ProfileOptions
from poplar.profile.profiler import profile_cluster
from poplar.simulate import simulate_profile
from poplar.stages import parse_stages
from poplar.models.workload import as_workload


def compare(measured, simulated) -> dict:
    """The largest differences between two profiles of one cluster, over its kinds and stages."""
    worst = {"max_micro_batch": 0, "curve": 0.0, "per_step": 0.0, "state_bytes": 0}
    for kind, device in measured.devices.items():
        for stage, m in device.stages.items():
            if not m.points:   # not timed: a kind beside it did not fit (the simulator times it all the same)
                continue
            s = simulated.stage(kind, stage)
            worst["max_micro_batch"] = max(worst["max_micro_batch"], abs(s.max_micro_batch - m.max_micro_batch))
            worst["state_bytes"] = max(worst["state_bytes"], abs(s.state_bytes - m.state_bytes))
            for size, seconds in m.points:
                worst["curve"] = max(worst["curve"], abs(s.time(size) / seconds - 1))
            if m.per_step_s:
                worst["per_step"] = max(worst["per_step"], abs(s.per_step_s / m.per_step_s - 1))
    return worst


def bench_cluster(name: str, workload: dict, global_batch: int, stages, steps: int) -> dict:
    wl, spec = as_workload(workload), load_cluster(name)
    options = ProfileOptions(stages=stages)
    start = time.perf_counter()
    measured, _ = profile_cluster(wl, spec.model_dump(), options)
    profiled_s = time.perf_counter() - start
    start = time.perf_counter()
    simulated = simulate_profile(wl, spec, options)
    simulated_s = time.perf_counter() - start
    result = make_plan(simulated, global_batch, stages)
    [figures] = measure_plans(wl, spec.model_dump(), [result.plan], steps=steps, rounds=1, warmup=1)
    return {"cluster": name, **compare(measured, simulated), "simulated_s": simulated_s, "profiled_s": profiled_s,
            "plan": str(result.plan), "predicted": result.predicted.samples_per_s,
            "measured": figures["samples_per_s"], "overruns": figures["overruns"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clusters", default=",".join(presets()), help="comma-separated presets or YAML files")
    p.add_argument("--model", default="tiny")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sample (default: the model's)")
    p.add_argument("--vocab-size", type=int, default=None, help="vocabulary (default: the model's)")
    p.add_argument("--global-batch", type=int, default=256)
    p.add_argument("--stages", default="0,1,2,3")
    p.add_argument("--steps", type=int, default=4, help="measured steps of the chosen plan")
    args = p.parse_args()
    workload = {"model": args.model, "seq_len": args.seq_len, "vocab_size": args.vocab_size}
    rows = [bench_cluster(c.strip(), workload, args.global_batch, parse_stages(args.stages), args.steps)
            for c in args.clusters.split(",") if c.strip()]
    print(f"{'cluster':<22} {'max mb':>6} {'curve':>7} {'per-step':>8} {'states':>6} {'sim s':>6} {'prof s':>6} "
          f"{'predicted':>10} {'measured':>10} {'error':>7}  plan")
    for r in rows:
        print(f"{r['cluster']:<22} {r['max_micro_batch']:>6} {100 * r['curve']:>6.2f}% {100 * r['per_step']:>7.1f}% "
              f"{r['state_bytes']:>6} {r['simulated_s']:>6.0f} {r['profiled_s']:>6.0f} {r['predicted']:>10,.0f} "
              f"{r['measured']:>10,.0f} {100 * (r['predicted'] / r['measured'] - 1):>+6.1f}%  {r['plan']}"
              + (f" ({r['overruns']} overruns)" if r["overruns"] else ""))


if __name__ == "__main__":
    main()
