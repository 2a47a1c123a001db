"""The paper's evaluation, simulated: its three clusters at two sizes, Llama at three sizes and BERT-large.

Each cluster pairs two GPU kinds, each kind on nodes of its own (8 GPUs a node at most,
NVLink inside where the card has it, PCIe where not) joined by 100 Gb/s InfiniBand:
A100-80GB + A100-40GB, V100-16GB + T4-16GB, A800-80GB + V100S-32GB, with 4+4 and 16+16
GPUs. Every model trains in the engine's mixed precision (fp32 master weights and AdamW
moments): bf16 where both kinds have it, else fp16 (the V100s and T4 have no bf16; the
paper trained those clusters in fp16), Llama-7B and 13B with activation checkpointing,
on a 2M-token global batch (2^21 tokens: 1,024 Llama samples of 2,048, 4,096 BERT
samples of 512). For each: Poplar's plan (stage, shape, allocation) against
DeepSpeed-style uniform, Whale-style proportional and each kind alone (its own plan on
its own GPUs), as `poplar simulate` reports them (poplar.compare.evaluate).

    python bench/bench_paper.py --out docs/paper-eval.json
"""

from __future__ import annotations

import argparse
import json
import time

from poplar.cluster.spec import parse_cluster
from poplar.planner.planner import PlanningError
from poplar.precision import fastest
from poplar.profile.options import ProfileOptions
from poplar.compare.evaluate import evaluate
from poplar.models.workload import Workload

TOKENS = 2**21
NETWORK = {"inter_node": {"bandwidth_gbs": 12.5, "latency_us": 5}, "intra_node": {"bandwidth_gbs": 16, "latency_us": 10}}
NVLINK = {"A100-80GB": 300, "A100-40GB": 300, "A800-80GB": 200, "V100-16GB": 150}   # GB/s one way; PCIe cards: none
PAIRS = {"a100": ("A100-80GB", "A100-40GB"), "v100-t4": ("V100-16GB", "T4-16GB"), "a800-v100s": ("A800-80GB", "V100S-32GB")}
# tokens a sample; whether every layer keeps only its input (activation checkpointing, as every real run of a
# 7B or 13B model on 16-80 GB cards does: without it, no stage of the V100-16GB + T4-16GB cluster fits a sample)
MODELS = {"llama-1b": (2048, False), "llama-7b": (2048, True), "llama-13b": (2048, True), "bert-large": (512, False)}


def cluster(pair: str, each: int) -> dict:
    devices = []
    for gpu in PAIRS[pair]:
        d = {"kind": gpu.lower(), "gpu": gpu, "count": each, "gpus_per_node": min(each, 8)}
        if gpu in NVLINK:
            d["intra_node"] = {"bandwidth_gbs": NVLINK[gpu], "latency_us": 3}
        devices.append(d)
    return {"network": NETWORK, "devices": devices}


def table(rows: list[dict]) -> str:
    """The rows as the markdown table of docs/simulate.md: each plan's model TFLOP/s, and Poplar's over it."""
    lines = ["| cluster | GPUs | model | Poplar's plan | Poplar TFLOP/s | uniform | proportional | each kind alone "
             "| of ideal |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        head = f"| {' + '.join(PAIRS[r['pair']])} | {r['each']}+{r['each']} | {r['model']} {r.get('precision', '')} "
        if "no_plan" in r:
            lines.append(head + "| no plan: the model and a sample fit no stage | - | - | - | - | - |")
            continue
        per_sample = r["tflops"] / r["samples_per_s"]    # model TFLOP a sample, whichever plan runs it

        def other(samples: float | None) -> str:
            if not samples:
                return "no plan"
            return f"{samples * per_sample:,.1f} ({r['samples_per_s'] / samples:.2f}x)"
        alone = ", ".join(f"{a['kind']} {other(a['samples_per_s'])}" for a in r["alone"])
        lines.append(head + f"| {r['label']} | {r['tflops']:,.1f} | {other(r['baselines']['uniform'])} | "
                     f"{other(r['baselines']['proportional'])} | {alone} | "
                     f"{100 * r['samples_per_s'] / r['ideal_samples_per_s']:.1f}% |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", default=",".join(PAIRS))
    p.add_argument("--sizes", default="4,16", help="GPUs of each kind")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--out", default="paper-eval.json", help="the figures, written after every row")
    p.add_argument("--table", nargs="*", help="print these runs' figures (JSON files) as a markdown table, and stop")
    args = p.parse_args()
    if args.table:
        print(table([r for path in args.table for r in json.load(open(path))]))
        return
    rows = []
    for model in args.models.split(","):        # models outermost: one model's steps are counted once for all
        seq_len, checkpointed = MODELS[model]
        wl = Workload(model=model, seq_len=seq_len, activation_checkpointing=checkpointed)
        for each in map(int, args.sizes.split(",")):
            for pair in args.pairs.split(","):
                start = time.perf_counter()
                spec = parse_cluster(cluster(pair, each))
                options = ProfileOptions(precision=fastest(lambda p: all(g.computes(p) for g in spec.devices)))
                try:
                    try:   # the states fit not even all the devices together: refused before anything runs
                        spec.check_holds_states(wl.name, wl.n_params(), options.precision)
                    except ValueError as e:
                        raise PlanningError(str(e)) from e
                    ev, _ = evaluate(wl, spec, TOKENS // wl.seq_len, options)
                except PlanningError as e:
                    rows.append({"pair": pair, "each": each, "model": model, "precision": options.precision,
                                 "no_plan": str(e)})
                    json.dump(rows, open(args.out, "w"), indent=1)
                    print(f"{pair} {each}+{each} {model}: no plan: {e}", flush=True)
                    continue
                rows.append({"pair": pair, "each": each, "precision": options.precision, **ev.to_dict(),
                             "wall_s": time.perf_counter() - start})
                json.dump(rows, open(args.out, "w"), indent=1)
                base = {b.name: (ev.speedup(b.samples_per_s) or 0) for b in ev.baselines}
                alone = ", ".join(f"{a.kind} alone {ev.speedup(a.samples_per_s) or 0:.2f}x" for a in ev.alone)
                print(f"{pair} {each}+{each} {model} {options.precision}: {ev.label}, {ev.poplar.samples_per_s:.2f} samples/s, "
                      f"x uniform {base['uniform']:.2f}, x proportional {base['proportional']:.2f}, {alone}, "
                      f"{100 * ev.poplar.samples_per_s / ev.ideal_samples_per_s:.1f}% of ideal "
                      f"({time.perf_counter() - start:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
