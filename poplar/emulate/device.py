"""One emulated GPU: real compute on the CPU, stretched to the device's speed, capped memory.

Speed. A rank's compute is measured as the CPU time of its own thread
(``time.thread_time``; one torch thread per rank), which does not grow when other
ranks compete for the host's cores. Before every collective, and at the end of a step,
the rank sleeps until the wall time it spent computing (waits for collectives excluded)
equals that CPU time divided by ``speed``. So a device of speed 0.5 takes twice the
host's time for the same work, and the ranks of a cluster wait for each other at
collectives as they would on the real devices, whatever else the host is doing. A
device can only be slowed down, so a cluster whose speeds add up to more than the host
can run is slowed as a whole by one common factor (``ClusterSpec.host_slowdown``),
which keeps every ratio between devices as declared.

Memory. The model-state bytes the engine holds plus the bytes autograd saves for the
backward pass (counted by ``saved_tensors_hooks`` as they are saved) must fit the
capacity; the allocation that would overflow it raises ``torch.OutOfMemoryError``,
as the CUDA allocator does.
"""

from __future__ import annotations

import contextlib
import time

import torch

from poplar.emulate.cluster import DeviceGroup
from poplar.engine.device import Device


class EmulatedDevice(Device):
    tracks_memory = True

    def __init__(self, spec: DeviceGroup, rank: int = 0, slowdown: float = 1.0):
        """``slowdown``: a factor common to the whole cluster (``ClusterSpec.host_slowdown``)."""
        if slowdown < 1.0:
            raise ValueError(f"slowdown must be at least 1.0, got {slowdown}")
        self.spec, self.rank = spec, rank
        self.speed = spec.speed / slowdown
        self.capacity = spec.memory_bytes
        # figures of the last step, for tests and reports
        self.compute_cpu_s = 0.0       # the host's CPU time of this rank's compute
        self.compute_wall_s = 0.0      # the emulated device's compute time (after stretching)
        self.wait_s = 0.0              # time blocked in collectives
        self.step_wall_s = 0.0         # the whole step, as the clock on the wall saw it
        self.micro_cpu_s: list[float] = []   # the part of compute_cpu_s in each micro-step, in order
        self.peak_bytes = 0            # model states + saved activations, at their highest
        self.peak_state_bytes = 0      # model states alone at the start of a micro-step, at their highest
        self._active = False

    # -- speed --------------------------------------------------------------------------
    # Accounts run over the whole step, so that a sleep that overshot (the host was busy)
    # is paid back by shorter sleeps later in the step.
    @contextlib.contextmanager
    def step(self):
        """One optimizer step: everything inside runs at the device's speed."""
        self.compute_cpu_s = self.compute_wall_s = self.wait_s = 0.0
        self.micro_cpu_s = []
        self._wait_cpu = 0.0
        self._start_wall, self._start_cpu = time.perf_counter(), time.thread_time()
        self._active = True
        try:
            yield self
        finally:
            self.boundary()
            self._active = False
            self.step_wall_s = time.perf_counter() - self._start_wall

    def boundary(self) -> None:
        """Pay the compute debt before anything other ranks can observe (a collective)."""
        if not self._active:
            return
        cpu = time.thread_time() - self._start_cpu - self._wait_cpu
        compute_wall = time.perf_counter() - self._start_wall - self.wait_s
        extra = cpu / self.speed - compute_wall
        if extra > 0:
            time.sleep(extra)
        self.compute_cpu_s = cpu
        self.compute_wall_s = time.perf_counter() - self._start_wall - self.wait_s

    @contextlib.contextmanager
    def waiting(self):
        """A wait for a collective: neither compute nor stretched."""
        if not self._active:
            yield
            return
        self.boundary()
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            self.wait_s += time.perf_counter() - wall
            self._wait_cpu += time.thread_time() - cpu

    def share_s(self, cpu_s: float) -> float:
        """The device time of ``cpu_s`` of this step's CPU work (its share of the stretched compute)."""
        return self.compute_s * cpu_s / self.compute_cpu_s if self.compute_cpu_s > 0 else 0.0

    @contextlib.contextmanager
    def span(self):
        """One whole micro-step: its CPU time (waits excluded) is kept in ``micro_cpu_s``."""
        if not self._active:
            yield
            return
        start_cpu, start_wait = time.thread_time(), self._wait_cpu
        try:
            yield
        finally:
            self.micro_cpu_s.append(time.thread_time() - start_cpu - (self._wait_cpu - start_wait))

    # -- memory -------------------------------------------------------------------------
    @contextlib.contextmanager
    def micro_step(self, state_bytes: int, state_storages: set[int]):
        """Count what autograd saves in one micro-step against the capacity.

        ``state_storages``: identities (``untyped_storage()._cdata``) of the engine's own
        buffers, which autograd saves by reference and ``state_bytes`` already counts.
        """
        seen: set[int] = set(state_storages)
        used = [state_bytes]
        self.peak_state_bytes = max(self.peak_state_bytes, state_bytes)
        self._check(state_bytes, 0)

        def pack(t: torch.Tensor):
            st = t.untyped_storage()
            key = st._cdata
            if key not in seen and st.nbytes() > 0:
                seen.add(key)
                self._check(used[0], st.nbytes())
                used[0] += st.nbytes()
                self.peak_bytes = max(self.peak_bytes, used[0])
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield

    def _check(self, used: int, more: int) -> None:
        self.peak_bytes = max(self.peak_bytes, used)
        if used + more > self.capacity:
            gib = 2**30
            raise torch.OutOfMemoryError(
                f"emulated {self.spec.kind} (rank {self.rank}) out of memory: tried to allocate "
                f"{more / gib:.3f} GiB with {used / gib:.3f} GiB in use of its {self.capacity / gib:.3f} GiB "
                "capacity; use a smaller micro-batch or a higher ZeRO stage")
