"""What the engine asks of the device a rank runs on; the real device needs nothing.

An emulated device (``poplar.emulate.EmulatedDevice``) implements these to run at its
own speed and within its own memory. The engine calls:

- ``step()``: a context around one optimizer step;
- ``micro_step(state_bytes, state_storages)``: a context around one micro-step's
  forward and backward, with the bytes of model state held meanwhile and the storages
  that already counts;
- ``boundary()``: right before a collective is launched;
- ``waiting()``: a context around each wait for a collective.
"""

from __future__ import annotations

import contextlib


class Device:
    """The real device: nothing to emulate."""

    def step(self):
        return contextlib.nullcontext()

    def micro_step(self, state_bytes: int, state_storages: set[int]):
        return contextlib.nullcontext()

    def boundary(self) -> None:
        pass

    def waiting(self):
        return contextlib.nullcontext()
