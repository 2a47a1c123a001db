"""Profiles cached on disk, keyed by everything that changes them.

A device kind's stage profile is keyed by the model and its shapes, the device's
figures, the stage, the world size, the precision, the largest micro-batch searched and
the engine options that change what is measured (how the model is cut into units, the
gradient buckets in flight...); the collectives' times by the whole cluster. An emulated
device's profile is in its own declared seconds, so nothing of the host is in its key;
a real GPU's key names the software that drives it.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

import poplar
from poplar.cluster.spec import ClusterSpec, DeviceGroup
from poplar.engine.config import EngineConfig
from poplar.profile.profile import CommProfile, StageProfile
from poplar.models.workload import Workload, as_workload

# engine options that change what a profile measures: the units (gradient buckets, gathers), the
# buckets in flight (memory), ZeRO-3's prefetch (time). The precision is keyed on its own; the
# others (clipping, checks) cost the same whatever the plan, so profiles are shared across them.
KEYED_ENGINE_OPTIONS = ("unit_classes", "unit_numel", "max_inflight_reduces", "prefetch")
# what a profile holds and how it is read off the run: raised when that changes (profiles cached before
# are then measured again). 2: a unit's backward ends where its gradient's collective is issued; 3: the
# parameter gathers' own work after the update; 4: the work between the gradient collectives' waits; 5: the sum
# across nodes alike an all-reduce among each slice's counterparts.
MEASURES = 5


def default_cache_dir() -> Path:
    return Path(os.environ.get("POPLAR_CACHE_DIR", Path.home() / ".cache" / "poplar" / "profiles"))


def engine_key(config: EngineConfig | None) -> dict:
    """The engine options that change a profile, where they differ from the defaults (units by class name).

    >>> engine_key(EngineConfig()), engine_key(EngineConfig(unit_numel=1000, clip_grad_norm=1.0))
    ({}, {'unit_numel': 1000})
    """
    if config is None:
        return {}
    changed = {k: v for k, v in config.model_dump(exclude_defaults=True).items() if k in KEYED_ENGINE_OPTIONS}
    if changed.get("unit_classes") is not None:
        changed["unit_classes"] = [c if isinstance(c, str) else f"{c.__module__}.{c.__qualname__}"
                                   for c in changed["unit_classes"]]
    return changed


def cache_key(workload: str | Workload, kind: dict, stage: int, world_size: int, precision: str = "fp32",
              max_micro_batch: int = 256, real: bool = False, config: EngineConfig | None = None) -> str:
    """Everything that changes a device's stage profile: model, its shapes, device, stage, world, precision, engine.

    ``kind``: the device's declared figures (an emulated device), or the GPU's name,
    memory and capability (``real``: the software driving it counts too). ``config``: the
    engine's options; the defaults add nothing to the key, so profiles cached before
    engine options were keyed are still read.
    """
    key = {"workload": as_workload(workload).cache_dict(), "device": kind, "stage": stage, "world_size": world_size,
           "dtype": precision, "max_micro_batch": max_micro_batch, "poplar": poplar.__version__, "measures": MEASURES}
    if real:
        key["software"] = {"torch": torch.__version__, "cuda": torch.version.cuda,
                           "cudnn": torch.backends.cudnn.version()}
    if engine := engine_key(config):
        key["engine"] = engine
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]


def kind_key(spec: ClusterSpec, kind: DeviceGroup) -> dict:
    """What sets a kind's profile: its figures (the catalogue's too) and its scaled memory; not its count or node."""
    data = kind.model_dump(exclude={"count", "node"})
    if kind.cuda is None:   # declared figures, resolved: a catalogue entry that changes changes the key
        data["resolved"] = {"memory_bytes": spec.memory_bytes(kind), "bandwidth_gbs": kind.bandwidth_gbs,
                            "tflops": {d: kind.peak_tflops(d) for d in ("fp32", "bf16", "fp16")
                                       if kind.computes(d)}}
    return data


class ProfileCache:
    """The cached stage profiles of every (kind, stage) of a cluster, and its collectives' times."""

    def __init__(self, directory: Path | None, workload: Workload, spec: ClusterSpec, stages, precision: str,
                 max_micro_batch: int, config: EngineConfig | None):
        self.directory = Path(directory or default_cache_dir())
        world, real = spec.world_size, spec.is_real
        self.stage_paths = {}
        for kind in {d.kind: d for d in spec.devices}.values():
            for s in stages:
                key = cache_key(workload, kind_key(spec, kind), s, world, precision, max_micro_batch, real, config)
                self.stage_paths[(kind.kind, s)] = self.directory / f"{key}.json"
        # the collectives and the ranks' synchronisation depend on the whole cluster
        comm_key = cache_key(workload, spec.model_dump(), -1, world, precision, real=real)
        self.comm_path = self.directory / f"comm-{comm_key}.json"

    def stages(self) -> dict[tuple[str, int], StageProfile]:
        """The (kind, stage) profiles on disk."""
        return {ks: StageProfile.model_validate_json(path.read_text())
                for ks, path in self.stage_paths.items() if path.exists()}

    def comm(self) -> CommProfile | None:
        return CommProfile.model_validate_json(self.comm_path.read_text()) if self.comm_path.exists() else None

    def save(self, measured: dict[tuple[str, int], StageProfile], comm: CommProfile) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        for ks, sp in measured.items():
            _write_atomic(self.stage_paths[ks], sp.model_dump_json())
        _write_atomic(self.comm_path, comm.model_dump_json())


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(text)
    tmp.replace(path)
