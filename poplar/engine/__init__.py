"""The heterogeneity-aware ZeRO engine: :func:`initialize` wraps a model, :class:`Engine` trains it.

See :mod:`poplar.engine.engine` for how its files divide the work.
"""

from poplar.engine.collectives import Comm
from poplar.engine.config import EngineConfig
from poplar.engine.engine import Engine, NonFiniteError, UpdateOutOfMemoryError, initialize

__all__ = ["Comm", "Engine", "EngineConfig", "NonFiniteError", "UpdateOutOfMemoryError", "initialize"]
