"""A rank's device as the loops that drive the engine see it: a clock, a step timer, the waits.

The engine knows no device: it computes and calls the collectives. What times a step
(the profiler, the training loop, the benchmarks) holds a :class:`Device` and wraps
each step in :meth:`Device.step`. The device gives its own communication object,
``device.comm`` (an :class:`~poplar.engine.collectives.ObservedComm`): an engine built
with ``comm=device.comm``, and any collective issued through it, is seen by the device,
which can then tell compute from waiting. Entering the device (``with device:``) starts
it (an emulated device agrees its clock there). The same code times a real GPU
(:class:`poplar.devices.cuda.CudaDevice`), an emulated one
(:class:`poplar.devices.emulated.EmulatedDevice`) and this host's CPU (this class).

>>> device = Device()
>>> with device, device.step():
...     _ = sum(range(1000))
>>> device.step_s >= device.compute_s >= 0
True
"""

from __future__ import annotations

import contextlib
import gc
import time
from typing import Any, Callable, Iterator

import torch

from poplar.engine.collectives import ObservedComm

Held = Callable[[], tuple[int, set[int]]]   # bytes of model state held, and the storages they are in


class Device:
    """This host's CPU, as it is: wall-clock time, no memory limit.

    After a step: ``step_s`` its time, ``wait_s`` the part spent waiting for collectives,
    ``compute_s`` the rest. ``overruns``: spans whose real work ran past the device's
    time (only an emulated device has a time of its own to run past); ``late_s``: the
    device seconds they added.
    """

    capacity: int | None = None
    dilation = 1.0    # wall seconds per device second
    torch_device = torch.device("cpu")   # where this rank's tensors (its batches, its collectives') live
    # what a profile of this device needs (poplar.profile): one timed round is the figure only
    # where time is deterministic; the share of memory a probe's limit leaves free; whether
    # engines of several micro-batch sizes may be alive at once
    timing_repeats = 3
    probe_headroom = 0.01
    many_engines_at_once = True

    def __init__(self):
        self.step_s = 0.0
        self.wait_s = 0.0
        self.peak_bytes = 0
        self.overruns = 0
        self.late_s = 0.0
        self._in_step = False
        self.comm = ObservedComm(self)   # collectives through it are seen by this device

    @property
    def compute_s(self) -> float:
        return self.step_s - self.wait_s

    def lateness(self) -> tuple[int, float]:
        """The overruns so far and the device seconds they added (a step's: the difference of two readings)."""
        return self.overruns, self.late_s

    # -- start, and the collectives it observes (through self.comm) -------------------------
    def __enter__(self) -> Device:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        pass

    def start(self) -> None:
        """Called on entering the device, on every rank at once (an emulated device agrees its clock here)."""

    def launch(self, op: str, nbytes: int, group=None, groups: int = 1) -> Any:
        return None

    def wait(self, token: Any, real_wait: Callable[[], Any]) -> None:
        if not self._in_step:
            real_wait()
            return
        start = self.clock()      # a GPU's clock first finishes the compute queued before the wait
        real_wait()
        self.wait_s += self.clock() - start

    # -- time ---------------------------------------------------------------------------
    def synchronize(self) -> None:
        """Until the work issued so far is done (a GPU's queue; nothing on a CPU)."""

    def clock(self) -> float:
        """Seconds on this device's clock, after the work issued so far."""
        self.synchronize()
        return time.perf_counter()

    @contextlib.contextmanager
    def step(self, held: Held | None = None):
        """Time one step (``step_s``, ``wait_s``). ``held``: the engine's ``held_state``, for memory accounting."""
        self.wait_s = 0.0
        start = self.clock()
        self._in_step = True
        try:
            with self._step_context(held):
                yield self
        finally:
            self._in_step = False
            self.step_s = self.clock() - start

    def _step_context(self, held: Held | None):
        return contextlib.nullcontext()

    # -- memory, as a profiler probes it --------------------------------------------------
    def check_cluster(self, cluster, rank: int) -> None:
        """Check that this is the device ``cluster`` describes for ``rank`` (on every rank alike)."""

    def state_to_reserve(self, state_bytes: int, live_bytes: int) -> int:
        """Of ``state_bytes`` of model state a memory probe must hold, the part it must reserve itself.

        ``live_bytes``: what live tensors (an engine's) hold meanwhile. This device counts only
        what a probe declares, so all of it.
        """
        return state_bytes

    def free_memory(self) -> None:
        """Give back what dead tensors held, so the next probe starts from the same memory."""
        gc.collect()   # reference cycles (an engine's hooks, autograd graphs) hold tensors too

    @contextlib.contextmanager
    def memory_probe(self, model, state_bytes: int) -> Iterator[Callable[[Callable[[], Any]], bool]]:
        """Yields ``fits(run)``: whether ``run`` (a forward and backward of ``model``) fits in this device's
        memory beside ``state_bytes`` of model state. Here: whether it raises ``torch.OutOfMemoryError``."""
        def fits(run: Callable[[], Any]) -> bool:
            try:
                run()
                return True
            except torch.OutOfMemoryError:
                return False
            finally:
                model.zero_grad(set_to_none=True)
        yield fits
