"""Jobs shared between worker processes and this one (:class:`SharedJobs`), the workers a
:class:`concurrent.futures.ProcessPoolExecutor` (:func:`worker_pool`).

What the executor is given, and why:

- **Forked where that is safe** (:func:`forking`: Linux, no Python thread but this one, Python 3.11 or later):
  a forked worker shares this process's imports (torch, Poplar, the model's library: seconds a process),
  begins at once, and runs nothing of the caller's main module again. The executor forks its workers
  together at the first job, before it starts its own thread (Python 3.11 on; Python 3.10's executor forks a
  worker per job beside that thread, so there it spawns them), and never forks another after.
- **Spawned elsewhere** (a fresh interpreter). Python's ``spawn`` start imports the caller's main module again
  in each worker, as ``__mp_main__``: what sits under ``if __name__ == "__main__":`` does not run there, what
  a script runs outside it does. Poplar's own commands are guarded; a script of the user's that starts these
  jobs on macOS, or beside a thread of its own, needs the guard too (multiprocessing says so in one line where
  it is missing).
- **A worker that dies** breaks the executor (:class:`~concurrent.futures.process.BrokenProcessPool`, every
  worker ended with it): it is warned of, with the last line the workers wrote, and every job not yet
  answered is run in this process.
- **An error in a job is raised here as itself** (the executor hands the worker's exception back, its
  traceback there as the ``__cause__``).
- What a worker prints goes to a log of its own, not into this process's output; a forked worker computes on
  one torch thread (an OpenMP pool the caller had started is not in it: one thread never asks for it).
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import sys
import tempfile
import threading
import warnings
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from poplar.lazy import imported_for_good


def forking() -> bool:
    """Whether workers are forked from this process rather than spawned: on Linux, with no Python thread but this
    one (a fork copies only the thread that calls it; the BLAS pools' native threads, which numpy and scipy
    start, stop around a fork by their own handlers), on Python 3.11 or later (see the module's docstring)."""
    return (sys.platform.startswith("linux") and sys.version_info >= (3, 11) and threading.active_count() == 1
            and not multiprocessing.current_process().daemon)    # (a daemonic process may start none)


def spare_cores() -> int:
    """The cores this process may use, less the one it runs on."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(0, cores - 1)


def worker_pool(workers: int, log: str, fork: bool | None = None) -> ProcessPoolExecutor:
    """An executor of ``workers`` processes, forked where ``fork`` says so (None: :func:`forking`), else spawned;
    what they print goes to the file ``log``."""
    forked = forking() if fork is None else fork
    return ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork" if forked else "spawn"),
                               initializer=_start_worker, initargs=(log, forked))


def _start_worker(log: str, forked: bool) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_APPEND)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    # (Python's own streams too: a forked worker's may be the caller's stand-ins, a test's capture)
    sys.stdout = sys.stderr = open(log, "a", buffering=1, errors="replace")   # noqa: SIM115 - the worker's life
    if forked:
        import torch

        torch.set_num_threads(1)
    imported_for_good()     # what the worker makes is all its collections scan (see poplar.lazy)


class SharedJobs:
    """``work(item, *args)`` for each of ``items``, in up to ``workers`` processes beside this one (None:
    :func:`spare_cores`; 0: all here) and in this one. A context manager: the workers begin at once; leaving it
    ends them (a job a worker has begun is let finish).

    The workers take the items from the first, each its next as it answers one; :meth:`results` takes here,
    from the last, what no worker has taken. Items of one ``key`` cost less after the first in one process
    (for each kind alone, a world size whose steps it has counted): the next item of a key a worker is on is
    left to the workers, and this process takes every item of a key no worker is on.
    """

    def __init__(self, work, items: list, args: tuple = (), keys: list | None = None, workers: int | None = None,
                 fork: bool | None = None):
        self.work, self.items, self.args = work, list(items), tuple(args)
        self.keys = list(range(len(self.items))) if keys is None else list(keys)
        self._queue = list(range(len(self.items)))      # the items no process has taken, in order
        self._running: set[int] = set()                 # taken by a worker, not yet answered
        self._answers: dict[int, object] = {}
        self._errors: list[BaseException] = []
        self._broken = self._warned = self._closed = False
        self._changed = threading.Condition(threading.RLock())
        self._pool, self._log = None, None
        n = min(len(self.items), spare_cores() if workers is None else workers)
        if n > 0 and not multiprocessing.current_process().daemon:
            fd, self._log = tempfile.mkstemp(prefix="poplar-workers-", suffix=".log")
            os.close(fd)
            self._pool = worker_pool(n, self._log, fork)
            try:
                with self._changed, warnings.catch_warnings():    # Python 3.12's, of the BLAS pools' threads
                    warnings.filterwarnings("ignore", "This process .* is multi-threaded", DeprecationWarning)
                    for _ in range(n):
                        self._hand_out()
            except BaseException:
                self.__exit__(*sys.exc_info())
                raise

    def results(self) -> list:
        """Each item's answer, in order: this process answers what no worker has taken, then waits for the rest.
        Raises a worker's error as itself; warns of a worker that died, and answers its items here."""
        while True:
            with self._changed:
                if self._errors:
                    raise self._errors[0]
                if self._broken and not self._warned:
                    self._warned = True
                    warnings.warn(f"a worker process ended without its answers{self._last_words()}: what the "
                                  "workers had not answered runs here instead", RuntimeWarning, stacklevel=2)
                if len(self._answers) == len(self.items):
                    return [self._answers[i] for i in range(len(self.items))]
                mine = self._take()
                if not mine:
                    self._changed.wait()
            for i in mine:
                answer = self.work(self.items[i], *self.args)
                with self._changed:
                    self._answers[i] = answer

    def _take(self) -> list[int]:
        """(Holding the lock.) The items this process answers next, taken from the queue (see the class)."""
        on = set() if self._broken else {self.keys[i] for i in self._running}
        left = {next(i for i in self._queue if self.keys[i] == key) for key in on
                if any(self.keys[i] == key for i in self._queue)}
        free = [i for i in self._queue if i not in left]
        if not free:
            return []
        last = free[-1]
        mine = [last] + ([i for i in free[:-1] if self.keys[i] == self.keys[last]] if self.keys[last] not in on else [])
        self._queue = [i for i in self._queue if i not in mine]
        return mine

    def _hand_out(self) -> None:
        """(Holding the lock.) The first item no process has taken, to the workers."""
        if self._closed or self._broken or not self._queue:
            return
        i = self._queue[0]
        try:
            future = self._pool.submit(self.work, self.items[i], *self.args)
        except (BrokenProcessPool, RuntimeError):   # broken or shut down meanwhile: the futures' callbacks say so
            return
        self._queue.pop(0)
        self._running.add(i)
        future.add_done_callback(functools.partial(self._answered, i))

    def _answered(self, i: int, future: Future) -> None:
        """A worker's answer to item ``i`` (or why there is none), and its next item (in the executor's thread)."""
        if future.cancelled():      # the pool is shut down: nothing waits for it
            return
        with self._changed:
            self._running.discard(i)
            error = future.exception()
            if error is None:
                self._answers[i] = future.result()
            elif isinstance(error, BrokenProcessPool):
                self._broken = True
                self._queue.append(i)
            else:
                self._errors.append(error)
            self._hand_out()
            self._changed.notify_all()

    def _last_words(self) -> str:
        try:
            with open(self._log, errors="replace") as f:
                said = [line.strip() for line in f if line.strip()]
        except OSError:
            said = []
        return f" ({said[-1]})" if said else ""

    def __enter__(self) -> SharedJobs:
        return self

    def __exit__(self, *exc) -> None:
        with self._changed:
            self._closed = True
        if self._pool is not None:
            self._pool.shutdown(wait=not exc or exc[0] is None, cancel_futures=True)
            self._pool = None
        if self._log is not None:
            os.unlink(self._log)
            self._log = None
