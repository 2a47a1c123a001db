"""`poplar bench`: Poplar's allocation against the baselines, measured side by side in one run.

Per cluster: profile the model (or reuse the cache), plan the global batch, then train
Poplar's plan and the ``uniform`` (DeepSpeed-style), ``proportional`` (Whale-style, by
rated speed) and ``measured-peak`` (by measured peak throughput) allocations of the same
stage in one launch of the cluster, in alternating rounds, and report measured samples/s
and tokens/s, the ratios, the share of the planner's ideal bound (the batch shared so
that every device finishes together, only the communication no plan hides), each plan's predicted step time against the measured one, and the
emulated devices' overruns (spans whose real work ran past their declared time: a figure
measured with overruns is flagged, 0 on a quiet host). On an emulated cluster every
figure is in the declared devices' time.

The real peer takes part in the same launch and rounds where it can run: DeepSpeed
ZeRO in Poplar's stage with the uniform plan's micro-batch and accumulation, under the
same emulated devices (:mod:`poplar.compare.peers.deepspeed`); out of memory, it is given the
next smaller micro-batch (same samples, more accumulation) up to twice. Where it cannot
run (not installed, an error at start-up, out of memory still), its row is left out,
Poplar's plans are measured without it, and ``peers`` says why in one line. Each cluster's figures are a
:class:`~poplar.compare.comparison.Comparison`.
"""

from __future__ import annotations

import contextlib
import json
from importlib.metadata import version
from pathlib import Path

from poplar.cluster.spec import ClusterSpec, load_cluster, presets
from poplar.engine.config import EngineConfig
from poplar.compare.comparison import Comparison, Contender, Measured, planned
from poplar.compare.measure import measure_plans
from poplar.compare.peers import PeerFailed
from poplar.planner import PlanResult
from poplar.runtime.plans import profile_and_plan
from poplar.models.workload import Workload

OOM_RETRIES = 2   # smaller micro-batches DeepSpeed is given after it ran out of memory


def check_clusters(arg: str, global_batch: int, precision: str = "fp32") -> list[str]:
    """The clusters ``arg`` names (see :func:`clusters`), each loaded and checked against ``global_batch`` and
    ``precision`` (every device must have it).

    Everything a benchmark can be refused for is found here, before anything is profiled.
    """
    names = clusters(arg)
    if not names:
        raise ValueError(f"--cluster {arg!r}: give a preset, a YAML file, several comma-separated, or 'all'")
    for name in names:
        spec = load_cluster(name)
        spec.check_global_batch(global_batch)
        spec.check_precision(precision)
    return names


def plan_cluster(cluster: str, workload: Workload, global_batch: int, use_cache: bool = True,
                 progress=None, stages=(0, 1, 2, 3), precision: str = "fp32") -> tuple[ClusterSpec, PlanResult]:
    """Profile ``workload`` on the cluster (or read the cache) in ``stages`` and ``precision`` and plan
    ``global_batch``.

    ``progress``: where the profiler's events go (an object with ``put((kind, stage, what))``).
    """
    spec = load_cluster(cluster)
    spec.check_global_batch(global_batch)
    heard = (lambda title: contextlib.nullcontext(progress)) if progress is not None else None
    return spec, profile_and_plan(workload, spec, global_batch, stages, EngineConfig(mixed_precision=precision),
                                  use_cache=use_cache, progress=heard)


def plan_and_measure(cluster: str, workload: Workload, global_batch: int, pick, steps: int = 12, rounds: int = 3,
                     use_cache: bool = True, warmup: int = 2, timeout_s: float = 900, stages=(0, 1, 2, 3)):
    """Profile (or read the cache), plan, and measure the ``(stage plan, allocation name)`` pairs ``pick(result)``
    names (stage plans flat or shaped: ``result.stages`` and ``result.shaped``).

    All of them in one launch of the cluster, in alternating rounds. Returns the
    planning result and ``(stage plan, allocation, measured)`` per pair that has a plan.
    """
    spec, result = plan_cluster(cluster, workload, global_batch, use_cache, stages=stages)
    pairs = [(sp, sp.allocations[n]) for sp, n in pick(result) if sp.allocations[n].plan is not None]
    measured = measure_plans(workload, spec.model_dump(), [a.plan for _, a in pairs], steps=steps, rounds=rounds,
                             warmup=warmup, timeout_s=timeout_s)
    return result, [(s, a, m) for (s, a), m in zip(pairs, measured)]


def _by_devices(spec: ClusterSpec, result: PlanResult, allocs: list) -> list[tuple[ClusterSpec, list]]:
    """The allocations by the devices they run on: Poplar's plan on the ranks it is for (those the planner left out
    sit out), the baselines on the whole cluster where Poplar's leaves some out (what a user would run otherwise)."""
    subset = spec.subset(result.ranks)
    mine = [a for a in allocs if a.plan.world_size == subset.world_size]
    whole = [a for a in allocs if a.plan.world_size != subset.world_size]
    return [(on, group) for on, group in ((subset, mine), (spec, whole)) if group]


def deepspeed_setup(result: PlanResult, workload: Workload):
    """DeepSpeed's setup for the chosen stage's uniform plan, or why there is none (one line)."""
    from poplar.compare.peers import deepspeed

    why = deepspeed.unavailable()
    if why:
        return None, why
    uniform = result.allocations()["uniform"]
    if uniform.plan is None:
        return None, f"no uniform plan to run it with: {uniform.why_not}"
    return deepspeed.DeepSpeedSetup.from_plan(uniform.plan, workload), None


def measure_with_peer(workload: Workload, cluster: dict, plans: list, setup, steps: int = 12,
                      rounds: int = 3) -> tuple[list[dict], Contender | str]:
    """Measure ``plans`` and the peer ``setup`` in one launch: the plans' figures, and the peer's or why it has none.

    A peer out of memory is tried again with its next smaller micro-batch (the same
    samples per rank in more micro-steps), at most ``OOM_RETRIES`` times; a peer that
    cannot run is left out, and the plans are measured without it.
    """
    failed = []
    while True:
        try:
            *figures, peer = measure_plans(workload, cluster, plans, steps=steps, rounds=rounds, peers=[setup])
            break
        except PeerFailed as e:
            failed.append(str(e))
            setup = setup.smaller() if "OutOfMemoryError" in str(e) and len(failed) <= OOM_RETRIES else None
            if setup is None:
                return measure_plans(workload, cluster, plans, steps=steps, rounds=rounds), failed[-1]
    own = {"version": version(setup.name), **setup.to_dict(), "global_batch": setup.global_batch_size}
    return figures, Contender(setup.name, setup=own, measured=_measured(peer), failed_before=tuple(failed))


def _measured(m: dict) -> Measured:
    """What :func:`~poplar.compare.measure.measure_plans` measured of one plan or peer."""
    return Measured(m["samples_per_s"], m["step_s"], m["busy_s"], m["overruns"], alone=m.get("alone", ""))


def bench_cluster(cluster: str, workload: Workload, global_batch: int, steps: int = 12, rounds: int = 3,
                  use_cache: bool = True, peers: bool = True, progress=None, precision: str = "fp32",
                  timeout_s: float = 900) -> Comparison:
    """Measure Poplar's plan, the baselines and (``peers``) DeepSpeed on one cluster; see the module's docstring.

    ``progress`` receives the profiler's events (see :func:`plan_cluster`). ``precision``: what the engine
    computes in (the peer runs fp32 alone: left out otherwise). ``timeout_s``: each launch's bound.
    """
    spec, result = plan_cluster(cluster, workload, global_batch, use_cache, progress, precision=precision)
    config = EngineConfig(mixed_precision=precision)
    allocs = [a for a in result.allocations().values() if a.plan is not None]
    # an allocation whose plan is another's (Poplar keeps a baseline's split when it
    # predicts none faster) is that plan: measured once, so the host's noise between two
    # runs of one plan does not read as a difference between the allocations
    same_as = {a.name: next(b.name for b in allocs if b.plan == a.plan) for a in allocs}
    unique = [a for a in allocs if same_as[a.name] == a.name]
    plans = [a.plan for a in unique]
    setup, notes = None, {}
    if peers and precision != "fp32":
        notes["deepspeed"] = f"measured in fp32 only; this run is {precision}"
    elif peers:
        setup, why = deepspeed_setup(result, workload)
        if why:
            notes["deepspeed"] = why
    if progress is not None:
        progress.phase(f"{cluster}: measuring {len(plans)} plans" + (f" and {setup.name}" if setup else "")
                       + f" in ZeRO-{result.stage}{'' if not result.chosen.shaped else ' ' + result.plan.shape.split()[0]}"
                       + f", {rounds} rounds of {steps} steps")
    by_name = {}
    groups = _by_devices(spec, result, unique)
    with_peer = next((i for i, (_, g) in enumerate(groups) if any(a.name == "uniform" for a in g)), 0)
    for i, (on, group) in enumerate(groups):
        plans = [a.plan for a in group]
        if setup is not None and i == with_peer:   # the peer runs the uniform split, on its devices
            measured, notes[setup.name] = measure_with_peer(workload, on.model_dump(), plans, setup, steps, rounds)
        else:
            measured = measure_plans(workload, on.model_dump(), plans, steps=steps, rounds=rounds, config=config,
                                     timeout_s=timeout_s)
        by_name.update({a.name: m for a, m in zip(group, measured)})
    rows = []
    for alloc in allocs:
        m, first = by_name[same_as[alloc.name]], same_as[alloc.name]
        rows.append(planned(alloc, measured=None if "failed" in m else _measured(m), failed=m.get("failed", ""),
                            same_plan_as="" if first == alloc.name else first))
    return Comparison(model=workload.name, cluster=cluster, world_size=spec.world_size, seq_len=workload.seq_len,
                      global_batch=global_batch, zero_stage=result.stage, shape=result.plan.shape,
                      label=result.chosen.label, reason=result.reason, ideal_samples_per_s=result.ideal_samples_per_s,
                      allocations=tuple(rows), precision=precision, peers=notes)


def bench_clusters(names: list[str], workload: Workload, global_batch: int, steps: int, *, use_cache: bool = True,
                   peers: bool = True, progress=None, json_out: Path | None = None,
                   precision: str = "fp32") -> tuple[list[Comparison], list[str]]:
    """:func:`bench_cluster` on each cluster in turn: the figures, and a line for each cluster that failed.

    A cluster that fails does not stop the others, and with ``json_out`` the figures so
    far (a failed cluster as ``{"cluster", "failed"}``) are written after every cluster,
    so nothing measured is lost to a later one. ``progress(cluster)``: a context manager
    receiving that cluster's events.
    """
    results, failed = [], []
    for name in names:
        with progress(name) if progress else contextlib.nullcontext() as events:
            try:
                results.append(bench_cluster(name, workload, global_batch, steps, use_cache=use_cache, peers=peers,
                                             progress=events, precision=precision))
            except Exception as e:   # noqa: BLE001 - reported in its line; the other clusters go on
                failed.append({"cluster": name, "failed": _one_line(e)})
        if json_out is not None:
            json_out.write_text(json.dumps([r.to_dict() for r in results] + failed, indent=2) + "\n")
    return results, [f"{f['cluster']}: failed: {f['failed']}" for f in failed]


def _one_line(e: Exception) -> str:
    line = getattr(e, "line", None) or next((x for x in str(e).splitlines() if x.strip()), "")
    return f"{type(e).__name__}: {line}" if line else type(e).__name__


def clusters(arg: str) -> list[str]:
    """``all``: every preset; otherwise comma-separated presets or YAML files."""
    return presets() if arg == "all" else [c.strip() for c in arg.split(",") if c.strip()]
