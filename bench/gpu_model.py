"""The device model held against a real GPU, and Poplar's step against a plain PyTorch loop on it.

    python bench/gpu_model.py declared --out DIR   # declared (poplar.emulate.model) vs real fwd+bwd
    python bench/gpu_model.py engine --out DIR     # poplar.initialize vs a plain loop: step time, MFU

``declared``: for each model and micro-batch, one bf16 forward+backward of the model is
run on the GPU under the catalogue's model of that GPU (:class:`~poplar.emulate.model.WorkCounter`,
the very operators the GPU runs, priced by the roofline the emulated cluster and the
simulator use), then timed for real with CUDA events (median of several). Each side is
split the same way: matrix products, attention, and the rest (memory-bound operators); the
real split comes from the kernels' device times (``torch.profiler``), and the gap between
the step and its kernels' sum is time the GPU sat idle waiting for the host to launch.

``engine``: the same micro-batch through ``poplar.initialize`` (ZeRO-0, one rank, bf16 mixed
precision) and through a plain loop (fp32 weights under bf16 autocast), each with fused
AdamW and SDPA attention; step-time ratio and MFU (the model's FLOPs as the device model
counts them, ``torch.utils.flop_counter``'s formulas, over the GPU's dense bf16 peak from
the catalogue).

Both write JSON under ``--out`` as each case finishes, and print a table. With ``--cpu``
they run tiny sizes on the CPU (a check of the script, not a measurement).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from pathlib import Path

import torch

import poplar
from poplar.cluster.catalogue import gpu as catalogue_gpu
from poplar.cluster.spec import DeviceGroup
from poplar.emulate.model import GpuModel, WorkCounter
from poplar.engine.dist import init_distributed
from poplar.precision import cast_model, torch_dtype
from poplar.models.workload import Workload

GPU_CASES = {"declared": [("llama-125m", 1024, [1, 4, 16, 32]), ("llama-1b", 1024, [1, 2, 4, 8])],
             "engine": [("llama-1b", 2048, [4])]}
CPU_CASES = {"declared": [("llama-tiny", 64, [1, 4])], "engine": [("llama-tiny", 64, [4])]}


def _category(name: str, flops: float) -> str:
    name = name.lower()
    if "attention" in name or "flash" in name or "fmha" in name:
        return "attention"
    if flops or any(k in name for k in ("gemm", "matmul", "mm", "cutlass", "sm90_xmma", "nvjet")):
        return "matmul"
    return "other"


class DeclaredSplit(WorkCounter):
    """The device model's seconds of every operator run inside it, and those seconds by category."""

    def __init__(self, model: GpuModel):
        super().__init__(model)
        self.split: dict[str, float] = {}

    def count(self, func, flops, nbytes, dtype) -> float:
        seconds = super().count(func, flops, nbytes, dtype)
        key = _category(func.__name__, flops)
        self.split[key] = self.split.get(key, 0.0) + seconds
        return seconds


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device, repeats: int) -> float:
    """Median seconds of ``fn()`` after two warm-ups (CUDA events on a GPU)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _kernel_split(fn, device) -> tuple[dict[str, float], int]:
    """The device time of the kernels one ``fn()`` runs, by category, and how many kernels."""
    from torch.profiler import ProfilerActivity, profile

    if device.type != "cuda":
        return {}, 0
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        _sync(device)
    split, n = {}, 0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time_total > 0:
            key = _category(e.name, 0)
            split[key] = split.get(key, 0.0) + e.device_time_total * 1e-6
            n += 1
    return split, n


def _gpu_kind(device) -> DeviceGroup:
    name = torch.cuda.get_device_properties(device).name if device.type == "cuda" else "NVIDIA H100 80GB HBM3"
    return DeviceGroup(kind="this-gpu", gpu=catalogue_gpu(name).name)


def declared(out: Path, cases, device, repeats: int) -> list[dict]:
    kind = _gpu_kind(device)
    model_of_gpu = GpuModel.of(kind)
    rows = []
    for name, seq_len, sizes in cases:
        wl = Workload(model=name, seq_len=seq_len)
        model = cast_model(wl.build(), device, torch.bfloat16)
        for mbs in sizes:
            batch = tuple(t.to(device) for t in wl.random_batch(mbs))

            def step():
                wl.loss(model, batch).backward()
                model.zero_grad(set_to_none=True)

            step()
            split = DeclaredSplit(model_of_gpu)
            with split:
                step()
            real_s = _timed(step, device, repeats)
            kernels, n_kernels = _kernel_split(step, device)
            row = {"model": name, "seq_len": seq_len, "micro_batch": mbs, "gpu": kind.gpu,
                   "declared_s": split.seconds, "declared_split_s": split.split,
                   "declared_launch_s": split.ops * model_of_gpu.kernel_overhead_s,
                   "operators": split.ops, "flops": split.flops, "real_s": real_s,
                   "real_kernel_split_s": kernels, "real_kernels": n_kernels,
                   "real_idle_s": max(0.0, real_s - sum(kernels.values())) if kernels else None}
            row["declared_over_real"] = row["declared_s"] / real_s
            row["real_tflops"] = split.flops / real_s / 1e12
            rows.append(row)
            print(f"{name} seq {seq_len} mbs {mbs}: declared {row['declared_s'] * 1e3:.2f} ms, real "
                  f"{real_s * 1e3:.2f} ms ({row['declared_over_real']:.3f}), {row['real_tflops']:.0f} TFLOP/s, "
                  f"kernels {kernels and {k: round(v * 1e3, 2) for k, v in kernels.items()}}, "
                  f"declared {({k: round(v * 1e3, 2) for k, v in split.split.items()})}", flush=True)
            (out / "declared.json").write_text(json.dumps(rows, indent=1))
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _plain_step(model, optimizer, batch, loss_fn, device, precision, scaler):
    """PyTorch's own mixed precision: fp32 weights under autocast (fp16: with GradScaler)."""
    with torch.autocast(device.type, dtype=torch_dtype(precision)):
        loss = loss_fn(model, batch)
    if scaler is None:
        loss.backward()
        optimizer.step()
    else:
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    optimizer.zero_grad(set_to_none=True)


def engine_vs_plain(out: Path, cases, device, repeats: int, precision: str = "bf16") -> list[dict]:
    kind = _gpu_kind(device)
    peak = kind.peak_tflops(precision) * 1e12
    fused = device.type == "cuda"
    if fused:   # the process group first: NCCL allocates outside torch's cache, before the models fill it
        init_distributed()
    rows = []
    for name, seq_len, sizes in cases:
        wl = Workload(model=name, seq_len=seq_len)
        for mbs in sizes:
            batch = tuple(t.to(device) for t in wl.random_batch(mbs))
            model = wl.build().to(device)
            with WorkCounter(GpuModel.of(kind)) as counted:   # the model's FLOPs (grouped-query attention too)
                wl.loss(model, batch).backward()
            model.zero_grad(set_to_none=True)
            flops = counted.flops
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)
            scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None
            plain_s = _timed(lambda: _plain_step(model, optimizer, batch, wl.loss, device, precision, scaler), device,
                             repeats)
            del model, optimizer
            if device.type == "cuda":   # NCCL allocates outside torch's cache: give it back what the loop held
                torch.cuda.empty_cache()
            plan = poplar.Plan(zero_stage=0, micro_batch_sizes=[mbs], accum_steps=[1])
            engine = poplar.initialize(wl.build(), functools.partial(torch.optim.AdamW, lr=1e-4, fused=fused), plan,
                                       mixed_precision=precision)
            engine_s = _timed(lambda: engine.train_batch(batch, wl.loss), device, repeats)
            row_scale = engine.loss_scale
            engine.close()
            del engine
            row = {"model": name, "seq_len": seq_len, "micro_batch": mbs, "gpu": kind.gpu, "precision": precision,
                   "flops": flops, "loss_scale": row_scale,
                   "plain_s": plain_s, "engine_s": engine_s, "engine_over_plain": engine_s / plain_s,
                   "plain_mfu": flops / plain_s / peak, "engine_mfu": flops / engine_s / peak}
            rows.append(row)
            print(f"{name} seq {seq_len} mbs {mbs} {precision}: plain {plain_s * 1e3:.1f} ms (MFU {row['plain_mfu']:.1%}), "
                  f"poplar {engine_s * 1e3:.1f} ms (MFU {row['engine_mfu']:.1%}), ratio "
                  f"{row['engine_over_plain']:.3f}", flush=True)
            (out / ("engine.json" if precision == "bf16" else f"engine-{precision}.json")).write_text(
                json.dumps(rows, indent=1))
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("section", choices=["declared", "engine"])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--models", nargs="*", help="only these of the section's models")
    parser.add_argument("--cpu", action="store_true", help="tiny sizes on the CPU: a check of the script")
    parser.add_argument("--precision", default="bf16", choices=["bf16", "fp16"], help="engine: the mixed precision")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cpu") if args.cpu else torch.device("cuda", torch.cuda.current_device())
    cases = [c for c in (CPU_CASES if args.cpu else GPU_CASES)[args.section] if not args.models or c[0] in args.models]
    if args.section == "declared":
        declared(args.out, cases, device, args.repeats)
    else:
        engine_vs_plain(args.out, cases, device, args.repeats, args.precision)


if __name__ == "__main__":
    main()
