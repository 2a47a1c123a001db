"""One emulated GPU: real compute on the CPU, stretched to the device's speed, capped memory.

Speed. Every piece of work the engine names (``span(key)`` around a micro-step,
``step(key)`` for the rest of an optimizer step) takes the device ``cost / speed``,
where ``cost`` is the host's CPU time for that work measured alone and kept in the
host's calibration table (:mod:`poplar.emulate.calibration`). So the device runs at its
declared speed whatever the host is doing: other ranks sharing its cores, a host that
drifts slower over minutes. Work without a key costs its CPU time in this thread
(``time.thread_time``, which does not count the time other ranks hold the core).

Before every collective, and at the end of a step, the rank sleeps until the wall time
it spent computing (waits for collectives excluded) equals the device time of its work
so far. So a device of speed 0.5 takes twice the host's time for the same work, and the
ranks of a cluster wait for each other at collectives as they would on the real
devices. A device can only be slowed down, so every cluster runs slower than declared by one
common factor (``ClusterSpec.host_slowdown``, at least 2: this shared host runs the
same work 1.5-1.9x slower than calibrated alone when ranks sleep between micro-steps),
which keeps every ratio between devices. The time of the work in progress between two
spans is estimated at the rate the calibrated work has run lately, and settled when
the span ends.

Memory. The model-state bytes the engine holds plus the bytes autograd saves for the
backward pass (counted by ``saved_tensors_hooks`` as they are saved) must fit the
capacity; the allocation that would overflow it raises ``torch.OutOfMemoryError``,
as the CUDA allocator does.
"""

from __future__ import annotations

import contextlib
import time

import torch

from poplar.emulate.calibration import Calibration, calibration
from poplar.emulate.cluster import DeviceGroup
from poplar.engine.device import Device


class EmulatedDevice(Device):
    tracks_memory = True

    def __init__(self, spec: DeviceGroup, rank: int = 0, slowdown: float = 1.0,
                 table: Calibration | None | bool = True):
        """``slowdown``: a factor common to the whole cluster (``ClusterSpec.host_slowdown``).

        ``table``: the calibration table (True: this host's default; False: none, every
        piece of work then costs its CPU time as measured).
        """
        if slowdown < 1.0:
            raise ValueError(f"slowdown must be at least 1.0, got {slowdown}")
        self.spec, self.rank = spec, rank
        self.speed = spec.speed / slowdown
        self.capacity = spec.memory_bytes
        self.table = calibration() if table is True else (table or None)
        self.names_work = self.table is not None
        # figures of the last step, for tests and reports
        self.compute_cpu_s = 0.0       # the host's CPU time of this rank's compute
        self.compute_wall_s = 0.0      # the emulated device's compute time (after stretching)
        self.target_s = 0.0            # what the device's work should take (compute_wall_s is more if the host lagged)
        self.wait_s = 0.0              # time blocked in collectives
        self.step_wall_s = 0.0         # the whole step, as the clock on the wall saw it
        self.micro_s: list[float] = []       # the device time of each micro-step (span), in order
        self.calibrating = False       # the last step ran work without a calibrated cost (see Device)
        self.peak_bytes = 0            # model states + saved activations, at their highest
        self.peak_state_bytes = 0      # model states alone at the start of a micro-step, at their highest
        self._active = False
        self._span_key: str | None = None
        self._rest_key: str | None = None
        self._rate = 1.0   # device work per CPU second of the work in progress (see _pay)

    # -- speed --------------------------------------------------------------------------
    # Accounts run over the whole step, so that a sleep that overshot (the host was busy)
    # is paid back by shorter sleeps later in the step.
    @contextlib.contextmanager
    def step(self, key: str | None = None):
        """One optimizer step: everything inside runs at the device's speed.

        ``key`` names the step's work outside its spans (the update, the bookkeeping).
        """
        self.compute_cpu_s = self.compute_wall_s = self.wait_s = self.target_s = 0.0
        self.micro_s = []
        self.calibrating = False
        self._wait_cpu = 0.0
        self._spans_cpu = self._spans_target = 0.0
        self._rest_key, self._span_key = key, None
        self._alone = {False: True, True: True}    # the rest of the step, the span: run alone so far
        self._start_wall, self._start_cpu = time.perf_counter(), time.thread_time()
        self._active = True
        self._hold()
        ok = False
        try:
            yield self
            ok = True
        finally:
            self._alone[False] &= ok       # a step that failed calibrates nothing
            self._pay(final=True, calibrate=ok)
            self._active = False
            self._rest_key = None
            self.step_wall_s = time.perf_counter() - self._start_wall

    def _cpu(self) -> float:
        return time.thread_time() - self._start_cpu - self._wait_cpu

    def _calibrating(self) -> bool:
        key = self._span_key if self._span_key is not None else self._rest_key
        return self.table is not None and key is not None and self.table.cost(key) is None

    def _hold(self) -> None:
        """Computing from here on: hold the host's lock, exclusively while calibrating.

        Time spent getting it counts as waiting: no real device would wait for it.
        """
        if self.table is None:
            return
        before, wall, cpu = self.table.lock.timeouts, time.perf_counter(), time.thread_time()
        self.table.lock.hold(exclusive=self._calibrating())
        if self._active:
            self.wait_s += time.perf_counter() - wall
            self._wait_cpu += time.thread_time() - cpu
        if self.table.lock.timeouts != before:   # not had: whatever runs now is not alone
            self._alone[self._span_key is not None] = False

    def _release(self) -> None:
        if self.table is not None:
            self.table.lock.release()

    def _cost(self, key: str | None, cpu: float, alone: bool) -> float:
        """The host cost of one piece of work: calibrated, or calibrating it now, or its CPU time."""
        if self.table is None or key is None:
            return cpu
        known = self.table.cost(key)
        if known is not None:
            return known
        self.calibrating = True
        return self.table.observe(key, cpu) if alone else cpu

    def _pay(self, final: bool = False, calibrate: bool = True) -> None:
        """Sleep off the device time of the work so far (the rest of the step at its end)."""
        self._release()
        cpu = self._cpu()
        if final:
            rest = cpu - self._spans_cpu
            target = self._spans_target + (self._cost(self._rest_key, rest, self._alone[False]) if calibrate else rest)
        else:   # the work since the last span, at the rate the calibrated work has been running lately,
            # and never beyond the cost of the span in progress where that is known: a sleep
            # cannot be taken back, and a span whose work (a whole micro-step before its
            # gradients' collective) ran slower than that rate would leave the device behind
            in_progress = (cpu - self._spans_cpu) * self._rate
            known = self.table.cost(self._span_key) if self.table is not None and self._span_key else None
            target = self._spans_target + (in_progress if known is None else min(in_progress, known))
        target /= self.speed
        compute_wall = time.perf_counter() - self._start_wall - self.wait_s
        if target > compute_wall:
            time.sleep(target - compute_wall)
        self.compute_cpu_s = cpu
        self.target_s = target
        self.compute_wall_s = time.perf_counter() - self._start_wall - self.wait_s

    def boundary(self) -> None:
        """Pay the compute debt before anything other ranks can observe (a collective)."""
        if not self._active:
            return
        self._pay()
        self._hold()

    @contextlib.contextmanager
    def waiting(self):
        """A wait for a collective: neither compute nor stretched, and no lock held meanwhile."""
        if not self._active:
            yield
            return
        self._pay()
        wall, cpu = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            self.wait_s += time.perf_counter() - wall
            self._wait_cpu += time.thread_time() - cpu
            self._hold()

    @contextlib.contextmanager
    def span(self, key: str | None = None):
        """One whole micro-step, ``key`` naming its work: costs its calibrated time."""
        if not self._active:
            yield
            return
        self._span_key, self._alone[True] = key, True
        self._hold()
        start_cpu = self._cpu()
        ok = False
        try:
            yield
            ok = True
        finally:
            alone = self._alone[True]
            cpu = self._cpu() - start_cpu
            cost = self._cost(key, cpu, alone) if ok else cpu
            if cpu > 0 and key is not None:   # calibrated cost per CPU second now: ~1/(how much slower the host runs)
                self._rate = 0.7 * self._rate + 0.3 * min(1.0, cost / cpu)
            self._spans_cpu += cpu
            self._spans_target += cost
            self.micro_s.append(cost / self.speed)
            self._span_key = None
            self._hold()

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
