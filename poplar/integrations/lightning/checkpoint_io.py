"""Lightning checkpoints of :class:`~poplar.integrations.lightning.strategy.PoplarStrategy`: a directory any world size
and plan resumes from.

A Lightning checkpoint path (``epoch=1-step=30.ckpt``) becomes a directory holding

- the engine's sharded, resharding checkpoint (:meth:`Session.save
  <poplar.integrations.session.Session.save>`: parameters, optimizer state, every rank its shard);
- ``lightning.pt``, rank 0's: Lightning's own state (epoch, global step, loops, callbacks,
  learning-rate schedulers, hyperparameters...) without the weights and optimizer states,
  which the engine's checkpoint holds.

A checkpoint written at the end of an epoch is resumed as the start of the next one
(:func:`settle_epoch_end`).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch

from poplar.integrations.session import Session

LIGHTNING_STATE = "lightning.pt"
_ENGINE_KEYS = ("state_dict", "optimizer_states")   # in the engine's checkpoint instead


def save(runtime: Session, checkpoint: dict[str, Any], path, rank0: bool) -> None:
    """Every rank: the engine's shards under directory ``path``; rank 0 then Lightning's state beside them."""
    path = Path(path)
    if path.is_file():
        raise ValueError(f"{path} is a file: PoplarStrategy writes a checkpoint as a directory; remove it or "
                         "save under another name")
    runtime.save(path, {"global_batch": runtime.plan.global_batch_size, "written_by": "PoplarStrategy"})
    if rank0:
        state = {k: v for k, v in checkpoint.items() if k not in _ENGINE_KEYS}
        state["poplar_step"] = runtime.engine.global_steps
        tmp = path / f"{LIGHTNING_STATE}.tmp"
        torch.save(state, tmp)
        os.replace(tmp, path / LIGHTNING_STATE)


def load(runtime: Session, path) -> dict[str, Any]:
    """Every rank: restore the engine from directory ``path`` (written on any world size, with any plan of the
    same global batch); Lightning's state, without the weights and optimizer states."""
    from poplar.runtime.checkpoint import CheckpointError

    path = Path(path)
    if not (path / LIGHTNING_STATE).is_file():
        raise ValueError(f"{path}: not a checkpoint PoplarStrategy wrote (a directory holding {LIGHTNING_STATE}); "
                         "resume from one saved while training with PoplarStrategy")
    state = torch.load(path / LIGHTNING_STATE, map_location="cpu", weights_only=False)
    meta = runtime.load(path, expect={"global_batch": runtime.plan.global_batch_size})
    if meta.get("step") != state.get("poplar_step"):
        raise CheckpointError(f"{path}: its engine checkpoint is of step {meta.get('step')} but its Lightning state "
                              f"of step {state.get('poplar_step')} (a save was cut short): resume from another")
    settle_epoch_end(state)
    return state


def settle_epoch_end(state: dict[str, Any]) -> None:
    """Lightning's loop state of a checkpoint written at an epoch's end (``on_train_epoch_end``, where
    ``ModelCheckpoint`` saves without validation) made that of the next epoch's start.

    Lightning restores such a checkpoint as "restarting at the epoch's end"; with ``max_steps``
    and no validation loop its epoch loop then takes one more batch into the finished epoch and
    the run leaves the batches an uninterrupted one would see. The epoch marked completed and its
    batch counts zero resume exactly, with or without validation, ``max_steps`` or ``max_epochs``.
    """
    try:
        fit = state["loops"]["fit_loop"]
        epochs, batches = fit["epoch_progress"], fit["epoch_loop.batch_progress"]
        t = epochs["total"]
        if not (t["ready"] == t["started"] == t["processed"] == t["completed"] + 1 and batches["is_last_batch"]):
            return
    except (KeyError, TypeError):   # another Lightning's layout: as it is
        return
    for part in ("total", "current"):
        epochs[part]["completed"] = epochs[part]["processed"]
    batches["current"] = {k: 0 for k in batches["current"]}
    batches["is_last_batch"] = False


def remove(path) -> None:
    """Remove a checkpoint (a directory, or a file another strategy wrote)."""
    path = Path(path)
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists():
        path.unlink()
