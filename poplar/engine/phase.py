"""Where a rank is in an optimizer step: idle, or at micro-step ``k`` of its ``n``; the step's transitions named.

:class:`~poplar.engine.engine.Engine` drives it (``train_batch``, or a loop of its own:
``begin_step``, then per micro-batch ``begin_micro_step`` and ``backward``, then
``end_step``); a call out of order is refused with what to call instead, before any
collective is issued (so no rank is left waiting in one).

>>> phase = StepPhase(micro_steps=2)
>>> phase.begin_step(); phase.begin_micro_step(), phase.end_micro_step(), phase.begin_micro_step()
(False, None, True)
>>> phase.end_micro_step(); phase.end_step(); phase.idle
True
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepPhase:
    micro_steps: int            # this rank's micro-steps in a step (its accumulation)
    done: int | None = None     # micro-steps done in the step begun; None: idle, no step begun

    @property
    def idle(self) -> bool:
        return self.done is None

    def begin_step(self) -> None:
        """A step begins (whatever a step given up left: its state is reset by the engine)."""
        self.done = 0

    def begin_micro_step(self) -> bool:
        """Before a micro-batch's forward; whether it is the step's last."""
        if self.done is None:
            raise RuntimeError("begin the step (begin_step) before its first micro-batch")
        if self.done >= self.micro_steps:
            raise RuntimeError(f"this rank has run its {self.micro_steps} micro-batches of the step: end the step "
                               "before the next forward")
        return self.done == self.micro_steps - 1

    def end_micro_step(self) -> None:
        """After a micro-batch's backward."""
        self.done = (self.done or 0) + 1

    def end_step(self) -> None:
        """Before the update: every micro-step of the step done; idle after it."""
        if self.done != self.micro_steps:
            raise RuntimeError(f"this rank ran {self.done or 0} of its {self.micro_steps} micro-batches: run them "
                               "all before the step")
        self.done = None
