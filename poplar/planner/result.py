"""What the planner hands back: each stage's allocations and bound, the chosen plan and why (a value to print,
save and load)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from poplar.plan import Plan, shaped_name
from poplar.planner.cost import Prediction
from poplar.profile.profile import Profile

BASELINES = ("uniform", "proportional", "measured-peak")
EVEN_SHARES, MEMORY_SHARES = "even-shares", "memory-shares"   # Poplar's split with even / memory-proportional shares


class PlanningError(ValueError):
    """No plan can be made; the message says what to change."""


@dataclass
class Allocation:
    name: str
    plan: Plan | None
    predicted: Prediction | None
    why_not: str = ""          # when plan is None


@dataclass
class StagePlan:
    stage: int
    ranks: list[int]                                   # profile ranks the plans are for
    allocations: dict[str, Allocation] = field(default_factory=dict)
    ideal_samples_per_s: float = 0.0
    excluded: str = ""                                 # why this stage was left out
    shaped: bool = False                               # hybrid over the nodes (two-level in stage 0)
    shape_name: str = ""                               # shaped over groups of several nodes: "2 nodes a group"

    @property
    def label(self) -> str:
        if not self.shaped:
            return f"stage {self.stage}"
        return f"stage {self.stage} {shaped_name(self.stage)}" + (f", {self.shape_name}" if self.shape_name else "")

    @property
    def poplar(self) -> Allocation:
        return self.allocations["poplar"]


@dataclass
class PlanResult:
    """The chosen plan and everything the planner predicted on the way."""

    plan: Plan
    stage: int
    predicted: Prediction
    stages: dict[int, StagePlan]
    ranks: list[int]                                   # profile rank of each plan entry
    reason: str
    excluded_ranks: list[int] = field(default_factory=list)
    profile: Profile | None = None
    shaped: dict[int, StagePlan] = field(default_factory=dict)   # every stage shaped to the nodes (several nodes)
    candidates: list = field(default_factory=list)   # the kinds, stages and shapes weighed, the fastest first
    weighed: int = 0                                 # how many were (poplar.planner.subsets)

    @property
    def chosen(self) -> StagePlan:
        """The stage plan the chosen plan comes from (shaped or flat)."""
        return self.shaped[self.stage] if self.plan.shard_groups else self.stages[self.stage]

    def allocations(self) -> dict[str, Allocation]:
        """The chosen plan as ``poplar``, beside the chosen stage's baselines (flat, as other systems run them) and,
        where it has shares, its split with even and memory-proportional ones. Where the chosen stage runs only with
        uneven shares, each baseline (and even shares: Poplar's plan without them) is its best stage's."""
        shares = {n: a for n, a in self.chosen.allocations.items() if n in (EVEN_SHARES, MEMORY_SHARES)}
        if EVEN_SHARES in shares and shares[EVEN_SHARES].plan is None:
            evens = [sp.allocations.get(EVEN_SHARES) or sp.allocations.get("poplar") for sp in self.stages.values()]
            evens = [a for a in evens if a is not None and a.plan is not None and not a.plan.shard_shares]
            if evens:
                shares[EVEN_SHARES] = replace(max(evens, key=lambda a: a.predicted.samples_per_s), name=EVEN_SHARES)
        return {"poplar": self.chosen.poplar, **{n: self._best(n) for n in BASELINES}, **shares}

    def _best(self, name: str) -> Allocation:
        """Allocation ``name`` at the chosen stage, or where it has none there, at the flat stage it runs fastest."""
        here = self.stages[self.stage].allocations.get(name)
        if here is not None and here.plan is not None:
            return here
        found = [a for sp in self.stages.values() if (a := sp.allocations.get(name)) is not None and a.plan is not None]
        return max(found, key=lambda a: a.predicted.samples_per_s,
                   default=here or Allocation(name, None, None, why_not="no stage has a plan for it"))

    @property
    def ideal_samples_per_s(self) -> float:
        """The ideal bound: the highest of every stage's and shape's planned (what any plan could approach)."""
        return max(sp.ideal_samples_per_s for sp in [*self.stages.values(), *self.shaped.values()] if not sp.excluded)

    def to_dict(self) -> dict:
        """plan.json: the plan, what it is predicted to do, and how the alternatives compare."""
        d = self.plan.to_dict()
        d["predicted"] = self.predicted.to_dict()
        d["meta"] = {
            "model": ({"name": self.profile.model.name, "seq_len": self.profile.model.seq_len}
                      if self.profile else None),
            "reason": self.reason,
            "ranks": self.ranks,
            "excluded_ranks": self.excluded_ranks,
            "device_kinds": [self.profile.ranks[r] for r in self.ranks] if self.profile else [],
            "stages": {s: _stage_dict(sp) for s, sp in self.stages.items()},
        }
        if self.shaped:
            d["meta"]["shaped_stages"] = {s: _stage_dict(sp) for s, sp in self.shaped.items()}
        if self.candidates:
            d["meta"]["candidates"] = [c.to_dict() for c in self.candidates]
        return d

    def save(self, path) -> None:
        import json
        from pathlib import Path

        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")



def _stage_dict(sp: StagePlan) -> dict:
    if sp.excluded:
        return {"excluded": sp.excluded}
    return {"ideal_samples_per_s": sp.ideal_samples_per_s,
            **{name: ({"plan": a.plan.to_dict(), "samples_per_s": a.predicted.samples_per_s,
                       "step_s": a.predicted.step_s} if a.plan else {"infeasible": a.why_not})
               for name, a in sp.allocations.items()}}
