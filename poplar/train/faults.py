"""Faults injected on purpose, to test that a run survives them: ``POPLAR_FAULT``.

``POPLAR_FAULT="kill@backward:rank=1:step=3"`` makes rank 1 send itself SIGKILL when
the backward pass of step 3 (counted from 1) begins. What: ``kill`` (SIGKILL),
``term`` (SIGTERM, as a scheduler's preemption), or ``shrink`` (an emulated device's
memory shrinks to the fraction ``to`` of itself, as when another process takes some:
``shrink@step:rank=1:step=3:to=0.5``). Where:

- ``forward``, ``backward``: as the model's forward / backward pass starts;
- ``collective``: while the other ranks wait inside a collective for this one (it
  lingers a moment before dying, so they are surely in it);
- ``save``: in the middle of writing a checkpoint (this rank's shard written, the
  checkpoint not yet complete);
- ``step``: as the step begins (``shrink`` only).

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
WHAT = {"kill": signal.SIGKILL, "term": signal.SIGTERM, "shrink": None}


@dataclass(frozen=True)
class Fault:
    what: str
    where: str
    rank: int
    step: int
    to: float = 0.5

    @classmethod
    def parse(cls, text: str) -> Fault:
        try:
            head, *fields = text.strip().split(":")
            what, where = head.split("@")
            kv = dict(f.split("=", 1) for f in fields)
            fault = cls(what, where, int(kv.pop("rank")), int(kv.pop("step")), float(kv.pop("to", 0.5)))
            if kv or what not in WHAT or where not in WHERE or (what == "shrink") != (where == "step"):
                raise ValueError
            if not 0 < fault.to <= 1:
                raise ValueError
        except (ValueError, KeyError):
            raise ValueError(f"POPLAR_FAULT={text!r}: write WHAT@WHERE:rank=R:step=S with WHAT one of "
                             f"{', '.join(WHAT)} and WHERE one of {', '.join(WHERE)} (shrink@step:...:to=F, "
                             "0 < F <= 1)") from None
        return fault


def armed() -> Fault | None:
    """The fault this process is to suffer, if any (none in a restarted torchrun group)."""
    text = os.environ.get("POPLAR_FAULT")
    if not text or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return None
    return Fault.parse(text)


_fired = False


def point(where: str, rank: int, step: int) -> None:
    """Called where a fault may strike; ``step`` counts from 1."""
    global _fired
    fault = armed()
    if fault is None or _fired or (fault.where, fault.rank, fault.step) != (where, rank, step):
        return
    _fired = True
    if where == "collective":
        time.sleep(0.5)
    os.kill(os.getpid(), WHAT[fault.what])


def shrink(device, rank: int, step: int) -> None:
    """At the start of step ``step`` (from 1): the ``shrink`` fault lowers an emulated device's memory."""
    global _fired
    fault = armed()
    if fault is None or _fired or fault.what != "shrink" or (fault.rank, fault.step) != (rank, step):
        return
    if not hasattr(device, "capacity"):
        raise ValueError("POPLAR_FAULT=shrink@...: only an emulated device's memory can shrink")
    _fired = True
    device.capacity = int(device.capacity * fault.to)


def install(model, rank: int, current_step) -> list:
    """Hooks on ``model`` for the ``forward`` and ``backward`` points; ``current_step()`` gives the step (from 1)."""
    fault = armed()
    if fault is None or fault.where not in ("forward", "backward") or fault.rank != rank:
        return []
    if fault.where == "forward":
        return [model.register_forward_pre_hook(lambda m, a: point("forward", rank, current_step()))]
    # the last linear layer (the head) is the first the backward pass reaches
    last = [m for m in model.modules() if isinstance(m, torch.nn.Linear)][-1]
    return [last.register_full_backward_pre_hook(lambda m, g: point("backward", rank, current_step()))]
