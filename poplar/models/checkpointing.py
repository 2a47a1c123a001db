"""Activation checkpointing: a model's blocks keep only their inputs in the forward and run again in the backward.

torch's non-reentrant checkpoint (what Hugging Face's ``activation_checkpointing_enable`` and
FSDP's checkpoint wrapper run) around each block: a Hugging Face layer's ``forward`` (its
hooks stay outside), the tiny model's blocks' whole call (their hooks run again). In
ZeRO-3 the re-run finds the unit gathered either way (:mod:`poplar.engine.unshard`). A block's
forward then saves its input alone; in the backward it computes again and what it saves
lives until the block's gradients are out. Checkpointing keeps those tensors away from any
other saved-tensor hooks (the emulated device counts memory with them): what a re-run
makes is shown instead to whatever :func:`recomputation_seen_by` registers.

>>> from poplar.models.tiny import TinyCausalLM
>>> enable(TinyCausalLM(vocab_size=50, d_model=32, n_layers=2, n_heads=2, max_seq_len=16)).checkpointing
True
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager

import torch.utils.checkpoint
from torch import nn

_watchers: list[Callable[[], ContextManager]] = []


@contextlib.contextmanager
def recomputation_seen_by(context: Callable[[], ContextManager]):
    """While inside, every block's re-run in the backward runs inside ``context()``."""
    _watchers.append(context)
    try:
        yield
    finally:
        _watchers.remove(context)


@contextlib.contextmanager
def _recomputing():
    with contextlib.ExitStack() as stack:
        for context in list(_watchers):
            stack.enter_context(context())
        yield


def _contexts():
    return contextlib.nullcontext(), _recomputing()


CHECKPOINT_KWARGS = {"use_reentrant": False, "context_fn": _contexts}


def checkpointed(block: nn.Module, *args, **kwargs):
    """``block(*args, **kwargs)``, checkpointed."""
    return torch.utils.checkpoint.checkpoint(block, *args, **kwargs, **CHECKPOINT_KWARGS)


def enable(model: nn.Module) -> nn.Module:
    """Checkpoint every block of ``model`` (a Hugging Face model's layers, or poplar's tiny model's blocks)."""
    if hasattr(model, "activation_checkpointing_enable"):    # transformers 5.x
        model.config.use_cache = False    # a cache is of no use in training, and checkpointing refuses one
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=CHECKPOINT_KWARGS)
    elif hasattr(model, "gradient_checkpointing_enable"):
        model.config.use_cache = False
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=CHECKPOINT_KWARGS)
    elif hasattr(model, "checkpointing"):
        model.checkpointing = True
    else:
        raise ValueError(f"{type(model).__name__} has no blocks to checkpoint")
    return model
