"""fp16 against fp32 on cards whose fp16 is their tensor cores' (V100, T4): the speed-up, profiled and trained.

For each precision, on one emulated cluster, in one run: profile the model (or read the
cache), plan the global batch, and train Poplar's plan and the uniform split side by
side (``poplar bench``'s measurement, :func:`poplar.compare.bench.bench_cluster`). Printed: each
kind's time per sample at its largest micro-batch in stage 0 (compute-bound: the ratio
there is the one to hold against the cards' tensor-core ratio, fp16 over fp32 peak); its fp32 /
fp16 step time at fractions of that micro-batch (a step's fixed part gains nothing); where
that time goes in one forward and backward at the fp32 run's largest micro-batch (the
matrix products, which run on the tensor cores, and the rest); and the trained plans'
samples/s with their fp16 / fp32 ratios.

    python bench/bench_precision.py --cluster bench/clusters/compute-differs-x0.05.yaml \
        --model bench/models/wide-llama --seq-len 32 --global-batch 128 --steps 3 --launch-timeout 5400
    python bench/bench_precision.py --simulate --cluster bench/clusters/compute-differs-x0.25.yaml \
        --model llama-125m --seq-len 256 --global-batch 32

``--simulate``: the time per sample from the simulator's profile (the emulated profiler's
figures, tests/simulate) and nothing trained.
"""

from __future__ import annotations

import argparse

from poplar.compare.bench import bench_cluster
from poplar.cluster.spec import load_cluster
from poplar.emulate.model import GpuModel, WorkCounter
from poplar.precision import torch_dtype
from poplar.profile.profiler import profile_cluster
from poplar.models.workload import model_source

PRECISIONS = ("fp32", "fp16")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", default="compute-differs")
    parser.add_argument("--model", default="llama-small", help="a preset or a Hugging Face model directory")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--launch-timeout", type=float, default=900,
                        help="seconds each profiling or measuring launch may run (a compute-bound model's paced steps are long)")
    parser.add_argument("--simulate", action="store_true", help="per-sample times from the simulated profile only")
    args = parser.parse_args()
    wl = model_source(args.model, seq_len=args.seq_len)
    spec = load_cluster(args.cluster)
    stages, runs = {}, {}
    for p in PRECISIONS:
        profile = _profile(wl, spec, p, min(256, args.global_batch), args.simulate, args.launch_timeout)
        stages.update({(p, kind.kind): profile.stage(kind.kind, 0) for kind in spec.devices})
        if not args.simulate:
            runs[p] = bench_cluster(args.cluster, wl, args.global_batch, args.steps, peers=False, precision=p,
                                   timeout_s=args.launch_timeout).to_dict()
            print(f"{p}: " + ", ".join(f"{name} {row.get('samples_per_s', 0):,.0f} samples/s ({row.get('overruns')} "
                                       f"overruns)" for name, row in runs[p]["allocations"].items()), flush=True)
    print(f"{args.cluster}, {wl.name} ({args.seq_len} tokens), global batch {args.global_batch}")
    _print_per_sample(spec, stages)
    _print_by_micro_batch(spec, stages)
    _print_products(wl, spec, {k.kind: stages["fp32", k.kind].max_micro_batch for k in spec.devices})
    if not args.simulate:
        _print_trained(runs)


def _print_per_sample(spec, stages: dict) -> None:
    per_sample = {key: (st.time(st.max_micro_batch) / st.max_micro_batch, st.max_micro_batch)
                  for key, st in stages.items()}
    print(f"{'kind':<12} {'tensor-core ratio':>18} " + " ".join(f"{p + ' ms/sample (mb)':>24}" for p in PRECISIONS)
          + f" {'fp16 / fp32 speed':>18}")
    for kind in spec.devices:
        peak = kind.peak_tflops("fp16") / kind.peak_tflops("fp32")
        cells = " ".join(f"{1e3 * per_sample[p, kind.kind][0]:>17.4f} ({per_sample[p, kind.kind][1]:>4})"
                         for p in PRECISIONS)
        print(f"{kind.kind:<12} {peak:>18.2f} {cells} {per_sample['fp32', kind.kind][0] / per_sample['fp16', kind.kind][0]:>18.2f}")


def _print_by_micro_batch(spec, stages: dict) -> None:
    """Each kind's fp32 / fp16 step time at fractions of the largest micro-batch both fit: a step's fixed part
    (the fp32 update, the launches) is the same in both, so a smaller share gains less."""
    fractions = (0, 0.25, 0.5, 0.75, 1)
    print(f"{'kind':<12} fp32 / fp16 step time at micro-batch")
    for kind in spec.devices:
        f32, f16 = stages["fp32", kind.kind], stages["fp16", kind.kind]
        top = min(f32.max_micro_batch, f16.max_micro_batch)
        sizes = sorted({max(1, round(f * top)) for f in fractions})
        print(f"{kind.kind:<12} " + "  ".join(f"{m}: {f32.time(m) / f16.time(m):.2f}" for m in sizes))


class _Split(WorkCounter):
    """The modelled seconds of the operators that count FLOPs (matrix products, attention) and of the rest."""

    def __init__(self, gpu: GpuModel):
        super().__init__(gpu)
        self.products = 0.0

    def count(self, func, flops, nbytes, dtype) -> float:
        seconds = super().count(func, flops, nbytes, dtype)
        self.products += seconds if flops else 0.0
        return seconds


def _print_products(wl, spec, micro_batch: dict) -> None:
    """Where one forward and backward's modelled time goes, fp32 against fp16 (the model in that dtype)."""
    print(f"{'kind':<12} {'forward+backward at mb':>22} {'products fp32 / fp16':>21} {'the rest fp32 / fp16':>21}"
          f" {'products ratio':>15} {'rest ratio':>11} {'whole ratio':>12}")
    for kind in spec.devices:
        mb, split = micro_batch[kind.kind], {}
        for p in PRECISIONS:
            model = wl.build().to(torch_dtype(p))
            with _Split(GpuModel.of(kind)) as split[p]:
                wl.loss(model, wl.random_batch(mb)).backward()
        f32, f16 = split["fp32"], split["fp16"]
        rest = [s.seconds - s.products for s in (f32, f16)]
        print(f"{kind.kind:<12} {mb:>22} {1e3 * f32.products:>10.3f} / {1e3 * f16.products:>.3f} ms"
              f" {1e3 * rest[0]:>10.3f} / {1e3 * rest[1]:>.3f} ms {f32.products / f16.products:>15.2f}"
              f" {rest[0] / rest[1]:>11.2f} {f32.seconds / f16.seconds:>12.2f}")


def _print_trained(runs: dict) -> None:
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


def _profile(wl, spec, precision: str, largest: int, simulate: bool, timeout_s: float):
    """The cluster's profile in ``precision``: simulated (stage 0), or measured (every stage, as the bench plans)."""
    if simulate:
        from poplar.profile.options import ProfileOptions
        from poplar.simulate import simulate_profile

        return simulate_profile(wl, spec, ProfileOptions(stages=(0,), max_micro_batch=largest, precision=precision))
    return profile_cluster(wl, spec, stages=(0, 1, 2, 3), precision=precision, max_micro_batch=largest,
                           timeout_s=timeout_s)[0]


if __name__ == "__main__":
    main()
