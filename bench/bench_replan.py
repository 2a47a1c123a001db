"""A device that slows mid-run: the static plan, re-planning while training, and a fresh plan of the slowed cluster.

    python bench/bench_replan.py                        # compute-differs (V100 + T4), the T4 at 60% from step 5
    python bench/bench_replan.py --rank 0 --factor 0.5 --steps 40
    python bench/bench_replan.py --cluster bench/clusters/older-card-1.yaml --rank 0 --factor 0.5   # issue 65's pair

Three runs of ``poplar train`` on the emulated cluster, one after the other, in stage 0
at 256 tokens a sample (where both cards take part):

- static: ``replan: off``; ``POPLAR_FAULT=slow@step`` slows rank ``--rank`` to ``--factor``
  of its speed from step 5, and the plan stays what the profile said;
- re-plan: the same fault, ``replan: auto`` (its defaults): the run measures the slowdown
  and plans again at a step boundary;
- fresh: the slowed cluster as a cluster file of its own (the card declared at the factor
  of its figures), profiled (the simulator's profile: the measured one to the declared
  model's precision, tests/simulate), planned and trained with no fault (on the ranks the
  planner keeps).

Each prints its median samples/s over the steps after the slowdown (the re-plan's: after
its change), the ranks each plan takes (a re-plan may change who takes part: the run is
started again on them from a checkpoint) and the ratios, and how far the re-planned run's
parameters are from the static run's (which never re-planned). The first run profiles the
cluster (minutes; cached after).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SLOW_AT = 5
FIELDS = dict(model="llama-tiny", seq_len=256, vocab_size=1024, global_batch=32, lr=3e-3, stages=[0])


def _run(fields: dict, fault: str | None) -> tuple[list[dict], dict]:
    """The run's log and its result (with its full parameters)."""
    from poplar.train.config import load_config
    from poplar.train.report import read_log
    from poplar.train.run import run_training

    os.environ.pop("POPLAR_FAULT", None)
    if fault:
        os.environ["POPLAR_FAULT"] = fault
    try:
        result = run_training(load_config(None, fields), return_state=True)
    finally:
        os.environ.pop("POPLAR_FAULT", None)
    return read_log(Path(fields["out"]) / "log.jsonl"), result


def _apart(a: dict, b: dict) -> float:
    """The largest difference between two runs' parameters."""
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def _median_after(records: list[dict], step: int) -> float:
    """Median samples/s over the steps after ``step`` (from 1), those an emulated host ran late left out."""
    kept = [r["samples_per_s"] for r in records if r["step"] + 1 > step and not r["overruns"]]
    return statistics.median(kept) if kept else float("nan")


def _fresh_plan(cluster_path: Path, out: Path):
    """The simulator's profile of the slowed cluster, planned as `poplar train` plans."""
    from poplar.cluster.spec import load_cluster
    from poplar.planner import make_plan
    from poplar.profile.options import ProfileOptions
    from poplar.simulate import simulate_profile
    from poplar.train.config import load_config
    from poplar.train.dataset import prepare_data, workload_of

    cfg = load_config(None, {**FIELDS, "cluster": str(cluster_path), "out": str(out)})
    options = ProfileOptions(stages=(0,), max_micro_batch=FIELDS["global_batch"], precision=cfg.engine.mixed_precision)
    profile = simulate_profile(workload_of(cfg.model_data, prepare_data(cfg.model_data)), load_cluster(cluster_path), options,
                               cfg.engine.model_copy(update={"mixed_precision": options.precision}))
    return make_plan(profile, FIELDS["global_batch"], [0])


def main() -> None:
    from poplar.cluster.spec import load_cluster

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cluster", default="compute-differs")
    ap.add_argument("--rank", type=int, default=1)
    ap.add_argument("--factor", type=float, default=0.6)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--dilation", type=float, default=300.0, help="the emulated pace (wall seconds a declared "
                    "second): large enough that the real work fits its spans (steps that overran are left out)")
    args = ap.parse_args()
    os.environ["POPLAR_DILATION"] = str(args.dilation)
    fault = f"slow@step:rank={args.rank}:step={SLOW_AT}:to={args.factor}"
    spec = load_cluster(args.cluster)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        base = {**FIELDS, "cluster": args.cluster, "steps": args.steps}
        static, kept = _run({**base, "replan": "off", "out": str(tmp / "static")}, fault)
        adaptive, replanned = _run({**base, "out": str(tmp / "replan")}, fault)
        changes = [r for r in adaptive if "replan" in r]
        after = changes[0]["step"] + 2 if changes else SLOW_AT    # from the step after the first under the new plan
        slowed = spec.slowed(args.rank, args.factor)
        (tmp / "slowed.yaml").write_text(slowed.to_yaml())
        result = _fresh_plan(tmp / "slowed.yaml", tmp / "fresh")
        (tmp / "fresh.yaml").write_text(slowed.subset(list(result.ranks)).to_yaml())   # the ranks it keeps
        result.plan.save(tmp / "fresh-plan.json")
        fresh, _ = _run({**base, "cluster": str(tmp / "fresh.yaml"), "plan": str(tmp / "fresh-plan.json"),
                         "out": str(tmp / "fresh")}, None)
    s, a, f = _median_after(static, SLOW_AT), _median_after(adaptive, after), _median_after(fresh, 1)
    print(f"\n{args.cluster}, rank {args.rank} at {args.factor:g} of its speed from step {SLOW_AT}, {args.steps} steps")
    print(f"  static plan on rank {_listed(kept['planning'].ranks)} ({kept['plan']}): {s:,.0f} samples/s after the "
          "slowdown")
    for r in changes:
        moved = r["replan"].get("ranks")
        where = f"; ranks {_listed(moved['before'])} -> {_listed(moved['after'])}" if moved else ""
        print(f"  re-planned after step {r['replan']['after_step']}: {r['replan']['why']}{where}")
    print(f"  re-plan ({replanned['plan']}): {a:,.0f} samples/s from step {after + 1}")
    print(f"  fresh profile + plan of the slowed cluster (rank {_listed(result.ranks)}: {result.plan}): "
          f"{f:,.0f} samples/s")
    print(f"  re-plan / fresh = {a / f:.3f}   static / fresh = {s / f:.3f}   re-plan / static = {a / s:.3f}")
    print(f"  parameters after {args.steps} steps, re-plan against static (never re-planned): largest difference "
          f"{_apart(replanned['state'], kept['state']):.2e}")


def _listed(ranks) -> str:
    return ", ".join(map(str, ranks))


if __name__ == "__main__":
    main()
