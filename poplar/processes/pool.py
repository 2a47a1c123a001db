"""Worker processes beside this one, each running its jobs and handing back their answers.

A worker is forked from this process where that is safe (:func:`forking`: Linux, no other Python thread): it
shares the imports (torch, Poplar and the model's library: seconds a process) and begins at once. Elsewhere it
is a fresh interpreter running :func:`serve` (nothing of the caller's main module is run). Either way its jobs
are handed to it whole (``{job: items}``; an item's answer is ``work(item, *args)``, ``work`` a module's
function), the jobs to skip come on a pipe, its answers go back on another (each in a file: a large answer
must not fill the pipe and hold the worker). One that dies without its answers raises :class:`WorkerDied`
here, with the last line it wrote to stderr: nothing waits on a process that is gone.

Not ``concurrent.futures.ProcessPoolExecutor``: its spawn and forkserver workers import the caller's main
module again (a user's script without a ``__main__`` guard would run once more in each), and a worker that
dies breaks the whole pool, every other worker's answers with it.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import select
import subprocess
import sys
import sysconfig
import tempfile
import threading
import traceback
import warnings
from pathlib import Path

from poplar.lazy import imported_for_good


class WorkerDied(RuntimeError):
    """A worker process ended without handing back its answers."""


_ROOT = str(Path(__file__).resolve().parents[2])   # where a worker imports poplar from: where this one did


def _worker_env() -> dict[str, str]:
    """This environment, with poplar's directory first on the path unless it is where packages are installed (a
    worker's interpreter finds it there anyway, and that directory must not come before the standard library)."""
    installed = {str(Path(p).resolve()) for p in (sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"])}
    if _ROOT in installed:
        return dict(os.environ)
    path = os.pathsep.join(p for p in (_ROOT, os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path}


def forking() -> bool:
    """Whether a worker is forked from this process rather than started afresh: on Linux, with no Python thread
    but this one (a fork copies only the thread that calls it; the BLAS pools' native threads, which numpy and
    scipy start, stop around a fork by their own handlers)."""
    return (sys.platform.startswith("linux") and threading.active_count() == 1
            and not multiprocessing.current_process().daemon)    # (a daemonic process may start none)


_OURS: set[int] = set()     # this process's ends of its workers' pipes: a worker forked later closes them


class Worker:
    """A worker process with its ``jobs`` (``{job: items}``), each item's answer ``work(item, *args)``, begun at
    once: forked where :func:`forking` says so (``fork``: None), else a fresh interpreter."""

    def __init__(self, jobs: dict[int, list], work, args: tuple, fork: bool | None = None):
        self.jobs, self.begun, self.skipped = jobs, set(), set()
        self._stderr = tempfile.TemporaryFile()
        self._job_file = None
        if forking() if fork is None else fork:
            self.process, self.fd, self._inbox = self._fork(jobs, (work, args))
        else:
            self.process, self.fd, self._inbox = self._spawn(jobs, (work, args))
        _OURS.update((self.fd, self._inbox))

    def _fork(self, jobs, task):
        inbox, to_worker = os.pipe()
        from_worker, outbox = os.pipe()
        process = multiprocessing.get_context("fork").Process(
            target=_forked, args=(jobs, task, inbox, outbox, self._stderr.fileno(), [*_OURS, to_worker, from_worker]),
            daemon=True)
        with warnings.catch_warnings():   # Python 3.12's, of the BLAS pools' threads (see forking)
            warnings.filterwarnings("ignore", "This process .* is multi-threaded", DeprecationWarning)
            process.start()
        os.close(inbox)
        os.close(outbox)
        return _Process(process), from_worker, to_worker

    def _spawn(self, jobs, task):
        with tempfile.NamedTemporaryFile("wb", suffix=".pkl", delete=False) as f:
            pickle.dump((jobs, task), f)     # a file, not the pipe: a large cluster must not block this process
            self._job_file = f.name
        process = subprocess.Popen([sys.executable, "-c", "from poplar.processes.pool import serve; serve()", self._job_file],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr,
                                   env=_worker_env())
        return process, process.stdout.fileno(), process.stdin.fileno()

    def skip(self, job: int) -> None:
        if job in self.jobs:
            self.skipped.add(job)
            try:
                _write(self._inbox, job)
            except OSError:   # it has ended: what it sent says why
                pass

    def receive(self) -> list[tuple[int, list]]:
        """One message: the job it has begun (nothing to hand back yet) or done; raises what went wrong."""
        message = _read(self.fd)
        if message is None:
            self.process.wait()
            self._stderr.seek(0)
            said = self._stderr.read().decode(errors="replace").strip().splitlines()[-1:]
            raise WorkerDied(f"the worker on {', '.join(str(k) for ks in self.jobs.values() for k in ks)} ended "
                             f"without its answers (exit code {self.process.returncode}{': ' + said[0] if said else ''})")
        what, job, value = message
        if what == "begun":
            self.begun.add(job)
            return []
        if what == "error":
            error, where = value
            raise error from RuntimeError(f"in the worker, on {', '.join(map(str, self.jobs[job]))}:\n{where}")
        with open(value, "rb") as f:
            answers = pickle.load(f)
        os.unlink(value)
        return [(job, answers)]

    def close(self) -> None:
        if self.fd not in _OURS:
            return
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        _OURS.difference_update((self.fd, self._inbox))
        if isinstance(self.process, subprocess.Popen):
            for f in (self.process.stdin, self.process.stdout):
                f.close()
        else:
            os.close(self.fd)
            os.close(self._inbox)
        self._stderr.close()
        if self._job_file:
            os.unlink(self._job_file)


class _Process:
    """A forked worker (a ``multiprocessing`` process), read as a :class:`subprocess.Popen` is."""

    def __init__(self, process):
        self._process = process

    def poll(self) -> int | None:
        return self._process.exitcode

    def kill(self) -> None:
        self._process.kill()

    def wait(self) -> int:
        self._process.join()
        return self._process.exitcode

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode


def _write(fd: int, value) -> None:
    data = pickle.dumps(value)
    data = len(data).to_bytes(8, "little") + data
    while data:
        data = data[os.write(fd, data):]


def _read(fd: int):
    """One value :func:`_write` wrote to ``fd``; None at the end of the stream."""
    size = _read_exactly(fd, 8)
    body = _read_exactly(fd, int.from_bytes(size, "little")) if size else None
    return pickle.loads(body) if body is not None else None


def _read_exactly(fd: int, n: int) -> bytes | None:
    parts = []
    while n:
        part = os.read(fd, n)
        if not part:
            return None
        parts.append(part)
        n -= len(part)
    return b"".join(parts)


def serve() -> None:
    """A fresh worker's main (``sys.argv[1]``: its jobs): :func:`_serve`, what the simulation prints to stderr."""
    outbox = os.dup(1)
    os.dup2(2, 1)    # what the simulation prints goes to stderr, not into the answers
    with open(sys.argv[1], "rb") as f:
        jobs, task = pickle.load(f)
    imported_for_good()     # a fresh interpreter: the simulator's collections scan only what its jobs make
    _serve(jobs, task, 0, outbox)


def _forked(jobs: dict, task: tuple, inbox: int, outbox: int, log: int, theirs: list[int]) -> None:
    """A forked worker's main: :func:`_serve`, what the simulation prints to ``log``; the pipes' other ends
    (``theirs``: this worker's and earlier ones') closed, so that each reader sees its writer go."""
    import torch

    for fd in theirs:
        os.close(fd)
    os.dup2(log, 1)
    os.dup2(log, 2)
    torch.set_num_threads(1)    # an OpenMP pool the caller had started is not in this process: one thread never asks it
    imported_for_good()     # what the caller made before the fork is not scanned again by this one's collections
    _serve(jobs, task, inbox, outbox)


def _serve(jobs: dict, task: tuple, inbox: int, outbox: int) -> None:
    """Each job not skipped (told on ``inbox``), in order, its answers (``task``: the work and its arguments)
    written to ``outbox``."""
    work, args = task
    skipped: set[int] = set()
    for job, items in jobs.items():
        while select.select([inbox], [], [], 0)[0]:
            told = _read(inbox)
            if told is None:
                return    # the caller has gone
            skipped.add(told)
        if job in skipped:
            continue
        _write(outbox, ("begun", job, None))
        try:
            answers = [work(item, *args) for item in items]
        except BaseException as e:   # handed back whole: the caller raises it as if it had run there
            _write(outbox, ("error", job, _picklable(e)))
            return
        # the answers (a plan of every rank) through a file: the pipe's buffer would hold this worker until the
        # caller, busy with its own work, reads them
        with tempfile.NamedTemporaryFile("wb", suffix=".pkl", delete=False) as f:
            pickle.dump(answers, f)
        _write(outbox, ("done", job, f.name))


def _picklable(e: BaseException) -> tuple[BaseException, str]:
    where = traceback.format_exc()
    try:
        pickle.dumps(e)
        return e, where
    except Exception:
        return RuntimeError(f"{type(e).__name__}: {e}"), where
