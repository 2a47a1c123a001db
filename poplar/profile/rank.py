"""What each rank of a profiled cluster runs, and the typed figures it hands back (:class:`RankProfile`).

Per stage, each rank
1. builds the engine for that stage and takes two steps of two micro-batches of 1, so
   the model states it holds at their most (optimizer states, and the gradients
   accumulated between micro-steps) are all there;
2. finds the largest micro-batch that fits its memory (:mod:`poplar.profile.probe`):
   the activations do not depend on the stage, the model states do and come from step 1;
3. times micro-batch sizes up to that limit (:mod:`poplar.profile.timing`), and at a
   middle size and the largest where the step's compute falls between its collectives
   (:mod:`poplar.profile.anatomy`).
Then the collectives are timed at the model's size and at a tiny one (their latency).

What differs between a real GPU and an emulated one is the device's
(:class:`poplar.devices.Device`): how a probe decides whether a micro-batch fits, how
much memory it leaves free, whether engines of several sizes may be alive at once.
"""

from __future__ import annotations

import statistics
from pydantic import BaseModel, ConfigDict

import poplar
from poplar.cluster.spec import parse_cluster
from poplar.engine.config import EngineConfig
from poplar.models.source import trained_and_frozen
from poplar.profile.anatomy import marked_step, measure_anatomy
from poplar.profile.options import ProfileOptions
from poplar.profile.probe import largest_micro_batch
from poplar.profile.procedure import States, at_even_share, timed_stage, with_less
from poplar.profile.profile import DOES_NOT_FIT, NOT_TIMED, CommProfile, StageProfile
from poplar.profile.timing import (RankRun, _time_group, fractions_held, skewed_shares, time_collectives,
                                   time_points, warm_up)
from poplar.profile.units import bucket_numels
from poplar.stages import OPTIMIZER_BYTES_PER_MASTER_BYTE
from poplar.stages import stage as zero_stage
from poplar.models.workload import Workload, as_workload


class RankProfile(BaseModel):
    """One rank's figures: its device kind's stage profiles as this rank measured them, the collectives' times."""

    model_config = ConfigDict(extra="forbid")

    kind: str
    stages: dict[int, StageProfile]
    comm: CommProfile
    dilation: float        # wall seconds per device second (1 but on an emulated device)
    overruns: int          # spans whose real work ran past the device's time


def profile_rank(rank: int, world_size: int, workload: str | Workload | dict, cluster: dict,
                 options: ProfileOptions, config: EngineConfig, progress=None) -> RankProfile:
    """What each rank of the cluster runs: ``options.stages`` profiled on its device, then the collectives.

    ``progress``: where the first rank of each device kind reports ``(kind, stage, what)`` (``put``).
    """
    from poplar.devices import rank_device

    spec = parse_cluster(cluster)
    spec.check_world_size(world_size)
    wl = as_workload(workload)
    kind = spec.device(rank).kind
    reports = [d.kind for d in spec.rank_devices()].index(kind) == rank   # the first rank of each kind
    with rank_device(spec, rank, wl, config.mixed_precision, most=options.max_micro_batch) as device:
        device.check_cluster(spec, rank)
        run = RankRun(device, rank, world_size, wl, config, options.warmup, options.repeats or device.timing_repeats,
                      kind, progress if reports else None)
        stages = {s: profile_stage(run, s, options) for s in options.stages}
        comm = time_collectives(device, trained_and_frozen(wl)[0], spec.node_groups(), repeats=run.repeats,
                                units=bucket_numels(wl, config))
        return RankProfile(kind=kind, stages=stages, comm=comm, dilation=device.dilation, overruns=device.overruns)


def profile_stage(run: RankRun, stage: int, options: ProfileOptions) -> StageProfile:
    """This rank's profile of its device in ``stage`` (every rank calls it at once: it agrees the sizes), as at an
    even share of the model states over the run's ranks.

    Where some rank holds no sample beside an even share, the ranks that do are given the sharded states (stages
    1-3) and the others timed beside none of them (:data:`~poplar.profile.profile.FITS_WITH_LESS`); where a rank holds no sample even so,
    or in stage 0, the ranks that do are timed among themselves and it is left out (:data:`DOES_NOT_FIT`). A
    profile timed at another share is written as at the even one (the planner takes it to any share).
    """
    return _profile(run, stage, options)[0]


def _profile(run: RankRun, stage: int, options: ProfileOptions) -> tuple[StageProfile, int]:
    """:func:`profile_stage`'s figures, and the sharded states' bytes this rank holds at an even share."""
    run.note(stage, "memory")
    even = _model_states(run, stage, options.precision)
    run.device.free_memory()   # the engine died with that frame: the probe holds the states itself
    if even.most is not None:
        return _timed(run, stage, options, even), even.sharded
    fits = run.each(even.fits_one)
    if stage and any(fits):
        shared = run.with_shares([1.0 if f else 0.0 for f in fits])
        states = _model_states(shared, stage, options.precision)
        run.device.free_memory()
        if states.most is not None:
            sp = _timed(shared, stage, options, states, fits[run.rank])
            return at_even_share(sp, states.sharded, even.sharded, run.device.capacity), even.sharded
    members = [r for r, f in enumerate(fits) if f]
    if not members:
        run.note(stage, "done")
        return StageProfile(max_micro_batch=int(even.fits_one), state_bytes=even.before, note=NOT_TIMED), 0
    among = run.among(members)
    if among is None:
        run.note(stage, "done")
        return StageProfile(max_micro_batch=0, state_bytes=even.before, note=DOES_NOT_FIT), 0
    sp, theirs = _profile(among, stage, options)
    return at_even_share(sp, theirs, even.sharded, run.device.capacity), even.sharded


class _RankMeasure:
    """The procedure's answers on this rank (:class:`~poplar.profile.procedure.Measure`): engines on its device,
    sizes and verdicts agreed with the other ranks of ``run``."""

    def __init__(self, run: RankRun, stage: int, options: ProfileOptions, states: States):
        self.run, self.stage, self.options, self.states = run, stage, options, states
        self.headroom = int(run.device.probe_headroom * run.device.capacity)

    def largest(self, held: int, limit: int) -> int:
        return largest_micro_batch(self.run.device, self.run.workload, held, limit=limit,
                                   precision=self.options.precision)

    def everyone(self, flag: bool) -> bool:
        return self.run.everyone(flag)

    def agree_sizes(self, mine: list[int]) -> list[list[int]]:
        return self.run.agree_sizes(mine)

    def time_points(self, rows: list[list[int]]) -> tuple[list[tuple[int, float]], float]:
        return time_points(self.run, self.stage, rows)

    def share_steps(self, row: list[int], micro_step: float) -> tuple[list, list]:
        return _share_steps(self.run, self.stage, self.states, self.options, row, micro_step)

    def anatomy(self, row: list[int]):
        return measure_anatomy(self.run, self.stage, row)

    def note(self, what: str) -> None:
        self.run.note(self.stage, what)


def _timed(run: RankRun, stage: int, options: ProfileOptions, states: States, fits: bool = True) -> StageProfile:
    """The procedure on this rank beside ``states`` (:func:`~poplar.profile.procedure.timed_stage`); ``fits``:
    whether this rank holds a sample beside an even share (else timed beside none of the sharded states)."""
    measure = _RankMeasure(run, stage, options, states)
    sp = timed_stage(measure, states, options.n_points, options.max_micro_batch)
    return sp if fits else with_less(measure, sp, run.device.capacity)


def _share_steps(run: RankRun, stage: int, states: States, options: ProfileOptions, row: list[int],
                 micro_step: float) -> tuple[list, list]:
    """The once-per-step part where the ranks hold unlike shares of the states (stages 1-3): its update grows with
    the share held, and unlike slices are gathered padded and copied out. Timed at the smallest sizes (``row``;
    this rank's micro-step there takes ``micro_step`` seconds) at two skews of the shares
    (:func:`~poplar.profile.timing.skewed_shares`), where every rank holds its sample beside its share of both.
    Not where the run is already at other shares or among some ranks only. Returns
    :attr:`~poplar.profile.profile.StageProfile.share_steps` and ``share_gathers``."""
    n = run.world_size
    if stage == 0 or n < 2 or run.shares is not None or run.group is not None:
        return [], []
    vectors = skewed_shares(run.agree_sizes([int(run.device.capacity)])[0])
    if not vectors:     # every rank as much memory (every rank agrees)
        return [], []
    headroom = int(run.device.probe_headroom * run.device.capacity)
    held = [held_at_shares(states.most, states.sharded, states.units, stage, v, run.rank, options.precision)
            for v in vectors]
    fits = all(largest_micro_batch(run.device, run.workload, h + headroom, limit=row[run.rank],
                                   precision=options.precision) >= row[run.rank] for h in held)
    if not run.everyone(fits):
        return [], []
    steps, gathers = [], []
    for shares in vectors:
        times: list[list[float]] = [[]]
        plan = poplar.Plan(stage, row, 1, shard_shares=shares)
        _time_group(run, stage, {0: plan}, times)
        marks, _ = marked_step(run, plan)
        run.device.free_memory()
        fraction = fractions_held(shares)[run.rank]
        steps.append((fraction, max(0.0, statistics.median(times[0]) - micro_step)))
        gathers.append((fraction, *marks.gather_phase()))
    return steps, gathers


def held_at_shares(most: int, sharded: int, units, stage: int, shares: list[float], rank: int,
                   precision: str) -> int:
    """The model states ``rank`` holds at their most with ``shares`` of them, from ``most`` at an even share (of
    which ``sharded`` bytes are its share; ``units``: the units' parameters)."""
    fractions = fractions_held(shares)
    return int(most + sharded * (fractions[rank] * len(shares) - 1)
               + zero_stage(stage).uneven_gather_bytes(fractions, list(units), precision))


def _model_states(run: RankRun, stage: int, precision: str) -> States:
    """The stage's model states, and whether every rank fits micro-batch 1 beside them."""
    # two micro-steps of one sample: the states held between micro-steps (accumulated
    # gradients) count too, as they will in any plan that accumulates
    engine = run.engine(poplar.Plan(stage, [1] * run.world_size, 2))
    # the optimizer's states come with its first step: counted before it, so that no rank
    # runs out of memory inside a step while the others wait for it in a collective
    before = engine.model_state_bytes() + optimizer_states_to_come(engine)
    fits, everyone = _fits_one(run, engine, before, precision)
    most = None
    if everyone:
        # optimizer states, then accumulated gradients, exist now (no figure read: at the host's speed)
        warm_up(engine, run.workload.random_batch(2), run.workload.loss, 2)
        most = engine.model_state_bytes()
    sharded = shard_bytes(engine, stage, precision)
    units = tuple(u.numel for u in engine.units)
    engine.close()
    return States(fits, before, most, sharded, units)


def shard_bytes(engine, stage: int, precision: str) -> int:
    """Bytes of the model states ``engine``'s rank holds only as its share of each unit."""
    return zero_stage(stage).sharded_bytes_per_param(precision) * sum(u.shard_numel for u in engine.units)


def optimizer_states_to_come(engine) -> int:
    """Bytes the profiler's AdamW will add at its first step: its moments, sized by what it updates."""
    if engine.optimizer.state:
        return 0
    return OPTIMIZER_BYTES_PER_MASTER_BYTE * sum(u.master.numel() * u.master.element_size() for u in engine.units)


def _fits_one(run: RankRun, engine, state_bytes: int, precision: str) -> tuple[bool, bool]:
    """Whether micro-batch 1 fits beside ``state_bytes`` of model state: on this rank, and on every rank."""
    held = run.device.state_to_reserve(state_bytes, engine.memory_report()["total"])
    fits = largest_micro_batch(run.device, run.workload, held, limit=1, precision=precision) == 1
    return fits, run.everyone(fits)
