"""Planning again while training: the profile's curves rescaled by what each rank now measures.

A profile is taken once; a card that throttles, a neighbour that takes a GPU's memory
bandwidth or a profile taken on another cluster make a rank compute slower (or faster)
than its kind's curves say. :class:`PlanBasis` is what a run keeps of its planning to plan
again: the profile and which of its ranks the plan's ranks are. :meth:`PlanBasis.cost`
is the cost model with each plan rank's compute times multiplied by its ``speeds`` factor
(1: as profiled; 2: twice the time), ranks of one kind with unlike factors split into kinds
of their own; :meth:`PlanBasis.replan` searches the best split of the same global batch on
it in the plan's ZeRO stage and shape (the engine keeps those; it cuts other shares of the states in place), and
:meth:`PlanBasis.regroup` plans it over the whole profile, as the planner plans a cluster (who takes part too: the
plan's ranks at their speeds, the profile's others as profiled).
"""

from __future__ import annotations

from dataclasses import dataclass

from poplar.plan import Plan
from poplar.planner.groups import groups_shape
from poplar.planner.cost import CostModel, Prediction
from poplar.planner.search import allocate, measured_proportional, uniform
from poplar.profile.profile import Profile, StageProfile

SPEED_STEP = 0.01   # factors are kept to this: ranks of a kind this close share one rescaled kind


def kept_speed(speed: float) -> float:
    """A speed factor to the step kept, within what a card can be (a rank measured idle is not infinitely fast)."""
    return min(max(round(speed / SPEED_STEP), 1), 10_000) * SPEED_STEP


def slowed_stage(sp: StageProfile, factor: float) -> StageProfile:
    """``sp`` with every time ``factor`` times as long (its memory as it was)."""
    anatomy = None if sp.anatomy is None else [
        a.model_copy(update={f: getattr(a, f) * factor for f in ("before_loss_s", "before_norm_s", "gather_issue_s",
                                                                 "gather_copy_s", "before_waits_s", "between_waits_s")})
        for a in sp.anatomy]
    return sp.model_copy(update={
        "points": [(m, t * factor) for m, t in sp.points], "per_step_s": sp.per_step_s * factor, "anatomy": anatomy,
        "share_steps": [(f, t * factor) for f, t in sp.share_steps],
        "share_gathers": [(f, a * factor, b * factor) for f, a, b in sp.share_gathers]})


def rescaled(profile: Profile, ranks: list[int], speeds: list[float]) -> Profile:
    """``profile`` with plan rank ``i`` (profile rank ``ranks[i]``) computing ``speeds[i]`` times as long."""
    kinds, devices = list(profile.ranks), dict(profile.devices)
    for r, factor in zip(ranks, speeds):
        factor = kept_speed(factor)
        if abs(factor - 1.0) < SPEED_STEP / 2:
            continue
        base = profile.ranks[r]
        name = f"{base} x{factor:.2f}"
        if name not in devices:
            dev = profile.devices[base]
            devices[name] = dev.model_copy(update={"kind": name, "stages": {
                s: slowed_stage(sp, factor) for s, sp in dev.stages.items()}})
        kinds[r] = name
    return profile.model_copy(update={"ranks": kinds, "devices": devices})


@dataclass(frozen=True)
class PlanBasis:
    """What a run keeps of its planning to plan again: the profile, the profile rank of each plan rank, and the
    speed each plan rank was last measured at (None: as profiled; a run re-launched on other ranks carries them)."""

    profile: Profile
    ranks: list[int]
    speeds: list[float] | None = None

    def cost(self, plan: Plan, speeds: list[float] | None = None) -> CostModel:
        """The cost model of ``plan``'s stage, shape and shares, each rank's compute times ``speeds`` times as long."""
        profile = self.profile if speeds is None else rescaled(self.profile, self.ranks, speeds)
        shape = groups_shape(profile, list(self.ranks), plan.shard_groups) if plan.shard_groups else None
        return CostModel(profile, plan.zero_stage, list(self.ranks), shaped=plan.shard_groups is not None,
                         shares=list(plan.shard_shares) if plan.shard_shares else None, shape=shape,
                         group_stages=list(plan.group_stages) if plan.group_stages else None)

    def predict(self, plan: Plan, speeds: list[float] | None = None) -> Prediction:
        return self.cost(plan, speeds).predict(plan)

    def replan(self, plan: Plan, speeds: list[float]) -> tuple[Plan, Prediction]:
        """The fastest split of ``plan``'s global batch at ``speeds`` in its stage and shape, and its prediction:
        Poplar's search and the baselines' splits at its shares, and (flat, stages 1-3) the planner's own choice
        of shares, as :func:`~poplar.planner.planner.plan_stage` makes it."""
        from poplar.planner.planner import plan_stage

        cost = self.cost(plan, speeds)
        found = []
        for search in (allocate, uniform, measured_proportional):
            try:
                found.append(_as(plan, search(cost, plan.global_batch_size)))
            except ValueError:     # this search finds no split (infeasible): the others may
                continue
        if plan.zero_stage and plan.shard_groups is None:   # other shares are cut in place (Engine.set_plan)
            chosen = plan_stage(cost.profile, plan.zero_stage, plan.global_batch_size, list(self.ranks)).poplar
            found += [chosen.plan] if chosen.plan is not None else []
        best = plan, cost.predict(plan)
        for candidate in found:   # at the plan's shares on its cost model, at others on theirs
            same = candidate.shard_shares == plan.shard_shares
            predicted = (cost if same else self.cost(candidate, speeds)).predict(candidate)
            if predicted.step_s < best[1].step_s:
                best = candidate, predicted
        return best

    def stages(self) -> list[int]:
        """The ZeRO stages the profile measured on every plan rank's kind."""
        kinds = {self.profile.ranks[r] for r in self.ranks}
        return sorted(set.intersection(*(set(self.profile.devices[k].stages) for k in kinds)))

    def restage(self, plan: Plan, speeds: list[float]) -> tuple[Plan, Prediction] | None:
        """The planner's best plan of ``plan``'s global batch in another profiled stage at ``speeds`` (flat plans;
        None where no other stage has one): what a run changes stage for where it is clearly faster."""
        from poplar.planner.planner import plan_stage

        if plan.shard_groups is not None:
            return None
        profile, best = rescaled(self.profile, self.ranks, speeds), None
        for stage in (s for s in self.stages() if s != plan.zero_stage):   # its own stage: replan's
            chosen = plan_stage(profile, stage, plan.global_batch_size, list(self.ranks)).poplar
            if chosen.plan is not None and (best is None or chosen.predicted.step_s < best[1].step_s):
                best = chosen.plan, chosen.predicted
        return best

    def regroup(self, plan: Plan, speeds: list[float]) -> tuple[Plan, Prediction, list[int]] | None:
        """The planner's plan of ``plan``'s global batch over the whole profile (:func:`~poplar.planner.make_plan`,
        every stage the profile measured): the plan's ranks at ``speeds``, the profile's other ranks as profiled;
        with its prediction and the profile ranks it takes (None: the planner finds none)."""
        from poplar.planner.planner import make_plan
        from poplar.planner.result import PlanningError

        profile = rescaled(self.profile, self.ranks, speeds)
        stages = sorted(set().union(*(set(d.stages) for d in self.profile.devices.values())))
        try:
            result = make_plan(profile, plan.global_batch_size, stages)
        except PlanningError:
            return None
        return result.plan, result.predicted, [int(r) for r in result.ranks]

    def to_dict(self) -> dict:
        return {"profile": self.profile.model_dump(mode="json"), "ranks": list(self.ranks),
                **({"speeds": list(self.speeds)} if self.speeds is not None else {})}

    @classmethod
    def from_dict(cls, data: dict) -> PlanBasis:
        speeds = data.get("speeds")
        return cls(Profile.model_validate(data["profile"]), [int(r) for r in data["ranks"]],
                   None if speeds is None else [float(s) for s in speeds])


def _as(plan: Plan, found: Plan) -> Plan:
    """``found``'s split with ``plan``'s shard groups and shares."""
    if plan.shard_groups is not None:
        found = found.with_shard_groups([list(g) for g in plan.shard_groups], plan.group_stages)
    if plan.shard_shares:
        found = found.with_shard_shares(list(plan.shard_shares))
    return found
