"""The simulated profile: the :class:`~poplar.profile.profile.Profile` the profiler would write, without running.

The profiler's procedure (:func:`poplar.profile.rank.profile_stage`), per stage, with
every tensor fake (``FakeTensorMode``: nothing allocated, so a model of any size is
profiled on a laptop) and each step run once for all device kinds
(:mod:`poplar.simulate.trace`: counted, then priced for each kind by the emulated
device's own roofline):

1. the stage's model states: the engine's own accounting, after two steps of two
   micro-batches of 1;
2. each kind's largest micro-batch: the bytes autograd saves in a forward and backward
   (what the emulated device counts) beside the states, against the kind's capacity,
   found by the probe's own search and checked by measuring the limit and one more;
3. each kind's timed points at its own sizes, the once-per-step part, and the step's
   anatomy (where its compute falls between the collectives).

The collectives' times are the network model's (:mod:`poplar.simulate.comm`). What a
fake tensor cannot say (a value: the loss, the gradient norm) reads as
:mod:`poplar.simulate.fake` gives it; only the step's time and memory depend on shapes.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable

import poplar
from poplar.cluster.spec import ClusterSpec, DeviceGroup, parse_cluster
from poplar.emulate.model import GpuModel
from poplar.engine.config import EngineConfig
from poplar.precision import cast_model, torch_dtype
from poplar.profile.fits import check_states_fit
from poplar.profile.options import ProfileOptions
from poplar.profile.probe import forward_backward, grow_then_bisect
from poplar.profile.profile import DOES_NOT_FIT, FITS_WITH_LESS, Profile, StageProfile
from poplar.profile.profiler import merge_stage
from poplar.profile.rank import optimizer_states_to_come, held_at_shares, shard_bytes
from poplar.profile.timing import RankRun, fraction_held, point_sizes, skewed_shares, timed_step
from poplar.simulate.comm import simulated_comm
from poplar.simulate.fake import fake_tensors
from poplar.simulate.trace import Activations, CountedMarks, CountingDevice, Steps, Trace
from poplar.stages import stage as zero_stage
from poplar.workload import Workload, as_workload


def simulate_stages(workload: str | Workload, cluster, options: ProfileOptions | None = None,
                    config: EngineConfig | None = None) -> dict[tuple[str, int], StageProfile]:
    """Every kind's stage profiles, simulated: ``{(kind, stage): StageProfile}``."""
    options, config = _resolved(options, config)
    wl, spec = as_workload(workload), parse_cluster(cluster)
    check_states_fit(wl, spec, options.precision)
    kinds: dict[str, DeviceGroup] = {}
    for d in spec.rank_devices():
        kinds.setdefault(d.kind, d)
    config = config.model_copy(update={"check_batches": False})   # the other ranks' batches are not there
    out = {}
    with fake_tensors():
        device = CountingDevice(spec, 0)
        with device:
            run = RankRun(device, 0, spec.world_size, wl, config, warmup=1, repeats=1)
            saved = _SAVED.get_or((wl.model_dump_json(), options.precision),
                                  lambda: Activations(_saved_bytes(device, wl, options.precision)))
            for stage in options.stages:
                for kind, sp in _stage(run, stage, options, kinds, saved).items():
                    out[(kind, stage)] = sp
    return out


def _saved_bytes(device: CountingDevice, wl: Workload, precision: str):
    """``m`` -> the bytes autograd saves at most in a forward and backward of ``m`` samples (the memory probe's
    run, the model's own parameters not counted again)."""
    model = cast_model(wl.build(), device.torch_device, torch_dtype(precision))
    own = {p.untyped_storage()._cdata for p in model.parameters()}

    def saved(m: int) -> int:
        device.peak_bytes = 0
        device.check_fits(lambda: (0, own), lambda: forward_backward(device, model, wl, m))
        model.zero_grad(set_to_none=True)
        device.free_memory()
        return device.peak_bytes
    return saved


def _stage(run: RankRun, stage: int, options: ProfileOptions, kinds: dict[str, DeviceGroup],
           saved: Activations) -> dict[str, StageProfile]:
    """Every kind's profile of ``stage`` (as :func:`poplar.profile.rank.profile_stage` decides, kind by kind)."""
    spec: ClusterSpec = run.device.cluster
    steps, recording = _counted(run, stage)
    before, most = recording.before, recording.most
    capacity = {k: spec.memory_bytes(d) for k, d in kinds.items()}
    headroom = {k: int(run.device.probe_headroom * capacity[k]) for k in kinds}
    sharded = shard_bytes(recording.engine, stage, options.precision)
    out = {}
    for k in kinds:
        fits = before + saved.exact(1) <= capacity[k]
        n = _largest(saved, most + headroom[k], capacity[k], options.max_micro_batch) if fits else 0
        memory = [(most, n)]
        if sharded and n < options.max_micro_batch:   # as the profiler measures: beside none of the sharded states
            fewer = most - sharded
            memory.insert(0, (fewer, _largest(saved, fewer + headroom[k], capacity[k], options.max_micro_batch)))
        if n:   # timed as far as a smaller share lets it go (the planner may give it one), its limit kept
            timed = _timed(steps, GpuModel.of(kinds[k]), max(n, memory[0][1]), most, options.n_points)
            out[k] = timed.model_copy(update={"max_micro_batch": n})
        elif memory[0][1]:   # holds a sample only with a smaller share of the states: timed up to that
            # and the most states beside which one sample fits, in place of the even share's (none fits there)
            memory[1] = (capacity[k] - headroom[k] - saved.exact(1), 1)
            timed = _timed(steps, GpuModel.of(kinds[k]), memory[0][1], most, options.n_points)
            out[k] = timed.model_copy(update={"max_micro_batch": 0, "note": FITS_WITH_LESS})
        else:
            out[k] = StageProfile(max_micro_batch=0, state_bytes=most if fits else before, note=DOES_NOT_FIT)
            continue
        out[k] = out[k].model_copy(update={"memory_points": memory})
    for k, (steps, gathers) in _share_steps(run, stage, recording, out, capacity, headroom, saved, kinds).items():
        out[k] = out[k].model_copy(update={"share_steps": steps, "share_gathers": gathers})
    return out


def _share_steps(run: RankRun, stage: int, recording: _Recording, timed: dict[str, StageProfile], capacity: dict,
                 headroom: dict, saved: Activations, kinds: dict[str, DeviceGroup]) -> dict[str, list]:
    """The once-per-step part at unlike shares, as the profiler times it (:func:`poplar.profile.rank._share_steps`:
    where every kind is timed at an even share and every rank holds a sample beside its states at both skews):
    each kind's ranks' shares, each priced from a step recorded on the first rank with the same shares as its:
    ``{kind: (share_steps, share_gathers)}``."""
    n, precision = run.world_size, run.config.mixed_precision
    if stage == 0 or n < 2 or any(not timed[k].max_micro_batch for k in kinds):
        return {}
    rank_kinds = [d.kind for d in run.device.cluster.rank_devices()]
    vectors = skewed_shares([capacity[k] for k in rank_kinds])
    engine = recording.engine
    units, sharded = [u.numel for u in engine.units], shard_bytes(engine, stage, precision)
    # a rank's figures depend on its kind and its weight only: one rank stands for those alike
    alike = [(v, r, k) for v in vectors for (k, _), r in {(k, v[r]): r for r, k in enumerate(rank_kinds)}.items()]
    if any(_largest(saved, held_at_shares(recording.most, sharded, units, stage, v, r, precision) + headroom[k],
                    capacity[k], 1) < 1 for v, r, k in alike):
        return {}
    out: dict[str, dict[float, tuple]] = {}
    traces: dict[tuple, Trace] = {}
    for v, r, k in alike:    # rank r's shares, moved to the first rank (slices of one size cost alike anywhere)
        first = (v[r], *(w for q, w in enumerate(v) if q != r))
        if first not in traces:
            traces[first] = _Recording.of(run, stage, list(first)).trace(1, 1)
        micro_step = timed[k].points[0][1] - timed[k].per_step_s
        gpu = GpuModel.of(kinds[k])
        out.setdefault(k, {})[fraction_held(v, r)] = (max(0.0, traces[first].busy(gpu) - micro_step),
                                                      traces[first].marks_on(gpu).gather_phase())
    return {k: ([(f, step) for f, (step, _) in sorted(points.items())],
                [(f, *phase) for f, (_, phase) in sorted(points.items())]) for k, points in out.items()}


# A kind is simulated alone: it is timed even where another kind does not fit (the planner then plans around the
# one that does not), and its notes are the profiler's (poplar.profile.profile).


class _Kept(OrderedDict):
    """The last ``most`` values made, by key."""

    def __init__(self, most: int):
        super().__init__()
        self.most = most

    def get_or(self, key, make: Callable[[], Any]) -> Any:
        if key in self:
            self.move_to_end(key)
        else:
            self[key] = make()
            while len(self) > self.most:
                self.popitem(last=False)
        return self[key]


# What a step runs depends on the model, the stage, the world's size and the engine's options, not on the
# devices: counted once a process, for every cluster simulated in it (as the saved bytes, by model and precision).
# Kept for the last few: the paper's evaluation simulates 24 models and worlds in one process.
_COUNTED = _Kept(most=16)
_SHARED = _Kept(most=8)     # the recordings at unlike shares
_SAVED = _Kept(most=4)


def _counted(run: RankRun, stage: int) -> tuple[Steps, _Recording]:
    """The stage's step traces for ``run``'s workload and world, and the recording (its states)."""
    step = (run.workload.model_dump_json(), stage, run.config.model_dump_json())

    def record() -> tuple[Steps, _Recording]:
        recording = _Recording(run, stage)
        checked = frozenset().union(*(s.held for key, (s, _) in _COUNTED.items() if key[:3] == step))
        steps = Steps(recording.trace, checked)
        steps.recorded(1, 2)    # two steps of two micro-batches of 1: the states at their most
        return steps, recording
    return _COUNTED.get_or((*step, run.world_size), record)


class _Recording:
    """A stage's steps recorded on one engine, re-planned to each micro-batch and accumulation after a warm-up
    step of one sample (the optimizer's states are made in it; the steps after it count the same operators as
    after a warm-up of two micro-batches); the model states around it.
    The engine lives on (fake: it holds no memory), for the sizes asked for later."""

    def __init__(self, run: RankRun, stage: int, shares: tuple[float, ...] | None = None):
        self.run, self.stage, self.shares = run, stage, shares
        self.engine = run.engine(self._plan(1, 1))
        self.before = self.engine.model_state_bytes() + optimizer_states_to_come(self.engine)
        timed_step(run.device, self.engine, run.workload.random_batch(1), run.workload.loss)
        self.most = 0

    @classmethod
    def of(cls, run: RankRun, stage: int, shares: list[float]) -> _Recording:
        """The stage's recording with ``shares`` of the states, made once a process (as the even one's steps)."""
        key = (run.workload.model_dump_json(), stage, run.config.model_dump_json(), run.world_size, tuple(shares))
        return _SHARED.get_or(key, lambda: cls(run, stage, tuple(shares)))

    def _plan(self, m: int, accumulation: int) -> poplar.Plan:
        return poplar.Plan(self.stage, [m] * self.run.world_size, accumulation, shard_shares=self.shares)

    def trace(self, m: int, accumulation: int) -> Trace:
        """The trace of a step of ``accumulation`` micro-batches of ``m``, with its marks."""
        run, wl, engine = self.run, self.run.workload, self.engine
        engine.set_plan(self._plan(m, accumulation))
        batch = wl.random_batch(m * accumulation)
        marks = CountedMarks(run.device)
        with marks.watch(engine), run.device.step(engine.held_state):
            engine.train_batch(batch, wl.loss)
            marks.mark("end", 0)
        if (m, accumulation) == (1, 2):
            self.most = engine.model_state_bytes()
        return Trace.of(run.device.recorder, marks, len(engine.units))


def _largest(saved: Activations, held: int, capacity: int, limit: int) -> int:
    """The probe's answer: the largest micro-batch up to ``limit`` whose saved bytes fit beside ``held``."""
    found = grow_then_bisect(lambda m: held + saved(m) <= capacity, limit)

    def fits(m: int) -> bool:
        return held + saved.exact(m) <= capacity

    if (found == 0 or fits(found)) and (found >= limit or not fits(found + 1)):
        return found     # read from the line, and measured: it fits, one more does not
    return grow_then_bisect(fits, limit)


def _timed(steps: Steps, gpu: GpuModel, limit: int, state: int, n_points: int) -> StageProfile:
    """A kind's points, once-per-step part and anatomy, priced from the stage's traces (as
    :func:`poplar.profile.timing.time_points` and :func:`poplar.profile.anatomy.measure_anatomy` measure)."""
    sizes = point_sizes(limit, n_points)
    one = [steps.at(m, 1).busy(gpu) for m in sizes]
    # the profiler's median over its smallest sizes of two steps of one against one of two: a counted step's
    # second micro-batch adds exactly the first's operators and the gradients' sum, whatever its size, so the
    # smallest size (recorded anyway, for the states) gives the same part without recording the others
    per_step = max(0.0, 2 * steps.at(1, 1).busy(gpu) - steps.at(1, 2).busy(gpu))
    anatomy = []
    for i in sorted({len(sizes) // 2, len(sizes) - 1}):     # a middle size and the largest
        trace = steps.at(sizes[i], 1)
        a = trace.marks_on(gpu).anatomy(trace.n_units, sizes[i])
        if a is not None:
            anatomy.append(a)
    timed = StageProfile(max_micro_batch=limit, state_bytes=state, points=list(zip(sizes, one)), per_step_s=per_step,
                         anatomy=sorted(anatomy, key=lambda a: a.micro_batch))
    return merge_stage([timed])     # as the profiler's: a size timed twice (a small limit) is one point


def simulate_profile(workload: str | Workload, cluster, options: ProfileOptions | None = None,
                     config: EngineConfig | None = None) -> Profile:
    """The :class:`Profile` of ``workload`` on ``cluster``, simulated (see the module)."""
    from poplar.profile.profiler import assemble

    options, config = _resolved(options, config)
    wl, spec = as_workload(workload), parse_cluster(cluster)
    stages = simulate_stages(wl, spec, options, config)
    with fake_tensors():     # the model is built once more, for its units: of any size
        profile = assemble(wl, spec, options.precision, config, stages, None)
    return profile.model_copy(update={"comm": simulated_comm(spec, wl.n_params())})


def _resolved(options: ProfileOptions | None, config: EngineConfig | None) -> tuple[ProfileOptions, EngineConfig]:
    """The options, and the engine's config in their precision (as :func:`poplar.profile.profile_cluster`)."""
    options = options or ProfileOptions()
    return options, (config or EngineConfig()).model_copy(update={"mixed_precision": options.precision})
