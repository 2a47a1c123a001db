"""Conversations trained by ``poplar train`` on an emulated cluster (an A100-80GB beside two T4-16GB) with a given,
uneven plan: the parameters those one device reaches on the same global batches, to 1e-5, in every ZeRO stage.

The model directory's tokenizer carries Llama 3's chat template (as TRL ships it): the assistant's tokens found by
rendering prefixes; ShareGPT rows on a template that marks them (``{% generation %}``).
"""

from pathlib import Path

import pytest
import torch

import poplar
from poplar.models.loss import IGNORE
from poplar.train.config import load_config
from poplar.train.dataset import prepare_data
from poplar.train.run import run_training
from tests.data.chat_models import CHATML_MARKED, rows, save_chat_model, trl_template, write_rows
from tests.helpers.one_device import reference

pytestmark = pytest.mark.slow

CLUSTER = str(Path(__file__).resolve().parents[2] / "examples" / "cluster-3.yaml")


@pytest.fixture(autouse=True)
def caches(tmp_path, monkeypatch):
    monkeypatch.setenv("POPLAR_DATA_CACHE", str(tmp_path / "data-cache"))
    monkeypatch.setenv("POPLAR_CACHE_DIR", str(tmp_path / "profile-cache"))
    monkeypatch.setenv("POPLAR_DILATION", "3")


@pytest.mark.parametrize("fmt, template, stage, local, accum, shares", [
    ("messages", "llama3", 0, [3, 5, 2], [1, 2, 1], None), ("messages", "llama3", 1, [4, 2, 6], [2, 1, 1], None),
    ("messages", "llama3", 2, [5, 3, 2], [1, 1, 1], None), ("messages", "llama3", 3, [2, 6, 4], [1, 1, 1], [1, 3, 0.5]),
    ("alpaca", "llama3", 1, [2, 5, 3], [2, 1, 1], None), ("sharegpt", "marked", 3, [4, 3, 3], [1, 1, 1], [2, 1, 1])])
def test_conversations_on_uneven_ranks_train_as_one_device(tmp_path, fmt, template, stage, local, accum, shares):
    model = save_chat_model(tmp_path / "model", CHATML_MARKED if template == "marked" else trl_template(template))
    plan = poplar.Plan.from_local_batches(stage, local, accum, shard_shares=shares)
    plan.save(tmp_path / "plan.json")
    data = write_rows(tmp_path / "rows.jsonl", rows(fmt, 48, seed=stage))
    cfg = load_config(None, {"model": str(model), "data": data,
                             "seq_len": 48, "global_batch": plan.global_batch_size, "steps": 3, "lr": 1e-2,
                             "cluster": CLUSTER, "plan": str(tmp_path / "plan.json"), "out": str(tmp_path / "run")})
    _, batches = prepare_data(cfg.model_data)
    counted = batches.targets != IGNORE
    # the loss is on the assistant's tokens alone: fewer than all, and a different number each sample
    assert 0 < counted.sum() < 0.7 * counted.numel() and len(set(counted.sum(1).tolist())) > 3
    result = run_training(cfg, return_state=True)
    want, losses = reference(cfg, 3)
    assert result["plan"] == plan and result["losses"] == pytest.approx(losses, rel=1e-5)
    for name, value in want.items():
        torch.testing.assert_close(result["state"][name], value, rtol=1e-5, atol=1e-5, msg=name)
