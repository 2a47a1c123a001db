"""The cluster file: which devices the ranks stand for, in rank order.

```yaml
devices:
  - kind: big-fast      # think A100-80GB
    count: 1
    speed: 1.0          # relative compute speed; 1.0 = this host's own
    memory_gb: 1.0      # memory capacity of the emulated device
  - kind: small-slow    # think T4-16GB
    count: 2
    speed: 0.35
    memory_gb: 0.3
```

Ranks are assigned to devices in file order: here rank 0 is ``big-fast``, ranks 1-2
are ``small-slow``.

A cluster of real CUDA devices is not written by hand: it is discovered from the
launched ranks (:mod:`poplar.profile.discover`), and each of its kinds carries the
GPU's properties (``cuda``) instead of a speed: a real device runs at its own.
"""

from __future__ import annotations

import os
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_serializer, model_validator

PRESETS_DIR = Path(__file__).parent / "presets"
MIN_SLOWDOWN = 2.0   # see ClusterSpec.host_slowdown and docs/profile.md (why 2)


class CudaProperties(BaseModel):
    """What tells one real CUDA device from another (``torch.cuda.get_device_properties``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, description="the GPU's name, e.g. 'NVIDIA H100 80GB HBM3'")
    total_memory: int = Field(gt=0, description="its memory, in bytes")
    major: int = Field(ge=0, description="compute capability, major")
    minor: int = Field(ge=0, description="compute capability, minor")

    @property
    def kind(self) -> str:
        """The kind's name: devices of one name, memory and capability are one kind."""
        return f"{self.name} ({self.total_memory / 2**30:.1f} GiB, sm_{self.major}{self.minor})"


class DeviceGroup(BaseModel):
    """``count`` identical devices of one kind."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: str = Field(min_length=1, description="a name for this kind of device")
    count: int = Field(1, gt=0, description="how many ranks are devices of this kind")
    # required (a cluster file must give it); None only for a discovered CUDA device
    speed: float | None = Field(gt=0, description="compute speed relative to this host (1.0 = the host's own)")
    memory_gb: float = Field(gt=0, description="memory capacity of one device, in GiB")
    cuda: CudaProperties | None = Field(None, description="a real CUDA device, as discovered; None: emulated")

    @model_validator(mode="after")
    def _speed_unless_real(self) -> DeviceGroup:
        if self.cuda is None and self.speed is None:
            raise ValueError("an emulated device needs a speed (give speed: 1.0 for this host's own)")
        if self.cuda is not None and self.speed is not None:
            raise ValueError("a real CUDA device runs at its own speed: leave speed out (null)")
        return self

    @model_serializer(mode="wrap")
    def _dump(self, handler):
        # an emulated device dumps exactly as before real devices existed: its dict is part
        # of the profile cache's keys and of the cluster files written
        data = handler(self)
        if self.cuda is None:
            data.pop("cuda", None)
        return data

    @property
    def memory_bytes(self) -> int:
        return self.cuda.total_memory if self.cuda is not None else int(self.memory_gb * 2**30)


class ClusterSpec(BaseModel):
    """The devices of an (emulated) heterogeneous cluster, in rank order."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    devices: list[DeviceGroup] = Field(min_length=1, description="device kinds, in rank order")

    @model_validator(mode="after")
    def _all_real_or_all_emulated(self) -> ClusterSpec:
        if len({d.cuda is None for d in self.devices}) > 1:
            raise ValueError("mixes real CUDA devices with emulated ones: a cluster is either discovered or "
                             "emulated, not both")
        return self

    @property
    def is_real(self) -> bool:
        """Real CUDA devices (discovered), not emulated ones."""
        return self.devices[0].cuda is not None

    @property
    def world_size(self) -> int:
        return sum(d.count for d in self.devices)

    def rank_devices(self) -> list[DeviceGroup]:
        """One entry per rank: the device that rank stands for."""
        return [d for d in self.devices for _ in range(d.count)]

    def device(self, rank: int) -> DeviceGroup:
        ranks = self.rank_devices()
        if not 0 <= rank < len(ranks):
            raise ValueError(f"rank {rank} is outside this cluster's {len(ranks)} devices")
        return ranks[rank]

    def check_world_size(self, world_size: int) -> None:
        if world_size != self.world_size:
            counts = ", ".join(f"{d.count} x {d.kind}" for d in self.devices)
            raise ValueError(f"the cluster file describes {self.world_size} devices ({counts}) but {world_size} "
                             f"ranks were launched: launch {self.world_size} ranks or change the devices' counts")

    def host_slowdown(self, cores: int | None = None, busy: float = 0.6) -> float:
        """How much slower than declared every device must run for the cluster to fit this host.

        A device cannot be sped up by sleeping less. So the whole cluster is slowed down
        by one common factor: at least ``MIN_SLOWDOWN`` (a host that runs up to that much
        slower than when it calibrated still keeps up), half as much again for every whole
        host's worth of ranks beyond the host's cores (ranks sharing a core inflate each other's
        CPU time: at 2, the fast rank of 4 on 2 cores ran up to 47% behind its time), and
        more until the devices' demand is ``busy`` of the host's cores (devices whose speeds
        add up to more than the host's cores would compete for them). Every ratio between
        devices stays as declared.
        """
        if self.is_real:   # nothing is emulated, so nothing needs slowing down
            return 1.0
        cores = cores or os.cpu_count() or 1
        ranks = sum(d.count for d in self.devices)
        shared = MIN_SLOWDOWN * (1 + 0.5 * max(0, (ranks - cores) // cores))
        return max(shared, sum(d.speed * d.count for d in self.devices) / (cores * busy))

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(), sort_keys=False)


def _field_errors(e: ValidationError) -> str:
    lines = []
    for err in e.errors():
        where = ".".join(str(p) for p in err["loc"]) or "(top level)"
        if err["type"] == "extra_forbidden":
            lines.append(f"{where}: unknown field (allowed: kind, count, speed, memory_gb under devices)")
        else:   # a validator's own message reads as it was written
            lines.append(f"{where}: {err['msg'].removeprefix('Value error, ')}")
    return "; ".join(lines)


def parse_cluster(data, source: str = "cluster") -> ClusterSpec:
    """Validate a cluster description (the YAML's content); errors name the field."""
    if not isinstance(data, dict):
        raise ValueError(f"{source}: expected a mapping with a 'devices' list, got {type(data).__name__}")
    try:
        return ClusterSpec.model_validate(data)
    except ValidationError as e:
        raise ValueError(f"{source}: {_field_errors(e)}") from None


def load_cluster(path_or_preset: str | Path) -> ClusterSpec:
    """Load a cluster file, or a preset by name (see :func:`presets`)."""
    path = Path(path_or_preset)
    if not path.exists() and (PRESETS_DIR / f"{path_or_preset}.yaml").exists():
        path = PRESETS_DIR / f"{path_or_preset}.yaml"
    if not path.exists():
        raise FileNotFoundError(f"no cluster file {str(path_or_preset)!r}; give a YAML path or one of the presets: "
                                f"{', '.join(presets())}")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML: {e}") from None
    return parse_cluster(data, str(path))


def presets() -> list[str]:
    return sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))
