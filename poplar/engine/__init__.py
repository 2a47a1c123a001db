"""The heterogeneity-aware ZeRO engine."""

from poplar.engine.engine import Engine, EngineConfig, initialize

__all__ = ["Engine", "EngineConfig", "initialize"]
