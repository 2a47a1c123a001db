"""The GPU catalogue: what each real GPU is sold as, from its vendor's data sheet.

One entry per GPU (:class:`GpuSpec`): memory, memory bandwidth, peak TFLOP/s per
dtype and the bandwidth of its link to the other GPUs of a node. Everything that
needs a GPU's figures reads them here: the emulated devices of a cluster file, the
rated speed of the Whale-style baseline, the MFU of a training run.

The TFLOP/s are the data sheet's *dense* peaks (no 2:4 sparsity: where a sheet
prints only the with-sparsity figure, half of it). ``fp32`` is plain FP32 without
TF32, which PyTorch leaves off for matmuls by default; ``bf16``/``fp16`` are tensor
cores with FP32 accumulation. A dtype the GPU has no hardware for (bf16 on a V100
or T4, TF32 before Ampere) is absent, not zero. Real kernels reach a fraction of
these peaks.

A real device is found by its CUDA name (``torch.cuda.get_device_properties().name``)
with :func:`match_cuda_name`, or by either kind of name with :func:`gpu`:

>>> gpu("A100-80GB").peak_tflops["bf16"]
312.0
>>> gpu("NVIDIA H100 PCIe").name
'H100-PCIe'
>>> peak_tflops("Tesla V100-SXM2-16GB", "bf16") is None     # no bf16 on a V100
True
"""

from __future__ import annotations

import difflib
import re

from pydantic import BaseModel, ConfigDict, Field, field_validator

DTYPES = ("fp32", "tf32", "bf16", "fp16")   # the dtypes a peak may be given for


class GpuSpec(BaseModel):
    """One GPU as its data sheet describes it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, description="catalogue key, e.g. 'A100-80GB'")
    memory_gb: float = Field(gt=0, description="memory as sold, GiB (80 for an A100-80GB)")
    memory_bandwidth_gbs: float = Field(gt=0, description="memory bandwidth, GB/s")
    peak_tflops: dict[str, float] = Field(
        description="dense peak TFLOP/s per dtype (fp32, tf32, bf16, fp16); a dtype without hardware is absent")
    link_gbs: float = Field(
        gt=0, description="per-GPU link to the node's other GPUs, GB/s as the sheet quotes it: NVLink where the "
                          "part has it (the total of both directions), else its PCIe slot (one direction)")
    match: tuple[str, ...] = Field(
        min_length=1, description="words that all appear in the CUDA device name of this GPU, e.g. ('A100', '80GB')")
    source: str = Field(min_length=1, description="the vendor document the figures come from: title and URL")

    @field_validator("peak_tflops")
    @classmethod
    def _peaks(cls, peaks: dict[str, float]) -> dict[str, float]:
        unknown = sorted(set(peaks) - set(DTYPES))
        if unknown:
            raise ValueError(f"unknown dtypes {unknown}: give peaks for {', '.join(DTYPES)}")
        if "fp32" not in peaks:
            raise ValueError("every GPU computes in fp32: give its fp32 peak")
        if any(v <= 0 for v in peaks.values()):
            raise ValueError("peaks must be positive: leave out a dtype the GPU lacks")
        return peaks

    @field_validator("match")
    @classmethod
    def _words(cls, match: tuple[str, ...]) -> tuple[str, ...]:
        # names are compared word by word (see match_cuda_name): a word with a separator in it never matches
        bad = [w for w in match if not re.fullmatch(r"[A-Za-z0-9]+", w)]
        if bad:
            raise ValueError(f"match words {bad} are not single words (letters and digits only)")
        return match


# Sources that several entries share.
_A100 = ("NVIDIA A100 Tensor Core GPU data sheet, "
         "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
         "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf")
_V100 = ("NVIDIA V100 Tensor Core GPU data sheet, "
         "https://images.nvidia.com/content/technologies/volta/pdf/volta-v100-datasheet-update-us-1165301-r5.pdf")
_H100 = ("NVIDIA H100 Tensor Core GPU data sheet, "
         "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet")
_H200 = ("NVIDIA H200 Tensor Core GPU data sheet, "
         "https://nvdam.widen.net/s/nb5zzzsjdf/hpc-datasheet-sc23-h200-datasheet-3002446")

_AMPERE_GA100 = {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0}
_HOPPER_SXM = {"fp32": 67.0, "tf32": 494.7, "bf16": 989.0, "fp16": 989.0}
_HOPPER_NVL = {"fp32": 60.0, "tf32": 417.5, "bf16": 835.0, "fp16": 835.0}

CATALOGUE: dict[str, GpuSpec] = {spec.name: spec for spec in [
    # -- data-centre parts ---------------------------------------------------------------
    GpuSpec(name="A100-80GB", memory_gb=80, memory_bandwidth_gbs=2039, peak_tflops=_AMPERE_GA100,
            link_gbs=600, match=("A100", "80GB"), source=_A100),
    # the first A100 was the 40 GB one: an A100 that names no memory is taken for it
    GpuSpec(name="A100-40GB", memory_gb=40, memory_bandwidth_gbs=1555, peak_tflops=_AMPERE_GA100,
            link_gbs=600, match=("A100",), source=_A100),
    GpuSpec(name="A800-80GB", memory_gb=80, memory_bandwidth_gbs=2039, peak_tflops=_AMPERE_GA100,
            link_gbs=400, match=("A800", "80GB"),
            source="NVIDIA A800 Tensor Core GPU data sheet, https://www.nvidia.cn/content/dam/en-zz/Solutions/"
                   "Data-Center/a800/nvidia-a800-datasheet-2029415.pdf"),
    GpuSpec(name="V100-16GB", memory_gb=16, memory_bandwidth_gbs=900, peak_tflops={"fp32": 15.7, "fp16": 125.0},
            link_gbs=300, match=("V100",), source=_V100),
    GpuSpec(name="V100S-32GB", memory_gb=32, memory_bandwidth_gbs=1134, peak_tflops={"fp32": 16.4, "fp16": 130.0},
            link_gbs=16, match=("V100S",), source=_V100),
    GpuSpec(name="T4-16GB", memory_gb=16, memory_bandwidth_gbs=320, peak_tflops={"fp32": 8.1, "fp16": 65.0},
            link_gbs=16, match=("T4",),
            source="NVIDIA T4 Tensor Core GPU data sheet, https://www.nvidia.com/content/dam/en-zz/Solutions/"
                   "Data-Center/tesla-t4/t4-tensor-core-datasheet-951643.pdf"),
    GpuSpec(name="H100-80GB", memory_gb=80, memory_bandwidth_gbs=3350, peak_tflops=_HOPPER_SXM,
            link_gbs=900, match=("H100",), source=_H100),   # SXM: "NVIDIA H100 80GB HBM3"
    GpuSpec(name="H100-PCIe", memory_gb=80, memory_bandwidth_gbs=2000,
            peak_tflops={"fp32": 51.0, "tf32": 378.0, "bf16": 756.0, "fp16": 756.0},
            link_gbs=64, match=("H100", "PCIe"), source=_H100),
    GpuSpec(name="H100-NVL", memory_gb=94, memory_bandwidth_gbs=3900, peak_tflops=_HOPPER_NVL,
            link_gbs=64, match=("H100", "NVL"), source=_H100),
    GpuSpec(name="H200", memory_gb=141, memory_bandwidth_gbs=4800, peak_tflops=_HOPPER_SXM,
            link_gbs=900, match=("H200",), source=_H200),
    GpuSpec(name="H200-NVL", memory_gb=141, memory_bandwidth_gbs=4800, peak_tflops=_HOPPER_NVL,
            link_gbs=64, match=("H200", "NVL"),
            source="NVIDIA H200 product page, specifications (H200 NVL), "
                   "https://www.nvidia.com/en-us/data-center/h200/"),
    # the Grace Hopper superchip's GPU computes as an H100 SXM; this is its 96 GB HBM3 version
    # ("NVIDIA GH200 480GB", 480 GB being the CPU's memory); the 144 GB HBM3e one has more and faster memory
    GpuSpec(name="GH200-96GB", memory_gb=96, memory_bandwidth_gbs=4000, peak_tflops=_HOPPER_SXM,
            link_gbs=900, match=("GH200",),
            source="NVIDIA GH200 Grace Hopper Superchip data sheet, https://nvdam.widen.net/content/tf2prbffgy/"
                   "original/grace-hopper-superchip-datasheet-nvidia-2705455.pdf"),
    GpuSpec(name="L4", memory_gb=24, memory_bandwidth_gbs=300,
            peak_tflops={"fp32": 30.3, "tf32": 60.0, "bf16": 121.0, "fp16": 121.0},
            link_gbs=32, match=("L4",),
            source="NVIDIA L4 Tensor Core GPU data sheet, https://nvdam.widen.net/s/rvq98gbwsw/l4-datasheet-2595652"),
    GpuSpec(name="L40S", memory_gb=48, memory_bandwidth_gbs=864,
            peak_tflops={"fp32": 91.6, "tf32": 183.0, "bf16": 362.05, "fp16": 362.05},
            link_gbs=32, match=("L40S",),
            source="NVIDIA L40S GPU data sheet, https://resources.nvidia.com/en-us-l40s/l40s-datasheet-28413"),
    GpuSpec(name="A10", memory_gb=24, memory_bandwidth_gbs=600,
            peak_tflops={"fp32": 31.2, "tf32": 62.5, "bf16": 125.0, "fp16": 125.0},
            link_gbs=32, match=("A10",),
            source="NVIDIA A10 Tensor Core GPU data sheet, https://www.nvidia.com/content/dam/en-zz/Solutions/"
                   "Data-Center/a10/pdf/a10-datasheet.pdf"),
    # -- GeForce cards: no data sheet; the architecture whitepaper's table of the card ----------
    GpuSpec(name="RTX-4090", memory_gb=24, memory_bandwidth_gbs=1008,
            peak_tflops={"fp32": 82.6, "tf32": 82.6, "bf16": 165.2, "fp16": 165.2},
            link_gbs=32, match=("RTX", "4090"),
            source="NVIDIA Ada GPU Architecture whitepaper (GeForce RTX 4090, appendix A), "
                   "https://images.nvidia.com/aem-dam/Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf"),
    GpuSpec(name="RTX-3090", memory_gb=24, memory_bandwidth_gbs=936,
            peak_tflops={"fp32": 35.6, "tf32": 35.6, "bf16": 71.0, "fp16": 71.0},
            link_gbs=32, match=("RTX", "3090"),
            source="NVIDIA Ampere GA102 GPU Architecture whitepaper (GeForce RTX 3090), "
                   "https://www.nvidia.com/content/PDF/nvidia-ampere-ga-102-gpu-architecture-whitepaper-v2.pdf"),
]}

_BY_KEY = {key.lower(): spec for key, spec in CATALOGUE.items()}


def _words(name: str) -> set[str]:
    # CUDA names join words with spaces and dashes ("NVIDIA A100-SXM4-40GB"): compare whole words, so that
    # "L4" is not found in "L40S", "A10" not in "A100", "V100" not in "V100S"
    return set(re.findall(r"[a-z0-9]+", name.lower()))


def match_cuda_name(device_name: str) -> GpuSpec | None:
    """The catalogue entry for a CUDA device name, or None where none fits.

    An entry fits when all its ``match`` words are words of the name; of several, the
    one with the most words (the most specific) wins: "NVIDIA H100 PCIe" fits both
    H100-80GB (``H100``) and H100-PCIe (``H100 PCIe``) and is the latter. The Grace
    Hopper superchip ("NVIDIA GH200 480GB") is its own entry, GH200-96GB, not an H200.

    >>> match_cuda_name("NVIDIA A100-SXM4-40GB").name
    'A100-40GB'
    >>> match_cuda_name("NVIDIA L40S").name, match_cuda_name("NVIDIA L4").name
    ('L40S', 'L4')
    """
    words = _words(device_name)
    fits = [spec for spec in CATALOGUE.values() if {w.lower() for w in spec.match} <= words]
    return max(fits, key=lambda spec: len(spec.match), default=None)


def _find(name: str) -> GpuSpec | None:
    return _BY_KEY.get(name.strip().lower()) or match_cuda_name(name)


def gpu_by_key(name: str) -> GpuSpec:
    """A catalogue entry by its exact key, in any case, as a cluster file names it.

    A person writes these names, so a misspelt one is refused with the close names (a
    CUDA device name is refused too, saying which key it is): nothing is guessed.

    >>> gpu_by_key("h100-pcie").name
    'H100-PCIe'
    >>> gpu_by_key("A100-80G")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: unknown GPU 'A100-80G': did you mean A100-80GB, H100-80GB, A800-80GB, A100-40GB? ...
    """
    spec = _BY_KEY.get(name.strip().lower())
    if spec is not None:
        return spec
    close = [_BY_KEY[c].name for c in difflib.get_close_matches(name.strip().lower(), list(_BY_KEY), n=3, cutoff=0.6)]
    cuda = match_cuda_name(name)   # "NVIDIA H100 PCIe", "t4": the entry their words name
    if cuda is not None and cuda.name not in close:
        close.append(cuda.name)
    known = f"did you mean {', '.join(close)}?" if close else f"the catalogue knows {', '.join(CATALOGUE)}"
    raise ValueError(f"unknown GPU {name!r}: {known} (or declare the device's own memory_gb, tflops and "
                     "memory_bandwidth_gbs in the cluster file)")


def gpu(name: str) -> GpuSpec:
    """A catalogue entry by its key (any case: "a100-80gb") or by a CUDA device name.

    For what a real GPU reports; a cluster file's names go through :func:`gpu_by_key`.

    >>> gpu("h200").memory_gb
    141.0
    >>> gpu("Tesla T4").name
    'T4-16GB'
    """
    spec = _find(name)
    if spec is None:
        raise ValueError(f"unknown GPU {name!r}: the catalogue knows {', '.join(CATALOGUE)}; "
                         "a cluster file may declare a device's own figures instead")
    return spec


def peak_tflops(name: str, dtype: str) -> float | None:
    """A GPU's dense peak TFLOP/s in ``dtype`` (fp32, tf32, bf16 or fp16).

    ``name`` is a catalogue key or a CUDA device name. None where the GPU is not in the
    catalogue or has no hardware for ``dtype``; a dtype outside those four is an error.

    >>> peak_tflops("NVIDIA H100 80GB HBM3", "bf16")
    989.0
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    spec = _find(name)
    return spec.peak_tflops.get(dtype) if spec is not None else None
