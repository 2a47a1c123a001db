#!/usr/bin/env python
"""How long automatic planning takes in each integration: a small module of the user's own, profiled, planned
and trained on an emulated pair from the cluster alone.

The module is a 6-17-9-2 MLP on random features (``tests/integrations/pace_workers.py``), the cluster
``bench/clusters/both-differ-0.01.yaml`` (A800-80GB beside V100S-32GB, memory x0.01), the global batch 48,
3 steps; each front end as its users write it:

    lightning   Trainer(strategy=PoplarStrategy(cluster=..., global_batch=48)).fit(module, loader)
    hf          PoplarTrainer(model=..., args=..., train_dataset=..., cluster=...).train()
    deepspeed   poplar.initialize(model, optimizer, config={"train_batch_size": 48, "poplar": {"cluster": ...}},
                                  training_data=..., loss=...), then DeepSpeed's loop

No pace is fixed (``POPLAR_DILATION`` is cleared): every emulated rank chooses its own from a probe of the
module. Each front end runs on a fresh profile cache (it profiles every ZeRO stage), one after another.
Printed per front end: the wall time of the whole fit on rank 0 (from building the strategy, trainer or
engine to the last step: profile, plan and training), the launch's wall time (processes started and the
framework imported too), the time dilation D the profiler's ranks and then the trainer's chose, the plan,
and the largest difference of its parameters from one device's training on the same global batches.

    flock -x /tmp/poplar-cpu.lock python bench/bench_integration_planning.py
    python bench/bench_integration_planning.py --systems lightning --json runs/planning.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from poplar.processes.spawn import spawn  # noqa: E402
from tests.integrations.pace_workers import PAIR, deepspeed_fit, hf_fit, lightning_fit, reference  # noqa: E402

SYSTEMS = ("lightning", "hf", "deepspeed")


def run(system: str, scratch: Path, cluster: str) -> dict:
    """One front end on a fresh profile cache: its figures."""
    os.environ["POPLAR_CACHE_DIR"] = str(scratch / f"{system}-profiles")
    args = {"lightning": (lightning_fit, (cluster,)), "hf": (hf_fit, (str(scratch / "hf-out"), cluster)),
            "deepspeed": (deepspeed_fit, (cluster,))}[system]
    start = time.monotonic()
    ranks = spawn(args[0], 2, *args[1], timeout_s=1200)
    launch_s = time.monotonic() - start
    want = reference()
    diff = max(float((ranks[0]["state"][k] - v).abs().max()) for k, v in want.items())
    profiled = max(r["probes"][0]["dilation"] for r in ranks)     # the profiler's devices start first
    return {"system": system, "fit_s": round(ranks[0]["wall_s"], 1), "launch_s": round(launch_s, 1),
            "profile_dilation": round(profiled, 1), "dilation": round(ranks[0]["dilation"], 1),
            "plan": ranks[0]["plan"], "max_param_diff": diff}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, of {', '.join(SYSTEMS)}")
    ap.add_argument("--cluster", default=PAIR, help="a two-card cluster file or preset")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown:
        ap.error(f"unknown system {unknown[0]!r}: choose from {', '.join(SYSTEMS)}")
    os.environ.pop("POPLAR_DILATION", None)
    rows = []
    with tempfile.TemporaryDirectory(prefix="poplar-planning-") as scratch:
        for system in systems:
            row = run(system, Path(scratch), args.cluster)
            rows.append(row)
            plan = row["plan"]
            print(f"{system:<10} fit {row['fit_s']:5.1f} s  launch {row['launch_s']:5.1f} s  "
                  f"D {row['profile_dilation']:.0f} profiling, {row['dilation']:.0f} training  "
                  f"stage {plan['zero_stage']} micro-batches "
                  f"{plan['micro_batch_sizes']} x {plan['accum_steps']}  max |param - one device| "
                  f"{row['max_param_diff']:.1e}", flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
