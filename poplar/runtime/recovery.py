"""Out of memory mid-step: the step is not lost, the plan is lowered, the step runs again.

A rank that runs out of memory (the profile was optimistic, memory fragmented, another
process took some) is somewhere in its step while the others wait for it inside a
collective that will never be matched. So:

1. the failing rank posts a notice (its rank, the step, the micro-batch that failed) to
   the rendezvous store, then leaves the process group, which breaks the others'
   pending collectives;
2. every rank reads the notice, drops the step's in-flight work
   (:meth:`~poplar.engine.engine.Engine.abandon_step`) and joins a new generation of the
   group (:func:`~poplar.engine.dist.rebuild_process_group`);
3. the plan is lowered the same way on every rank: the failing rank's micro-batch is
   halved and it runs more of them, every rank keeping its samples
   (:meth:`poplar.Plan.lower_micro_batch`), so the update stays exactly the same;
4. the step runs again from its start. The update had not been applied (it waits for
   every rank), so the parameters are those of a run that never ran out of memory.

An out-of-memory inside the optimizer's update itself cannot be undone this way (ranks
may have updated already): it stops the run, naming the last checkpoint.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from poplar.engine.dist import can_rebuild, rebuild_process_group
from poplar.engine.engine import UpdateOutOfMemoryError
from poplar.runtime.watchdog import lost_peer

NOTICE_WAIT_S = 10.0


class StepRecovery:
    """Runs each step's attempts; see the module's docstring. ``on_new_plan(plan, notice)`` hears of every change."""

    def __init__(self, rank: int, engine, on_new_plan: Callable[[Any, dict], None]):
        self.rank, self.engine, self.on_new_plan = rank, engine, on_new_plan
        self.generation = 0
        self._store = None
        if can_rebuild():
            self._store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                        is_master=False, timeout=timedelta(seconds=30))
        self._prefix = f"poplar/recovery/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"

    def run(self, step: int, attempt: Callable[[], Any]) -> Any:
        """``attempt()`` (the step), again after each recovery, until it completes."""
        while True:
            try:
                return attempt()
            except torch.OutOfMemoryError as e:
                if self._store is None or isinstance(e, UpdateOutOfMemoryError):   # ranks may be apart
                    raise
                notice = {"rank": self.rank, "step": step + 1,
                          "micro_batch": self.engine.plan.micro_batch_sizes[self.rank],
                          "error": str(e).strip().splitlines()[0] if str(e).strip() else "out of memory"}
                key = self._key()
                self._store.compare_set(key, "", json.dumps(notice))
                notice = json.loads(self._store.get(key))   # another rank's, if it ran out first
            except Exception as e:
                if self._store is None or not lost_peer(e):
                    raise
                notice = self._wait_for_notice()
                if notice is None:
                    raise
            self._recover(notice)

    def _key(self) -> str:
        return f"{self._prefix}{self.generation}"

    def _wait_for_notice(self) -> dict | None:
        deadline = time.monotonic() + NOTICE_WAIT_S
        while time.monotonic() < deadline:
            if self._store.check([self._key()]):
                return json.loads(self._store.get(self._key()))
            time.sleep(0.05)
        return None

    def _recover(self, notice: dict) -> None:
        if notice["micro_batch"] <= 1:
            raise torch.OutOfMemoryError(
                f"rank {notice['rank']} is out of memory at step {notice['step']} with micro-batches of one "
                f"sample ({notice['error']}): use a higher ZeRO stage, a smaller model or fewer samples on it")
        self.engine.abandon_step()      # its in-flight works belong to the group about to go
        self.generation += 1
        rebuild_process_group(self.generation)
        self.engine.regroup()
        plan = self.engine.plan.lower_micro_batch(notice["rank"], notice["micro_batch"] // 2)
        self.engine.set_plan(plan)
        self.on_new_plan(plan, notice)
