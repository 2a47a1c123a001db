"""Every SIGTERM counted, even two that land while the main thread is inside one long C call.

Python runs a signal's handler on the main thread between bytecodes, so two signals that
arrive during one collective (a gloo wait does not return to Python) run it once: a second
SIGTERM meant as "stop now" would read as the first. Python's C-level handler also writes
one byte per signal to the wakeup fd; a thread reads them and counts every one.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Callable


class SigtermCounter:
    """Calls ``on_sigterm(n)`` for the n-th SIGTERM while active; inactive off the main thread."""

    def __init__(self, on_sigterm: Callable[[int], None]):
        self.on_sigterm = on_sigterm
        self.count = 0
        self._saved: tuple | None = None

    def __enter__(self) -> SigtermCounter:
        if threading.current_thread() is not threading.main_thread():
            return self
        read, write = os.pipe()
        os.set_blocking(write, False)
        previous_fd = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        # A Python handler must be set for the C handler to write the byte; the count is taken from the pipe.
        previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)
        reader = threading.Thread(target=self._read, args=(read,), name="poplar-sigterm", daemon=True)
        reader.start()
        self._saved = (previous, previous_fd, read, write, reader)
        return self

    def _read(self, fd: int) -> None:
        while data := os.read(fd, 64):
            for signum in data:
                if signum == signal.SIGTERM:
                    self.count += 1
                    self.on_sigterm(self.count)

    def __exit__(self, *exc) -> None:
        if self._saved is None:
            return
        previous, previous_fd, read, write, reader = self._saved
        self._saved = None
        signal.signal(signal.SIGTERM, previous)
        signal.set_wakeup_fd(previous_fd)
        os.close(write)   # the reader sees the end of the pipe
        reader.join(timeout=5)
        os.close(read)
