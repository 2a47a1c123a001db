"""PlanSchedule: every rank trains every step with one plan, and each rank's batch is cut with it, however far
each rank's loader reads ahead, however many batches a resuming Trainer drops, wherever a pass is abandoned.

Walked exhaustively over small spaces with the real sampler (no processes: the ranks' agreement on how far ahead
to put a change, one all-reduce in a run, is the max taken here)."""

import itertools
from collections import deque

import pytest

import poplar
from poplar.integrations.sampler import PlanBatchSampler
from poplar.integrations.step_plans import PlanSchedule

PLANS = [poplar.Plan(1, [3, 1, 2]), poplar.Plan(1, [1, 4, 1]), poplar.Plan(1, [2, 2, 2]), poplar.Plan(1, [1, 1, 4])]
STEPS, PER_EPOCH = 12, 7


class Rank:
    """One rank's loader (reading ``depth`` batches ahead of the step it trains) and runtime."""

    def __init__(self, rank: int, depth: int, skip: int):
        self.rank, self.depth = rank, depth
        self.sampler = PlanBatchSampler(PER_EPOCH * 6, PLANS[0], rank, shuffle=False)
        self.schedule = self.sampler.schedule
        self.schedule.skip = skip
        self.epoch = 0
        self._new_pass(skip)

    def _new_pass(self, skip: int = 0) -> None:
        self.sampler.set_epoch(self.epoch)
        self.it, self.buffer = iter(self.sampler), deque()
        for _ in range(skip):                 # HF's resume: cut and dropped unseen
            next(self.it)

    def step(self) -> poplar.Plan:
        while len(self.buffer) < self.depth + 1:
            batch = next(self.it, None)
            if batch is None:                 # the epoch's end: the next pass
                self.epoch += 1
                self._new_pass()
                continue
            self.buffer.append(batch)
        batch, plan = self.buffer.popleft(), self.schedule.take()
        assert len(batch) == plan.local_batch_size(self.rank), "the batch was cut with another plan"
        return plan

    def abandon(self) -> None:
        """A pass given up with batches read ahead (Lightning's limit_train_batches): the next one starts."""
        self.epoch += 1
        self._new_pass()


@pytest.mark.parametrize("depths", [(0, 0, 0), (0, 1, 2), (2, 0, 1), (3, 3, 0), (1, 1, 1)])
@pytest.mark.parametrize("changes", [(1,), (0, 4), (2, 3, 7)])
@pytest.mark.parametrize("skip, abandon", [(0, None), (2, None), (0, 5), (3, 6)])
def test_every_rank_trains_each_step_with_one_plan_and_its_batch_cut_with_it(depths, changes, skip, abandon):
    ranks = [Rank(r, d, skip) for r, d in enumerate(depths)]
    seen, nxt = [], itertools.cycle(PLANS[1:])
    for step in range(STEPS):
        if step == abandon:
            for r in ranks:
                r.abandon()
        plans = {r.step() for r in ranks}
        assert len(plans) == 1
        seen.append(plans.pop())
        if step in changes:
            ahead = max(len(r.schedule.pending) for r in ranks)     # the all-reduce
            new = next(nxt)
            for r in ranks:
                r.schedule.change(new, ahead)
    for step in changes:                      # each change in force within the read-ahead, and kept
        assert seen[-1] == ranks[0].schedule.latest
        assert any(p is not seen[step] for p in seen[step + 1:step + 2 + max(depths)])


def test_a_batch_not_cut_by_the_sampler_takes_the_plan_in_force():
    schedule = PlanSchedule(PLANS[0])
    assert schedule.take() is PLANS[0]
    assert schedule.change(PLANS[1], 0) == 1 and schedule.take() is PLANS[1] and schedule.taken == 2
