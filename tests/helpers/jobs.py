"""Work for the jobs shared between worker processes and this one (tests/processes/test_pool.py): module
functions, so that a worker, forked or spawned, finds them by name."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

LAST_WORDS = "a worker's last words"


def where_answered(item: tuple[str, list[str]], directory: str) -> tuple[str, int]:
    """``item``: a name, and the names that must have been answered first (waited for, a minute at most). Marks the
    name answered (a file in ``directory``); the name and the process that answered it."""
    name, after = item
    deadline = time.monotonic() + 60
    while not all((Path(directory) / other).exists() for other in after):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name}: {after} not answered in a minute")
        time.sleep(0.01)
    (Path(directory) / name).touch()
    return name, os.getpid()


def answer_or_die(item: int, here: int) -> int:
    """Twice ``item`` in the process ``here``; elsewhere (a worker) the process ends, saying why on stderr."""
    if os.getpid() != here:
        print(LAST_WORDS, file=sys.stderr, flush=True)
        os._exit(3)
    return 2 * item


def fails_there(item: str, here: int) -> str:
    """``item`` in the process ``here``; a TypeError elsewhere (a worker)."""
    if os.getpid() != here:
        raise TypeError(f"{item}: not supported between a worker and this test")
    return item
