"""The suite's markers are honest: a test not marked ``slow`` that starts a process fails, however it starts it
and whatever it makes of the refusal; one marked ``slow`` (itself or through a fixture) may start them.

Each case is a small test file run by pytest in this process with the suite's own plugins (``pytester``)."""

import pytest

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
