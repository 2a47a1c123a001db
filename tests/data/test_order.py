"""The one rule an epoch's order is drawn by (:mod:`poplar.data.order`): ``poplar train``'s checkpoints resume on the
order they were written with, so the rule is pinned here."""

import doctest

import torch

import poplar.data.order
from poplar.data.order import epoch_order


def test_the_module_examples_run():
    failed, tried = doctest.testmod(poplar.data.order)
    assert tried > 0 and failed == 0


def test_the_order_is_the_permutation_seeded_by_seed_times_1000003_plus_epoch():
    for seed, epoch in [(0, 0), (0, 5), (3, 0), (42, 7)]:
        want = torch.randperm(50, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
        assert torch.equal(epoch_order(50, seed, epoch), want)
