"""A real CUDA device: nothing emulated, only its step timed so the figures mean what they say.

CUDA runs asynchronously: the host queues kernels and moves on, so a wall clock read on
the host measures how fast kernels were queued, not how long they ran. This device
synchronises where a figure is read: at a step's start and end, around every wait for
a collective (first the compute queued before it, so the wait is the collective's
alone) and around every micro-step. ``compute_s`` (the step's wall time minus those
waits) is then the GPU's own work, which the profiler and the training log report.
The synchronisations cost a little overlap between the host queueing and the GPU
running; that is the price of knowing compute from waiting.

Memory is the device's own: its capacity is the GPU's total memory, running out raises
``torch.OutOfMemoryError`` from the allocator, and the peak of each step comes from
``torch.cuda.max_memory_allocated``.

>>> device = CudaDevice()                      # doctest: +SKIP  (needs a GPU)
>>> engine = poplar.initialize(model, optimizer, plan, device=device)   # doctest: +SKIP
>>> engine.train_batch(batch, loss_fn); device.compute_s, device.peak_bytes   # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import time

import torch

from poplar.engine.device import Device


class CudaDevice(Device):
    """The CUDA device this rank computes on (default: the current one)."""

    def __init__(self, index: int | None = None):
        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device here (torch.cuda.is_available() is False): use an emulated "
                               "cluster (--cluster FILE|PRESET) or run on a machine with GPUs")
        self.index = torch.cuda.current_device() if index is None else index
        self.torch_device = torch.device("cuda", self.index)
        self.properties = torch.cuda.get_device_properties(self.index)
        self.capacity = self.properties.total_memory
        # figures of the last step
        self.step_wall_s = 0.0
        self.wait_s = 0.0
        self.micro_s: list[float] = []   # each micro-step's compute (its waits excluded), in order
        self.peak_bytes = 0              # the allocator's peak during the step
        self._span_wait = 0.0

    def _sync(self) -> None:
        torch.cuda.synchronize(self.index)

    @contextlib.contextmanager
    def step(self, key: str | None = None):
        self._sync()                     # work queued before the step is not the step's
        torch.cuda.reset_peak_memory_stats(self.index)
        self.wait_s, self.micro_s = 0.0, []
        start = time.perf_counter()
        try:
            yield self
        finally:
            self._sync()
            self.step_wall_s = time.perf_counter() - start
            self.peak_bytes = torch.cuda.max_memory_allocated(self.index)

    @contextlib.contextmanager
    def span(self, key: str | None = None):
        self._sync()
        start, waited = time.perf_counter(), self.wait_s
        try:
            yield
        finally:
            self._sync()
            self.micro_s.append(time.perf_counter() - start - (self.wait_s - waited))

    @contextlib.contextmanager
    def waiting(self):
        # Only this stream: a device-wide synchronize would also wait for the collectives
        # in flight on NCCL's streams, which finish when the slowest rank joins them.
        stream = torch.cuda.current_stream(self.index)
        stream.synchronize()
        start = time.perf_counter()
        try:
            yield
        finally:
            stream.synchronize()         # work.wait() made this stream wait for the collective
            self.wait_s += time.perf_counter() - start

    @contextlib.contextmanager
    def reserve(self, nbytes: int):
        """Hold ``nbytes`` of the GPU's memory meanwhile (e.g. model states a probe does not build)."""
        held = torch.empty(max(0, int(nbytes)), dtype=torch.uint8, device=self.torch_device)
        try:
            yield               # not the tensor: a reference kept by the caller would outlive the block
        finally:
            del held
