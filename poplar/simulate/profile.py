"""The simulated profile: the :class:`~poplar.profile.profile.Profile` the profiler would write, without running.

Each device kind of the cluster is profiled by the profiler's own procedure
(:func:`poplar.profile.rank.profile_stage`: the states, the memory probe, the timed
points, the step's anatomy), on its first rank's :class:`~poplar.devices.simulated.
SimulatedDevice`, with every tensor fake (``FakeTensorMode``: no memory is allocated,
so a model of any size can be profiled on a laptop). Each operator costs what the
emulated device charges for it and the saved activations count against the same
capacity, so the figures are those of the emulated cluster, counted instead of paced.
The kinds run side by side in threads, so that where the profiler's ranks agree (does
every device fit a sample?) the kinds agree the same way. The collectives' times are
the network model's: the emulated network's, without its ranks.

What a fake tensor cannot say (a value: the loss, the gradient norm) reads as
:mod:`poplar.simulate.fake` gives it; only the step's time and memory depend on the shapes.
"""

from __future__ import annotations

import threading

from poplar.cluster.spec import ClusterSpec, parse_cluster
from poplar.devices.simulated import SimulatedDevice
from poplar.engine.config import EngineConfig
from poplar.profile.options import ProfileOptions
from poplar.profile.profile import Profile, StageProfile
from poplar.profile.rank import profile_stage
from poplar.profile.timing import RankRun
from poplar.simulate.comm import simulated_comm
from poplar.simulate.fake import fake_tensors
from poplar.workload import Workload, as_workload

AGREE_TIMEOUT_S = 600.0   # a kind's thread waits this long for the others at a point of agreement


class _Agreement:
    """Where the kinds' threads agree, as the profiler's ranks do by an all-reduce."""

    def __init__(self, parties: int):
        self._barrier = threading.Barrier(parties, timeout=AGREE_TIMEOUT_S)
        self._flags: list[bool] = []
        self._lock = threading.Lock()

    def all(self, flag: bool) -> bool:
        with self._lock:
            self._flags.append(flag)
        self._barrier.wait()
        every = all(self._flags)
        if self._barrier.wait() == 0:   # every thread has read: one clears for the next agreement
            self._flags.clear()
        self._barrier.wait()
        return every

    def abort(self) -> None:
        self._barrier.abort()


class SimulatedRun(RankRun):
    """One kind's profiling in the simulator: it agrees with the other kinds' threads, not with ranks."""

    agreement: _Agreement | None = None

    def everyone(self, flag: bool) -> bool:
        return self.agreement.all(flag) if self.agreement is not None else flag

    def agree_sizes(self, mine: list[int]) -> list[list[int]]:
        return [[m] * self.world_size for m in mine]   # the other ranks' sizes change nothing of this rank's


def simulate_kind(spec: ClusterSpec, rank: int, workload: Workload, options: ProfileOptions, config: EngineConfig,
                  agreement: _Agreement | None = None) -> dict[int, StageProfile]:
    """The stage profiles of rank ``rank``'s device kind, simulated."""
    config = config.model_copy(update={"check_batches": False})   # the other ranks' batches are not there
    with fake_tensors():
        device = SimulatedDevice(spec, rank)
        with device:
            run = SimulatedRun(device, rank, spec.world_size, workload, config, warmup=1, repeats=1,
                               kind=spec.device(rank).kind)
            run.agreement = agreement
            return {s: profile_stage(run, s, options) for s in options.stages}


def simulate_stages(workload: str | Workload, cluster, options: ProfileOptions | None = None,
                    config: EngineConfig | None = None) -> dict[tuple[str, int], StageProfile]:
    """Every kind's stage profiles, simulated side by side (one thread a kind)."""
    options, config = _resolved(options, config)
    wl, spec = as_workload(workload), parse_cluster(cluster)
    wl.n_params()   # the model built once here (on the meta device): its modules imported before the threads
    firsts = {}
    for r, d in enumerate(spec.rank_devices()):
        firsts.setdefault(d.kind, r)
    agreement = _Agreement(len(firsts))
    results: dict[str, dict[int, StageProfile]] = {}
    errors: list[BaseException] = []

    def one(kind: str, rank: int) -> None:
        try:
            results[kind] = simulate_kind(spec, rank, wl, options, config, agreement)
        except BaseException as e:   # the others must not wait for this one
            errors.append(e)
            agreement.abort()

    threads = [threading.Thread(target=one, args=(k, r), name=f"simulate-{k}") for k, r in firsts.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0])
    return {(k, s): sp for k, stages in results.items() for s, sp in stages.items()}


def simulate_profile(workload: str | Workload, cluster, options: ProfileOptions | None = None,
                     config: EngineConfig | None = None) -> Profile:
    """The :class:`Profile` of ``workload`` on ``cluster``, simulated (see the module)."""
    from poplar.profile.profiler import _assemble

    options, config = _resolved(options, config)
    wl, spec = as_workload(workload), parse_cluster(cluster)
    stages = simulate_stages(wl, spec, options, config)
    with fake_tensors():     # the model is built once more, for its units: of any size
        profile = _assemble(wl, spec, options.precision, config, stages, None)
    return profile.model_copy(update={"comm": simulated_comm(spec, wl.n_params())})


def _resolved(options: ProfileOptions | None, config: EngineConfig | None) -> tuple[ProfileOptions, EngineConfig]:
    """The options, and the engine's config in their precision (as :func:`poplar.profile.profile_cluster`)."""
    options = options or ProfileOptions()
    return options, (config or EngineConfig()).model_copy(update={"mixed_precision": options.precision})
