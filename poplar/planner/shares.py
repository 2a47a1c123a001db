"""Uneven shares of the model states: what a kind can do at its share, and the shares the planner tries.

In stages 1-3 a rank may hold any fraction ``f`` of its group's copy of the sharded
states (:attr:`poplar.plan.Plan.shard_shares`). Against the even share ``1/n`` it holds
``(f - 1/n)`` of the model's parameters times the stage's bytes per parameter held
(:meth:`poplar.stages.ZeroStage.sharded_bytes_per_param`: defined once) more, and its
largest micro-batch is what the profile's memory points say beside those states
(:meth:`~poplar.profile.profile.StageProfile.max_micro_batch_at`): a small card that gives
up its share takes larger micro-batches, the big card that takes it smaller ones. Its
update grows with its share (on the line from the stage's update at an even share to
ZeRO-0's, the whole model's, where the profile has one). Every all-gather of unlike
shards moves every rank's slice padded to the largest (:mod:`poplar.engine.collectives`):
``n`` times the largest fraction of the even gather (:func:`gather_scale`).

The planner tries each kind's weight proportional to a power of its memory
(:data:`POWERS`: 0 is the even split, 1 memory-proportional shares, the baseline; more
skews further), and proportional to the states each kind has room for beside ``m``
samples (:func:`room_shares`, ``m`` = 1, 2, 4, ...: every kind then holds ``m``, where the
cluster has that room at all: this finds the shares that fit a model no power does), with
every rank of a kind alike.

>>> weights({"big": 80.0, "small": 40.0}, ["big", "small", "small"], 1)
[2.0, 1.0, 1.0]
>>> gather_scale([0.5, 0.25, 0.25])
1.5
"""

from __future__ import annotations

import math

import numpy as np

from poplar.profile.profile import Profile, StageProfile
from poplar.stages import stage as zero_stage

POWERS = (0.5, 1.0, 1.5, 2.0, 3.0)   # memory ** power: the shares' weights tried besides the even split
PROPORTIONAL = 1.0                   # the baseline: shares in proportion to each device's memory
ROOM_TRIES = 8                       # room shares for 1, 2, 4 ... 128 samples at most


def weights(memory: dict[str, float], rank_kinds: list[str], power: float) -> list[float]:
    """Each rank's weight: its memory to ``power``, relative to the smallest kind's (0: even)."""
    least = min(memory[k] for k in rank_kinds)
    return [round((memory[k] / least) ** power, 6) for k in rank_kinds]


def fractions(shares: list[float]) -> list[float]:
    total = sum(shares)
    return [s / total for s in shares]


def gather_scale(fraction: list[float]) -> float:
    """How many times the even all-gather's bytes an all-gather of these fractions moves."""
    return len(fraction) * max(fraction)


def gather_buffer_bytes(fraction: list[float], stage: int, unit_numels: list[int], precision: str) -> float:
    """ZeRO-3's gather buffers with unlike slices (:meth:`poplar.stages.ZeroStage.uneven_gather_bytes`)."""
    return zero_stage(stage).uneven_gather_bytes(fraction, unit_numels, precision)


def stage_at_share(sp: StageProfile, *, stage: int, precision: str, n_params: int, world: int, fraction: float,
                   capacity: float, full: StageProfile | None = None, buffers: float = 0.0,
                   uneven: bool = False, bandwidth_gbs: float | None = None) -> StageProfile:
    """``sp`` (measured at an even share over ``world`` ranks) for a rank holding ``fraction`` of the states, and
    ``buffers`` bytes more (:func:`gather_buffer_bytes`); ``uneven``: the ranks' shares differ; ``bandwidth_gbs``:
    the kind's memory bandwidth (:func:`update_at`)."""
    even = 1 / world
    more = zero_stage(stage).sharded_bytes_per_param(precision) * n_params * (fraction - even)
    state = sp.state_bytes + more + buffers
    if uneven and len({f for f, _ in sp.share_steps}) >= 2:
        per_step = _on_line(sp.share_steps, fraction)
    else:
        per_step = update_at(sp, fraction, even, full, more, bandwidth_gbs, grow_only=True)
    largest = sp.max_micro_batch_at(state, capacity) if sp.points else 0
    if largest == 0 or not sp.points:
        return sp.model_copy(update={"state_bytes": int(state), "max_micro_batch": 0, "points": [],
                                     "per_step_s": per_step})
    shift = per_step - sp.per_step_s
    points = [(m, t + shift) for m, t in sp.points if m <= largest]
    if not points:   # every measured point is too large now: the compute scales down from the first
        m0, t0 = sp.points[0]
        points = [(largest, (t0 - sp.per_step_s) * largest / m0 + per_step)]
    elif largest > points[-1][0]:   # more than measured: on the line through the last two points, not the spline's
        (ma, ta), (mb, tb) = (points[-2] if len(points) > 1 else (0, shift + sp.per_step_s)), points[-1]
        points.append((largest, tb + (tb - ta) / (mb - ma) * (largest - mb)))
    return sp.model_copy(update={"state_bytes": int(math.ceil(state)), "max_micro_batch": largest,
                                 "points": points, "per_step_s": per_step,
                                 "anatomy": _gathers_at(sp, fraction, uneven)})


UPDATE_PASSES = 2   # an update reads each byte of the states it shards and writes it back


def update_at(sp: StageProfile, fraction: float, even: float, full: StageProfile | None, more_bytes: float,
              bandwidth_gbs: float | None, grow_only: bool = False) -> float:
    """The once-per-step part (the update) of a rank holding ``fraction`` of the sharded states, ``more_bytes``
    more than at the profile's ``even`` share: on the line from the even share's to ZeRO-0's (the whole model's
    update) where the kind has one; else the even share's plus those bytes read and written at the kind's memory
    bandwidth, where it is known (the even share's is mostly fixed costs at a large world: launches, the norm);
    else, for a larger share, the even share's times ``fraction / even`` (``grow_only``: the even share's)."""
    if full is not None and even < 1:
        return max(0.0, sp.per_step_s + (full.per_step_s - sp.per_step_s) * (fraction - even) / (1 - even))
    if fraction <= even:
        return sp.per_step_s
    if bandwidth_gbs:
        return sp.per_step_s + UPDATE_PASSES * more_bytes / (bandwidth_gbs * 1e9)
    return sp.per_step_s if grow_only else sp.per_step_s * fraction / even


def _on_line(points: list[tuple[float, float]], fraction: float) -> float:
    """The seconds at ``fraction`` on the line fit through ``points`` ((fraction, seconds); two fractions or more),
    never falling: holding more never costs less, and a falling line is noise."""
    f, t = np.array(points, dtype=float).T
    slope = max(0.0, np.polyfit(f, t, 1)[0])
    return max(0.0, float(np.mean(t) + slope * (fraction - np.mean(f))))


def _gathers_at(sp: StageProfile, fraction: float, uneven: bool) -> list | None:
    """``sp``'s anatomy with the parameter all-gathers' own work (stages 1-2) at ``fraction``, where the shares
    are unlike and it was measured so (:attr:`~poplar.profile.profile.StageProfile.share_gathers`)."""
    if not (uneven and sp.anatomy and len({f for f, *_ in sp.share_gathers}) >= 2):
        return sp.anatomy
    issue = _on_line([(f, i) for f, i, _ in sp.share_gathers], fraction)
    copy = _on_line([(f, c) for f, _, c in sp.share_gathers], fraction)
    return [a.model_copy(update={"gather_issue_s": issue, "gather_copy_s": copy}) for a in sp.anatomy]


def room_shares(profile: Profile, stage: int, kinds: list[str]) -> dict[int, list[float]]:
    """``{m: each rank's weight}``: in proportion to the sharded states its kind holds at most beside ``m`` samples
    (as :func:`stage_at_share` reads the memory points), for each ``m`` = 1, 2, 4, ... the cluster has room for."""
    model = profile.model
    whole = zero_stage(stage).sharded_bytes_per_param(model.dtype) * model.trained_params
    out = {}
    for m in (2 ** i for i in range(ROOM_TRIES)):
        shares, buffers = None, 0.0
        for _ in range(2):   # the rooms beside the gathers' buffers that the shares they give would need
            room = {k: _room(profile.stage(k, stage), whole, profile.world_size, profile.devices[k].memory_gb * 2**30,
                             m, buffers) for k in dict.fromkeys(kinds)}
            if min(room.values()) <= 0 or sum(room[k] for k in kinds) < whole:
                return out
            most = max(room.values())    # the largest room 1 (a room of next to nothing: a share of 0)
            shares = [math.floor(room[k] / most * 1e6) / 1e6 for k in kinds]
            buffers = gather_buffer_bytes(fractions(shares), stage, model.unit_numels, model.dtype)
        out[m] = shares
    return out


def _room(sp: StageProfile, whole: float, world: int, capacity: float, micro_batch: int, buffers: float) -> float:
    """The most bytes of the sharded states beside which ``micro_batch`` samples and ``buffers`` fit (0: not even
    with none)."""
    if not sp.points:
        return 0.0
    base = sp.state_bytes - whole / world + buffers     # the states held at a share of 0
    if sp.max_micro_batch_at(base, capacity) < micro_batch:
        return 0.0
    lo, hi = base, base + whole                  # fits at lo; past hi no share matters
    if sp.max_micro_batch_at(hi, capacity) >= micro_batch:
        return whole
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sp.max_micro_batch_at(mid, capacity) >= micro_batch else (lo, mid)
    return (lo - base) * (1 - 1e-6)
