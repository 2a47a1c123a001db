"""The suite's markers are honest: a test not marked ``slow`` that starts a process fails, however it starts it
and whatever it makes of the refusal; one marked ``slow`` (itself or through a fixture) may start them. And a
``paced`` test runs with nothing beside it.

Each marking case is a small test file run by pytest in this process with the suite's own plugins
(``pytester``); the lock is the one this run's tests hold."""

import fcntl
import os

import pytest

from tests import parallel

PLUGINS = ("-p", "tests.markers", "-p", "tests.no_process")

UNMARKED = '''
import multiprocessing
import os
import subprocess
import sys

import pytest


def test_subprocess():
    subprocess.run([sys.executable, "-c", "pass"])


def test_the_refusal_caught():
    try:
        subprocess.check_output(["true"])
    except Exception:
        pass


def test_multiprocessing():
    multiprocessing.get_context("spawn").Process(target=print).start()


def test_fork():
    if os.fork() == 0:
        os._exit(0)


def test_system():
    os.system("true")


@pytest.fixture(scope="module")
def ranks():
    return subprocess.run(["true"])


def test_a_fixture_that_starts_one(ranks):
    pass


def test_none_started():
    assert sum(range(4)) == 6
'''


def test_a_test_not_marked_slow_that_starts_a_process_fails_with_one_line(pytester):
    pytester.makepyfile(test_unmarked=UNMARKED)
    result = pytester.runpytest_inprocess(*PLUGINS, "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=5, errors=1)
    for how in ("subprocess.Popen", "multiprocessing Process.start", "os.fork", "os.system"):
        result.stdout.fnmatch_lines([f"starts a process ({how}): mark it slow"])
    # the refused test did not go on past the refusal: its exception is the only one shown
    assert "During handling" not in result.stdout.str()
    failed = {r.nodeid.split("::")[1] for r in result.reprec.getreports() if r.failed}
    assert failed == {"test_subprocess", "test_the_refusal_caught", "test_multiprocessing", "test_fork",
                      "test_system", "test_a_fixture_that_starts_one"}


def test_a_fixture_that_requests_starts_processes_marks_its_tests_slow(pytester):
    pytester.makepyfile(test_fixture='''
import subprocess

import pytest


@pytest.fixture(scope="module")
def ranks(starts_processes):
    return subprocess.run(["true"])


@pytest.fixture
def through(ranks):
    return ranks


def test_direct(ranks):
    pass


def test_through_another(through):
    pass


def test_none():
    pass
''')
    result = pytester.runpytest_inprocess(*PLUGINS, "-p", "no:cacheprovider", "-m", "not slow")
    result.assert_outcomes(passed=1, deselected=2)      # and no process started


@pytest.mark.slow
def test_a_test_marked_slow_may_start_processes(pytester):
    pytester.makepyfile(test_marked='''
import subprocess
import sys

import pytest

pytestmark = pytest.mark.paced     # another marker beside it changes nothing


@pytest.fixture(scope="module")
def ranks(starts_processes):
    return subprocess.run(["true"]).returncode


@pytest.mark.slow
def test_marked():
    assert subprocess.run([sys.executable, "-c", "pass"]).returncode == 0


def test_marked_by_its_fixture(ranks):
    assert ranks == 0
''')
    result = pytester.runpytest_inprocess(*PLUGINS, "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)


def _could_lock(path: str, how: int) -> bool:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, how | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def test_a_test_holds_the_lock_shared_so_that_no_paced_test_runs_beside_it():
    assert _could_lock(parallel.LOCK, fcntl.LOCK_SH) and not _could_lock(parallel.LOCK, fcntl.LOCK_EX)


@pytest.mark.paced
def test_a_paced_test_holds_the_lock_alone_and_no_test_starts_beside_it():
    assert not _could_lock(parallel.LOCK, fcntl.LOCK_SH) and not _could_lock(parallel.TURNSTILE, fcntl.LOCK_EX)
