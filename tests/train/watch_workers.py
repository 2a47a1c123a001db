"""Processes for tests/train/test_watchdog.py: ranks that watch each other, one of which dies or freezes."""

from __future__ import annotations

import os
import signal
import sys
import time

from poplar.runtime.watchdog import Watchdog


def watched(rank: int, world_size: int, port: int, fate: str, log: str) -> None:
    sys.stderr = open(f"{log}.{rank}", "w", buffering=1)
    dog = Watchdog(rank, world_size, dead_after_s=2.0, interval_s=0.1, address=("127.0.0.1", port),
                   where=lambda: "during step 7")
    if fate == "freeze":      # as if on another host: only the heartbeat can tell
        dog.host = f"elsewhere-{rank}"
    dog.start()
    time.sleep(1.0)
    if rank == world_size - 1:
        if fate == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif fate == "freeze":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif fate == "fail":
            dog.fail("ValueError: a bad batch")
            os._exit(1)
        elif fate == "finish":
            dog.finished()
            os._exit(0)
    time.sleep(30 if fate != "finish" else 3.5)   # in a long computation, or a collective that never ends
    dog.finished()
    os._exit(0)
