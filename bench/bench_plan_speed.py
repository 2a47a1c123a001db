"""How long planning takes for 1,024 ranks of 6 device kinds (all four stages, both baselines, the ideal bound).

With ``--network``, the profile also holds what the cost model's schedule needs: the
collectives' times, flat and shaped to nodes of 8 ranks (so the planner weighs two-level
and hybrid too), 33 units and each stage's step anatomy. With ``--shares``, the kinds'
memory differs and each sharded stage records its memory points (a rank holding none of
the states takes half as many samples again), so the planner searches uneven shares too.

    python bench/bench_plan_speed.py
    python bench/bench_plan_speed.py --network
    python bench/bench_plan_speed.py --shares
"""

from __future__ import annotations

import argparse
import statistics
import time

from poplar.planner import make_plan
from poplar.profile.profile import (CommProfile, DeviceProfile, ModelInfo, Profile, ShapedComm, StageProfile,
                                    StepAnatomy)

UNITS = 33           # the root and 32 layers
NODE = 8             # ranks per node


def synthetic_profile(ranks: int = 1024, kinds: int = 6, network: bool = False, shares: bool = False) -> Profile:
    """``kinds`` device kinds, from fast with much memory to slow with little, on ``ranks`` ranks (``network``:
    with collectives, flat and on nodes of 8, units and step anatomies; ``shares``: memory points)."""
    devices, order = {}, []
    n_params, state = 10**8, 10 * 2**30
    held = 12 * n_params // ranks   # fp32 ZeRO-1/2's sharded bytes at an even share
    for i in range(kinds):
        limit = 16 + 8 * i
        alpha, beta, update = 0.005 * (1 + i), 0.001 * (1 + i / 2), 0.01
        anatomy = [_anatomy(m) for m in (limit // 2, limit)] if network else None
        stage = StageProfile(max_micro_batch=limit, state_bytes=state, per_step_s=update, anatomy=anatomy,
                             points=[(m, update + alpha + beta * m + 2e-6 * m * m) for m in (1, 4, limit // 2, limit)])
        memory = [(state - held, limit + limit // 2), (state, limit)] if shares else []
        devices[f"gpu{i}"] = DeviceProfile(kind=f"gpu{i}", memory_gb=80.0 - 8 * i if shares else 1.0,
                                           stages={s: stage.model_copy(update={"memory_points": memory if s else []})
                                                   for s in range(4)})
        order += [f"gpu{i}"] * (ranks // kinds + (1 if i < ranks % kinds else 0))
    model = ModelInfo(name="synthetic", n_params=n_params, seq_len=2048,
                      unit_numels=[n_params // UNITS] * UNITS if network else [])
    return Profile(model=model, ranks=order, devices=devices, comm=_comm(ranks, n_params) if network else None)


def _anatomy(micro_batch: int) -> StepAnatomy:
    share = 0.9 / (UNITS - 1)
    return StepAnatomy(micro_batch=micro_batch, forward=[0.04] + [share / 3] * (UNITS - 1),
                       backward=[0.04] + [2 * share / 3] * (UNITS - 1), root_middle=0.02,
                       before_loss_s=1e-4, before_norm_s=5e-4)


def _flat(numel: int, ranks: int, gbs: float, latency_s: float) -> CommProfile:
    ring = 4 * numel * (ranks - 1) / ranks / (gbs * 1e9) + (ranks - 1) * latency_s
    return CommProfile(numel=numel, all_reduce_s=2 * ring, reduce_scatter_s=ring, all_gather_s=ring,
                       latency_s={"all_reduce": 2 * (ranks - 1) * latency_s, "reduce_scatter": (ranks - 1) * latency_s,
                                  "all_gather": (ranks - 1) * latency_s})


def _comm(ranks: int, numel: int) -> CommProfile:
    groups = [list(range(s, min(s + NODE, ranks))) for s in range(0, ranks, NODE)]
    across = 2 * 4 * numel / NODE / 12.5e9 + 2 * (len(groups) - 1) * 5e-6
    shaped = ShapedComm(groups=groups, numel=numel, inside=[_flat(numel, len(g), 150.0, 5e-6) for g in groups],
                        reduce_across_s=across, across_latency_s=2 * (len(groups) - 1) * 5e-6,
                        sum_s=4 * numel / NODE / 1e12, sum_latency_s=5e-6)
    return _flat(numel, ranks, 12.5, 5e-6).model_copy(update={"shaped": shaped})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--network", action="store_true", help="with collectives (flat and on nodes), units, anatomies")
    p.add_argument("--shares", action="store_true", help="kinds of unlike memory, with memory points: shares searched")
    args = p.parse_args()
    profile = synthetic_profile(network=args.network, shares=args.shares)
    print(f"{profile.world_size} ranks of {len(profile.devices)} kinds"
          + (f", nodes of {NODE}, {UNITS} units" if args.network else ""))
    for batch in (1024, 8192, 65536):
        times = []
        for _ in range(3):
            start = time.perf_counter()
            result = make_plan(profile, batch)
            times.append(time.perf_counter() - start)
        shares = ", uneven shares" if result.plan.shard_shares else ""
        print(f"global batch {batch:>6}: {statistics.median(times):.3f} s (median of 3); chosen "
              f"{result.chosen.label}{shares}, {result.predicted.samples_per_s:,.0f} samples/s predicted")


if __name__ == "__main__":
    main()
