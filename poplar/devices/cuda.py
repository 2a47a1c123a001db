"""A real CUDA device: nothing emulated, only its steps timed so the figures mean what they say.

CUDA runs asynchronously: the host queues kernels and moves on, so a wall clock read on
the host measures how fast kernels were queued, not how long they ran. This device
synchronises where a figure is read: its clock (a step's start and end) and around every
wait for a collective (first the compute queued before it, so the wait is the
collective's alone). ``compute_s`` (the step's time minus those waits) is then the GPU's
own work, which the profiler and the training log report. It observes the collectives
issued through ``device.comm``, as an emulated device does.

Memory is the device's own: its capacity is the GPU's total memory, running out raises
``torch.OutOfMemoryError`` from the allocator, and the peak of each step comes from
``torch.cuda.max_memory_allocated``.

>>> device = CudaDevice()                      # doctest: +SKIP  (needs a GPU)
>>> engine = poplar.initialize(model, optimizer, plan, comm=device.comm)   # doctest: +SKIP
>>> with device, device.step():                # doctest: +SKIP
...     engine.train_batch(batch, loss_fn)
>>> device.compute_s, device.peak_bytes        # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist

from poplar.devices.base import Device, Held


class CudaDevice(Device):
    """The CUDA device this rank computes on (default: the current one)."""

    # more left free than on an emulated device: a probe runs on a freshly emptied allocator, a
    # training step on one that earlier allocations have fragmented (an H100 at bf16 had 2.6 GiB
    # reserved but unusable)
    probe_headroom = 0.04
    many_engines_at_once = False   # the GPU holds each engine's states for real: at the limit only one fits

    def __init__(self, index: int | None = None):
        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device here (torch.cuda.is_available() is False): use an emulated "
                               "cluster (--cluster FILE|PRESET) or run on a machine with GPUs")
        super().__init__()
        self.index = torch.cuda.current_device() if index is None else index
        self.torch_device = torch.device("cuda", self.index)
        self.properties = torch.cuda.get_device_properties(self.index)
        self.capacity = self.properties.total_memory

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.index)

    def clock(self) -> float:
        # Inside a step only this stream: a device-wide synchronize would also wait for the
        # collectives in flight on NCCL's streams, which finish when the slowest rank joins
        # them (after a wait, work.wait() has made this stream wait for its collective).
        if self._in_step:
            torch.cuda.current_stream(self.index).synchronize()
            return time.perf_counter()
        return super().clock()

    @contextlib.contextmanager
    def _step_context(self, held: Held | None):
        torch.cuda.reset_peak_memory_stats(self.index)
        try:
            yield
        finally:
            self.peak_bytes = torch.cuda.max_memory_allocated(self.index)

    # -- memory, as a profiler probes it --------------------------------------------------
    def check_cluster(self, cluster, rank: int) -> None:
        """This GPU, checked against ``cluster``'s description of ``rank`` on every rank alike (none left waiting)."""
        from poplar.cluster.kinds import CudaProperties
        from poplar.engine.dist import context

        if context().device.type != "cuda":   # the group's backend: every rank raises alike
            raise ValueError("real CUDA devices are profiled with one GPU per rank over NCCL: launch under torchrun "
                             "on GPU machines (or in this process on one GPU)")
        p = self.properties
        here = CudaProperties(name=p.name, total_memory=p.total_memory, major=p.major, minor=p.minor)
        expected = cluster.device(rank).cuda
        ok = torch.tensor([int(here == expected)], device=self.torch_device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        fix = "profile the devices the ranks run on (discover them: no --cluster)"
        if here != expected:
            raise ValueError(f"rank {rank} runs on {here.kind}, but the cluster describes {expected.kind}: {fix}")
        if not ok.item():
            raise ValueError(f"another rank's GPU differs from the cluster's description: {fix}")

    def state_to_reserve(self, state_bytes: int, live_bytes: int) -> int:
        """The GPU already holds the live tensors (``live_bytes``): the probe reserves only the rest."""
        return state_bytes - live_bytes

    def free_memory(self) -> None:
        super().free_memory()
        torch.cuda.empty_cache()

    @contextlib.contextmanager
    def memory_probe(self, model, state_bytes: int):
        """Real out-of-memory: ``model`` on the GPU, the rest of ``state_bytes`` reserved beside it."""
        own = sum(st.nbytes() for st in {p.untyped_storage()._cdata: p.untyped_storage()
                                         for p in model.parameters()}.values())
        # the engine hands each gradient to its own buffers (counted in state_bytes) and frees
        # it at once: so does the probe, or its gradients would count twice
        hooks = [p.register_post_accumulate_grad_hook(drop_grad) for p in model.parameters() if p.requires_grad]
        try:
            with self.reserve(state_bytes - own):
                yield lambda run: self._fits(model, run)
        finally:
            for h in hooks:
                h.remove()
            self.free_memory()

    def _fits(self, model, run) -> bool:
        fits = True
        try:
            run()
            self.synchronize()   # an asynchronous failure surfaces here, not in the next probe
        except torch.OutOfMemoryError:
            fits = False
        except RuntimeError as e:   # cuBLAS reports its own failed allocations otherwise
            if "CUBLAS_STATUS_ALLOC_FAILED" not in str(e):
                raise
            fits = False
        # after the handler: the error's traceback no longer holds the batch and the graph
        model.zero_grad(set_to_none=True)
        self.free_memory()
        return fits

    @contextlib.contextmanager
    def reserve(self, nbytes: int):
        """Hold ``nbytes`` of the GPU's memory meanwhile (e.g. model states a probe does not build)."""
        held = torch.empty(max(0, int(nbytes)), dtype=torch.uint8, device=self.torch_device)
        try:
            yield               # not the tensor: a reference kept by the caller would outlive the block
        finally:
            del held


def drop_grad(param: torch.Tensor) -> None:
    """A gradient hook that frees the gradient at once (its buffers are elsewhere, or nowhere)."""
    param.grad = None
