"""Hugging Face: ``PoplarTrainer``, a ``transformers.Trainer`` whose ranks train on Poplar's engine."""

from poplar.integrations.hf.trainer import PoplarTrainer

__all__ = ["PoplarTrainer"]
