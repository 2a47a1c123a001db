"""Lightning's '16-mixed' on a real GPU (skipped elsewhere; a CPU's Lightning turns it into 'bf16-mixed' itself):
``PoplarStrategy`` trains the engine's fp16 with its loss scale, the very parameters of a run that asks the engine
for fp16 directly, and Lightning's own autocast and GradScaler take no part."""

from __future__ import annotations

import pytest
import torch

import poplar

pytestmark = pytest.mark.slow

pl = pytest.importorskip("lightning.pytorch")

from poplar.integrations.lightning.strategy import PoplarStrategy  # noqa: E402
from tests.integrations.lightning_workers import GLOBAL_BATCH, N_STEPS, SEED, LitTiny, dataset  # noqa: E402

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def fit(accelerator: str, precision: str, config: dict) -> dict:
    """One rank, the whole global batch in two micro-batches: the final weights, the engine's precision and scale."""
    lit = LitTiny()
    strategy = PoplarStrategy(plan=poplar.Plan(0, [GLOBAL_BATCH // 2], [2]), seed=SEED, config=config)
    trainer = pl.Trainer(strategy=strategy, accelerator=accelerator, devices=1, precision=precision,
                         max_steps=N_STEPS, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(lit, torch.utils.data.DataLoader(dataset(), batch_size=4, shuffle=True))
    engine = strategy.runtime.engine
    return {"state": {k: v.detach().cpu().clone() for k, v in lit.state_dict().items()},
            "precision": engine.config.mixed_precision, "scale": engine.loss_scale}


@needs_cuda
def test_16_mixed_is_the_engines_fp16_on_the_gpu():
    spelled = fit("cuda", "16-mixed", {})
    direct = fit("cuda", "32-true", {"mixed_precision": "fp16"})
    # the same scale after the same overflows (on the H200 one, 2^16 -> 2^15: docs/devices.md)
    assert spelled["precision"] == direct["precision"] == "fp16" and spelled["scale"] == direct["scale"]
    for key, value in direct["state"].items():
        assert torch.equal(spelled["state"][key], value), key
        assert torch.isfinite(value).all(), key
