"""What `poplar simulate` reports: Poplar's plan beside the baselines and beside each kind of device alone.

The paper's comparison, on a simulated profile: Poplar's plan (the planner's choice of
stage, shape and allocation) against DeepSpeed-style ``uniform`` and Whale-style
``proportional`` splits (each at its best stage and shape), against the homogeneous
clusters of each kind alone (the same devices, nodes and links, the other kinds left
out: their own simulated profile and plan), and against the ideal bound. Where one kind
alone is faster than every plan of the whole cluster (the others' memory holds every rank
to a sample a micro-step, or their links to slow collectives), Poplar's answer is to
leave the others out, and it says so. Throughput in
samples, tokens and model FLOPs (three times a sample's forward FLOPs: the backward
does twice the forward's), and each kind's share of it: its model TFLOP/s per device
and its MFU (of the device's peak in the compute dtype).

>>> per_device_tflops(samples=4, flops_per_sample=1e12, step_s=2.0)
6.0
"""

from __future__ import annotations

import time

from pydantic import BaseModel, ConfigDict

from poplar.compare.alone import Alone, AloneRuns
from poplar.cluster.spec import ClusterSpec
from poplar.planner import make_plan
from poplar.planner.planner import PlanResult
from poplar.profile.options import ProfileOptions
from poplar.profile.profile import Profile
from poplar.profile.units import STEP_FLOPS_PER_FORWARD
from poplar.simulate.profile import simulate_profile
from poplar.models.workload import Workload

BASELINES = ("uniform", "proportional", "measured-peak")


class KindShare(BaseModel):
    """One device kind's part of the chosen plan."""

    model_config = ConfigDict(extra="forbid")

    kind: str
    ranks: int
    samples: int          # a rank's samples a step (its largest, where ranks of the kind differ)
    micro_batch: int
    accum: int
    tflops: float         # model TFLOP/s a device computes, over the whole step
    mfu: float            # of the device's peak TFLOP/s in the compute dtype


class Evaluation(BaseModel):
    """Poplar's plan for a model on a cluster, simulated, and what it is compared with."""

    model_config = ConfigDict(extra="forbid")

    model: str
    cluster: str
    world_size: int
    global_batch: int
    seq_len: int
    label: str                          # the chosen stage and shape
    reason: str
    samples_per_s: float
    tokens_per_s: float
    tflops: float                       # the cluster's model TFLOP/s
    ideal_samples_per_s: float
    baselines: dict[str, float | None]  # each at its best stage and shape; None: no plan
    kinds: list[KindShare]
    alone: list[Alone]
    simulated_s: float
    planned_s: float

    def speedup(self, samples_per_s: float | None) -> float | None:
        return None if not samples_per_s else self.samples_per_s / samples_per_s


def per_device_tflops(samples: float, flops_per_sample: float, step_s: float) -> float:
    """Model TFLOP/s of a device that trains ``samples`` a step of ``flops_per_sample`` forward FLOPs (a step's:
    :data:`~poplar.profile.units.STEP_FLOPS_PER_FORWARD` times those)."""
    return STEP_FLOPS_PER_FORWARD * samples * flops_per_sample / step_s / 1e12


def evaluate(workload: Workload, spec: ClusterSpec, global_batch: int, options: ProfileOptions,
             alone: bool = True, workers: int | None = None) -> tuple[Evaluation, PlanResult]:
    """Simulate, plan and compare (``alone``: also each kind's homogeneous cluster, in up to ``workers``
    processes beside this one, :class:`poplar.compare.alone.AloneRuns`)."""
    start = time.perf_counter()
    kinds = list(dict.fromkeys(d.kind for d in spec.rank_devices()))
    with AloneRuns(workload, spec, kinds if alone and len(kinds) > 1 else [], global_batch, options, workers) as runs:
        profile = simulate_profile(workload, spec, options)
        simulated = time.perf_counter() - start
        result = make_plan(profile, global_batch, options.stages)
        planned = time.perf_counter() - start - simulated
        others = runs.results()
    baselines, label, reason = _best_baselines(result), result.chosen.label, result.reason
    faster = max((o for o in others if o[1] is not None), key=lambda o: o[1].predicted.samples_per_s, default=None)
    if faster is not None and faster[1].predicted.samples_per_s > result.predicted.samples_per_s:
        # fewer devices go faster (the others' memory or links hold every rank back): Poplar says so
        left_out = sorted({k for k in profile.ranks if k != faster[0].kind})
        reason = (f"leaving {', '.join(left_out)} out is {faster[1].predicted.samples_per_s / result.predicted.samples_per_s:.2f}x "
                  f"faster than the whole cluster's best plan ({result.chosen.label}): launch without them. "
                  f"{faster[1].reason}")
        label = f"{faster[0].kind} only, {faster[1].chosen.label}"
        result = faster[1]
    pred = result.predicted
    evaluation = Evaluation(
        model=workload.name, cluster=spec.describe(), world_size=spec.world_size, global_batch=global_batch,
        seq_len=profile.model.seq_len, label=label, reason=reason,
        samples_per_s=pred.samples_per_s, tokens_per_s=pred.tokens_per_s,
        tflops=per_device_tflops(global_batch, sum(profile.model.unit_flops), pred.step_s),
        ideal_samples_per_s=result.chosen.ideal_samples_per_s, baselines=baselines,
        kinds=_shares(result, result.profile), alone=[a for a, _ in others], simulated_s=simulated,
        planned_s=planned)
    return evaluation, result


def _best_baselines(result: PlanResult) -> dict[str, float | None]:
    """Each baseline's throughput at its best stage and shape (None where it has no plan in any)."""
    out: dict[str, float | None] = {}
    options = [sp for sp in [*result.stages.values(), *result.shaped.values()] if not sp.excluded]
    for name in BASELINES:
        found = [sp.allocations[name].predicted.samples_per_s for sp in options
                 if name in sp.allocations and sp.allocations[name].plan is not None]
        out[name] = max(found) if found else None
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
        if share is None or b > share.samples:
            tflops = per_device_tflops(b, flops, step)
            out[kind] = KindShare(kind=kind, ranks=(share.ranks if share else 0), samples=b,
                                  micro_batch=plan.micro_batch_sizes[i], accum=plan.accum_steps[i], tflops=tflops,
                                  mfu=tflops / peak if peak else 0.0)
        out[kind].ranks += 1
    return list(out.values())
