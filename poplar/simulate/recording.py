"""A stage's steps recorded on fake tensors, once a process: by model, stage, engine options, world size and
shares of the states (what a step runs depends on those, not on the devices it is priced for).

A deep model's steps are drawn from two shallow ones where its layers allow (:mod:`poplar.simulate.layers`); each
recording's engine lives on (fake: it holds no memory) for the sizes asked of it later.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections import OrderedDict
from typing import Any, Callable

import poplar
from poplar.profile.rank import optimizer_states_to_come, shard_bytes
from poplar.profile.timing import RankRun, timed_step
from poplar.simulate.layers import DEEP, SHALLOW, DeepRecording, Shallow, layers_of, shallowest
from poplar.simulate.trace import CountedMarks, Steps, Trace
from poplar.models.workload import ModelSource


class Kept(OrderedDict):
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
COUNTED = Kept(most=16)
SHARED = Kept(most=64)    # the steps at unlike shares
DRAWN: dict[tuple, bool] = {}    # (model, stage, engine options, depth) -> whether deep steps are drawn from there


def counted(run: RankRun, stage: int, shares: tuple[float, ...] | None = None) -> tuple[Steps, Any]:
    """The stage's step traces for ``run``'s workload and world (at ``shares`` of the states: None, even), and
    the recording (its states)."""
    step = (model_key(run.workload), stage, run.config.model_dump_json())

    def record() -> tuple[Steps, Any]:
        recording = recorded(run, stage, shares)
        checked = frozenset().union(*(s.held for key, (s, _) in COUNTED.items() if key[:3] == step))
        return Steps(recording.trace, checked), recording
    return COUNTED.get_or((*step, run.world_size, shares), record)


def shared(run: RankRun, stage: int, shares: tuple[float, ...]) -> Trace:
    """The stage's step of one sample with ``shares`` of the states, recorded once a process on the even share's
    engine re-cut to them (:meth:`Recording.recut`: no engine built nor warmed up a share vector)."""
    key = (model_key(run.workload), stage, run.config.model_dump_json(), run.world_size, tuple(shares))
    return SHARED.get_or(key, lambda: counted(run, stage)[1].recut(tuple(shares)).trace(1, 1))


def recorded(run: RankRun, stage: int, shares: tuple[float, ...] | None = None):
    """The stage's recording: drawn from the model with a few of its layers where they allow
    (:func:`_drawn`), else the model's own."""
    if shares is not None:   # the even share's engine, re-cut: nothing built again
        return counted(run, stage)[1].recut(shares)
    layers = layers_of(run.workload)
    if layers is None or layers < DEEP:
        return Recording(run, stage)
    return _drawn(run, stage, layers, shallowest(stage))


def _drawn(run: RankRun, stage: int, layers: int, shallow: int):
    """The recording drawn from the model with ``shallow`` layers and one more (:mod:`poplar.simulate.layers`),
    the drawing checked against a recording of one more still, once a model, stage, engine options and depth;
    where it fails, drawn from one layer more (up to :data:`~poplar.simulate.layers.SHALLOW`), then the model's
    own."""
    def other():
        return _drawn(run, stage, layers, shallow + 1) if shallow < SHALLOW else Recording(run, stage)
    a, b = (Recording(dataclasses.replace(run, workload=Shallow(run.workload, d)), stage)
            for d in (shallow, shallow + 1))
    deep = DeepRecording(a, b, layers, other, shallow=shallow)
    key = (model_key(run.workload), stage, run.config.model_dump_json(), shallow)
    if key in DRAWN:
        return deep if DRAWN[key] else other()
    c = Recording(dataclasses.replace(run, workload=Shallow(run.workload, shallow + 2)), stage)
    if not deep.states_match(c):     # what the engines hold before a step: no step run
        DRAWN[key] = False
        return other()
    # the steps checked before the first is drawn: a recording whose steps are never asked for runs none
    deep.check = lambda: DRAWN[key] if key in DRAWN else DRAWN.setdefault(key, deep.steps_match(c))
    return deep


class Recording:
    """A stage's steps recorded on one engine, re-planned to each micro-batch and accumulation after a warm-up
    step of one sample (the optimizer's states are made in it; the steps after it count the same operators as
    after a warm-up of two micro-batches); the model states around it.
    The engine lives on (fake: it holds no memory), for the sizes asked for later; nothing is run until a step
    or the states at their most are asked for (the states before a step are the engine's, as built).
    :meth:`recut` gives the same engine's recording at other shares of the states: nothing built again."""

    def __init__(self, run: RankRun, stage: int, shares: tuple[float, ...] | None = None):
        self.run, self.stage, self.shares = run, stage, shares
        self.engine = run.engine(self._plan(1, 1))
        self._home = shares     # the shares the engine was built at, and is warmed up at
        self._warm = [False]    # the engine's, shared with the recordings re-cut from this one
        self._states()
        self._most = None
        self._traces: dict[tuple[int, int], Trace] = {}   # each size once: the steps after the warm-up count alike

    def _states(self) -> None:
        """The model states before a step and the sharded bytes, as the engine is cut now (read at once: the
        engine is cut again for the recordings that share it)."""
        engine = self.engine
        self.before = engine.model_state_bytes() + optimizer_states_to_come(engine)
        self.sharded = shard_bytes(engine, self.stage, self.run.config.mixed_precision)

    @property
    def most(self) -> int:
        """The model states at their most: after a step of two micro-batches of one sample."""
        if self._most is None:
            self.trace(1, 2)
        return self._most

    @property
    def units(self) -> tuple[int, ...]:
        return tuple(u.numel for u in self.engine.units)

    def recut(self, shares: tuple[float, ...]) -> Recording:
        """This engine's recording with ``shares`` of the states: its states re-cut to them before each of its
        steps (the engine's own :meth:`~poplar.engine.Engine.set_plan`, as re-planning cuts them), warmed up once
        for both; the same states and operators as an engine built and warmed up at those shares."""
        other = copy.copy(self)
        other.shares, other._most, other._traces = tuple(shares), None, {}
        self.engine.set_plan(other._plan(1, 1))
        other._states()
        return other

    @property
    def recorded(self) -> tuple[tuple[int, int], ...]:
        """The ``(micro-batch, accumulation)`` steps recorded so far (a step is run only when its trace is asked)."""
        return tuple(self._traces)

    def _plan(self, m: int, accumulation: int) -> poplar.Plan:
        return poplar.Plan(self.stage, [m] * self.run.world_size, accumulation, shard_shares=self.shares)

    def trace(self, m: int, accumulation: int) -> Trace:
        """The trace of a step of ``accumulation`` micro-batches of ``m``, with its marks."""
        if (m, accumulation) not in self._traces:
            self._traces[(m, accumulation)] = self._record(m, accumulation)
        return self._traces[(m, accumulation)]

    def _record(self, m: int, accumulation: int) -> Trace:
        run, wl, engine = self.run, self.run.workload, self.engine
        if not self._warm[0]:
            engine.set_plan(poplar.Plan(self.stage, [1] * run.world_size, 1, shard_shares=self._home))
            timed_step(run.device, engine, wl.random_batch(1), wl.loss)
            self._warm[0] = True
        engine.set_plan(self._plan(m, accumulation))
        batch = wl.random_batch(m * accumulation)
        marks = CountedMarks(run.device)
        with marks.watch(engine), run.device.step(engine.held_state):
            engine.train_batch(batch, wl.loss)
            marks.mark("end", 0)
        if (m, accumulation) == (1, 2):
            self._most = engine.model_state_bytes()
        return Trace.of(run.device.recorder, marks, tuple(u.numel for u in engine.units))


def model_key(wl: ModelSource) -> str:
    """The model source's identity, as a key of the process's memos."""
    return json.dumps(wl.identity(), sort_keys=True)
