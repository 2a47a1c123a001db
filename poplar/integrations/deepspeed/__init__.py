"""DeepSpeed's calls on Poplar's engine: ``initialize`` from a DeepSpeed ZeRO config."""

from poplar.integrations.deepspeed.initialize import DeepSpeedStyleEngine, initialize

__all__ = ["DeepSpeedStyleEngine", "initialize"]
