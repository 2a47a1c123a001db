"""What a run prints, readable in a terminal and in a log alike.

Rich reads a console that is not a terminal (a pipe, a file) as 80 columns wide and cuts
every table to it; here such a console is as wide as a table needs. Text that may hold
brackets (paths, ``pip install 'poplar-zero[bench]'``) is printed as written, never read
as markup. Long waits report progress: a bar per device kind and stage in a terminal, a
line per stage in a log, and in a log a line at least every ``HEARTBEAT_S`` seconds.
"""

from __future__ import annotations

import threading
import time

from rich.console import Console

LOG_WIDTH = 250      # a log's lines are read whole: no table is cut to the 80 columns rich assumes
HEARTBEAT_S = 30.0   # in a log, the longest silence while something runs


def console() -> Console:
    """The commands' console: the terminal's width, or wide enough for every table in a log."""
    here = Console()
    return here if here.is_terminal else Console(width=max(here.width, LOG_WIDTH))


def say(out: Console, text: str) -> None:
    """``text`` as written (no markup, no highlighting), as one line where it is one."""
    out.print(text, markup=False, highlight=False, soft_wrap=True)


class Progress:
    """Progress of a long wait, fed by the profiler's events (``put((stage, what))``).

    Events may name the device kind too (``(kind, stage, what)``). In a terminal each
    (kind, stage) is a bar; in a log each stage is a line when it starts and when it is
    done, and a heartbeat line says what still runs after every ``HEARTBEAT_S`` quiet seconds.

    >>> import io
    >>> log = Console(file=io.StringIO(), width=100)
    >>> with Progress(log, "both-differ: profiling", steps=4) as p:
    ...     p.put((0, "memory")); p.put((0, "round 1/2")); p.put((0, "done"))
    >>> print(log.file.getvalue().replace("0 s", "N s"), end="")
    both-differ: profiling
    both-differ: stage 0: memory
    both-differ: stage 0: done (N s)
    """

    def __init__(self, out: Console, title: str, steps: int = 4, heartbeat_s: float = HEARTBEAT_S,
                 after_s: float = 0.0):
        self.out, self.title, self.steps, self.heartbeat_s = out, title, steps, heartbeat_s
        self.after_s = after_s   # shown only once the wait has lasted this long (a quick one says nothing)
        self.prefix = title.split(":")[0]
        self._bar = None
        self._tasks: dict = {}
        self._started: dict = {}
        self._last = time.monotonic()
        self._doing = title
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._shown, self._closed, self._phase = False, False, None
        self.heard = 0           # events put: none where the wait measured nothing (a profile read from the cache)
        self._timer: threading.Timer | None = None

    def __enter__(self) -> Progress:
        if self.after_s > 0:
            self._timer = threading.Timer(self.after_s, self._show)
            self._timer.daemon = True
            self._timer.start()
        else:
            self._show()
        return self

    def _show(self) -> None:
        with self._lock:
            if self._shown or self._closed:
                return
            self._shown = True
            say(self.out, self.title)
            if self.out.is_terminal:
                from rich.progress import BarColumn, TextColumn, TimeElapsedColumn
                from rich.progress import Progress as Bars

                self._bar = Bars(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(), console=self.out,
                                 transient=True)
                self._bar.start()
            else:
                self._thread = threading.Thread(target=self._heartbeat, daemon=True)
                self._thread.start()
            if self._phase is not None:   # the wait under way when it is shown late
                self._show_phase(self._phase)

    def __exit__(self, *exc) -> None:
        with self._lock:
            self._closed = True
            if self._timer is not None:
                self._timer.cancel()
        self._stop.set()
        if self._bar is not None:
            self._bar.stop()
        if self._thread is not None:
            self._thread.join()

    def phase(self, what: str) -> None:
        """Another long wait begins (measuring, after profiling): a line in a log, a bar of its own in a terminal."""
        with self._lock:
            self._phase = what
            if self._shown:
                self._show_phase(what)

    def _show_phase(self, what: str) -> None:
        self._last, self._doing = time.monotonic(), what
        if self._bar is not None:
            self._tasks[what] = self._bar.add_task(what, total=None)
        else:
            say(self.out, what)

    def put(self, event: tuple) -> None:
        """One event of the profiler: ``(stage, what)`` or ``(kind, stage, what)``."""
        *kind, stage, what = event
        self.heard += 1
        where = f"{self.prefix}: " + (f"{kind[0]} " if kind else "") + f"stage {stage}"
        self._last, self._doing = time.monotonic(), f"{where}: {what}"
        first = where not in self._started
        self._started.setdefault(where, self._last)
        if self._bar is not None:
            if first:
                self._tasks[where] = self._bar.add_task(where, total=self.steps)
            self._bar.update(self._tasks[where], advance=1, description=self._doing)
        elif first:
            say(self.out, self._doing)
        elif what == "done":
            say(self.out, f"{self._doing} ({self._last - self._started[where]:.0f} s)")

    def _heartbeat(self) -> None:
        while not self._stop.wait(min(1.0, self.heartbeat_s)):
            quiet = time.monotonic() - self._last
            if quiet >= self.heartbeat_s:
                say(self.out, f"{self._doing}: still running ({quiet:.0f} s since the last report)")
                self._last = time.monotonic()
