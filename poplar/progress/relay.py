"""The progress events of every rank of a running process group, shown by rank 0's display.

The profiler's first rank of each device kind reports that kind's stages; under torchrun
(or Lightning's launcher, or poplar's) that rank is often another process than rank 0,
which alone shows progress. A reporting rank writes its events to the group's rendezvous
store (the TCP store its environment names, ``MASTER_ADDR:MASTER_PORT``); a thread of
rank 0 reads them as they come and hands them, one at a time with rank 0's own, to its
display. Without such a store (a group made by hand) rank 0 shows its own events only.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import threading
from datetime import timedelta

import torch.distributed as dist

POLL_S = 0.5                   # how often rank 0 reads the others' events: a display's pace, not a timed one
STORE_TIMEOUT = timedelta(seconds=10)   # a display waits on it no longer
_waits = itertools.count()     # every rank relays the same waits in the same order: the n-th keeps its own keys


@contextlib.contextmanager
def relayed(progress):
    """Where this rank reports ``(kind, stage, what)`` events (``put``) during the ``with``: on rank 0,
    ``progress`` (None: nothing is shown) fed with every rank's events as well; on the others, the store
    towards rank 0.

    Every rank of the group enters it at once, and leaves it after a collective that follows its last
    event (as the profiler's gathering of the ranks' figures), so that rank 0 shows every event.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        yield progress
        return
    prefix = f"poplar/progress/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{next(_waits)}"
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        yield progress if dist.get_rank() == 0 else None
        return
    if dist.get_rank() != 0:
        yield _ToRankZero(prefix)
        return
    if progress is None:
        yield None
        return
    try:
        shown = _FromEveryRank(progress, prefix)
    except (RuntimeError, ValueError, OSError):   # no store to read (a display never stops a run): its own events
        yield progress
        return
    try:
        yield shown
    except BaseException:
        shown.close(drain=False)
        raise
    shown.close(drain=True)


def _store(prefix: str):
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=STORE_TIMEOUT)
    return dist.PrefixStore(prefix, store)


class _ToRankZero:
    """A rank's events, numbered in the store in the order they happen (it connects at its first event)."""

    def __init__(self, prefix: str):
        self.prefix, self.store = prefix, None   # prefix None: the store could not be reached, nothing is sent

    def put(self, event: tuple) -> None:
        if self.prefix is None:
            return
        try:
            if self.store is None:
                self.store = _store(self.prefix)
            n = self.store.add("count", 1)
            self.store.set(str(n), json.dumps(list(event)))
        except (RuntimeError, ValueError, OSError):   # no store to write to: this rank's events go unseen
            self.prefix = None


class _FromEveryRank:
    """Rank 0's display, fed with its own events and, by a thread, with those the other ranks write."""

    def __init__(self, progress, prefix: str):
        self.progress, self.store, self.seen = progress, _store(prefix), 0
        self._lock = threading.Lock()   # the display hears one event at a time, from either thread
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="poplar-progress-relay", daemon=True)
        self._thread.start()

    def put(self, event: tuple) -> None:
        with self._lock:
            self.progress.put(tuple(event))

    def _read(self) -> None:
        count = self.store.add("count", 0)
        while self.seen < count:
            self.seen += 1
            self.put(json.loads(self.store.get(str(self.seen))))

    def _poll(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                self._read()
            except (RuntimeError, ValueError):   # the store went away (a rank failed): the failure says why
                return

    def close(self, drain: bool) -> None:
        self._stop.set()
        self._thread.join()
        if drain:
            with contextlib.suppress(RuntimeError, ValueError):
                self._read()   # the events written since the last read: every rank has reported by now
