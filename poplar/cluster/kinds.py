"""One kind of device in a cluster file: a catalogue GPU's figures, declared ones, or a real CUDA device's
properties (:class:`DeviceGroup`); what it computes in and how fast (:mod:`poplar.cluster.spec` places the kinds
on ranks and nodes)."""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer, model_validator

from poplar.cluster.catalogue import gpu_by_key as catalogue_gpu
from poplar.cluster.network import Link

KERNEL_OVERHEAD_US = 5.0     # launch cost of one eager kernel, host side included
FLOPS_EFFICIENCY = 0.7       # of the data sheet's peak, what dense matrix work reaches
BANDWIDTH_EFFICIENCY = 0.8   # of the data sheet's memory bandwidth, what streaming work reaches


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
    """``count`` identical devices of one kind, on one node."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    kind: str = Field(min_length=1, description="a name for this kind of device")
    count: int = Field(1, gt=0, description="how many ranks are devices of this kind")
    gpu: str | None = Field(None, description="a catalogue GPU whose figures this kind takes")
    memory_gb: float | None = Field(None, gt=0, description="memory of one device in GiB, before memory_scale")
    tflops: dict[str, float] | float | None = Field(
        None, description="peak dense TFLOP/s per dtype (fp32, bf16), or one figure for every dtype")
    memory_bandwidth_gbs: float | None = Field(None, gt=0, description="memory bandwidth, GB/s")
    kernel_overhead_us: float = Field(KERNEL_OVERHEAD_US, ge=0, description="fixed cost of every kernel")
    flops_efficiency: float = Field(FLOPS_EFFICIENCY, gt=0, le=1, description="of peak TFLOP/s, what is reached")
    bandwidth_efficiency: float = Field(BANDWIDTH_EFFICIENCY, gt=0, le=1,
                                        description="of peak bandwidth, what is reached")
    node: int = Field(0, ge=0, description="the node these ranks sit on (with gpus_per_node: the first)")
    gpus_per_node: int | None = Field(None, gt=0, description="spread the ranks over nodes of this many each, "
                                      "from `node` (if not given: the node after the previous kinds')")
    intra_node: Link | None = Field(None, description="the link among these ranks inside a node (NVLink, PCIe); "
                                    "default: the network's intra_node")
    cuda: CudaProperties | None = Field(None, description="a real CUDA device, as discovered; None: emulated")

    @field_validator("tflops", mode="before")
    @classmethod
    def _positive_tflops(cls, v):
        figures = v.values() if isinstance(v, dict) else [] if v is None else [v]
        if any(isinstance(f, bool) or not isinstance(f, (int, float)) or not math.isfinite(f) or f <= 0
               for f in figures):
            raise ValueError(f"every TFLOP/s figure must be a finite number above 0 (one, or one per dtype: "
                             f"{{fp32: 19.5, bf16: 312}}), got {v!r}")
        return v

    @model_validator(mode="after")
    def _figures(self) -> DeviceGroup:
        if self.cuda is not None:
            declared = [f for f in ("gpu", "tflops", "memory_bandwidth_gbs") if getattr(self, f) is not None]
            if declared:
                raise ValueError(f"kind {self.kind!r} is a real CUDA device: it has no declared {', '.join(declared)}")
            return self
        if self.gpu is not None:
            catalogue_gpu(self.gpu)   # exactly a catalogue name: a misspelt one fails here, naming the close ones
            return self
        missing = [f for f in ("memory_gb", "tflops", "memory_bandwidth_gbs") if getattr(self, f) is None]
        if missing:
            raise ValueError(f"kind {self.kind!r}: give gpu: NAME (a catalogue GPU) or declare "
                             f"{', '.join(missing)}")
        return self

    @model_serializer(mode="wrap")
    def _dump(self, handler):
        data = handler(self)   # only what was given: a dumped file reads like the one written
        return {k: v for k, v in data.items() if v is not None and not (k in _DEFAULTS and v == _DEFAULTS[k])}

    # -- resolved figures (the catalogue's, overridden by the file's) --------------------
    @property
    def is_real(self) -> bool:
        return self.cuda is not None

    @property
    def memory_gib(self) -> float:
        """Memory before scaling: the file's, the catalogue's or the real device's."""
        if self.cuda is not None:
            return self.cuda.total_memory / 2**30
        return self.memory_gb if self.memory_gb is not None else catalogue_gpu(self.gpu).memory_gb

    def computes(self, dtype: str) -> bool:
        """Whether this kind has hardware for ``dtype`` (fp32, tf32, bf16 or fp16): fp32 always; a real
        device's bf16 from compute capability 8 (Ampere); a declared single figure, every dtype; else the
        dtypes the catalogue (or the file's table) gives a figure for."""
        if dtype in ("fp32", "tf32"):
            return True
        if self.cuda is not None:
            return dtype == "fp16" or self.cuda.major >= 8
        if isinstance(self.tflops, (int, float)):
            return True
        table = self.tflops if self.tflops is not None else catalogue_gpu(self.gpu).peak_tflops
        return dtype in table

    def peak_tflops(self, dtype: str) -> float:
        """Peak dense TFLOP/s for ``dtype``; refused (one line) for a dtype the GPU has no hardware for."""
        if not self.computes(dtype):
            raise ValueError(f"kind {self.kind!r} ({self.gpu or 'declared'}) has no {dtype} hardware: "
                             f"{no_dtype_advice(dtype)}")
        if self.tflops is not None:
            if isinstance(self.tflops, (int, float)):
                return float(self.tflops)
            table = self.tflops
        else:
            table = catalogue_gpu(self.gpu).peak_tflops if self.gpu else {}
        if dtype in table:
            return float(table[dtype])
        if "fp32" in table:   # tf32 where the card has none: plain fp32
            return float(table["fp32"])
        raise ValueError(f"kind {self.kind!r}: no TFLOP/s for {dtype} or fp32")

    @property
    def bandwidth_gbs(self) -> float:
        if self.memory_bandwidth_gbs is not None:
            return self.memory_bandwidth_gbs
        return catalogue_gpu(self.gpu).memory_bandwidth_gbs

    def slowed(self, factor: float, kind: str | None = None) -> DeviceGroup:
        """This kind at ``factor`` of its speed (a card that throttles, a neighbour taking its bandwidth): every
        operator takes ``1 / factor`` of its time; its memory as it was. ``kind``: the new kind's name."""
        table = self.tflops if isinstance(self.tflops, dict) else None
        tflops = ({d: f * factor for d, f in table.items()} if table is not None else
                  self.tflops * factor if self.tflops is not None else
                  {d: self.peak_tflops(d) * factor for d in catalogue_gpu(self.gpu).peak_tflops})
        return self.model_copy(update={"kind": kind or self.kind, "tflops": tflops,
                                       "memory_bandwidth_gbs": self.bandwidth_gbs * factor,
                                       "kernel_overhead_us": self.kernel_overhead_us / factor})


_DEFAULTS = {name: f.default for name, f in DeviceGroup.model_fields.items()}


def no_dtype_line(precision: str, lacking: list[str]) -> str:
    """The one line that refuses ``precision`` to the devices named in ``lacking``."""
    return (f"mixed precision {precision}: {', '.join(lacking)} {'has' if len(lacking) == 1 else 'have'} no "
            f"{precision} hardware: {no_dtype_advice(precision)}")


def no_dtype_advice(dtype: str) -> str:
    """What to do instead of ``dtype`` on a card without it (V100, T4: fp16 tensor cores, no bf16)."""
    if dtype == "bf16":
        return ("train in fp16 (mixed_precision: fp16, --mixed-precision fp16: fp32 master weights and a dynamic "
                "loss scale) or fp32, or declare the kind's tflops.bf16 in the cluster file if it has bf16")
    return f"train in fp32, or declare the kind's tflops.{dtype} in the cluster file if it has {dtype}"
