"""The declared device model: what a piece of work takes on a GPU, counted from the work itself.

Every operator the rank runs (forward, backward, the optimizer update, the engine's
own copies) is seen as it runs, by a ``TorchDispatchMode``, and costs on the modelled
GPU what a roofline says:

    time = kernel overhead + max(FLOPs / achievable FLOP/s, bytes moved / achievable bandwidth)

FLOPs come from ``torch.utils.flop_counter``'s formulas (matrix products, attention,
convolutions); bytes are the operator's inputs and outputs. So a small micro-batch is
bound by reading the weights and by kernel launches, a large one by arithmetic, and
throughput rises with the micro-batch and saturates, as on a real GPU. Views cost
nothing; collectives are the network's (:mod:`poplar.emulate.network`), not compute.
Nothing here reads the host's speed.

>>> import torch
>>> from poplar.cluster.spec import DeviceGroup
>>> gpu = GpuModel.of(DeviceGroup(kind="a100", gpu="A100-80GB"))
>>> a, b = torch.randn(512, 512), torch.randn(512, 512)
>>> with WorkCounter(gpu) as work:
...     c = a @ b
>>> round(work.seconds * 1e6, 1)    # 2*512^3 FLOPs at 70% of 19.5 TFLOP/s, plus 5 us to launch
24.7
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.utils.flop_counter as flop_counter
from torch.utils._python_dispatch import TorchDispatchMode

from poplar.cluster.spec import DeviceGroup

_aten = torch.ops.aten
# Operators that launch no kernel: allocation without a fill, storage bookkeeping.
_FREE = {getattr(_aten, name) for name in (
    "empty", "empty_strided", "empty_like", "set_", "resize_", "lift_fresh", "_local_scalar_dense", "sym_size",
    "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size", "record_stream",
    "_fused_sdp_choice") if hasattr(_aten, name)}     # (attention's choice of kernel: the host's, asked of proxies)
_NOT_COMPUTE = ("c10d", "_c10d_functional", "profiler", "prims", "prim")   # prim: a fake tensor's device query
# Matrix products a CPU without half-precision units runs ~100x slower in fp16/bf16 than in fp32
# (docs/devices.md): computed as a GPU computes them, exact products summed in fp32, rounded once.
_WIDENED = {_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default}
_HALF = (torch.float16, torch.bfloat16)


def _shape(t):
    return t.shape if isinstance(t, torch.Tensor) else t


def _cpu_attention_flops(fwd: bool):
    """CPU's flash-attention kernels are missing from flop_counter's table: the GPU kernels' formulas."""
    def count(*args, out_val=None, **kwargs):
        if fwd:
            q, k, v = (_shape(t) for t in args[:3])
            return flop_counter.sdpa_flop_count(q, k, v)
        grad_out, q, k, v = (_shape(t) for t in args[:4])
        return flop_counter.sdpa_backward_flop_count(grad_out, q, k, v)
    return count


def _grouped_query(count, first: int, heads_dim: int):
    """Grouped-query attention (fewer key/value heads than query heads: SDPA's ``enable_gqa``, which CUDA's
    kernels take as it is) costs what attention over the key/value heads repeated costs; flop_counter's
    formulas want equal heads. ``first``: where the query is among the arguments (a backward's first is the
    output's gradient); ``heads_dim``: 1 in (batch, heads, seq, dim), 2 in (batch, seq, heads, dim)."""
    def wrapped(*args, out_val=None, **kwargs):
        args = list(args)
        heads = _shape(args[first])[heads_dim]
        for i in (first + 1, first + 2):
            shape = _shape(args[i])
            if isinstance(shape, torch.Size) and len(shape) == 4 and shape[heads_dim] != heads:
                # a meta tensor of the repeated shape: some formulas read shapes, others tensors
                args[i] = torch.empty([*shape[:heads_dim], heads, *shape[heads_dim + 1:]], device="meta")
        return count(*args, out_val=out_val, **kwargs)
    return wrapped


def _grouped_mm_flops(mat_a, mat_b, *args, out_val=None, **kwargs) -> int:
    """A grouped matrix product (a mixture of experts' layers: each expert's rows against its weights) costs its
    groups' products together, whatever the split: 2 x rows x inner x columns, times the groups where both are
    batched (flop_counter has no formula for it)."""
    a, b = _shape(mat_a), _shape(mat_b)
    batched = a[0] if len(a) == 3 and len(b) == 3 else 1
    return 2 * batched * a[-2] * a[-1] * b[-1]


_FLOPS = dict(flop_counter.flop_registry)
if hasattr(_aten, "_grouped_mm"):
    _FLOPS[_aten._grouped_mm] = _grouped_mm_flops
for _name, _fwd in (("_scaled_dot_product_flash_attention_for_cpu", True),
                    ("_scaled_dot_product_flash_attention_for_cpu_backward", False)):
    if hasattr(_aten, _name):
        _FLOPS[getattr(_aten, _name)] = _cpu_attention_flops(_fwd)
for _packet in list(_FLOPS):
    _name = getattr(_packet, "__name__", "")
    if "attention" in _name and hasattr(_aten, _name):
        _FLOPS[_packet] = _grouped_query(_FLOPS[_packet], first=1 if "backward" in _name else 0,
                                         heads_dim=1 if "scaled_dot_product" in _name else 2)


@dataclass(frozen=True)
class GpuModel:
    """The figures of one modelled GPU that set its compute time."""

    name: str
    tflops: dict[str, float]        # achievable-before-efficiency peak per dtype
    bandwidth_gbs: float
    kernel_overhead_s: float
    flops_efficiency: float
    bandwidth_efficiency: float

    @classmethod
    def of(cls, kind: DeviceGroup) -> GpuModel:
        return cls(name=kind.kind, tflops={d: kind.peak_tflops(d) for d in ("fp32", "bf16", "fp16") if kind.computes(d)},
                   bandwidth_gbs=kind.bandwidth_gbs, kernel_overhead_s=kind.kernel_overhead_us * 1e-6,
                   flops_efficiency=kind.flops_efficiency, bandwidth_efficiency=kind.bandwidth_efficiency)

    def flops_per_s(self, dtype: torch.dtype) -> float:
        key = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")
        if key not in self.tflops:   # never priced at another dtype's rate (the edges refuse it first)
            raise ValueError(f"{self.name} has no {key} hardware: it cannot compute in {key}")
        return self.tflops[key] * 1e12 * self.flops_efficiency

    def op_seconds(self, flops: float, nbytes: float, dtype: torch.dtype) -> float:
        compute = flops / self.flops_per_s(dtype) if flops else 0.0
        memory = nbytes / (self.bandwidth_gbs * 1e9 * self.bandwidth_efficiency)
        return self.kernel_overhead_s + max(compute, memory)


def op_cost(func, args, kwargs, out) -> tuple[float, float, torch.dtype] | None:
    """(FLOPs, bytes moved, compute dtype) of one operator that ran; None if it launches no kernel."""
    if func.is_view or func._overloadpacket in _FREE or func.namespace in _NOT_COMPUTE:
        return None
    nbytes, dtype = 0, None
    for t in _tensors((args, kwargs, out)):
        nbytes += t.numel() * t.element_size()
        if dtype is None and t.is_floating_point():
            dtype = t.dtype
    counter = _FLOPS.get(func._overloadpacket)
    flops = counter(*args, **kwargs, out_val=out) if counter is not None else 0
    return float(flops), float(nbytes), dtype or torch.float32


def _tensors(value) -> list[torch.Tensor]:
    """The tensors in an operator's arguments or results, in order: an operator's are in lists, tuples and
    dicts only (``tree_leaves``, general, took a sixth of a simulated step)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def run_widened(func, args, kwargs):
    """``func(*args, **kwargs)``; a half-precision matrix product on the CPU summed in fp32 and rounded
    once to its dtype (what the GPU's tensor cores do, and the CPU's own kernel, in another order)."""
    if func in _WIDENED and args[-1].dtype in _HALF and args[-1].device.type == "cpu":
        wide = [a.float() if isinstance(a, torch.Tensor) else a for a in args]
        return func(*wide, **kwargs).to(args[-1].dtype)
    return func(*args, **kwargs)


class WorkCounter(TorchDispatchMode):
    """Adds up the modelled GPU's seconds for every operator run inside it (``seconds``).

    ``add(seconds)``, where given, receives each operator's time as it runs instead (an
    emulated device's clock).
    """

    def __init__(self, gpu: GpuModel, add: Callable[[float], None] | None = None):
        super().__init__()
        self.gpu, self.add = gpu, add
        self.seconds = 0.0
        self.ops = 0
        self.flops = 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = run_widened(func, args, kwargs)
        cost = op_cost(func, args, kwargs, out)
        if cost is not None:
            self.count(func, *cost)
        return out

    def count(self, func, flops: float, nbytes: float, dtype: torch.dtype) -> float:
        """One operator that ran: its modelled seconds, added up (or handed to ``add``) and returned."""
        seconds = self.gpu.op_seconds(flops, nbytes, dtype)
        if self.add is None:
            self.seconds += seconds
            self.ops += 1
            self.flops += flops
        else:
            self.add(seconds)
        return seconds
