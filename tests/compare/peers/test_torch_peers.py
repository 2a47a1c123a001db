"""torch's own peers and what every peer's setup shares, without processes (tests/compare/test_bench_engine.py runs them)."""

import pickle

import pytest
import torch

from poplar.compare.peers.deepspeed import DeepSpeedSetup
from poplar.compare.peers.torch_peers import TorchSetup


def test_each_stage_names_the_torch_system_that_shards_as_much():
    names = [TorchSetup(zero_stage=k, micro_batch_size=2, accum_steps=1, world_size=2).name for k in range(4)]
    assert names == ["torch DDP", "torch ZeroRedundancyOptimizer + DDP", "FSDP2 reshard_after_forward=False",
                     "FSDP2 reshard_after_forward=True"]
    with pytest.raises(ValueError, match="zero_stage = 4: torch's peers stand for stages 0-3"):
        TorchSetup(zero_stage=4, micro_batch_size=2, accum_steps=1, world_size=2)


def test_a_setup_crosses_into_the_ranks_and_sizes_their_batches():
    setup = TorchSetup(zero_stage=2, micro_batch_size=3, accum_steps=2, world_size=4, lr=1e-3, seed=7)
    assert pickle.loads(pickle.dumps(setup)) == setup
    assert (setup.global_batch_size, setup.local_batch_size(3)) == (24, 6)
    assert setup.config() == {"zero_stage": 2, "micro_batch_size": 3, "accum_steps": 2, "world_size": 4,
                              "lr": 1e-3, "seed": 7}


@pytest.mark.parametrize("setup", [TorchSetup(1, micro_batch_size=3, accum_steps=2, world_size=2),
                                   DeepSpeedSetup(1, micro_batch_size=3, accum_steps=2, world_size=2, hidden_size=None)])
def test_a_local_batch_is_split_into_the_accumulated_micro_batches(setup):
    x = torch.arange(6).reshape(6, 1)
    micro = setup.micro_batches((x, x + 100))
    assert [(a.flatten().tolist(), b.flatten().tolist()) for a, b in micro] == [([0, 1, 2], [100, 101, 102]),
                                                                                ([3, 4, 5], [103, 104, 105])]
    with pytest.raises(ValueError, match=r"takes 6 samples per rank \(2 micro-batches of 3\); got 5"):
        setup.micro_batches((x[:5], x[:5]))


def test_deepspeed_without_a_hidden_size_keeps_its_own_bucket_sizes():
    own = DeepSpeedSetup(3, micro_batch_size=2, accum_steps=1, world_size=2, hidden_size=None).config()
    assert own["zero_optimization"] == {"stage": 3}
    auto = DeepSpeedSetup(3, micro_batch_size=2, accum_steps=1, world_size=2, hidden_size=64).config()
    assert auto["zero_optimization"]["reduce_bucket_size"] == 64 * 64
