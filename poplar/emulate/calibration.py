"""What a computation costs on this host, measured alone once and kept: the emulated devices' clock.

An emulated device's time for a piece of work is the host's CPU time for that work
divided by the device's speed. Measured afresh every time, that time would follow
whatever the host is doing: ranks sharing its cores inflate each other's CPU time
(three ranks on two cores: +25% here), and a shared host drifts by 10-40% over minutes.
A real GPU does neither. So each computation the engine names (a key: the model, the
stage, the micro-batch's shape) is calibrated once:

- alone: while a rank calibrates, it holds the host-wide calibration lock exclusively,
  and every rank holds it shared while it computes anything, so no other rank of any
  emulated cluster on this host computes meanwhile (waits and sleeps hold no lock, so
  no rank can block another that waits for it);
- as the best of its first ``OBSERVATIONS`` runs (the most reproducible figure on a
  shared host: here one computation's CPU time alone varied by 20-40% from run to run
  and second to second, its best by a few percent), kept on disk per host (the first
  process to finish a key writes it; the others adopt that value), so every rank, every
  later launch, the profiler and the training that follows it all see the same times.

A key ``family@m`` names the work of a micro-batch of ``m`` samples in a family (the
same model, stage, shapes per sample and loss, whatever the micro-step's place in the
step). A real device's time is a smooth function of the micro-batch size; calibrations
of single sizes are not (one size's best of 5 came out 60% above its neighbours' here).
So a size lying between two calibrated sizes of its family is not calibrated but
interpolated linearly between them, and fixed for everyone like a calibration. The
profiler calibrates the sizes it measures (five per device kind, from 1 to its limit),
so every micro-batch a plan then gives a device runs close to the time the profile's
curve says (the profile's spline and the line between its points differ by a few
percent where the curve bends, 9% at most in the profiles measured here). Tried and
dropped: the same spline on both sides. The family's calibrated sizes are every
kind's, noisy ones included (a size can cost less than a smaller one), and a spline
through them swung 13-25% away from one kind's profile between two of its points.

Only computations with a key are calibrated; anything else runs at its measured CPU time.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import platform
import time
import uuid
from pathlib import Path

import torch

OBSERVATIONS = 5          # runs of a computation whose best becomes its calibrated cost
SCHEME = 9                # how work is named and costed (9: micro-step families by size, linear between calibrated sizes, one rest per engine); a new one, a new table
LOCK_TIMEOUT_S = 10.0     # a lock not had by then is given up on: the work runs unlocked (never a hang)


def default_dir() -> Path:
    base = os.environ.get("POPLAR_CACHE_DIR")
    return Path(base) / "calibration" if base else Path.home() / ".cache" / "poplar" / "calibration"


def host_fingerprint() -> str:
    """What makes calibrations of one host comparable: its CPU, torch, poplar (threads are in each key)."""
    import poplar

    cpu = platform.processor()
    try:
        cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name")), cpu)
    except OSError:
        pass
    what = [platform.machine(), cpu, os.cpu_count(), torch.__version__, poplar.__version__, SCHEME]
    return hashlib.sha256(json.dumps(what).encode()).hexdigest()[:16]


def host_lock_path() -> Path:
    """One lock for the whole host, whatever table a process uses: the cores are what it guards."""
    import tempfile

    return Path(os.environ.get("POPLAR_HOST_LOCK", Path(tempfile.gettempdir()) / "poplar-host.lock"))


class HostLock:
    """The host-wide calibration lock (``flock`` on a file): exclusive to calibrate, shared to compute.

    One per process (``flock`` locks belong to the open file, so two in one process would
    block each other). Acquiring polls with a timeout; one not had in ``LOCK_TIMEOUT_S``
    is given up on and counted in ``timeouts``.
    """

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        self.mode: int | None = None
        self.timeouts = 0

    def hold(self, exclusive: bool) -> None:
        want = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
        if self.mode == want:
            return
        if self.mode is not None:
            self.release()   # converting is not atomic anyway: release, then take anew
        deadline = time.monotonic() + LOCK_TIMEOUT_S
        while True:
            try:
                fcntl.flock(self._fd, want | fcntl.LOCK_NB)
                self.mode = want
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    self.timeouts += 1
                    return
                time.sleep(0.0002)

    def release(self) -> None:
        if self.mode is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            self.mode = None

    @property
    def exclusive(self) -> bool:
        return self.mode == fcntl.LOCK_EX


class Calibration:
    """The calibrated CPU seconds of this host's keyed computations (see the module's docstring).

    The table is a JSON-lines file: a header with an identifier (a profile measured
    against one table is not reused with another), then one line per calibrated key.
    """

    def __init__(self, directory: Path | None = None):
        directory = Path(directory or default_dir())
        fp = host_fingerprint()
        self.path = directory / f"host-{fp}.jsonl"
        self.lock = _process_lock(host_lock_path())
        self.id: str | None = None
        self.costs: dict[str, float] = {}
        self._anchors: dict[str, dict[int, float]] = {}   # per family: the sizes calibrated, not interpolated
        self._observed: dict[str, list[float]] = {}
        directory.mkdir(parents=True, exist_ok=True)
        self.lock.hold(exclusive=True)
        try:
            if not self.path.exists() or self.path.stat().st_size == 0:
                header = {"id": uuid.uuid4().hex[:12], "host": fp}
                self._append(header)
            self._read()
        finally:
            self.lock.release()

    # -- the table ------------------------------------------------------------------------
    def _append(self, entry: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(entry) + "\n")

    def _read(self) -> None:
        for line in self.path.read_text().splitlines():
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:   # a line cut short by a killed process: skip it
                continue
            if "id" in entry and self.id is None:
                self.id = str(entry["id"])
            elif "key" in entry:
                self._add(entry)

    def _add(self, entry: dict) -> None:
        """Take one table line in; the first value of a key stays (another process may have written it first)."""
        key, cost = entry["key"], float(entry["cpu_s"])
        if key in self.costs:
            return
        self.costs[key] = cost
        family, m = _family(key)
        if family is not None and not entry.get("interpolated"):
            self._anchors.setdefault(family, {})[m] = cost

    def cost(self, key: str | None) -> float | None:
        """The calibrated CPU seconds of ``key``'s computation, or None while it is being calibrated.

        A size between two calibrated sizes of its family is interpolated (and fixed) instead.
        """
        if key is None:
            return None
        key = _threaded(key)
        known = self.costs.get(key)
        if known is not None:
            return known
        family, m = _family(key)
        sizes = self._anchors.get(family) if family is not None else None
        if not sizes:
            return None
        below = max((s for s in sizes if s < m), default=None)
        above = min((s for s in sizes if s > m), default=None)
        if below is None or above is None:   # no extrapolation: a size outside the calibrated ones is calibrated
            return None
        share = (m - below) / (above - below)
        return self._fix(key, sizes[below] + share * (sizes[above] - sizes[below]), interpolated=True)

    # -- calibrating ----------------------------------------------------------------------
    def observe(self, key: str, cpu_s: float) -> float:
        """One run of ``key``'s computation took ``cpu_s`` of CPU time alone; returns its cost for now.

        The ``OBSERVATIONS``-th run fixes the key's cost: another process's value if it
        wrote one first, else the best of these runs, written for everyone.
        """
        key = _threaded(key)
        if key in self.costs:
            return self.costs[key]
        seen = self._observed.setdefault(key, [])
        seen.append(cpu_s)
        if len(seen) < OBSERVATIONS:
            return cpu_s
        del self._observed[key]
        return self._fix(key, min(seen))

    def _fix(self, key: str, cpu_s: float, interpolated: bool = False) -> float:
        """Fix ``key``'s cost for every process: the value another process wrote first, else ``cpu_s``."""
        held, exclusive = self.lock.mode is not None, self.lock.exclusive
        self.lock.hold(exclusive=True)    # read, then write: one process at a time
        try:
            self._read()
            if key not in self.costs:
                entry = {"key": key, "cpu_s": cpu_s, **({"interpolated": True} if interpolated else {})}
                self._append(entry)
                self._add(entry)
        finally:
            if held:
                self.lock.hold(exclusive=exclusive)
            else:
                self.lock.release()
        return self.costs[key]


def _threaded(key: str) -> str:
    """The same work costs differently on a different number of torch threads."""
    return key if "|threads=" in key else f"{key}|threads={torch.get_num_threads()}"


def _family(key: str) -> tuple[str | None, int]:
    """``family@m|threads=N`` -> (``family|threads=N``, m); a key without a size -> (None, 0)."""
    base, at, rest = key.rpartition("@")
    size, _, threads = rest.partition("|")
    if not at or not size.isdigit():
        return None, 0
    return f"{base}|{threads}", int(size)


_LOCKS: dict[Path, HostLock] = {}


def _process_lock(path: Path) -> HostLock:
    if path not in _LOCKS:
        _LOCKS[path] = HostLock(path)
    return _LOCKS[path]


_TABLES: dict[Path, Calibration] = {}


def calibration(directory: Path | None = None) -> Calibration:
    """This process's calibration table for ``directory`` (default: the cache's)."""
    directory = Path(directory or default_dir())
    if directory not in _TABLES:
        _TABLES[directory] = Calibration(directory)
    return _TABLES[directory]
