"""A rank's device as the loops that drive the engine see it: a clock, a step timer, the waits.

The engine knows no device: it computes and calls the collectives. What times a step
(the profiler, the training loop, the benchmarks) holds a :class:`Device` and wraps
each step in :meth:`Device.step`; entering the device (``with device:``) plugs it into
the collectives' one seam (:func:`poplar.engine.collectives.observe`), so it sees every
wait and can tell compute from waiting. The same code times a real GPU
(:class:`poplar.devices.cuda.CudaDevice`), an emulated one
(:class:`poplar.emulate.EmulatedDevice`) and this host's CPU (this class).

>>> device = Device()
>>> with device, device.step():
...     _ = sum(range(1000))
>>> device.step_s >= device.compute_s >= 0
True
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable

from poplar.engine import collectives as C

Held = Callable[[], tuple[int, set[int]]]   # bytes of model state held, and the storages they are in


class Device:
    """This host's CPU, as it is: wall-clock time, no memory limit.

    After a step: ``step_s`` its time, ``wait_s`` the part spent waiting for collectives,
    ``compute_s`` the rest. ``overruns``: spans whose real work ran past the device's
    time (only an emulated device has a time of its own to run past).
    """

    capacity: int | None = None
    dilation = 1.0    # wall seconds per device second

    def __init__(self):
        self.step_s = 0.0
        self.wait_s = 0.0
        self.peak_bytes = 0
        self.overruns = 0
        self._in_step = False
        self._seam: contextlib.ExitStack | None = None

    @property
    def compute_s(self) -> float:
        return self.step_s - self.wait_s

    # -- the seam -----------------------------------------------------------------------
    def __enter__(self) -> Device:
        self._seam = contextlib.ExitStack()
        self._seam.enter_context(C.observe(self))
        try:
            self.start()
        except BaseException:
            self.__exit__()   # a device that could not start observes nothing
            raise
        return self

    def __exit__(self, *exc) -> None:
        seam, self._seam = self._seam, None
        if seam is not None:
            seam.close()

    def start(self) -> None:
        """Called once the device observes the collectives (an emulated device agrees its clock here)."""

    def launch(self, op: str, nbytes: int) -> Any:
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
