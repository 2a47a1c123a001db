"""Each kind of device alone: its homogeneous cluster simulated and planned, beside the whole cluster's.

The paper's baselines 1 and 2 (:mod:`poplar.evaluate`): the same devices, nodes and links
with the other kinds left out. Each is a simulation and a plan of its own, independent of
the whole cluster's, so they run in worker processes while this process simulates and plans
the whole cluster (:class:`AloneRuns`): as many workers as the machine has cores to spare.
The kinds of one world size are one job (their steps are counted once, for that world).
Each worker takes its jobs from the first; this process, done with the whole cluster, takes
from the last the jobs no worker has begun (its counted steps are warm; a worker starts
cold) and tells the worker to skip them, so neither waits on the other while work remains.

A worker is a fresh interpreter running :func:`serve` (no state of this process is copied,
nothing of the caller's main module is run): its jobs pickled in a file, the jobs to skip on
its standard input, its answers on its standard output. It is killed when the runs end. One
that dies without its answers is warned of, with the last line it wrote to stderr, and its
jobs are run here: nothing waits on a process that is gone.

Not ``concurrent.futures.ProcessPoolExecutor``: its spawn and forkserver workers import the
caller's main module again (a user's script without a ``__main__`` guard that evaluates a
cluster would run once more in each), its fork workers copy this process's
counted steps and caches (gigabytes for a 4,096-GPU cluster), and a worker that dies breaks
the whole pool, every other worker's answers with it.
"""

from __future__ import annotations

import os
import pickle
import select
import subprocess
import sys
import sysconfig
import tempfile
import traceback
import warnings
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from poplar.cluster.spec import ClusterSpec
from poplar.lazy import imported_for_good
from poplar.planner import make_plan
from poplar.planner.planner import PlanningError, PlanResult
from poplar.profile.options import ProfileOptions
from poplar.simulate.profile import simulate_profile
from poplar.workload import Workload



class Alone(BaseModel):
    """The homogeneous cluster of one kind: its own best plan, or why it has none."""

    model_config = ConfigDict(extra="forbid")

    kind: str
    ranks: int
    label: str = ""
    samples_per_s: float | None = None
    why_not: str = ""


def alone_cluster(spec: ClusterSpec, kind: str) -> ClusterSpec:
    """``spec`` with only the devices of ``kind``: on the same nodes, over the same links."""
    return spec.model_copy(update={"devices": [d for d in spec.devices if d.kind == kind]})


def plan_alone(workload: Workload, spec: ClusterSpec, kind: str, global_batch: int,
               options: ProfileOptions) -> tuple[Alone, PlanResult | None]:
    """``kind`` alone on ``spec``: simulated and planned, or why it cannot run ``global_batch``."""
    sub = alone_cluster(spec, kind)
    if global_batch < sub.world_size:
        return Alone(kind=kind, ranks=sub.world_size, why_not=f"a global batch of {global_batch} is smaller than "
                     f"its {sub.world_size} ranks"), None
    try:     # devices that cannot hold the model's states together: no plan, said at once (not a failed run)
        sub.check_holds_states(workload.name, workload.n_params(), options.precision)
    except ValueError as e:
        return Alone(kind=kind, ranks=sub.world_size, why_not=str(e)), None
    try:
        result = make_plan(simulate_profile(workload, sub, options), global_batch, options.stages)
    except PlanningError as e:
        return Alone(kind=kind, ranks=sub.world_size, why_not=str(e)), None
    return Alone(kind=kind, ranks=sub.world_size, label=result.chosen.label,
                 samples_per_s=result.predicted.samples_per_s), result


def spare_cores() -> int:
    """The cores this process may use, less the one it runs on (none where pipes cannot be waited on together)."""
    if os.name != "posix":
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(0, cores - 1)


Answer = tuple[Alone, PlanResult | None]


def jobs_of(spec: ClusterSpec, kinds: list[str]) -> list[list[str]]:
    """``kinds`` in jobs of one kind each (planning a kind alone at 512 ranks takes as long as counting its steps),
    those whose clusters alone have as many ranks together, the larger such groups first: a worker takes its jobs
    from the first, this process from the last, so a world's steps are mostly counted in one process."""
    by_size: dict[int, list[str]] = {}
    for kind in kinds:
        by_size.setdefault(alone_cluster(spec, kind).world_size, []).append(kind)
    return [[k] for group in sorted(by_size.values(), key=len, reverse=True) for k in group]


class AloneRuns:
    """Each of ``kinds`` alone, begun at once in up to ``workers`` processes (None: :func:`spare_cores`);
    :meth:`results` runs here what no worker has begun and waits for the rest. A context manager: leaving it
    ends the workers."""

    def __init__(self, workload: Workload, spec: ClusterSpec, kinds: list[str], global_batch: int,
                 options: ProfileOptions, workers: int | None = None):
        self.kinds, self.args = kinds, (workload, spec, global_batch, options)
        self.jobs = jobs_of(spec, kinds)
        self.worlds = [alone_cluster(spec, job[0]).world_size for job in self.jobs]
        n = min(len(self.jobs), spare_cores() if workers is None else max(0, workers))
        self.workers: list[_Worker] = []
        self.done: dict[int, list[Answer]] = {}
        try:
            for i in range(n):
                self.workers.append(_Worker({j: self.jobs[j] for j in range(i, len(self.jobs), n)}, self.args))
        except BaseException:
            self.__exit__()
            raise

    def results(self) -> list[Answer]:
        """Each kind's answer, in the order of ``kinds``."""
        while len(self.done) < len(self.jobs):
            self._take(timeout=0)
            begun = {j for w in self.workers for j in w.begun}
            free = [j for j in range(len(self.jobs)) if j not in self.done and j not in begun]
            if free:
                job = free[-1]
                # a world no worker is on: its other kinds too, whose steps this process will then have counted
                working = {self.worlds[j] for j in begun if j not in self.done}
                for j in (j for j in free if j == job or self.worlds[job] not in working
                          and self.worlds[j] == self.worlds[job]):
                    for w in self.workers:
                        w.skip(j)
                self.done[job] = [plan_alone(self.args[0], self.args[1], k, *self.args[2:]) for k in self.jobs[job]]
            else:
                self._take(timeout=None)
        out = {k: a for j, answers in self.done.items() for k, a in zip(self.jobs[j], answers)}
        return [out[k] for k in self.kinds]

    def _take(self, timeout: float | None) -> None:
        """The answers the workers sent, waiting up to ``timeout`` seconds (None: until one sends). A worker that
        ended without its answers is warned of and dropped: its jobs are left for this process."""
        while True:     # every message sent so far, not one: what a worker has begun must be known here at once
            waiting = [w for w in self.workers if set(w.jobs) - set(self.done)]
            ready = select.select([w.fd for w in waiting], [], [], timeout)[0] if waiting else []
            if not ready:
                return
            timeout = 0
            for w in waiting:
                if w.fd in ready:
                    self._receive(w)

    def _receive(self, w: _Worker) -> None:
        try:
            for job, answers in w.receive():
                self.done.setdefault(job, answers)
        except WorkerDied as e:
            warnings.warn(f"{e}; simulating them here instead", RuntimeWarning, stacklevel=4)
            self.workers.remove(w)
            w.close()

    def __enter__(self) -> AloneRuns:
        return self

    def __exit__(self, *exc) -> None:
        for w in self.workers:
            w.close()


class WorkerDied(RuntimeError):
    """A worker process ended without handing back its answers."""


_ROOT = str(Path(__file__).resolve().parent.parent)   # where a worker imports poplar from: where this one did


def _worker_env() -> dict[str, str]:
    """This environment, with poplar's directory first on the path unless it is where packages are installed (a
    worker's interpreter finds it there anyway, and that directory must not come before the standard library)."""
    installed = {str(Path(p).resolve()) for p in (sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"])}
    if _ROOT in installed:
        return dict(os.environ)
    path = os.pathsep.join(p for p in (_ROOT, os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path}


class _Worker:
    """A worker process with its ``jobs`` (``{job: kinds}``), begun at once."""

    def __init__(self, jobs: dict[int, list[str]], args: tuple):
        self.jobs, self.begun = jobs, set()
        with tempfile.NamedTemporaryFile("wb", suffix=".pkl", delete=False) as f:
            pickle.dump((jobs, args), f)     # a file, not the pipe: a large cluster must not block this process
            self._job_file = f.name
        self._stderr = tempfile.TemporaryFile()
        self.process = subprocess.Popen([sys.executable, "-c", "from poplar.alone import serve; serve()",
                                         self._job_file], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=self._stderr, env=_worker_env())
        self.fd = self.process.stdout.fileno()

    def skip(self, job: int) -> None:
        if job in self.jobs:
            try:
                _write(self.process.stdin.fileno(), job)
            except OSError:   # it has ended: what it sent says why
                pass

    def receive(self) -> list[tuple[int, list[Answer]]]:
        """One message: the job it has begun (nothing to hand back yet) or done; raises what went wrong."""
        message = _read(self.fd)
        if message is None:
            self.process.wait()
            self._stderr.seek(0)
            said = self._stderr.read().decode(errors="replace").strip().splitlines()[-1:]
            raise WorkerDied(f"the worker simulating {', '.join(k for ks in self.jobs.values() for k in ks)} alone "
                             f"ended without its answers (exit code {self.process.returncode}"
                             f"{': ' + said[0] if said else ''})")
        what, job, value = message
        if what == "begun":
            self.begun.add(job)
            return []
        if what == "error":
            error, where = value
            raise error from RuntimeError(f"in the worker, simulating {', '.join(self.jobs[job])} alone:\n{where}")
        with open(value, "rb") as f:
            answers = pickle.load(f)
        os.unlink(value)
        return [(job, answers)]

    def close(self) -> None:
        if self.process.stdout.closed:
            return
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        for f in (self.process.stdin, self.process.stdout, self._stderr):
            f.close()
        os.unlink(self._job_file)


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
    """A worker's main (``sys.argv[1]``: its jobs): each job not skipped, in order, its answers written out."""
    out = os.dup(1)
    os.dup2(2, 1)    # what the simulation prints goes to stderr, not into the answers
    with open(sys.argv[1], "rb") as f:
        jobs, args = pickle.load(f)
    imported_for_good()     # a fresh interpreter: the simulator's collections scan only what its jobs make
    skipped: set[int] = set()
    for job, kinds in jobs.items():
        while select.select([0], [], [], 0)[0]:
            told = _read(0)
            if told is None:
                return    # the caller has gone
            skipped.add(told)
        if job in skipped:
            continue
        _write(out, ("begun", job, None))
        try:
            answers = [plan_alone(args[0], args[1], k, *args[2:]) for k in kinds]
        except BaseException as e:   # handed back whole: the caller raises it as if it had run there
            _write(out, ("error", job, _picklable(e)))
            return
        # the answers (a plan of every rank) through a file: the pipe's buffer would hold this worker until the
        # caller, busy with the whole cluster, reads them
        with tempfile.NamedTemporaryFile("wb", suffix=".pkl", delete=False) as f:
            pickle.dump(answers, f)
        _write(out, ("done", job, f.name))


def _picklable(e: BaseException) -> tuple[BaseException, str]:
    where = traceback.format_exc()
    try:
        pickle.dumps(e)
        return e, where
    except Exception:
        return RuntimeError(f"{type(e).__name__}: {e}"), where
