"""Checkpoints you can trust: sharded (``torch.distributed.checkpoint``), atomic, checked, reshardable.

Layout under a run's directory::

    checkpoints/step-00000040/                 one DCP checkpoint (every rank wrote its own shard)
    checkpoints/step-00000040/poplar.json      what the run was: step, workload, global batch, plan, ...
    checkpoints/step-00000040/extras.pt        an integration's own state (its loop, scheduler), if any
    checkpoints/step-00000040/manifest.json    every file's size and SHA-256
    checkpoints/latest                         the name of the newest complete checkpoint

Writing: every rank writes into ``step-N.tmp``; after a barrier rank 0 hashes the
files, writes the manifest last, renames the directory and replaces ``latest``
(``os.replace``: atomic). A crash at any point leaves the earlier checkpoints whole; a
``.tmp`` directory is never read and the next save removes it. The newest
``keep`` checkpoints are kept, so one damaged leaves another to fall back on.

Reading: :func:`find_resumable` checks the newest checkpoint's manifest (a missing,
truncated or changed file fails it) and falls back to the previous one, saying so.
Loading reads tensors only (DCP; its metadata is covered by the manifest). The state is
saved under global keys with its layout (:mod:`poplar.engine.state_dict`), so a
checkpoint written on N ranks with one plan and ZeRO stage loads on M ranks with
another.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

MANIFEST, META, EXTRAS = "manifest.json", "poplar.json", "extras.pt"
# what a checkpoint may lack and still be resumed from (written in bf16 or fp32, resumed in fp16: a fresh loss
# scale; written before steps skipped were counted)
OPTIONAL_KEYS = ("loss_scale", "skipped_steps")


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from (damaged, or another run's); the message says which and why."""


def _name(step: int) -> str:
    return f"step-{step:08d}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _agree_ok(ok: bool) -> bool:
    """Every rank's ``ok``, and-ed (a rank alone in its group decides alone)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return ok
    flag = torch.tensor([0.0 if ok else 1.0])
    if dist.get_backend() == "nccl":
        flag = flag.cuda()
    dist.all_reduce(flag)
    return float(flag) == 0.0


@contextlib.contextmanager
def dcp_errors(doing: str, path: Path, fix: str):
    """``torch.distributed.checkpoint``'s failures (a ``BaseException`` with every rank's traceback) in one line."""
    try:
        yield
    except CheckpointException as e:
        rank, (error, _) = next(iter(e.failures.items())) if e.failures else (None, (e, None))
        what = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise CheckpointError(f"checkpoint {path} could not be {doing} (rank {rank}: {type(error).__name__}"
                              f"{': ' + what if what else ''}): {fix}") from None


def _finite(engine) -> bool:
    return all(bool(torch.isfinite(u.master).all()) for u in engine.units)


def save_checkpoint(engine, root: str | Path, step: int, meta: dict, keep: int = 2,
                    on_shard_written: Callable[[int], None] | None = None, extras=None) -> Path:
    """Every rank calls this; returns the checkpoint's directory. Refuses to write non-finite parameters.

    ``extras``: rank 0's picklable state of the loop around the engine (an integration's
    loop counters, a scheduler), written inside the checkpoint (:func:`read_extras`).

    ``on_shard_written(step)``: called once this rank's shard is written, before the
    checkpoint is complete (a test's crash goes there).
    """
    if not _agree_ok(_finite(engine)):
        raise CheckpointError(f"step {step}: the parameters hold NaN or infinity on some rank; no checkpoint was "
                              "written (the last complete one stands)")
    root = Path(root)
    final, tmp = root / _name(step), root / f"{_name(step)}.tmp"
    rank0 = dist.get_rank() == 0
    if rank0:
        for stale in root.glob("*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    with dcp_errors("written", tmp, f"check the free space and the permissions under {root}"):
        dcp.save(engine.sharded_state_dict(), checkpoint_id=str(tmp))
    if on_shard_written is not None:
        on_shard_written(step)
    dist.barrier()
    if rank0:
        full_meta = {**meta, "step": step, "layout": engine.layout(),
                     "optimizer": engine.optimizer_hyperparameters()}
        (tmp / META).write_text(json.dumps(full_meta, indent=2))
        if extras is not None:
            torch.save(extras, tmp / EXTRAS)
        files = {p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)}
                 for p in sorted(tmp.iterdir()) if p.is_file()}
        (tmp / MANIFEST).write_text(json.dumps({"files": files}, indent=2))   # last: its presence means whole
        _fsync_dir(tmp)
        if final.exists():   # a step written again (a resumed run repeating its last save): move the old aside first
            aside = root / f"{_name(step)}.old.tmp"
            final.rename(aside)
            tmp.rename(final)
            shutil.rmtree(aside, ignore_errors=True)
        else:
            tmp.rename(final)
        pointer = root / "latest.tmp"
        pointer.write_text(final.name)
        os.replace(pointer, root / "latest")
        _fsync_dir(root)
        for old in complete_checkpoints(root)[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def complete_checkpoints(root: str | Path) -> list[Path]:
    """Checkpoint directories holding a manifest, oldest first (not yet checked against it)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.glob("step-*") if p.is_dir() and not p.name.endswith(".tmp") and (p / MANIFEST).exists()]
    return sorted(found, key=lambda p: p.name)


def verify(path: str | Path) -> str | None:
    """What is wrong with the checkpoint at ``path`` (None: every file matches its manifest)."""
    path = Path(path)
    try:
        files = json.loads((path / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"{MANIFEST} is missing or unreadable"
    for name, want in files.items():
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != want["bytes"]:
            return f"{name} has {f.stat().st_size} bytes, {want['bytes']} were written"
        if _sha256(f) != want["sha256"]:
            return f"{name} does not match its checksum"
    if META not in files or not any(n.endswith(".distcp") for n in files) or ".metadata" not in files:
        return "the manifest lists no complete DCP checkpoint"
    return None


def find_resumable(root: str | Path, report=print) -> Path | None:
    """The newest checkpoint under ``root`` that passes :func:`verify`; each damaged one is reported and skipped."""
    for path in reversed(complete_checkpoints(root)):
        problem = verify(path)
        if problem is None:
            return path
        report(f"checkpoint {path} is damaged ({problem}); falling back to the one before it")
    return None


def check_resumable(root: str | Path, expect: dict) -> Path | None:
    """What resuming from ``root`` would load, checked before anything is written (None: nothing to resume).

    Raises :class:`CheckpointError` when every checkpoint is damaged, or the newest
    intact one is another run's (``expect`` as for :func:`load_checkpoint`).
    """
    problems: list[str] = []
    path = find_resumable(root, report=problems.append)
    if path is None:
        if problems:
            raise CheckpointError(f"no intact checkpoint under {root}: " + "; ".join(
                p.replace("; falling back to the one before it", "") for p in problems)
                + "; start a new run with another --out")
        return None
    _same_run(path, read_meta(path), expect)
    return path


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint by name, unverified (for messages; resume uses :func:`find_resumable`)."""
    found = complete_checkpoints(root)
    return found[-1] if found else None


def read_meta(path: str | Path) -> dict:
    try:
        return json.loads((Path(path) / META).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path}: {META} unreadable ({e})") from None


def read_extras(path: str | Path):
    """The ``extras`` saved with the checkpoint at ``path`` (None: none were)."""
    f = Path(path) / EXTRAS
    return torch.load(f, weights_only=False) if f.is_file() else None


def _same_run(path: Path, meta: dict, expect: dict) -> None:
    """Raise unless the checkpoint's ``meta`` agrees with ``expect`` (the first field that differs is named)."""
    for key, value in expect.items():
        if meta.get(key) != value:
            raise CheckpointError(f"checkpoint {path} was written with {key} = {meta.get(key)!r}, this run has "
                                  f"{value!r}: resume with the same {key}, or start a new run (another --out)")


def read_tensors(path: str | Path, tensors: dict[str, torch.Tensor]) -> None:
    """Fill ``tensors`` (plain tensors, each of its saved key's whole shape) from the checkpoint at ``path``, in
    this process alone (no process group): a unit's fp32 master at a time, for an export."""
    import warnings

    path = Path(path)
    with dcp_errors("read", path, "it is damaged: export the one before it"), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")   # (one process is meant)
        dcp.load(tensors, checkpoint_id=str(path), no_dist=True)


def load_checkpoint(engine, path: str | Path, expect: dict) -> dict:
    """Restore ``engine`` from ``path`` (every rank; any world size, plan and stage). Returns its meta.

    ``expect``: what must be the same as when it was written (the workload, the global
    batch, the data's order); the error names the first that differs.
    """
    path = Path(path)
    meta = read_meta(path)
    _same_run(path, meta, expect)
    if meta.get("layout") != engine.layout():
        raise CheckpointError(f"checkpoint {path} holds another model's units ({len(meta.get('layout') or [])} "
                              f"units, this model has {len(engine.layout())}): resume the model it was written with")
    state = engine.prepare_sharded_load()
    with dcp_errors("read", path, "it is damaged: remove it to resume from the one before, or start a new run"):
        saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
        for key in OPTIONAL_KEYS:
            if key in state and key not in saved:
                del state[key]
        dcp.load(state, checkpoint_id=str(path))
    engine.load_sharded_state_dict(state, meta.get("optimizer"))
    return meta
