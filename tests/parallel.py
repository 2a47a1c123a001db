"""How the suite runs side by side (pytest-xdist, a test file's tests on one worker): paced tests with nothing
beside them.

Every test holds a lock on a file in the temporary directory, for its setup, call and teardown: a ``paced``
test exclusively, any other shared. The file is this user's, not the run's: an xdist run's workers share it,
and so do two runs at once. A paced test that waits for its turn holds a second lock (the turnstile) that any
test takes before its own, so no new test starts beside the one that runs while it waits: the paced test
begins as soon as that one ends. A run of paced tests on one worker keeps the lock from one to the next.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from contextlib import ExitStack, contextmanager

import pytest

_HELD: set[int] = set()


def _drop_held() -> None:
    """In a process a test forked: its copies of the locks (one is released when its last copy is closed: a
    child that outlived its test would hold it). A process started afresh has none (opened close-on-exec)."""
    for fd in _HELD:
        os.close(fd)
    _HELD.clear()


os.register_at_fork(after_in_child=_drop_held)


@contextmanager
def _locked(path: str, how: int):
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    _HELD.add(fd)
    try:
        fcntl.flock(fd, how)
        yield
    finally:
        _HELD.discard(fd)
        os.close(fd)        # releases the lock


BASE = os.path.join(tempfile.gettempdir(), f"poplar-tests-{os.getuid()}")
TURNSTILE, LOCK = f"{BASE}.turnstile", f"{BASE}.lock"


def _paced(item) -> bool:
    return item is not None and item.get_closest_marker("paced") is not None


_alone: ExitStack | None = None     # the exclusive lock, while a run of paced tests goes on


def _take_alone() -> None:
    global _alone
    if _alone is None:
        with ExitStack() as taking:
            taking.enter_context(_locked(TURNSTILE, fcntl.LOCK_EX))
            taking.enter_context(_locked(LOCK, fcntl.LOCK_EX))
            _alone = taking.pop_all()


def _leave_alone() -> None:
    global _alone
    if _alone is not None:
        _alone.close()
        _alone = None


# outermost, so that pytest-timeout does not count the wait for a turn as the test's time
@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    if _paced(item):
        _take_alone()
        try:
            return (yield)
        finally:
            if not _paced(nextitem):
                _leave_alone()
    with ExitStack() as held:
        with _locked(TURNSTILE, fcntl.LOCK_EX):
            held.enter_context(_locked(LOCK, fcntl.LOCK_SH))
        return (yield)
