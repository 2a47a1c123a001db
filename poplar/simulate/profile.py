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

import dataclasses
from typing import Callable

from poplar.cluster.spec import ClusterSpec, DeviceGroup, parse_cluster
from poplar.emulate.model import GpuModel
from poplar.engine.config import EngineConfig
from poplar.precision import cast_model, torch_dtype
from poplar.profile.fits import check_states_fit
from poplar.profile.options import ProfileOptions
from poplar.profile.probe import forward_backward, grow_then_bisect
from poplar.profile.procedure import States, at_even_share, timed_stage, with_less
from poplar.profile.profile import DOES_NOT_FIT, NOT_TIMED, Profile, StageProfile
from poplar.profile.profiler import merge_stage
from poplar.profile.rank import held_at_shares
from poplar.profile.timing import RankRun, fractions_held, skewed_shares
from poplar.simulate.comm import simulated_comm
from poplar.simulate.fake import fake_tensors
from poplar.simulate.layers import DEEP, SHALLOW, Shallow, deeper_info, layers_of
from poplar.simulate.recording import Kept, Recording, counted, model_key, shared
from poplar.simulate.trace import Activations, CountingDevice, Steps
from poplar.models.workload import ModelSource, Workload, as_workload


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
            saved = SAVED.get_or((model_key(wl), options.precision), lambda: _saved(device, wl, options.precision))
            for stage in options.stages:
                for kind, sp in _stage(run, stage, options, kinds, saved).items():
                    out[(kind, stage)] = sp
    return out


# The saved bytes depend on the model and the precision only, the model's units and their FLOPs on the engine's
# options too: each made once a process, for the last few.
SAVED = Kept(most=4)
_INFO = Kept(most=4)


def _saved(device: CountingDevice, wl: ModelSource, precision: str) -> Activations:
    """The bytes autograd saves at most in a step of ``m`` samples: drawn through the model with
    :data:`~poplar.simulate.layers.SHALLOW` layers and one more where its layers allow (each layer saves alike),
    checked at one more still; else measured on the model."""
    layers = layers_of(wl)
    if layers is None or layers < DEEP:
        return Activations(saved_bytes_of(device, wl, precision))
    a, b, c = (Activations(saved_bytes_of(device, Shallow(wl, d), precision))
               for d in (SHALLOW, SHALLOW + 1, SHALLOW + 2))
    drawn = _DrawnActivations(a, b, SHALLOW + 2)
    if all(drawn.exact(m) == c.exact(m) for m in (1, 2)):
        return _DrawnActivations(a, b, layers)
    return Activations(saved_bytes_of(device, wl, precision))


class _DrawnActivations(Activations):
    """The saved bytes of the model with ``layers`` layers, from those of two shallow ones (``a``, ``b``: one layer
    apart); each on its line where both are (:meth:`Activations.proven` of each)."""

    def __init__(self, a: Activations, b: Activations, layers: int):
        super().__init__(lambda m: a.exact(m) + (layers - SHALLOW) * (b.exact(m) - a.exact(m)))
        self.parts = (a, b)

    def proven(self, upto: int) -> bool:
        return all(p.proven(upto) for p in self.parts) and super().proven(upto)


def saved_bytes_of(device: CountingDevice, wl: ModelSource, precision: str):
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
    """Every kind's profile of ``stage``: the profiler's procedure (:mod:`poplar.profile.procedure`) for each kind,
    on the stage's counted steps priced on its roofline; where some kind holds no sample beside an even share, as
    the profiler goes on (:func:`poplar.profile.rank.profile_stage`): at other shares, or among the others."""
    spec: ClusterSpec = run.device.cluster
    steps, recording = counted(run, stage)
    measures = {k: _KindMeasure(steps, GpuModel.of(d), saved, spec.memory_bytes(d), run.device.probe_headroom)
                for k, d in kinds.items()}
    fits_one = {k: recording.before + saved.exact(1) <= m.capacity for k, m in measures.items()}
    if not all(fits_one.values()):    # (no step at an even share is run then)
        larger = None
        if stage and any(fits_one.values()):
            larger = _at_larger_shares(run, stage, options, kinds, saved, fits_one, recording.sharded)
        return larger or _among_members(run, stage, options, kinds, saved, fits_one, recording)
    states = States(True, recording.before, recording.most, recording.sharded, recording.units)
    fits = {k: m.largest(states.most + m.headroom, options.max_micro_batch) > 0 for k, m in measures.items()}
    shares = _Shares(run, stage, recording, measures, kinds) if stage and all(fits.values()) else None
    out = {}
    for k, m in measures.items():
        m.shares = (lambda micro_step, k=k: shares.of(k, micro_step)) if shares else None
        out[k] = merge_stage([_kind_stage(m, states, options, fits[k])])
    return out


def _at_larger_shares(run: RankRun, stage: int, options: ProfileOptions, kinds: dict[str, DeviceGroup],
                      saved: Activations, fits_one: dict[str, bool], even: int) -> dict[str, StageProfile] | None:
    """As the profiler where some kind holds no sample beside an even share
    (:func:`poplar.profile.rank.profile_stage`): the kinds that do hold the sharded states, the others none; each
    kind timed on the step recorded at those shares (its rank moved first) and written as at an even share
    (``even``: its sharded bytes there). None where some kind holds no sample even so."""
    spec: ClusterSpec = run.device.cluster
    rank_kinds = [d.kind for d in spec.rank_devices()]
    shares = [1.0 if fits_one[k] else 0.0 for k in rank_kinds]
    at_shares = {k: counted(run, stage, _moved_first(shares, rank_kinds.index(k))) for k in kinds}
    if any(rec.before + saved.exact(1) > spec.memory_bytes(kinds[k]) for k, (_, rec) in at_shares.items()):
        return None
    out = {}
    for k, (steps, rec) in at_shares.items():
        m = _KindMeasure(steps, GpuModel.of(kinds[k]), saved, spec.memory_bytes(kinds[k]), run.device.probe_headroom)
        sp = timed_stage(m, States(True, rec.before, rec.most, rec.sharded, rec.units), options.n_points,
                         options.max_micro_batch)
        sp = sp if fits_one[k] else with_less(m, sp, m.capacity)
        out[k] = merge_stage([at_even_share(sp, rec.sharded, even, m.capacity)])
    return out


def _among_members(run: RankRun, stage: int, options: ProfileOptions, kinds: dict[str, DeviceGroup],
                   saved: Activations, fits_one: dict[str, bool], recording) -> dict[str, StageProfile]:
    """As the profiler where some kind holds no sample even so: the kinds that do simulated among their own ranks
    (the cluster without the others), each written as at an even share of the whole cluster's; the others not
    timed (:data:`~poplar.profile.profile.DOES_NOT_FIT`)."""
    spec: ClusterSpec = run.device.cluster
    members = [r for r, d in enumerate(spec.rank_devices()) if fits_one[d.kind]]
    if not members:
        return {k: StageProfile(max_micro_batch=0, state_bytes=recording.before, note=NOT_TIMED) for k in kinds}
    out = {k: StageProfile(max_micro_batch=0, state_bytes=recording.before, note=DOES_NOT_FIT)
           for k in kinds if not fits_one[k]}
    sub = spec.subset(members)
    with CountingDevice(sub, 0) as device:
        among = dataclasses.replace(run, device=device, world_size=sub.world_size)
        theirs = _stage(among, stage, options, {k: d for k, d in kinds.items() if fits_one[k]}, saved)
        sharded = counted(among, stage)[1].sharded
    for k, sp in theirs.items():
        out[k] = at_even_share(sp, sharded, recording.sharded, spec.memory_bytes(kinds[k]))
    return out


def _moved_first(shares: list[float], rank: int) -> tuple[float, ...]:
    """``shares`` with ``rank``'s moved to the first rank, whose steps are recorded (slices of one size cost alike)."""
    return (shares[rank], *(w for q, w in enumerate(shares) if q != rank))


def _kind_stage(m: _KindMeasure, states: States, options: ProfileOptions, fits: bool) -> StageProfile:
    """One kind, as a rank of the profiler: timed beside an even share where it holds a sample there; else beside
    none of the sharded states, where it holds one there (:data:`~poplar.profile.profile.FITS_WITH_LESS`); else not at all."""
    if fits:
        return timed_stage(m, states, options.n_points, options.max_micro_batch)
    fewer = states.most - states.sharded
    if states.sharded and m.largest(fewer + m.headroom, 1):
        sp = timed_stage(m, states._replace(most=fewer, sharded=0), options.n_points, options.max_micro_batch)
        return at_even_share(with_less(m, sp, m.capacity), 0, states.sharded, m.capacity)
    return StageProfile(max_micro_batch=0, state_bytes=states.most, note=DOES_NOT_FIT)


class _KindMeasure:
    """The procedure's answers for one device kind (:class:`~poplar.profile.procedure.Measure`): the stage's
    counted steps priced on its roofline, its memory against its capacity; a kind is measured alone."""

    def __init__(self, steps: Steps, gpu: GpuModel, saved: Activations, capacity: int, headroom: float):
        self.steps, self.gpu, self.saved, self.capacity = steps, gpu, saved, capacity
        self.headroom = int(headroom * capacity)
        self.shares: Callable[[float], tuple[list, list]] | None = None   # the kind's share steps, where measured

    def largest(self, held: int, limit: int) -> int:
        return largest_that_fits(self.saved, held, self.capacity, limit)

    def everyone(self, flag: bool) -> bool:
        # a kind is measured alone: timed even where another kind's headroom leaves it no sample (the profiler's
        # ranks, agreeing, time none then; the planner plans around the one that has no room)
        return flag

    def agree_sizes(self, mine: list[int]) -> list[list[int]]:
        return [[m] for m in mine]

    def time_points(self, rows: list[list[int]]) -> tuple[list[tuple[int, float]], float]:
        """As :func:`poplar.profile.timing.time_points`: the once-per-step part from two steps of one sample
        against one of two (a counted step's second micro-batch adds exactly the first's operators and the
        gradients' sum, whatever its size: the smallest size gives the profiler's median)."""
        sizes = [row[0] for row in rows]
        per_step = max(0.0, 2 * self.steps.at(1, 1).busy(self.gpu) - self.steps.at(1, 2).busy(self.gpu))
        return [(m, self.steps.at(m, 1).busy(self.gpu)) for m in sizes], per_step

    def share_steps(self, row: list[int], micro_step: float) -> tuple[list, list]:
        return self.shares(micro_step) if self.shares else ([], [])

    def anatomy(self, row: list[int]):
        trace = self.steps.at(row[0], 1)
        return trace.marks_on(self.gpu).anatomy(trace.n_units, row[0])

    def note(self, what: str) -> None:
        pass


class _Shares:
    """The once-per-step part at unlike shares, as the profiler times it (:func:`poplar.profile.rank._share_steps`:
    where every kind holds a sample at an even share and every rank beside its states at both skews): each kind's
    ranks' shares, each priced from a step recorded on the first rank with the same shares as its."""

    def __init__(self, run: RankRun, stage: int, recording: Recording, measures: dict[str, _KindMeasure],
                 kinds: dict[str, DeviceGroup]):
        self.run, self.stage, self.measures, self.kinds = run, stage, measures, kinds
        rank_kinds = [d.kind for d in run.device.cluster.rank_devices()]
        vectors = skewed_shares([measures[k].capacity for k in rank_kinds])
        units, sharded = list(recording.units), recording.sharded
        # a rank's figures depend on its kind and its weight only: one rank stands for those alike
        self.alike = [(v, r, k) for v in vectors for (k, _), r in {(k, v[r]): r for r, k in enumerate(rank_kinds)}.items()]
        self.held = all(measures[k].largest(held_at_shares(recording.most, sharded, units, stage, v, r,
                                                           run.config.mixed_precision) + measures[k].headroom, 1) >= 1
                        for v, r, k in self.alike)

    def of(self, kind: str, micro_step: float) -> tuple[list, list]:
        """``kind``'s share steps and share gathers (:class:`~poplar.profile.profile.StageProfile`)."""
        if not self.held or self.run.world_size < 2:
            return [], []
        points: dict[float, tuple] = {}
        gpu = self.measures[kind].gpu
        for v, r, k in self.alike:    # rank r's shares, moved to the first rank
            if k != kind:
                continue
            trace = shared(self.run, self.stage, _moved_first(v, r))    # once a process
            points[fractions_held(v)[r]] = (max(0.0, trace.busy(gpu) - micro_step), trace.marks_on(gpu).gather_phase())
        return ([(f, step) for f, (step, _) in sorted(points.items())],
                [(f, *phase) for f, (_, phase) in sorted(points.items())])


def largest_that_fits(saved: Activations, held: int, capacity: int, limit: int) -> int:
    """The probe's answer: the largest micro-batch up to ``limit`` whose saved bytes fit beside ``held``."""
    found = grow_then_bisect(lambda m: held + saved(m) <= capacity, limit)
    if saved.proven(limit + 1):
        return found     # read from the line, exact up to one more than the limit: it fits, one more does not

    def fits(m: int) -> bool:
        return held + saved.exact(m) <= capacity

    if (found == 0 or fits(found)) and (found >= limit or not fits(found + 1)):
        return found     # read from the line, and measured: it fits, one more does not
    return grow_then_bisect(fits, limit)


def simulate_profile(workload: str | Workload, cluster, options: ProfileOptions | None = None,
                     config: EngineConfig | None = None) -> Profile:
    """The :class:`Profile` of ``workload`` on ``cluster``, simulated (see the module)."""
    from poplar.profile.profiler import assemble

    options, config = _resolved(options, config)
    wl, spec = as_workload(workload), parse_cluster(cluster)
    stages = simulate_stages(wl, spec, options, config)
    with fake_tensors():     # the model is built once more, for its units: of any size; once a process
        info = _INFO.get_or((model_key(wl), options.precision, config.model_dump_json()),
                            lambda: drawn_model_info(wl, options.precision, config))
    profile = assemble(wl, spec, options.precision, config, stages, None, info.model_copy(deep=True))
    comm = simulated_comm(spec, profile.model.trained_params, tuple(profile.model.unit_numels))
    return profile.model_copy(update={"comm": comm})


def drawn_model_info(wl: ModelSource, precision: str, config: EngineConfig):
    """What the profile says of the model (:func:`poplar.profile.profiler.model_info`), drawn from the model with
    one layer and two where its layers allow (:func:`~poplar.simulate.layers.deeper_info`), checked at three: its
    80 layers not built nor run; else the model's own."""
    from poplar.profile.profiler import model_info

    layers = layers_of(wl)
    if layers is None or layers < DEEP:
        return model_info(wl, precision, config)
    a, b, c = (model_info(Shallow(wl, d), precision, config) for d in (1, 2, 3))
    drawn = deeper_info(a, b, 3, 1)
    if drawn is None or drawn.model_copy(update={"name": c.name}) != c:
        return model_info(wl, precision, config)
    return deeper_info(a, b, layers, 1).model_copy(update={"name": wl.name})


def _resolved(options: ProfileOptions | None, config: EngineConfig | None) -> tuple[ProfileOptions, EngineConfig]:
    """The options, and the engine's config in their precision (as :func:`poplar.profile.profile_cluster`)."""
    options = options or ProfileOptions()
    return options, (config or EngineConfig()).model_copy(update={"mixed_precision": options.precision})
