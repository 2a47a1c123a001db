"""Faults injected on purpose, to test that a run survives them: ``POPLAR_FAULT``.

``POPLAR_FAULT="kill@backward:rank=1:step=3"`` makes rank 1 send itself SIGKILL when
the backward pass of step 3 (counted from 1) begins. What: ``kill`` (SIGKILL),
``term`` (SIGTERM, as a scheduler's preemption), ``shrink`` (an emulated device's
memory shrinks to the fraction ``to`` of itself, as when another process takes some:
``shrink@step:rank=1:step=3:to=0.5``), or ``slow`` (an emulated device computes at the
fraction ``to`` of its declared speed from that step on, as a card that throttles;
``until=U``: at its speed again from step ``U``: ``slow@step:rank=1:step=5:to=0.6:until=12``; a run resumed or
started again on other ranks inside that span computes slowed from its first step). ``rank`` is the device's
rank in the whole cluster where a re-plan can start the run again on other devices (``Run.device_rank``), the
launched rank otherwise.
Where:

- ``forward``, ``backward``: as the model's forward / backward pass starts;
- ``collective``: while the other ranks wait inside a collective for this one (it
  lingers a moment before dying, so they are surely in it);
- ``save``: in the middle of writing a checkpoint (this rank's shard written, the
  checkpoint not yet complete);
- ``step``: as the step begins (``shrink`` and ``slow`` only).

The fault fires once, in torchrun's first attempt (a restarted group runs clean).
Unset, nothing here costs anything.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

import torch

WHERE = ("forward", "backward", "collective", "save", "step")
WHAT = {"kill": signal.SIGKILL, "term": signal.SIGTERM, "shrink": None, "slow": None}
AT_STEP = ("shrink", "slow")   # what strikes as a step begins (and only there)


@dataclass(frozen=True)
class Fault:
    what: str
    where: str
    rank: int
    step: int
    to: float = 0.5
    until: int | None = None    # slow: the step from which the device is at its speed again

    @classmethod
    def parse(cls, text: str) -> Fault:
        try:
            head, *fields = text.strip().split(":")
            what, where = head.split("@")
            kv = dict(f.split("=", 1) for f in fields)
            until = kv.pop("until", None)
            fault = cls(what, where, int(kv.pop("rank")), int(kv.pop("step")), float(kv.pop("to", 0.5)),
                        None if until is None else int(until))
            if kv or what not in WHAT or where not in WHERE or (what in AT_STEP) != (where == "step"):
                raise ValueError
            if not 0 < fault.to <= 1 or (until is not None and (what != "slow" or fault.until <= fault.step)):
                raise ValueError
        except (ValueError, KeyError):
            raise ValueError(f"POPLAR_FAULT={text!r}: write WHAT@WHERE:rank=R:step=S with WHAT one of "
                             f"{', '.join(WHAT)} and WHERE one of {', '.join(WHERE)} (shrink@step:...:to=F, "
                             "0 < F <= 1; slow@step:...:to=F[:until=U], U after S)") from None
        return fault


def armed() -> Fault | None:
    """The fault this process is to suffer, if any (none in a restarted torchrun group)."""
    text = os.environ.get("POPLAR_FAULT")
    if not text or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return None
    return Fault.parse(text)


class FaultInjector:
    """The fault armed for this rank, as a component the trainer holds: it strikes at its point, once.

    The trainer calls :meth:`on_step_start` and :meth:`on_step_end` as it calls every
    component's; the forward and backward points are hooks on the model, the save point
    runs inside a checkpoint's writing (:meth:`on_shard_written`).
    """

    def __init__(self, fault: Fault, rank: int):
        self.fault, self.rank = fault, rank
        self.fired = False
        self.step = 0          # the step in progress, from 1
        self._device = None
        self._hooks: list = []

    @classmethod
    def for_rank(cls, rank: int) -> FaultInjector | None:
        fault = armed()
        return None if fault is None else cls(fault, rank)

    def attach(self, model: torch.nn.Module, device) -> FaultInjector:
        """Hooks for the ``forward`` and ``backward`` points; ``device`` is the one a ``shrink`` lowers."""
        self._device = device
        if self.fault.rank != self.rank or self.fault.where not in ("forward", "backward"):
            return self
        if self.fault.where == "forward":
            self._hooks.append(model.register_forward_pre_hook(lambda m, a: self.point("forward", self.step)))
        else:   # the last linear layer (the head) is the first the backward pass reaches
            last = [m for m in model.modules() if isinstance(m, torch.nn.Linear)][-1]
            self._hooks.append(last.register_full_backward_pre_hook(lambda m, g: self.point("backward", self.step)))
        return self

    def point(self, where: str, step: int) -> None:
        """Where a fault may strike; ``step`` counts from 1."""
        f = self.fault
        if self.fired or (f.where, f.rank, f.step) != (where, self.rank, step):
            return
        self.fired = True
        if where == "collective":   # linger: the others are surely waiting inside the collective
            time.sleep(0.5)
        os.kill(os.getpid(), WHAT[f.what])

    def on_step_start(self, step: int) -> None:
        self.step = step
        f = self.fault
        slowed = f.step <= step < (f.until or step + 1)   # as it is from a resume on too (a card stays slow)
        if f.what == "slow" and f.rank == self.rank and (step in (f.step, f.until) or (slowed and not self.fired)):
            if not hasattr(self._device, "slow"):
                raise ValueError("POPLAR_FAULT=slow@...: only an emulated device can be slowed")
            self.fired = True
            self._device.slow(f.to if slowed else 1.0)
        if self.fired or f.what != "shrink" or (f.rank, f.step) != (self.rank, step):
            return
        if getattr(self._device, "capacity", None) is None:
            raise ValueError("POPLAR_FAULT=shrink@...: only an emulated device's memory can shrink")
        self.fired = True
        self._device.capacity = int(self._device.capacity * f.to)

    def on_step_end(self, step: int) -> None:
        self.point("collective", step)

    def on_shard_written(self, step: int) -> None:
        self.point("save", step)

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
