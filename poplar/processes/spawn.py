"""Run a function on N local processes joined in a gloo process group.

This is how tests, the demo and benchmarks start an (emulated) cluster on one machine
without torchrun. Every wait is bounded: a rank that fails or hangs stops all of them.

>>> def hello(rank, world_size):
...     return rank * 10
>>> spawn(hello, 2)   # doctest: +SKIP
[0, 10]
"""

from __future__ import annotations

import os
import pickle
import signal
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from poplar.engine import flight
from poplar.engine.dist import init_distributed, shutdown
from poplar.lazy import imported_for_good
from poplar.processes.sigterm import SigtermCounter

# A rank that stops because another died or failed exits with these (poplar.runtime.watchdog does).
EXIT_PEER_DIED = 3
EXIT_PEER_FAILED = 4
WATCH_EXITS = (EXIT_PEER_DIED, EXIT_PEER_FAILED)
WATCH_SETTLE_S = 2.0    # how long the launcher waits for the death such an exit follows to show


class RankFailed(RuntimeError):
    """A spawned rank raised or died; the message carries that rank's traceback or how it ended."""

    def __init__(self, message: str, rank: int | None = None, error: str | None = None, line: str | None = None,
                 error_message: str | None = None):
        super().__init__(message)
        self.rank = rank
        self.error = error                    # the exception's type name; None: the rank died
        self.error_message = error_message    # the exception's own message
        self.line = line or message.splitlines()[0]   # the failure in one line


def exit_reason(code: int | None) -> str:
    """How a process ended, in words: 'was killed by SIGKILL', 'exited with code 3'."""
    if code is not None and code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _forward_sigterm(procs) -> SigtermCounter:
    """Pass every SIGTERM on to the ranks while they run (a second one means "stop now" to them)."""
    def forward(count: int) -> None:
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGTERM)
    return SigtermCounter(forward)


def _entry(rank: int, fn, world_size: int, port: int, timeout_s: float, threads: int, results, env, args, kwargs):
    # A rank forked from the server has the server's environment: the launcher's, as it is now, replaces it.
    os.environ.clear()
    os.environ.update(env)
    # The launcher hosts the rendezvous store, as torchrun's agent does: it outlives any rank.
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
                      TORCHELASTIC_USE_AGENT_STORE="True")
    torch.set_num_threads(threads)
    imported_for_good()     # what the server imported: the probe's collections scan only what the rank makes
    try:
        init_distributed(timeout_s=timeout_s, backend="gloo")
        out = fn(rank, world_size, *args, **kwargs)
    except BaseException as e:  # report, then let the parent stop the others
        results.put((rank, "error", (type(e).__name__, str(e), traceback.format_exc())))
        raise
    # Plain pickle copies tensors: shared-memory handles would die with this process.
    results.put((rank, "ok", pickle.dumps(out)))
    try:
        shutdown()
    except Exception:   # the result is in; a group broken by the function's own test of failures may not close
        pass


# Ranks are forked from a server that imported torch, poplar's trainer and the Hugging Face models once (a
# fresh interpreter would spend seconds importing them for every rank); the server never touches a GPU or
# starts a Python thread (numpy's BLAS pool, which transformers brings, shuts itself down around a fork).
START_METHOD = "forkserver"


def _context():
    ctx = mp.get_context(START_METHOD)
    ctx.set_forkserver_preload(["torch", "torch.distributed", "poplar", "poplar.processes.spawn", "poplar.train.trainer",
                                "transformers.models.llama.modeling_llama", "transformers.models.bert.modeling_bert"])
    return ctx


def spawn(fn: Callable[..., Any], world_size: int, *args, timeout_s: float = 120.0, threads: int = 1,
          collective_timeout_s: float | None = None, on_poll: Callable[[], None] | None = None,
          **kwargs) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` processes; return their results.

    ``fn`` must be importable (a module-level function). Raises :class:`RankFailed` with
    the first failing rank's traceback, or :class:`TimeoutError` after ``timeout_s``.
    ``on_poll`` is called while waiting (e.g. to show progress the ranks report).

    A rank that dies stops the others at once. SIGTERM sent to this process is passed on
    to every rank (a rank that handles it, as training does, can save and return).
    """
    ctx = _context()
    results = ctx.SimpleQueue()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=timeout_s))
    coll_timeout = collective_timeout_s or max(10.0, timeout_s / 2)
    records = tempfile.TemporaryDirectory(prefix="poplar-flight-")   # each rank's last collective (flight)
    env = {**os.environ, flight.ENV: records.name}
    pc = mp.start_processes(_entry, args=(fn, world_size, store.port, coll_timeout, threads, results,
                                          env, args, kwargs),
                            nprocs=world_size, join=False, start_method=START_METHOD)
    ranks = _Ranks(pc.processes, results, records.name)
    try:
        with _forward_sigterm(pc.processes):
            if not ranks.supervise(time.monotonic() + timeout_s, on_poll):
                raise TimeoutError(f"{world_size} ranks did not finish within {timeout_s:.0f} s")
    finally:
        ranks.stop()
        records.cleanup()
    del store
    return ranks.outputs_or_raise()


class _Ranks:
    """The spawned ranks as the launcher watches them: their results, their errors, how they ended."""

    def __init__(self, procs, results, records: str):
        self.procs, self.results, self.records = procs, results, records
        self.outputs: dict[int, Any] = {}
        self.errors: dict[int, tuple[str | None, str, str]] = {}   # rank: (exception type, message, details)

    def drain(self) -> None:
        while not self.results.empty():
            rank, status, payload = self.results.get()
            if status == "ok":
                self.outputs[rank] = pickle.loads(payload)
            else:
                self.errors[rank] = payload

    def supervise(self, deadline: float, on_poll: Callable[[], None] | None) -> bool:
        """Until every rank handed in its result or one failed or died (True), or the deadline passed (False)."""
        while len(self.outputs) < len(self.procs):
            self.drain()
            if self.errors:
                self._aborted()
                return True
            if self._died():
                return True
            if time.monotonic() > deadline:
                return False
            if on_poll is not None:
                on_poll()
            time.sleep(0.02)
        return True

    def _died(self) -> bool:
        """A rank that died before handing in its result failed (one that dies after has done its work)."""
        dead = self._dead()
        if not dead:
            return False
        # ranks a watch stopped (exit codes 3, 4) stopped because another died: let that death show too
        settle = time.monotonic() + WATCH_SETTLE_S
        while all(self.procs[r].exitcode in WATCH_EXITS for r in dead) and time.monotonic() < settle:
            time.sleep(0.02)
            dead = self._dead()
        self.drain()
        dead = [r for r in dead if r not in self.outputs]
        if dead and not self.errors:
            first = min(dead, key=lambda r: self.procs[r].exitcode in WATCH_EXITS)   # the cause, not its echoes
            how = f"rank {first} {exit_reason(self.procs[first].exitcode)} before returning"
            how += self._mismatch(first)
            self.errors[first] = (None, how, how)
        return bool(self.errors)

    def _mismatch(self, rank: int) -> str:
        """``": ..."``: the collective a killed ``rank`` died in where its peers sized it otherwise (gloo aborts
        such a rank), as the ranks' flight records show; else nothing (a rank killed for another reason)."""
        if self.procs[rank].exitcode >= 0:
            return ""
        line = flight.mismatch_line(self.records, rank, len(self.procs))
        return f": {line}" if line and "mismatch" in line else ""

    def _aborted(self) -> None:
        """Ranks that raised may only have lost a peer that gloo aborted in a mismatched collective: that rank
        is the cause reported (its death follows theirs within moments)."""
        settle = time.monotonic() + WATCH_SETTLE_S
        while time.monotonic() < settle:
            for r in self._dead():
                line = self._mismatch(r)
                if line:
                    how = f"rank {r} {exit_reason(self.procs[r].exitcode)} before returning{line}"
                    self.errors = {r: (None, how, how), **self.errors}
                    return
            if len(self._dead()) + len(self.outputs) == len(self.procs):
                return
            time.sleep(0.02)

    def _dead(self) -> list[int]:
        return [r for r, p in enumerate(self.procs) if not p.is_alive() and r not in self.outputs]

    def stop(self) -> None:
        """With every result in, the ranks only leave the group: give them a moment; then stop what is left."""
        grace = time.monotonic() + (10.0 if len(self.outputs) == len(self.procs) else 0.0)
        for p in self.procs:
            p.join(timeout=max(0.0, grace - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)

    def outputs_or_raise(self) -> list[Any]:
        if self.errors:
            rank = next(iter(self.errors))   # the first to fail: the others may only have lost it
            error, message, details = self.errors[rank]
            line = message.strip().splitlines()[0] if message.strip() else error
            raise RankFailed(f"rank {rank} failed:\n{details}", rank=rank, error=error, error_message=message,
                             line=line if error is None else f"rank {rank}: {error}: {line}")
        missing = [r for r in range(len(self.procs)) if r not in self.outputs]
        if missing:
            raise RankFailed(f"ranks {missing} returned no result")
        return [self.outputs[r] for r in range(len(self.procs))]
