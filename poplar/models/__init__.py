"""Models by name, for the command line, the profiler and benchmarks.

The presets' shapes (:mod:`poplar.models.presets`) need no torch: a command refuses a model
too large for its cluster before importing it. The built-in models are
:mod:`poplar.models.tiny`'s, imported when first asked for.
"""

from __future__ import annotations

from poplar.models.presets import MODEL_PRESETS   # name: TinyCausalLM arguments (max_seq_len: trained on)

_TINY = ("TinyCausalLM", "build_model", "causal_lm_loss", "random_token_batch")


def __getattr__(name: str):
    import importlib

    if name in _TINY:
        return getattr(importlib.import_module("poplar.models.tiny"), name)
    if not name.startswith("_"):   # a submodule, as an eager import would have left it
        try:
            return importlib.import_module(f"poplar.models.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"poplar.models.{name}":
                raise
    raise AttributeError(f"module 'poplar.models' has no attribute {name!r}")


__all__ = ["MODEL_PRESETS", *_TINY]
