"""Profiles given as exact points, so that the best plan is known."""

from __future__ import annotations

import functools

from poplar.profile.profile import CommProfile, DeviceProfile, ModelInfo, Profile, StageProfile

# collectives with a latency each, timed at 1000 elements
COMM = CommProfile(numel=1000, all_reduce_s=2e-4, reduce_scatter_s=1e-4, all_gather_s=1e-4,
                   latency_s={"all_reduce": 2e-5, "reduce_scatter": 1e-5, "all_gather": 1e-5})


def affine_stage(alpha: float, beta: float, max_mbs: int, per_step: float = 0.0) -> StageProfile:
    """A step of one micro-batch of ``m`` takes ``per_step + alpha + beta * m`` (points on a line, so the
    natural spline through them is that line)."""
    sizes = sorted({1, max(1, max_mbs // 2), max_mbs}) if max_mbs > 0 else []
    return StageProfile(max_micro_batch=max_mbs, state_bytes=0, per_step_s=per_step,
                        points=[(m, per_step + alpha + beta * m) for m in sizes])


def make_profile(kinds: dict[str, tuple[int, float, float, int]], stages=(0, 1, 2, 3), per_step: float = 0.0,
                 comm: CommProfile | None = None, seq_len: int = 16, max_by_stage=None, dtype: str = "fp32",
                 rated_tflops: dict[str, float | None] | None = None) -> Profile:
    """``kinds[name] = (count, alpha, beta, max_micro_batch)``; ranks in the dict's order.

    ``max_by_stage[name][stage]`` overrides a kind's limit in one stage; ``rated_tflops[name]``
    is a kind's rating (what the profiler stores from the data sheet; default None: unrated).
    """
    devices, ranks = {}, []
    for name, (count, alpha, beta, max_mbs) in kinds.items():
        limits = {s: (max_by_stage or {}).get(name, {}).get(s, max_mbs) for s in stages}
        devices[name] = DeviceProfile(kind=name, memory_gb=1.0, rated_tflops=(rated_tflops or {}).get(name),
                                      stages={s: affine_stage(alpha, beta, limits[s], per_step) for s in stages})
        ranks += [name] * count
    return Profile(model=ModelInfo(name="synthetic", n_params=1000, seq_len=seq_len, unit_numels=[400, 300, 300],
                                   dtype=dtype),
                   ranks=ranks, devices=devices, comm=comm)


@functools.lru_cache(maxsize=None)
def memory_skewed() -> Profile:
    """The memory-skewed preset's profile of a small Llama in stage 2 (simulated, as the profiler measures), where
    its small card is capped by its share of the states; simulated once a process."""
    from poplar.cluster.spec import load_cluster
    from poplar.profile.options import ProfileOptions
    from poplar.simulate import simulate_profile
    from poplar.models.workload import Workload

    wl = Workload(model="llama-small", seq_len=16, vocab_size=1024, activation_checkpointing=True)
    return simulate_profile(wl, load_cluster("memory-skewed"), ProfileOptions(stages=(2,), max_micro_batch=64,
                                                                             n_points=3))
