"""What `poplar simulate` reports: Poplar's plan beside the baselines and beside each kind of device alone.

The paper's comparison, on a simulated profile: Poplar's plan (the planner's choice of
stage, shape and allocation) against DeepSpeed-style ``uniform`` and Whale-style
``proportional`` splits (each at its best stage and shape), against the homogeneous
clusters of each kind alone (the same devices, nodes and links, the other kinds left
out: their own simulated profile and plan), and against the ideal bound. Which kinds take
part is the planner's choice (every subset of the kinds weighed, :mod:`poplar.planner.subsets`);
where a kind alone, profiled on its own, is predicted faster still, the reason says so.
The answer is a :class:`~poplar.compare.comparison.Comparison`
(predicted figures). Throughput in
samples, tokens and model FLOPs (three times a sample's forward FLOPs: the backward
does twice the forward's), and each kind's share of it: its model TFLOP/s per device
and its MFU (of the device's peak in the compute dtype).

>>> per_device_tflops(samples=4, flops_per_sample=1e12, step_s=2.0)
6.0
"""

from __future__ import annotations

import dataclasses
import time

from poplar.cluster.spec import ClusterSpec
from poplar.compare.alone import AloneRuns
from poplar.compare.comparison import Comparison, Contender, KindShare, planned
from poplar.models.workload import Workload
from poplar.planner import make_plan
from poplar.planner.planner import PlanResult
from poplar.profile.options import ProfileOptions
from poplar.profile.profile import Profile
from poplar.profile.units import STEP_FLOPS_PER_FORWARD
from poplar.simulate.profile import simulate_profile

BASELINES = ("uniform", "proportional", "measured-peak")


def per_device_tflops(samples: float, flops_per_sample: float, step_s: float) -> float:
    """Model TFLOP/s of a device that trains ``samples`` a step of ``flops_per_sample`` forward FLOPs (a step's:
    :data:`~poplar.profile.units.STEP_FLOPS_PER_FORWARD` times those)."""
    return STEP_FLOPS_PER_FORWARD * samples * flops_per_sample / step_s / 1e12


def evaluate(workload: Workload, spec: ClusterSpec, global_batch: int, options: ProfileOptions,
             alone: bool = True, workers: int | None = None) -> tuple[Comparison, PlanResult]:
    """Simulate, plan and compare (``alone``: also each kind's homogeneous cluster, in up to ``workers``
    processes beside this one, :class:`poplar.compare.alone.AloneRuns`): the comparison, and the planning
    result of Poplar's plan."""
    start = time.perf_counter()
    kinds = list(dict.fromkeys(d.kind for d in spec.rank_devices()))
    with AloneRuns(workload, spec, kinds if alone and len(kinds) > 1 else [], global_batch, options, workers) as runs:
        profile = simulate_profile(workload, spec, options)
        simulated = time.perf_counter() - start
        result = make_plan(profile, global_batch, options.stages)
        planned_s = time.perf_counter() - start - simulated
        others = runs.results()
    label, reason = result.chosen.label, result.reason
    if result.excluded_ranks:
        label = f"{', '.join(dict.fromkeys(profile.ranks[r] for r in result.ranks))} only, {label}"
    faster = max((o for o in others if o[1] is not None), key=lambda o: o[1].predicted.samples_per_s, default=None)
    if faster is not None and faster[1].predicted.samples_per_s > result.predicted.samples_per_s * (1 + 0.01):
        # its own profile (its own world's collectives) says more than this one's weighing of it: said, not chosen
        reason += (f"; {faster[0].kind} alone, profiled on its own, is predicted "
                   f"{faster[1].predicted.samples_per_s / result.predicted.samples_per_s:.2f}x this plan")
    peaks = {k: d.rated_tflops or 0.0 for k, d in profile.devices.items()}
    counts = {k: profile.ranks.count(k) for k in peaks}
    kinds_shares = _shares(result, result.profile)
    poplar = Contender("poplar", result.plan, result.predicted.samples_per_s, result.predicted.step_s, label=label,
                        peak_tflops=sum(peaks[k.kind] * k.ranks for k in kinds_shares))   # the GPUs it runs on
    everyone = sum(peaks[k] * counts[k] for k in peaks)
    baselines = [dataclasses.replace(b, peak_tflops=everyone) for b in _best_baselines(result)]
    comparison = Comparison(
        model=workload.name, cluster=spec.describe(), world_size=spec.world_size, seq_len=profile.model.seq_len,
        global_batch=global_batch, zero_stage=result.stage, shape=result.plan.shape, label=label, reason=reason,
        ideal_samples_per_s=result.chosen.ideal_samples_per_s, precision=options.precision,
        allocations=(poplar, *baselines, *(dataclasses.replace(a, peak_tflops=peaks[a.kind] * counts[a.kind])
                                           for a, _ in others)),
        kinds=tuple(kinds_shares), tflops=per_device_tflops(global_batch, sum(profile.model.unit_flops),
                                                            result.predicted.step_s),
        simulated_s=simulated, planned_s=planned_s)
    return comparison, result


def _best_baselines(result: PlanResult) -> list[Contender]:
    """Each baseline at its best stage and shape (no plan where it has none in any)."""
    options = [sp for sp in [*result.stages.values(), *result.shaped.values()] if not sp.excluded]
    out = []
    for name in BASELINES:
        found = [sp.allocations[name] for sp in options if name in sp.allocations and sp.allocations[name].plan is not None]
        best = max(found, key=lambda a: a.predicted.samples_per_s, default=None)
        out.append(planned(best) if best is not None else Contender(name, why_not="no plan in any stage or shape"))
    return out


def _shares(result: PlanResult, profile: Profile) -> list[KindShare]:
    plan, step = result.plan, result.predicted.step_s
    flops = sum(profile.model.unit_flops)
    out: dict[str, KindShare] = {}
    for i, r in enumerate(result.ranks):
        kind = profile.ranks[r]
        peak = profile.devices[kind].rated_tflops or 0.0
        b = plan.local_batch_sizes[i]
        share = out.get(kind)
        ranks = share.ranks + 1 if share else 1
        if share is None or b > share.samples:
            tflops = per_device_tflops(b, flops, step)
            out[kind] = KindShare(kind=kind, ranks=ranks, samples=b, micro_batch=plan.micro_batch_sizes[i],
                                  accum=plan.accum_steps[i], tflops=tflops, mfu=tflops / peak if peak else 0.0)
        else:
            out[kind] = dataclasses.replace(share, ranks=ranks)
    return list(out.values())
