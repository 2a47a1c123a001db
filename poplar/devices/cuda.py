"""A real CUDA device: nothing emulated, only its steps timed so the figures mean what they say.

CUDA runs asynchronously: the host queues kernels and moves on, so a wall clock read on
the host measures how fast kernels were queued, not how long they ran. This device
synchronises where a figure is read: its clock (a step's start and end) and around every
wait for a collective (first the compute queued before it, so the wait is the
collective's alone). ``compute_s`` (the step's time minus those waits) is then the GPU's
own work, which the profiler and the training log report. It observes the collectives
through the same seam as an emulated device (:mod:`poplar.engine.collectives`).

Memory is the device's own: its capacity is the GPU's total memory, running out raises
``torch.OutOfMemoryError`` from the allocator, and the peak of each step comes from
``torch.cuda.max_memory_allocated``.

>>> device = CudaDevice()                      # doctest: +SKIP  (needs a GPU)
>>> with device, device.step():                # doctest: +SKIP
...     engine.train_batch(batch, loss_fn)
>>> device.compute_s, device.peak_bytes        # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import time

import torch

from poplar.devices.base import Device, Held


class CudaDevice(Device):
    """The CUDA device this rank computes on (default: the current one)."""

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

    @contextlib.contextmanager
    def reserve(self, nbytes: int):
        """Hold ``nbytes`` of the GPU's memory meanwhile (e.g. model states a probe does not build)."""
        held = torch.empty(max(0, int(nbytes)), dtype=torch.uint8, device=self.torch_device)
        try:
            yield               # not the tensor: a reference kept by the caller would outlive the block
        finally:
            del held
