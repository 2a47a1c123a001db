"""Cost model, batch allocation and search: the plan that maximises heterogeneous throughput."""

from poplar.planner.bound import ideal_samples_per_s
from poplar.planner.cost import CostModel, Prediction
from poplar.planner.planner import PlanningError, PlanResult, StagePlan, make_plan, plan_stage
from poplar.planner.search import Infeasible, allocate, measured_proportional, proportional, uniform

__all__ = ["CostModel", "Infeasible", "PlanResult", "PlanningError", "Prediction", "StagePlan", "allocate",
           "ideal_samples_per_s", "make_plan", "measured_proportional", "plan_stage", "proportional",
           "uniform"]
