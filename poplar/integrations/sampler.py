"""Each rank's slice of every global batch, from any map-style dataset: :class:`PlanBatchSampler`.

The global batches are the same whatever the plan and the world size: step ``s`` of an
epoch takes samples ``order[s*G:(s+1)*G]`` of the epoch's order (a permutation drawn from
the seed and the epoch, :func:`poplar.data.order.epoch_order`, as ``poplar train``'s global
batches are; or the dataset's own order), and rank ``r`` its plan's ``sample_range(r)`` of
them. A run resumed on other ranks, with another plan, therefore sees the very batches an
uninterrupted run would.

>>> import poplar
>>> plan = poplar.Plan(zero_stage=1, micro_batch_sizes=[3, 1], accum_steps=[1, 2])
>>> list(PlanBatchSampler(10, plan, rank=1, shuffle=False))
[[3, 4], [8, 9]]
>>> list(PlanBatchSampler(10, plan, rank=1, shuffle=False, micro_batches=True))
[[3], [4], [8], [9]]
"""

from __future__ import annotations

from torch.utils.data import DataLoader, Sampler

from poplar.data.order import epoch_order
from poplar.integrations.step_plans import PlanSchedule
from poplar.plan import Plan


class PlanBatchSampler(Sampler[list[int]]):
    """The indices ``rank`` takes at every optimizer step of an epoch (or, with ``micro_batches``, at every
    micro-step). Incomplete global batches at an epoch's end are left out, as ``drop_last`` does.

    Each step is cut with the plan its ``schedule`` puts in force there (a re-planned run's runtime
    shares it: :mod:`poplar.integrations.step_plans`); the global batches stay the same."""

    def __init__(self, n_samples: int, plan: Plan, rank: int, shuffle: bool = True, seed: int = 0,
                 micro_batches: bool = False):
        if n_samples < plan.global_batch_size:
            raise ValueError(f"the dataset has {n_samples} samples, fewer than one global batch of "
                             f"{plan.global_batch_size}: give more data or plan a smaller global batch")
        self.n_samples, self.plan, self.rank = n_samples, plan, rank
        self.shuffle, self.seed, self.micro_batches = shuffle, seed, micro_batches
        self.epoch = 0
        self.skip_steps = 0     # optimizer steps of this epoch already taken (a resumed run)
        self.schedule = PlanSchedule(plan)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    @property
    def steps_per_epoch(self) -> int:
        return self.n_samples // self.plan.global_batch_size

    def _order(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.n_samples))
        return epoch_order(self.n_samples, self.seed, self.epoch).tolist()

    def __iter__(self):
        order, size = self._order(), self.plan.global_batch_size
        self.schedule.restart()
        for step in range(self.skip_steps, self.steps_per_epoch):
            plan = self.schedule.cut()
            lo, hi = plan.sample_range(self.rank)
            mine = order[step * size + lo:step * size + hi]
            if not self.micro_batches:
                yield mine
                continue
            start = 0
            for n in plan.micro_batches(self.rank):
                yield mine[start:start + n]
                start += n
        self.skip_steps = 0

    def __len__(self) -> int:
        per_step = len(self.schedule.latest.micro_batches(self.rank)) if self.micro_batches else 1
        return (self.steps_per_epoch - self.skip_steps) * per_step


def plan_loader(dataset, plan: Plan, rank: int, *, collate_fn=None, shuffle: bool = True, seed: int = 0,
                micro_batches: bool = False, num_workers: int = 0, pin_memory: bool = False) -> DataLoader:
    """A ``DataLoader`` over ``dataset`` whose batches are ``rank``'s slices (see :class:`PlanBatchSampler`)."""
    if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
        raise TypeError(f"{type(dataset).__name__} is not a map-style dataset (len and indexing): Poplar gives each "
                        "rank its samples by index; wrap an iterable dataset in a list or a Dataset")
    sampler = PlanBatchSampler(len(dataset), plan, rank, shuffle=shuffle, seed=seed, micro_batches=micro_batches)
    return DataLoader(dataset, batch_sampler=sampler, collate_fn=collate_fn, num_workers=num_workers,
                      pin_memory=pin_memory)
