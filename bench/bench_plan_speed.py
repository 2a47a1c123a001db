"""How long planning takes for 1,024 ranks of 6 device kinds (all four stages, both baselines, the ideal bound).

    python bench/bench_plan_speed.py
"""

from __future__ import annotations

import statistics
import time

from poplar.planner import make_plan
from poplar.profile.profile import DeviceProfile, ModelInfo, Profile, StageProfile


def synthetic_profile(ranks: int = 1024, kinds: int = 6) -> Profile:
    """``kinds`` device kinds, from fast with much memory to slow with little, on ``ranks`` ranks."""
    devices, order = {}, []
    for i in range(kinds):
        limit = 16 + 8 * i
        alpha, beta, update = 0.005 * (1 + i), 0.001 * (1 + i / 2), 0.01
        stage = StageProfile(max_micro_batch=limit, state_bytes=0, per_step_s=update,
                             points=[(m, update + alpha + beta * m + 2e-6 * m * m) for m in (1, 4, limit // 2, limit)])
        devices[f"gpu{i}"] = DeviceProfile(kind=f"gpu{i}", memory_gb=1.0, stages={s: stage for s in range(4)})
        order += [f"gpu{i}"] * (ranks // kinds + (1 if i < ranks % kinds else 0))
    return Profile(model=ModelInfo(name="synthetic", n_params=10**8, seq_len=2048), ranks=order, devices=devices)


def main() -> None:
    profile = synthetic_profile()
    print(f"{profile.world_size} ranks of {len(profile.devices)} kinds")
    for batch in (1024, 8192, 65536):
        times = []
        for _ in range(3):
            start = time.perf_counter()
            result = make_plan(profile, batch)
            times.append(time.perf_counter() - start)
        print(f"global batch {batch:>6}: {statistics.median(times):.3f} s (median of 3); chosen stage "
              f"{result.stage}, {result.predicted.samples_per_s:,.0f} samples/s predicted")


if __name__ == "__main__":
    main()
