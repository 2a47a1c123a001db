"""The run resolved once at the edge (poplar.train.description.Run): the config settled once, the data made by one
process and received whole by every rank."""

from __future__ import annotations

import pickle
from multiprocessing.reduction import ForkingPickler

import pytest
import torch
import torch.multiprocessing  # noqa: F401  (registers torch's tensor reductions, shared memory, with ForkingPickler)

from poplar.cluster.spec import load_cluster
from poplar.processes.spawn import RankFailed, spawn
from poplar.train.config import load_config
from poplar.train.dataset import own_model, prepare_run_data
from poplar.train.launching import InProcess, Launch, on_planned_ranks, settle


@pytest.fixture(autouse=True)
def caches(tmp_path, monkeypatch):
    monkeypatch.setenv("POPLAR_DATA_CACHE", str(tmp_path / "data-cache"))


def test_the_config_is_settled_once_and_the_command_s_own_is_left_as_it_was():
    asked = load_config(None, {"cluster": "both-differ", "mixed_precision": "auto"})
    cfg, launch, cluster, said = settle(asked, None)
    assert said.startswith(f"poplar: mixed precision auto: {cfg.engine.mixed_precision}")
    assert cfg is not asked and asked.engine.mixed_precision == "fp32"     # the command's config is not rewritten
    assert cluster == load_cluster("both-differ") and launch.world_size == cluster.world_size
    plain = load_config(None, {"cluster": "both-differ"})
    assert settle(plain, None)[0] is plain and settle(plain, None)[3] is None    # nothing to resolve: the same config


def test_the_planned_ranks_cluster_is_written_for_the_record_and_the_config_keeps_the_command_s(tmp_path):
    import poplar

    cluster = load_cluster("both-differ")
    launch = Launch(False, cluster.world_size, "emulated", False)
    narrowed, ran, written = on_planned_ranks(launch, poplar.Plan(0, [4]), [1], cluster, str(tmp_path))
    assert narrowed.world_size == 1 and ran == cluster.subset([1]) and written == str(tmp_path / "cluster.yaml")
    assert load_cluster(written) == ran
    assert on_planned_ranks(launch, poplar.Plan(0, [2, 2]), [0, 1], cluster, str(tmp_path)) == (launch, cluster, None)


def test_the_run_s_data_reach_a_spawned_rank_whole_not_through_shared_memory():
    cfg = load_config(None, {"seq_len": 32, "vocab_size": 512, "global_batch": 8, "eval_data": 0.1})
    data = prepare_run_data(cfg.model_data, own_model(cfg.model_data))
    copy = pickle.loads(ForkingPickler.dumps(data))     # as a spawned rank receives its arguments
    assert torch.equal(copy.batches.sequences, data.batches.sequences)
    assert torch.equal(copy.eval_samples.tokens, data.eval_samples.tokens)
    assert not copy.batches.sequences.is_shared() and not data.batches.sequences.is_shared()
    assert copy.model == data.model and copy.tokenizer.digest == data.tokenizer.digest


def shared(rank: int, world_size: int, fail: bool) -> dict:
    """A rank of a group of ``world_size``: what ``InProcess.share`` gives it, and which ranks made it."""
    made = []

    def make():
        made.append(rank)
        if fail:
            raise ValueError("--data x.jsonl: no such file")
        return {"made by": rank}

    with InProcess(Launch(True, world_size, "cpu", False, rank)) as ranks:
        return {"value": ranks.share(make), "made": made}


@pytest.mark.slow
def test_rank_0_makes_what_every_rank_receives_and_its_error_is_every_rank_s():
    ranks = spawn(shared, 2, False, timeout_s=60)
    assert [r["value"] for r in ranks] == [{"made by": 0}] * 2 and [r["made"] for r in ranks] == [[0], []]
    with pytest.raises(RankFailed, match="no such file") as failed:
        spawn(shared, 2, True, timeout_s=60)
    assert failed.value.error == "ValueError"
