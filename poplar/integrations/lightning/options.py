"""What :class:`~poplar.integrations.lightning.strategy.PoplarStrategy` takes from Lightning's options and calls, or refuses.

Poplar runs each step's micro-batches, backward, clipping and update itself, so the Trainer
options that would do these again are refused in one line, before any process starts, and
``gradient_clip_val`` and ``precision`` become the engine's own settings. With no plan and no
cluster, ``accumulate_grad_batches`` is the even split's accumulation count (:func:`take_accumulation`).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from poplar.engine.config import EngineConfig

# Lightning's name: the engine's (Lightning itself turns '16-mixed' into 'bf16-mixed' on a CPU, saying so)
PRECISIONS = {"32-true": "fp32", "32": "fp32", "bf16-mixed": "bf16", "16-mixed": "fp16", "16": "fp16"}


def engine_config(trainer, module, precision_plugin, config: EngineConfig) -> EngineConfig:
    """``config`` with the Trainer's clipping and precision in it; a one-line ValueError for what Poplar refuses."""
    if trainer.accumulate_grad_batches != 1:
        raise ValueError(f"accumulate_grad_batches={trainer.accumulate_grad_batches}: the Poplar plan decides "
                         "each rank's accumulation; leave Trainer(accumulate_grad_batches=1), or give neither a plan "
                         "nor a cluster to split the loader's batch_size evenly with it")
    if not module.automatic_optimization:
        raise ValueError("manual optimization: PoplarStrategy runs each step's micro-batches, backward and "
                         "update itself; set automatic_optimization = True")
    precision = getattr(precision_plugin, "precision", "32-true")
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}: PoplarStrategy trains in '32-true', 'bf16-mixed' or '16-mixed' "
                         "(bf16 or fp16 compute, fp32 master weights; fp16 with a dynamic loss scale); give one of them")
    update = {"mixed_precision": PRECISIONS[precision]} if PRECISIONS[precision] != "fp32" else {}
    clip = trainer.gradient_clip_val
    if clip:
        if trainer.gradient_clip_algorithm not in (None, "norm"):
            raise ValueError(f"gradient_clip_algorithm={trainer.gradient_clip_algorithm!r}: Poplar clips the "
                             "global gradient norm only; give gradient_clip_algorithm='norm'")
        if config.clip_grad_norm not in (None, float(clip)):
            raise ValueError(f"gradient_clip_val={clip} and config clip_grad_norm={config.clip_grad_norm}: "
                             "give one of them")
        update["clip_grad_norm"] = float(clip)
    return config.model_copy(update=update)


def take_accumulation(trainer, taken: tuple | None) -> tuple:
    """``(trainer, accumulate_grad_batches)`` for the even split, Lightning's own then set to 1 (as its SWA
    callback sets it): each batch Lightning hands the strategy is a rank's whole step, which the engine
    accumulates. Taken once per trainer (``taken``: what was taken before; the strategy gives it back at the end)."""
    if taken is not None and taken[0] is trainer:
        return taken
    given = trainer.accumulate_grad_batches
    trainer.accumulate_grad_batches = 1
    return trainer, given


def loss_of(output) -> torch.Tensor:
    """The micro-batch's mean loss from what ``training_step`` returned."""
    loss = output.get("loss") if isinstance(output, Mapping) else output
    if not isinstance(loss, torch.Tensor):
        raise ValueError(f"training_step returned {type(output).__name__}: with PoplarStrategy it must return the "
                         "micro-batch's mean loss (a tensor, or a dict with 'loss') on every call")
    return loss


def take_weights(module: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Give ``module`` its own copies of ``state``'s parameters (they were views of the engine's buffers)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name in state:
                p.data = state[name].detach().to(p.device).clone()
