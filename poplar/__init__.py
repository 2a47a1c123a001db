"""Poplar: ZeRO data parallelism for clusters of different GPUs.

>>> import poplar
>>> plan = poplar.Plan(zero_stage=1, micro_batch_sizes=[4, 2], accum_steps=[1, 2])
>>> plan.global_batch_size
8
"""

import os

from poplar.lazy import lazy_attributes
from poplar.plan import Plan

# the engine (and torch, two seconds to import) only when asked for: a command that refuses its input says so first
_ENGINE_NAMES = ("Engine", "EngineConfig", "NonFiniteError")
__getattr__ = lazy_attributes("poplar", {name: "poplar.engine" for name in _ENGINE_NAMES})

_DEEPSPEED_KEYS = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                   "zero_optimization", "gradient_clipping", "bf16", "fp16", "optimizer", "scheduler", "poplar"}


def initialize(*args, **kwargs):
    """Wrap a model for heterogeneous ZeRO training: Poplar's engine, or DeepSpeed's calls.

    - ``initialize(model, optimizer_factory, plan, config=None, **engine_options)``: the
      :class:`Engine` (see :func:`poplar.engine.engine.initialize`);
    - ``initialize(model=..., optimizer=..., config="ds_config.json", ...)``: DeepSpeed's
      ``initialize``, its arguments and its ``(engine, optimizer, dataloader, lr_scheduler)``
      (see :mod:`poplar.integrations.deepspeed.initialize`). A config that is a file, or a dict with
      DeepSpeed's fields, or DeepSpeed's own arguments choose this form.
    """
    if _deepspeed_style(args, kwargs):
        from poplar.integrations.deepspeed.initialize import initialize as deepspeed_initialize

        return deepspeed_initialize(*args, **kwargs)
    from poplar.engine import initialize as engine_initialize

    return engine_initialize(*args, **kwargs)


def _deepspeed_style(args: tuple, kwargs: dict) -> bool:
    config = kwargs.get("config", kwargs.get("config_params"))
    if config is None and len(args) > 3:
        config = args[3]
    if isinstance(config, (str, os.PathLike)):
        return True
    if isinstance(config, dict) and _DEEPSPEED_KEYS & set(config):
        return True
    return bool({"args", "model_parameters", "training_data", "lr_scheduler", "config_params"} & set(kwargs))


__all__ = ["Engine", "EngineConfig", "NonFiniteError", "Plan", "initialize"]
__version__ = "0.3.0"
