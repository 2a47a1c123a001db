"""Every rank watches every other: a rank that dies stops the whole run within a bound.

A collective waits for a missing peer until its timeout (minutes), and a launcher on
another node may never notice. So each rank runs a :class:`Watchdog` thread beside its
training: over its own connection to the rendezvous store (torchrun's agent, or the
launcher's) it beats a counter, and it reads every other rank's. A peer is dead when
its process is gone (ranks on this host are checked directly, at once) or its counter
has not moved for ``dead_after_s``. The first rank to see it writes one line to the
store; every rank prints that line, naming the dead rank and the last complete
checkpoint, and exits with :data:`EXIT_PEER_DIED`. A rank that fails on its own (an
error, not a death) posts its one-line error the same way, so the others stop at once
rather than at a collective's timeout.

Keys are scoped by torchrun's restart count: a restarted group does not read the
previous attempt's verdict.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from poplar.processes.spawn import EXIT_PEER_DIED, EXIT_PEER_FAILED  # noqa: F401  (defined where the launcher reads them)

DEFAULT_DEAD_AFTER_S = float(os.environ.get("POPLAR_DEAD_AFTER_S", "30"))


def _process_gone(pid: int) -> bool:
    """True when ``pid`` on this host has exited (a zombie not yet reaped counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False


def lost_peer(error: BaseException) -> bool:
    """Whether ``error`` is a collective's failure (as when a peer's process is gone)."""
    if isinstance(error, dist.DistError):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and any(w in text for w in ("gloo", "Gloo", "NCCL", "Connection"))


def store_address() -> tuple[str, int] | None:
    """The rendezvous store this process group was made with (torchrun's or the launcher's), if known."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    return (addr, int(port)) if addr and port else None


class Watchdog:
    """Beats for this rank and watches the others; see the module's docstring.

    ``where`` returns a short text of where the run stands (the step, the last complete
    checkpoint), added to the line printed when a peer dies. ``exit`` ends the process
    (``os._exit``: the main thread may be blocked inside a collective).
    """

    def __init__(self, rank: int, world_size: int, *, dead_after_s: float = DEFAULT_DEAD_AFTER_S,
                 interval_s: float = 0.25, where: Callable[[], str] = lambda: "",
                 address: tuple[str, int] | None = None, exit: Callable[[int], None] = os._exit):
        self.rank, self.world_size = rank, world_size
        self.dead_after_s, self.interval_s = dead_after_s, interval_s
        self.where, self._exit = where, exit
        address = address or store_address()
        if address is None:
            raise ValueError("no rendezvous store to watch the ranks through: set MASTER_ADDR and MASTER_PORT "
                             "(torchrun and poplar's launcher do)")
        self._store = dist.TCPStore(address[0], address[1], is_master=False,
                                    timeout=timedelta(seconds=max(5.0, min(30.0, dead_after_s))))
        self._prefix = f"poplar/watch/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.host = socket.gethostname()

    # ------------------------------------------------------------------ the store's keys
    def _key(self, *parts) -> str:
        return self._prefix + "/".join(str(p) for p in parts)

    def _counter(self, key: str) -> int:
        return int(self._store.add(key, 0))   # add 0: the value, without blocking on a missing key

    # ------------------------------------------------------------------ life
    def start(self) -> Watchdog:
        self._store.set(self._key("pid", self.rank), f"{self.host}:{os.getpid()}")
        self._store.add(self._key("beat", self.rank), 1)
        self._thread = threading.Thread(target=self._run, name="poplar-watchdog", daemon=True)
        self._thread.start()
        return self

    def finished(self) -> None:
        """This rank is done (or leaving on purpose): it no longer beats, and no one should mourn it."""
        try:
            self._store.set(self._key("done", self.rank), "1")
        except Exception:  # the store may already be gone with the run's end; nothing to tell then
            pass
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5 * self.interval_s + 1)

    def fail(self, message: str, lost_peer: bool = False) -> None:
        """This rank failed with ``message`` (one line): tell the others, so they stop now.

        ``lost_peer``: the failure was a collective's (a peer may have died): first give
        the watch the time to find the dead rank, so the line names the cause.
        """
        if lost_peer and self._thread is not None:
            deadline = time.monotonic() + self.dead_after_s + 4 * self.interval_s
            while self._thread.is_alive() and time.monotonic() < deadline:
                time.sleep(self.interval_s)   # the watch ends the process itself when it finds the dead rank
        try:
            self._store.compare_set(self._key("verdict"), "",
                                    f"{EXIT_PEER_FAILED}|{self.rank}|rank {self.rank} failed: {message}")
            self._store.set(self._key("done", self.rank), "1")
        except Exception:
            pass
        self._stop.set()

    def __enter__(self) -> Watchdog:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.finished()

    # ------------------------------------------------------------------ watching
    def _run(self) -> None:
        seen = {r: (0, time.monotonic()) for r in range(self.world_size) if r != self.rank}
        pids: dict[int, tuple[str, int]] = {}
        store_lost = None
        while not self._stop.wait(self.interval_s):
            try:
                self._store.add(self._key("beat", self.rank), 1)
                if self._store.check([self._key("verdict")]):
                    self._give_up(self._store.get(self._key("verdict")).decode())
                    return
                for r in list(seen):
                    if self._store.check([self._key("done", r)]):
                        del seen[r]
                        continue
                    why = self._dead(r, seen, pids)
                    if why:
                        self._declare(r, why)
                        return
                store_lost = None
            except Exception as e:   # the store's host (torchrun's agent, the launcher, rank 0) is gone
                if self._stop.is_set():
                    return
                store_lost = store_lost or time.monotonic()
                if time.monotonic() - store_lost > self.dead_after_s:
                    self._give_up(f"{EXIT_PEER_DIED}|-1|the rendezvous store at {store_address()} stopped "
                                  f"answering ({type(e).__name__}): its host (the launcher or torchrun's agent) died")
                    return

    def _dead(self, r: int, seen: dict, pids: dict) -> str | None:
        if r not in pids and self._store.check([self._key("pid", r)]):
            host, _, pid = self._store.get(self._key("pid", r)).decode().rpartition(":")
            pids[r] = (host, int(pid))
        if r in pids and pids[r][0] == self.host and _process_gone(pids[r][1]):
            if self._store.check([self._key("done", r)]):
                return None
            return f"its process {pids[r][1]} is gone"
        beats, since = seen[r]
        now_beats = self._counter(self._key("beat", r))
        if now_beats != beats:
            seen[r] = (now_beats, time.monotonic())
            return None
        silent = time.monotonic() - since
        if silent > self.dead_after_s:
            return f"no heartbeat for {silent:.0f} s"
        return None

    def _declare(self, r: int, why: str) -> None:
        verdict = f"{EXIT_PEER_DIED}|{r}|rank {r} died ({why})"
        try:   # the first verdict stands: every rank prints the same line
            self._store.compare_set(self._key("verdict"), "", verdict)
            verdict = self._store.get(self._key("verdict")).decode()
        except Exception:
            pass
        self._give_up(verdict)

    def _give_up(self, verdict: str) -> None:
        """Print the verdict (one rank prints: the lowest that is not the one it names), then exit."""
        code, culprit, text = verdict.split("|", 2)
        if self.rank == min([r for r in range(self.world_size) if r != int(culprit)] or [self.rank]):
            where = ""
            try:
                where = self.where()
            except Exception:  # the line must come out whatever the run's state
                pass
            print(f"poplar: {text}" + (f"; {where}" if where else ""), file=sys.stderr, flush=True)
        self._exit(int(code))
