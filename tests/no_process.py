"""The guard that keeps ``-m "not slow"`` honest: a test not marked ``slow`` that starts a process fails.

Around each test's setup (its fixtures' too), call and teardown, every way Python starts a process is
replaced by one that refuses and says so; the test then fails with one line, whatever it did with the
refusal (caught, retried, fallen back on):

    FAILED tests/test_x.py::test_y - starts a process (subprocess.Popen): mark it slow

A test marked ``slow`` (itself, its module, or through a fixture, see ``tests/conftest.py``) is left alone.
A pytest plugin: ``tests/conftest.py`` registers it for every run, not only ``-m "not slow"`` runs, so that a
new test that starts a process unmarked fails CI.
"""

from __future__ import annotations

import multiprocessing.process
import os
import subprocess
from contextlib import contextmanager

import _posixsubprocess
import pytest

MESSAGE = "starts a process ({how}): mark it slow"

# every door to a new process: subprocess (run, check_output, os.popen), multiprocessing (torch.multiprocessing,
# concurrent.futures' process pools), the forkserver and resource tracker multiprocessing starts (fork_exec),
# and the os module's own
DOORS = [(subprocess.Popen, "__init__", "subprocess.Popen"),
         (multiprocessing.process.BaseProcess, "start", "multiprocessing Process.start"),
         (_posixsubprocess, "fork_exec", "_posixsubprocess.fork_exec"),
         *((os, name, f"os.{name}") for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system"))]


class UnmarkedProcess(RuntimeError):
    """Raised where a test not marked ``slow`` starts a process (the process is not started)."""


@contextmanager
def refused(started: list[str]):
    """Every door in :data:`DOORS` refuses while inside; each refusal is appended to ``started``."""
    def refuse(how):
        def refusing(*args, **kwargs):
            started.append(how)
            raise UnmarkedProcess(MESSAGE.format(how=how))
        return refusing

    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in DOORS if hasattr(owner, name)]
    for owner, name, how in DOORS:
        if hasattr(owner, name):
            setattr(owner, name, refuse(how))
    try:
        yield
    finally:
        for owner, name, door in reversed(saved):
            setattr(owner, name, door)


def _guarded(item):
    if item.get_closest_marker("slow") is not None:
        return (yield)
    started: list[str] = []
    try:
        with refused(started):
            return (yield)
    finally:
        if started:     # in place of whatever the test made of the refusal
            raise pytest.fail.Exception(MESSAGE.format(how=started[0]), pytrace=False) from None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    return (yield from _guarded(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    return (yield from _guarded(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item):
    return (yield from _guarded(item))
