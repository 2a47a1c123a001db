"""fp16 on a real GPU (skipped elsewhere): the engine's update is GradScaler's on the same micro-batches, CUDA's
fp16 kernels and all, skipped steps too (the CPU's: tests/engine/test_fp16.py)."""

import pytest
import torch

import poplar
from tests.helpers.models import ORDER_TOLERANT_OPTIMIZER as OPTIMIZER
from tests.helpers.models import lm_loss, make_batches, make_model, reference_train_fp16

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@needs_cuda
@pytest.mark.parametrize("stage", [0, 3])
def test_fp16_on_the_gpu_is_grad_scalers_update(stage):
    plan = poplar.Plan(stage, [3], [2])
    engine = poplar.initialize(make_model(), OPTIMIZER, plan, mixed_precision="fp16",
                               loss_scale={"growth_interval": 2})

    def loss_fn(model, batch):
        return lm_loss(model, batch) * (float("inf") if engine.loss_scale >= 2 ** 16 else 1.0)

    batches, scales = make_batches(7, plan.global_batch_size), []
    for batch in batches:
        scales.append(engine.loss_scale)
        engine.train_batch(batch, loss_fn)
    state = engine.full_state_dict()
    engine.close()
    ref, _, ref_scales = reference_train_fp16(batches, optimizer=OPTIMIZER, scaler_kw={"growth_interval": 2},
                                              overflow_from=2.0 ** 16, micro_batches=[[3, 3]], device="cuda")
    assert scales == ref_scales == [2 ** 16, 2 ** 15, 2 ** 15, 2 ** 16, 2 ** 15, 2 ** 15, 2 ** 16]
    for key, value in ref.items():
        torch.testing.assert_close(state[key].cuda(), value, atol=1e-5, rtol=0, msg=lambda m, key=key: f"{key}: {m}")
