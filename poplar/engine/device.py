"""What the engine asks of the device a rank runs on; the real device needs nothing.

An emulated device (``poplar.emulate.EmulatedDevice``) implements these to run at its
own speed and within its own memory. The engine calls:

- ``step(key)``: a context around one optimizer step; ``key`` (a string, or None)
  names the step's work outside its micro-steps, so that the same work can be
  recognised again (an emulated device runs a recognised piece of work in a fixed time);
- ``micro_step(state_bytes, state_storages)``: a context around one micro-step's
  forward and backward, with the bytes of model state held meanwhile and the storages
  that already counts;
- ``boundary()``: right before a collective is launched;
- ``waiting()``: a context around each wait for a collective;
- ``span(key)``: a context around one whole micro-step (its collectives' launches and
  waits included); ``key`` names its work, as for ``step``.
"""

from __future__ import annotations

import contextlib
import time


class Device:
    """The real device: nothing to emulate; it only keeps the time of the last step.

    ``step_wall_s`` is the last step's wall time and ``wait_s`` the part of it spent
    waiting for collectives, so ``compute_s`` is the rest (what the profiler measures).
    ``calibrating``: the last step did work the device had no fixed time for yet (an
    emulated device measuring it: slower than its steady steps); never on a real one.
    """

    step_wall_s = 0.0
    wait_s = 0.0
    calibrating = False
    tracks_memory = False   # True: the engine reports its state bytes to micro_step()
    names_work = False      # True: the engine names its work (the keys of step() and span())

    @property
    def compute_s(self) -> float:
        return self.step_wall_s - self.wait_s

    def span(self, key: str | None = None):
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def step(self, key: str | None = None):
        self.wait_s = 0.0
        start = time.perf_counter()
        try:
            yield self
        finally:
            self.step_wall_s = time.perf_counter() - start

    def micro_step(self, state_bytes: int, state_storages: set[int]):
        return contextlib.nullcontext()

    def boundary(self) -> None:
        pass

    @contextlib.contextmanager
    def waiting(self):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.wait_s += time.perf_counter() - start
