"""Steps run on a rank's device, each timed in the device's step, their figures kept: :class:`TimedSteps`.

The one step loop of every caller that times what it runs on a device: a rank's training
(:class:`~poplar.runtime.rank.RankRuntime`, every front end's), the comparisons'
measurements (:mod:`poplar.compare.measure`: Poplar's engines and the peers alike) and the
profiler's timed steps and collectives (:mod:`poplar.profile.timing`). Each step runs inside
:meth:`Device.step <poplar.devices.base.Device.step>`, given what the stepped thing holds
(an engine's ``held_state``, which an emulated device's memory cap counts), and after it
its figures are kept: the step's time on the device's clock (``step_s``), the part spent
waiting for collectives (``wait_s``) and the rest (``busy_s``), the overruns the step added,
and when it began and ended on this host (``walls``, ``time.perf_counter``). A step not
kept (a warm-up's) is run and timed all the same, and forgotten.

>>> from poplar.devices.base import Device
>>> with Device() as device:
...     steps = TimedSteps(device)
...     steps.run(lambda: sum(range(1000)), keep=False)
...     steps.run(lambda: sum(range(1000)))
499500
499500
>>> len(steps.step_s), steps.step_s[0] >= steps.busy_s[0] >= 0
(1, True)
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Iterator, TypeVar

from poplar.devices.base import Device, Held

T = TypeVar("T")


class TimedSteps:
    """Steps on ``device`` with ``held`` (what each step holds, for memory accounting; None: nothing declared),
    each one's figures kept in order."""

    def __init__(self, device: Device, held: Held | None = None):
        self.device, self.held = device, held
        self.step_s: list[float] = []     # each step's time on the device's clock
        self.wait_s: list[float] = []     # the part of it spent waiting for collectives
        self.busy_s: list[float] = []     # the rest: the rank's own work
        self.walls: list[tuple[float, float]] = []   # when each began and ended on this host (perf_counter)
        self.overruns = 0                 # spans whose real work ran past an emulated device's time, in all

    @contextlib.contextmanager
    def step(self, keep: bool = True) -> Iterator[Device]:
        """The context one step runs in (for loops that drive its parts themselves); its figures kept unless
        ``keep`` is False. A step that raises keeps nothing."""
        start, before = time.perf_counter(), self.device.overruns
        with self.device.step(self.held) as device:
            yield device
        if keep:
            self.step_s.append(device.step_s)
            self.wait_s.append(device.wait_s)
            self.busy_s.append(device.compute_s)
            self.walls.append((start, time.perf_counter()))
            self.overruns += device.overruns - before

    def run(self, step: Callable[[], T], keep: bool = True) -> T:
        """``step()`` run as one step (see :meth:`step`); what it returns."""
        with self.step(keep):
            return step()
