"""How faithfully the emulated cluster keeps its declared pace: measured against declared, side by side.

    python bench/bench_emulation.py                 # 2 and 4 ranks, and 2 ranks beside a busy core

Per device kind: a step of one micro-batch at sizes 1..16 (the `tiny` model, ZeRO-0),
its wall time over the dilation (waits for the other ranks left out) against the same
step's declared time counted operator by operator. Across two nodes (1.25 GB/s, 50 us):
an all-reduce of 1 KB to 64 MB from launch to completion against latency + size over
bandwidth, and an all-reduce launched before a longer stretch of compute. Prints the
ratios and the overruns (:mod:`poplar.devices.fidelity` measures).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys

from poplar.devices.fidelity import collective_times, micro_steps, overlapped_collective
from poplar.processes.spawn import spawn

TWO = {"memory_scale": 0.001, "devices": [{"kind": "a100-80gb", "gpu": "A100-80GB"},
                                          {"kind": "t4-16gb", "gpu": "T4-16GB"}]}
FOUR = {"memory_scale": 0.001, "devices": [{"kind": "a100-80gb", "gpu": "A100-80GB", "count": 2},
                                           {"kind": "t4-16gb", "gpu": "T4-16GB", "count": 2}]}
TWO_NODES = {"network": {"inter_node": {"bandwidth_gbs": 1.25, "latency_us": 50}},
             "devices": [{"kind": "a", "gpu": "A100-80GB", "node": 0}, {"kind": "b", "gpu": "A100-80GB", "node": 1}]}


def report_steps(title: str, ranks: list[dict]) -> None:
    print(f"\n{title}: dilation {ranks[0]['dilation']:.0f}, overruns {sum(r['overruns'] for r in ranks)}")
    for rank, r in enumerate(ranks):
        ratios = [s["measured"] / s["declared"] for s in r["sizes"]]
        cells = "  ".join(f"{s['m']}: {1e3 * s['declared']:.3f}/{1e3 * s['measured']:.3f}" for s in r["sizes"])
        print(f"  rank {rank} {r['kind']:<10} measured/declared median {statistics.median(ratios):.4f} "
              f"(range {min(ratios):.4f}-{max(ratios):.4f}); ms declared/measured at m = {cells}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,2,4,8,16", help="micro-batch sizes, comma-separated")
    sizes = [int(s) for s in parser.parse_args().sizes.split(",")]
    report_steps("2 ranks", spawn(micro_steps, 2, TWO, sizes, 3, timeout_s=600))
    report_steps("4 ranks on this host's cores", spawn(micro_steps, 4, FOUR, sizes, 3, timeout_s=900))
    hog = subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 600\nwhile time.time() < end: pass"])
    try:
        report_steps("2 ranks, another process keeping a core busy", spawn(micro_steps, 2, TWO, sizes, 3, timeout_s=600))
    finally:
        hog.kill()
        hog.wait()
    r, _ = spawn(collective_times, 2, TWO_NODES, [2**10, 2**13, 2**16, 2**20, 2**24, 2**26], 3, timeout_s=600)
    print(f"\nall-reduce across two nodes (1.25 GB/s, 50 us), overruns {r['overruns']}:")
    for s in r["sizes"]:
        print(f"  {s['bytes']:>10,} bytes: declared {1e3 * s['declared']:9.3f} ms, measured "
              f"{1e3 * s['measured']:9.3f} ms, ratio {s['measured'] / s['declared']:.4f}")
    o, _ = spawn(overlapped_collective, 2, TWO_NODES, 2**20, timeout_s=600)
    print(f"  1 MiB launched before {1e3 * o['compute']:.2f} ms of compute ({1e3 * o['network']:.2f} ms on the "
          f"wire): the step less its barrier took {1e3 * (o['step'] - o['wait']):.2f} ms, "
          f"{(o['step'] - o['wait']) / o['compute']:.4f} of the compute; waited {1e6 * o['waited_for']:.1f} us for it")


if __name__ == "__main__":
    main()
