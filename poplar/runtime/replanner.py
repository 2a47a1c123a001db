"""A plan that follows the cluster: measured steps against the plan's prediction, a new plan where it pays.

Every step every rank gathers each rank's step and busy time (:class:`~poplar.runtime.step_figures.StepFigures`,
one small all-gather), so every rank holds the same figures and :meth:`Replanner.observe`
decides alike on every rank without a word more: the gather is the agreement. A step
counts as *off* when its time, or a rank's busy time, is more than ``threshold`` from what
the plan predicts. After ``patience`` such steps in a row (and not within ``every`` steps
of the last re-plan), each rank's compute is rescaled by what it measured against its
prediction (:class:`~poplar.planner.replan.PlanBasis`), the planner searches the same
global batch again in the plan's stage, shape and shares, and the new plan is taken from
the next step where it is predicted faster by more than half the threshold; where the loop
can change stage (through a checkpoint), the planner's plan of another profiled stage is
taken instead where it is predicted faster still by the whole threshold. Either way
the rescaled prediction becomes the one steps are held to (with the step time's own
residual, so a cost model a little off on this cluster is not re-planned over and over).

Who takes part is weighed too (``who``): the planner plans the global batch over the whole
profile (:meth:`~poplar.planner.replan.PlanBasis.regroup`: the run's ranks at their measured
speeds, the ranks sitting out as profiled), so a card that sat out is weighed again when the
others slow, and one that became a drag may sit out. Where that plan takes other ranks and is
predicted faster than the best on these ranks by the whole threshold, the re-plan names them
(:attr:`Replan.ranks`): the run stops at the step boundary with a checkpoint and its launcher
starts it again on them (``who="relaunch"``: ``poplar train`` spawning an emulated cluster,
:mod:`poplar.train.relaunch`); where nothing can launch other ranks (``who="said"``: torchrun's
ranks) that is said once (:meth:`Replanner.notice`) and the run goes on as it is.

Not counted: the first step after the start and after each change (a warm-up), and a
step in which an emulated device's real work ran past its declared time (``overruns``:
the host's time, not the device's) by more than :data:`LATE_SHARE` of the threshold of
the step; a step late by less is counted (a host late on every step by a little must not
freeze re-planning where it is: it cannot put a step off by itself). A new split of the same global batch leaves every
update exactly what it was (:meth:`poplar.engine.engine.Engine.set_plan`).

When: :class:`ReplanConfig` (``poplar train``'s ``replan:`` section, an integration's ``replan=``,
:func:`replan_config`).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Literal

from poplar.plan import Plan
from poplar.runtime.replan_settings import ReplanConfig, replan_config  # noqa: F401  (the settings, beside)
from poplar.planner.replan import SPEED_STEP, PlanBasis, kept_speed

LATE_SHARE = 0.25    # of the threshold: a step whose host lateness is under this share of its time still counts
Who = Literal["kept", "said", "relaunch"]   # who takes part: not weighed; weighed and said; weighed and changed


@dataclass(frozen=True)
class Replan:
    """One re-plan: after step ``step`` (from 1), ``before`` gave way to ``after``."""

    step: int
    why: str
    before: Plan
    after: Plan
    speeds: list[float]         # each rank's compute time over its profile's
    measured_step_s: float      # the steps that led here (median)
    kept_step_s: float          # the plan before, predicted at these speeds
    predicted_step_s: float     # the plan after, predicted at these speeds
    ranks: list[int] | None = None          # the profile ranks ``after`` is for, where they change (a re-launch)
    ranks_before: list[int] | None = None   # the profile ranks ``before`` was for, beside them
    after_speeds: list[float] | None = None  # the speed of each of ``ranks`` (those sitting out till now: 1.0)

    def record(self) -> dict:
        moved = {} if self.ranks is None else {"ranks": {"before": self.ranks_before, "after": self.ranks}}
        return {"after_step": self.step, "why": self.why, "before": self.before.to_dict(),
                "after": self.after.to_dict(), "speeds": self.speeds, "measured_step_s": self.measured_step_s,
                "kept_step_s": self.kept_step_s, "predicted_step_s": self.predicted_step_s, **moved}

    def line(self) -> str:
        moved = "" if self.ranks is None else (f"; re-launched on profile rank {', '.join(map(str, self.ranks))} "
                                               f"(was {', '.join(map(str, self.ranks_before))}) from this step's "
                                               "checkpoint")
        return (f"poplar: re-planned after step {self.step}: {self.why}; {self.before} -> {self.after}, "
                f"predicted {self.kept_step_s * 1e3:.3g} -> {self.predicted_step_s * 1e3:.3g} ms a step "
                f"(measured {self.measured_step_s * 1e3:.3g}){moved}")


class Replanner:
    """Holds a run's steps to its plan's prediction; see the module's docstring."""

    def __init__(self, config: ReplanConfig, basis: PlanBasis, plan: Plan, restage: bool = False, who: Who = "kept"):
        """``restage``: another ZeRO stage may be taken where it is predicted faster by the whole threshold (the
        loop can change stage: through a checkpoint, :meth:`~poplar.runtime.rank.RankRuntime.change_plan`);
        ``who``: whether who takes part is weighed, and whether the run can change it (see the module's
        docstring)."""
        self.config, self.basis, self.plan, self.restage, self.who = config, basis, plan, restage, who
        self.speeds = list(basis.speeds) if basis.speeds is not None else [1.0] * plan.world_size
        self.expected = basis.predict(plan, self.speeds)
        self.said: str | None = None     # a line for the run to print (:meth:`notice`), said once
        self.told = False
        self.residual = 1.0            # measured step over predicted, where the speeds explain the busy times
        self.window: list = []         # the off steps in a row, each's figures
        self.last_change: int | None = None
        self.settling = True
        self.stopped: str | None = None   # why re-planning stopped (the run goes on with its plan)

    def observe(self, step: int, figures) -> Replan | None:
        """After step ``step`` (from 1), with every rank's figures: the re-plan to train with from the next step.
        A plan that cannot be searched (a profile the rescaled speeds break) stops re-planning, never the run:
        every rank meets the same error on the same figures, so all stop alike."""
        if self.stopped:
            return None
        if self.settling or self._late(figures):
            self.settling = False
            return None
        self.window = [*self.window, figures][-self.config.patience:] if self._off(figures) else []
        if len(self.window) < self.config.patience or (
                self.last_change is not None and step - self.last_change < self.config.every):
            return None
        try:
            return self._evaluate(step)
        except (ValueError, ArithmeticError) as e:
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
            self.stopped = f"re-planning stops after step {step}, the plan kept: {why}"
            return None

    def _late(self, figures) -> bool:
        """Whether the host's lateness (the most device seconds a rank's overruns added) may have put it off."""
        return figures.late_s > LATE_SHARE * self.config.threshold * figures.step_s

    def _off(self, figures) -> bool:
        limit = self.config.threshold
        if abs(figures.step_s / (self.residual * self.expected.step_s) - 1) > limit:
            return True
        return any(abs(b / p - 1) > limit for b, p in zip(figures.busy_s, self.expected.busy_s) if p > 0)

    def _evaluate(self, step: int) -> Replan | None:
        busy = [statistics.median(f.busy_s[i] for f in self.window) for i in range(len(self.speeds))]
        measured = statistics.median(f.step_s for f in self.window)
        speeds = [kept_speed(s * b / p) if p > 0 else s for s, b, p in zip(self.speeds, busy, self.expected.busy_s)]
        kept = self.basis.predict(self.plan, speeds)
        found, predicted = self.basis.replan(self.plan, speeds)
        other = self.basis.restage(self.plan, speeds) if self.restage else None
        if other is not None and other[1].step_s * (1 + self.config.threshold) < min(predicted.step_s, kept.step_s):
            found, predicted = other
        moved = self._regroup(speeds, min(predicted.step_s, kept.step_s))
        why = _why(self.speeds, speeds, measured / (self.residual * self.expected.step_s))
        self.speeds, self.window, self.residual = speeds, [], measured / kept.step_s
        if moved is not None:
            found, predicted, ranks = moved
            at = dict(zip(self.basis.ranks, speeds))
            change = Replan(step, why, self.plan, found, speeds, measured, kept.step_s, predicted.step_s, ranks,
                            list(self.basis.ranks), [at.get(r, 1.0) for r in ranks])
        elif found == self.plan or predicted.step_s * (1 + self.config.threshold / 2) > kept.step_s:
            self.expected = kept
            return None
        else:
            change = Replan(step, why, self.plan, found, speeds, measured, kept.step_s, predicted.step_s)
        self.plan, self.expected, self.last_change, self.settling = found, predicted, step, True
        return change

    def _regroup(self, speeds: list[float], best_s: float):
        """The planner's plan over the whole profile, its prediction and its ranks, where it takes other ranks than
        the run's and is predicted faster than ``best_s`` (the best on these ranks) by the whole threshold, and the
        run can change who takes part (where it cannot, that is said once); None otherwise."""
        if self.who == "kept":
            return None
        found = self.basis.regroup(self.plan, speeds)
        if found is None or found[2] == list(self.basis.ranks) or \
                found[1].step_s * (1 + self.config.threshold) >= best_s:
            return None
        if self.who == "relaunch":
            return found
        if not self.told:
            self.told = True
            self.said = (f"a plan on profile rank {', '.join(map(str, found[2]))} is predicted "
                         f"{best_s / found[1].step_s:.2f}x as fast as these ranks' best; a change of who takes part "
                         "needs the launcher to start the ranks (`poplar train` on an emulated cluster): this run "
                         "keeps its ranks")
        return None

    def notice(self) -> str | None:
        """A line to print once (where the run cannot change who takes part), then None."""
        said, self.said = self.said, None
        return said


def _why(before: list[float], after: list[float], off: float) -> str:
    """The ranks whose speed moved (more than the noise of a few steps), and how far the steps were off."""
    moved = [f"rank {i} computes at {1 / s:.2f}x its profile's speed (was {1 / b:.2f}x)"
             for i, (b, s) in enumerate(zip(before, after)) if abs(s / b - 1) > 2 * SPEED_STEP]
    return (", ".join(moved) or "the ranks compute as they did") + f"; steps measured {off:.2f}x the prediction"


def replanner_for(replan: ReplanConfig, basis: PlanBasis | None, plan: Plan, world_size: int,
                  baseline: str = "poplar", restage: bool = False, who: Who = "kept") -> Replanner | None:
    """The run's :class:`Replanner` (``replan``: its :class:`ReplanConfig`; ``restage``: the
    loop can change stage; ``who``: who takes part weighed), or None where its plan is kept: ``replan: off``, a plan
    given without the planning it came from, a baseline's allocation (trained to be measured as it is), a rank
    alone (unless others sat out and who takes part is weighed)."""
    if replan.mode == "off" or basis is None or baseline != "poplar":
        return None
    if world_size < 2 and (who == "kept" or basis.profile.world_size < 2):
        return None
    try:
        return Replanner(replan, basis, plan, restage, who)
    except ValueError:    # the plan is not one this profile predicts (another's, resumed): kept as it is
        return None
