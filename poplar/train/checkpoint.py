"""Sharded, atomic checkpoints with ``torch.distributed.checkpoint``.

Layout under a run's directory::

    checkpoints/step-00000040/      one DCP checkpoint (every rank wrote its own shard)
    checkpoints/step-00000040/poplar.json   what the run was: step, plan, world, workload
    checkpoints/latest              the name of the newest complete checkpoint

A checkpoint is written to ``step-N.tmp`` and renamed by rank 0 only after every rank
has finished writing (a barrier), then ``latest`` is replaced atomically; a crash
mid-write leaves the previous checkpoint as ``latest`` and the partial one as ``.tmp``
(removed by the next save). Resuming needs the same number of ranks and ZeRO stage (the
shards are the plan's); the error says so otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp


def _name(step: int) -> str:
    return f"step-{step:08d}"


def save_checkpoint(engine, root: str | Path, step: int, meta: dict) -> Path:
    """Every rank calls this; returns the checkpoint's directory."""
    root = Path(root)
    final, tmp = root / _name(step), root / f"{_name(step)}.tmp"
    if dist.get_rank() == 0:
        for stale in root.glob("*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    dcp.save(engine.sharded_state_dict(), checkpoint_id=str(tmp))
    dist.barrier()
    if dist.get_rank() == 0:
        (tmp / "poplar.json").write_text(json.dumps({**meta, "step": step}, indent=2))
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        latest = root / "latest.tmp"
        latest.write_text(final.name)
        os.replace(latest, root / "latest")
    dist.barrier()
    return final


def latest_checkpoint(root: str | Path) -> Path | None:
    pointer = Path(root) / "latest"
    if not pointer.exists():
        return None
    path = Path(root) / pointer.read_text().strip()
    return path if (path / "poplar.json").exists() else None


def load_checkpoint(engine, path: str | Path, expect: dict) -> dict:
    """Restore ``engine`` from ``path``; ``expect`` (world size, stage, workload) must match. Returns its meta."""
    path = Path(path)
    meta = json.loads((path / "poplar.json").read_text())
    for key, value in expect.items():
        if meta.get(key) != value:
            raise ValueError(f"checkpoint {path} was written with {key} = {meta.get(key)!r}, this run has "
                             f"{value!r}: resume with the same {key}, or start a new run (another --out)")
    state = engine.prepare_sharded_load()
    dcp.load(state, checkpoint_id=str(path))
    engine.load_sharded_state_dict(state)
    return meta
