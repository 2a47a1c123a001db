"""fp16 against fp32 on cards whose fp16 is their tensor cores' (V100, T4): the speed-up, profiled and trained.

For each precision, on one emulated cluster, in one run: profile the model (or read the
cache), plan the global batch, and train Poplar's plan and the uniform split side by
side (``poplar bench``'s measurement, :func:`poplar.bench.bench_cluster`). Printed: each
kind's time per sample at its largest micro-batch in stage 0 (compute-bound: the ratio
there is the one to hold against the cards' tensor-core ratio, fp16 over fp32 peak), and
the trained plans' samples/s with their fp16 / fp32 ratios.

    python bench/bench_precision.py --cluster compute-differs --model llama-small --seq-len 128 --global-batch 64
    python bench/bench_precision.py --simulate --cluster bench/clusters/compute-differs-x0.25.yaml \
        --model llama-125m --seq-len 256 --global-batch 32

``--simulate``: the time per sample from the simulator's profile (the emulated profiler's
figures, tests/simulate) and nothing trained: a model large enough to be compute-bound
takes longer to profile for real on a CPU than a launch may run.
"""

from __future__ import annotations

import argparse

from poplar.bench import bench_cluster
from poplar.cluster.spec import load_cluster
from poplar.profile.profiler import profile_cluster
from poplar.workload import Workload

PRECISIONS = ("fp32", "fp16")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", default="compute-differs")
    parser.add_argument("--model", default="llama-small")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--simulate", action="store_true", help="per-sample times from the simulated profile only")
    args = parser.parse_args()
    wl = Workload(model=args.model, seq_len=args.seq_len)
    spec = load_cluster(args.cluster)
    per_sample, runs = {}, {}
    for p in PRECISIONS:
        profile = _profile(wl, spec, p, min(256, args.global_batch), args.simulate)
        for kind in spec.devices:
            stage = profile.stage(kind.kind, 0)
            per_sample[p, kind.kind] = (stage.time(stage.max_micro_batch) / stage.max_micro_batch,
                                        stage.max_micro_batch)
        if not args.simulate:
            runs[p] = bench_cluster(args.cluster, wl, args.global_batch, args.steps, peers=False, precision=p)
    print(f"{args.cluster}, {wl.name} ({args.seq_len} tokens), global batch {args.global_batch}")
    print(f"{'kind':<12} {'tensor-core ratio':>18} " + " ".join(f"{p + ' ms/sample (mb)':>24}" for p in PRECISIONS)
          + f" {'fp16 / fp32 speed':>18}")
    for kind in spec.devices:
        peak = kind.peak_tflops("fp16") / kind.peak_tflops("fp32")
        cells = " ".join(f"{1e3 * per_sample[p, kind.kind][0]:>17.4f} ({per_sample[p, kind.kind][1]:>4})"
                         for p in PRECISIONS)
        print(f"{kind.kind:<12} {peak:>18.2f} {cells} {per_sample['fp32', kind.kind][0] / per_sample['fp16', kind.kind][0]:>18.2f}")
    if args.simulate:
        return
    print(f"{'allocation':<12} " + " ".join(f"{p + ' samples/s (ZeRO)':>24}" for p in PRECISIONS)
          + f" {'fp16 / fp32':>12} {'overruns':>9}")
    for name in ("poplar", "uniform"):
        rows = [runs[p]["allocations"][name] for p in PRECISIONS]
        if any("samples_per_s" not in r for r in rows):
            print(f"{name:<12} (no measurement: {[r.get('failed') for r in rows]})")
            continue
        cells = " ".join(f"{r['samples_per_s']:>17,.0f} ({runs[p]['zero_stage']})" for p, r in zip(PRECISIONS, rows))
        print(f"{name:<12} {cells:>49} {rows[1]['samples_per_s'] / rows[0]['samples_per_s']:>12.2f} "
              f"{sum(r['overruns'] for r in rows):>9}")


def _profile(wl, spec, precision: str, largest: int, simulate: bool):
    """The cluster's profile in ``precision``: simulated (stage 0), or measured (every stage, as the bench plans)."""
    if simulate:
        from poplar.profile.options import ProfileOptions
        from poplar.simulate import simulate_profile

        return simulate_profile(wl, spec, ProfileOptions(stages=(0,), max_micro_batch=largest, precision=precision))
    return profile_cluster(wl, spec, stages=(0, 1, 2, 3), precision=precision, max_micro_batch=largest)[0]


if __name__ == "__main__":
    main()
