"""Which operators of a recorded step change with the world's size, and in proportion to what.

A probe for the simulator's cost at thousands of ranks (docs/simulate.md, "What is not done yet"): the step of one
sample of a shallow model (``--layers``) is recorded on fake tensors at three world sizes, even shares, in ZeRO-1-3,
and the operators are compared one by one; each that changes is printed with its bytes at each size and the
unit's slice sizes it follows.

    python bench/simulate_worlds.py --model llama-125m --worlds 4,8,24
"""

from __future__ import annotations

import argparse
from collections import Counter

import numpy as np

from poplar.cluster.spec import parse_cluster
from poplar.engine.config import EngineConfig
from poplar.profile.timing import RankRun
from poplar.simulate.fake import fake_tensors
from poplar.simulate.layers import Shallow
from poplar.simulate.recording import Recording
from poplar.simulate.trace import CountingDevice, operator_name
from poplar.models.workload import as_workload


def step_at(workload, world: int, stage: int):
    """The step of one sample, and each unit's slice, on rank 0 of ``world`` alike ranks."""
    spec = parse_cluster({"devices": [{"kind": "a", "gpu": "A100-80GB", "count": world, "gpus_per_node": 8}]})
    with fake_tensors():
        device = CountingDevice(spec, 0)
        with device:
            run = RankRun(device, 0, world, workload, EngineConfig(check_batches=False), warmup=1, repeats=1)
            made = Recording(run, stage)
            return made.trace(1, 1), [u.shard_numel for u in made.engine.units]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-125m")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--worlds", default="4,8,24")
    args = ap.parse_args()
    workload = Shallow(as_workload(args.model), args.layers)
    worlds = [int(w) for w in args.worlds.split(",")]
    for stage in (1, 2, 3):
        steps = [step_at(workload, w, stage) for w in worlds]
        (first, slices), others = steps[0], [t for t, _ in steps[1:]]
        alike = all(len(t.flops) == len(first.flops) and np.array_equal(t.ops, first.ops) and t.marks == first.marks
                    and [x[::2] for x in t.launches] == [x[::2] for x in first.launches] and t.waits == first.waits
                    for t in others)
        changed = [i for i in range(len(first.flops))
                   if any(t.nbytes[i] != first.nbytes[i] or t.flops[i] != first.flops[i] for t in others)]
        print(f"ZeRO-{stage}: {len(first.flops)} operators, the same at every world: {alike}; "
              f"{len(changed)} change with it; slices at {worlds[0]}: {slices}")
        kinds = Counter(operator_name(int(first.ops[i])) for i in changed)
        for name, n in kinds.most_common():
            rows = [i for i in changed if operator_name(int(first.ops[i])) == name][:2]
            sizes = "; ".join(" / ".join(f"{int(t.nbytes[i])}" for t in [first, *others]) for i in rows)
            print(f"  {n:4d} x {name:32s} bytes at {args.worlds}: {sizes}")
        launches = sum(a != b for t in others for a, b in zip(first.launches, t.launches))
        print(f"  launches whose bytes change: {launches} (the padding)")


if __name__ == "__main__":
    main()
