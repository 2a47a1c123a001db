"""A profile measured with the engine's options it will train with: the planner's prediction against training.

For each set of engine options (the defaults, then fewer reductions in flight and no
ZeRO-3 prefetch): profile the model on the emulated cluster with them (the profile
records them: ``Profile.engine``), plan the global batch in one stage, and train that
plan with the same options on the same cluster (``poplar.compare.measure``, as ``poplar bench``
and ``poplar train`` run it). Printed side by side: the plan's predicted step, the
measured one, their ratio, and the other options' profile's prediction of the same plan
(what a profile that did not record the options would have predicted).

    python bench/bench_engine_options.py --cluster both-differ --model tiny --global-batch 64 --stage 3
"""

from __future__ import annotations

import argparse

from poplar.cluster.spec import load_cluster
from poplar.engine.config import EngineConfig
from poplar.compare.measure import measure_plans
from poplar.planner import make_plan
from poplar.planner.cost import CostModel
from poplar.profile.options import ProfileOptions
from poplar.profile.profiler import profile_cluster
from poplar.models.workload import as_workload

OPTIONS = {"defaults": EngineConfig(), "1 in flight, no prefetch": EngineConfig(max_inflight_reduces=1, prefetch=False)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", default="both-differ")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    wl, spec = as_workload(args.model), load_cluster(args.cluster)
    options = ProfileOptions(stages=(args.stage,), max_micro_batch=min(256, args.global_batch))
    profiles = {name: profile_cluster(wl, spec, options, config=config)[0] for name, config in OPTIONS.items()}
    print(f"{args.cluster}, {args.model}, global batch {args.global_batch}, ZeRO-{args.stage}")
    print(f"{'engine options':<26} {'recorded':<64} {'predicted ms':>12} {'measured ms':>12} {'error':>8} "
          f"{'other profile':>14}")
    for name, config in OPTIONS.items():
        profile = profiles[name]
        plan = make_plan(profile, args.global_batch, [args.stage]).plan
        measured = measure_plans(wl, spec.model_dump(), [plan], steps=args.steps, config=config)[0]
        predicted = CostModel(profile, args.stage).predict(plan).step_s
        other = next(p for n, p in profiles.items() if n != name)
        crossed = CostModel(other, args.stage).predict(plan).step_s
        recorded = ", ".join(f"{k}={v}" for k, v in profile.engine.model_dump().items())
        print(f"{name:<26} {recorded:<64} {1e3 * predicted:>12.3f} {1e3 * measured['step_s']:>12.3f} "
              f"{100 * (predicted / measured['step_s'] - 1):>+7.1f}% {1e3 * crossed:>11.3f} ms"
              f"  (overruns {measured['overruns']})")


if __name__ == "__main__":
    main()
