"""Models by name, for the command line, the profiler and benchmarks.

The presets' shapes (:mod:`poplar.models.presets`) need no torch: a command refuses a model
too large for its cluster before importing it. The built-in models are
:mod:`poplar.models.tiny`'s, imported when first asked for.
"""

from __future__ import annotations

from poplar.lazy import lazy_attributes
from poplar.models.presets import MODEL_PRESETS   # name: TinyCausalLM arguments (max_seq_len: trained on)

_TINY = ("TinyCausalLM", "build_model", "causal_lm_loss", "random_token_batch")
__getattr__ = lazy_attributes("poplar.models", {name: "poplar.models.tiny" for name in _TINY})

__all__ = ["MODEL_PRESETS", *_TINY]
