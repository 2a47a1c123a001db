"""Poplar: ZeRO data parallelism for clusters of different GPUs.

>>> import poplar
>>> plan = poplar.Plan(zero_stage=1, micro_batch_sizes=[4, 2], accum_steps=[1, 2])
>>> plan.global_batch_size
8
"""

from poplar.engine import Engine, EngineConfig, NonFiniteError, initialize
from poplar.plan import Plan

__all__ = ["Engine", "EngineConfig", "NonFiniteError", "Plan", "initialize"]
__version__ = "0.3.0"
