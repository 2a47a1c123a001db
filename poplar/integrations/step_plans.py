"""The integrations' plan following the cluster: which plan each step's batch is cut with, and re-planning.

A framework's loader reads ahead: Lightning fetches the next batch before it runs a step,
a ``DataLoader`` with workers cuts several; HF's resume skips batches it has cut. So a plan
cannot simply change under the loader. :class:`PlanSchedule` is shared by a rank's
:class:`~poplar.integrations.sampler.PlanBatchSampler` and its runtime: the sampler cuts each
step's batch with the plan in force at that step and queues which one it was; the runtime
takes, at each step, the plan of the batch it is about to train (the engine switches where
it differs, :meth:`~poplar.engine.engine.Engine.set_plan`). :class:`FollowedPlan` holds the
run's :class:`~poplar.runtime.replanner.Replanner`: after every step each rank's figures are
gathered (as ``poplar train``'s step log gathers them), and a new plan is put in force from
the first step no rank has cut yet (the ranks' queues agreed by one all-reduce), so every
rank trains every step with one plan and each rank's data is cut with it.
"""

from __future__ import annotations

from collections import deque

from poplar.plan import Plan


class PlanSchedule:
    """The plan in force from each step on, and the plans of the batches cut and not yet trained (in order).

    Steps are counted from this process's first (``taken``): the runtime takes one plan a step.
    """

    def __init__(self, plan: Plan):
        self.changes: list[tuple[int, Plan]] = [(0, plan)]
        self.taken = 0
        self.pending: deque[Plan] = deque()
        self.skip = 0          # cuts of the next pass another loader drops unseen (HF's resume skips them)

    @property
    def latest(self) -> Plan:
        return self.changes[-1][1]

    def at(self, step: int) -> Plan:
        return next(plan for start, plan in reversed(self.changes) if start <= step)

    def cut(self) -> Plan:
        """The sampler: the plan the next batch is cut with (queued for the runtime unless it is to be skipped)."""
        plan = self.at(self.taken + len(self.pending))
        if self.skip:
            self.skip -= 1
        else:
            self.pending.append(plan)
        return plan

    def restart(self) -> None:
        """The sampler: a new pass over the data; what the last one cut and nobody trained is dropped."""
        self.pending.clear()

    def take(self) -> Plan:
        """The runtime, as a step starts: the plan its batch was cut with (one not cut by the sampler: in force)."""
        plan = self.pending.popleft() if self.pending else self.at(self.taken)
        self.taken += 1
        return plan

    def change(self, plan: Plan, ahead: int) -> int:
        """``plan`` in force from ``ahead`` steps after those taken (none of them cut yet); that step."""
        start = self.taken + ahead
        self.changes = [*[(s, p) for s, p in self.changes if s < start], (start, plan)]
        return start


class FollowedPlan:
    """A rank's re-planning in an integration's loop: each step's plan taken, its figures observed."""

    def __init__(self, replanner, schedule: PlanSchedule, rank: int, change_plan):
        """``change_plan(plan)``: the engine on another plan, between steps (the runtime's)."""
        from poplar.engine.collectives import Comm

        self.replanner, self.schedule, self.rank, self.change_plan = replanner, schedule, rank, change_plan
        self.comm = Comm()        # the figures' small collectives, unpaced (as poplar train's)
        self.replans: list = []   # each :class:`~poplar.runtime.replanner.Replan` taken
        self._late = (0, 0.0)

    def before_step(self, engine, device) -> None:
        plan = self.schedule.take()
        if plan != engine.plan:
            self.change_plan(plan)
        self._late = device.lateness()

    def after_step(self, engine, device) -> None:
        """Every rank: the step's figures gathered; a re-plan decided alike everywhere and put in force."""
        from poplar.runtime.step_figures import StepFigures

        if self.replanner is None:
            return
        figures = StepFigures.gather(device, self.comm, self._late, 0.0, None)
        if engine.plan != self.replanner.plan:    # a re-plan not yet in force: its steps are not its plan's
            return
        change = self.replanner.observe(self.schedule.taken, figures)
        if self.replanner.stopped:
            if self.rank == 0:
                print(f"poplar: {self.replanner.stopped}", flush=True)
            self.replanner = None
        if change is None:
            return
        _, (ahead,) = self.comm.agree([len(self.schedule.pending)], device.torch_device)
        start = self.schedule.change(change.after, ahead)
        self.replans.append(change)
        if self.rank == 0:
            print(f"{change.line()}; in force from step {start + 1} of this process", flush=True)
