"""One order of the global batches for every front end (:func:`poplar.data.order.epoch_order`): the integrations'
sampler cuts, over all its ranks, the very global batches ``poplar train``'s :class:`~poplar.data.text.GlobalBatches`
serves, for the same samples, seed and global batch; so a run resumed through another front end continues with
them."""

import pytest
import torch

import poplar
from poplar.data.text import GlobalBatches
from poplar.integrations.sampler import PlanBatchSampler

N_SAMPLES, GLOBAL_BATCH = 23, 6     # three global batches an epoch, five samples left out


@pytest.mark.parametrize("seed", [0, 1, 42])
@pytest.mark.parametrize("plan", [poplar.Plan(0, [GLOBAL_BATCH]), poplar.Plan(2, [5, 1], [1, 1]),
                                  poplar.Plan(1, [2, 1], [2, 2])], ids=["one-rank", "two-ranks", "accumulated"])
def test_the_samplers_ranks_together_cut_poplar_trains_global_batches(seed, plan):
    samples = torch.arange(N_SAMPLES).unsqueeze(1)   # a sample's one token is its index
    train = GlobalBatches(samples, GLOBAL_BATCH, seed=seed)
    samplers = [PlanBatchSampler(N_SAMPLES, plan, rank, seed=seed) for rank in range(plan.world_size)]
    for epoch in range(3):
        for s in samplers:
            s.set_epoch(epoch)
        cut = [sum(step, []) for step in zip(*samplers)]   # each step's slices, rank after rank
        assert len(cut) == train.per_epoch == N_SAMPLES // GLOBAL_BATCH
        served = [train.batch(epoch * train.per_epoch + k)[:, 0].tolist() for k in range(train.per_epoch)]
        assert cut == served, (epoch, cut, served)


def test_another_seed_or_epoch_draws_another_order():
    def order(seed: int, epoch: int) -> tuple:
        sampler = PlanBatchSampler(N_SAMPLES, poplar.Plan(0, [GLOBAL_BATCH]), 0, seed=seed)
        sampler.set_epoch(epoch)
        return tuple(sum(sampler, []))
    assert len({order(seed, epoch) for seed in (0, 1) for epoch in (0, 1)}) == 4
