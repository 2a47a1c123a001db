"""Jobs shared between worker processes and this one: forked where that is safe, else spawned; the same answers
either way; an error in a worker raised here as itself; a worker that dies warned of, its jobs answered here."""

import os
import subprocess
import sys

import pytest

from poplar.processes.pool import SharedJobs
from tests.helpers.jobs import LAST_WORDS, answer_or_die, fails_there, where_answered

pytestmark = pytest.mark.slow


def test_a_worker_is_forked_from_a_process_with_no_other_python_thread():
    """On Linux (the BLAS pools' native threads stop around a fork); not beside another Python thread."""
    code = ("import threading, torch, poplar.cli.main, transformers.models.llama.modeling_llama\n"
            "from poplar.processes.pool import forking\n"
            "alone = forking()\n"
            "t = threading.Thread(target=threading.Event().wait, args=(5,), daemon=True); t.start()\n"
            "print(alone, forking())")
    said = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert said.stdout.split() == (["True", "False"] if sys.platform.startswith("linux") else ["False", "False"])


@pytest.mark.parametrize("fork", [True, False])
def test_the_workers_answer_what_this_process_would(fork, tmp_path):
    items = [(name, []) for name in "abcd"]
    with SharedJobs(where_answered, items, (str(tmp_path),), workers=2, fork=fork) as jobs:
        answers = jobs.results()
    assert [name for name, _ in answers] == list("abcd")
    assert {pid for _, pid in answers[:2]}.isdisjoint({os.getpid()})   # the first two, taken by the workers at once


def test_a_key_a_worker_is_on_is_left_to_it_and_one_none_is_on_is_taken_here(tmp_path):
    """Items of one key cost less after the first in one process: this process leaves a worker the next item of its
    key (``a2``), and takes every item of a key no worker is on (``b1``, ``b2``)."""
    def run(items, keys):
        directory = tmp_path / "-".join(keys)
        directory.mkdir()
        with SharedJobs(where_answered, items, (str(directory),), keys=keys, workers=1, fork=True) as jobs:
            return {name: pid != os.getpid() for name, pid in jobs.results()}    # answered by a worker

    # the worker's first item waits for this process to answer b: the worker is on key a meanwhile
    assert run([("a1", ["b"]), ("a2", []), ("b", [])], ["a", "a", "b"]) == {"a1": True, "a2": True, "b": False}
    assert run([("a", ["b1", "b2"]), ("b1", []), ("b2", [])], ["a", "b", "b"]) == {"a": True, "b1": False,
                                                                                   "b2": False}


@pytest.mark.parametrize("fork", [True, False])
def test_an_error_in_a_worker_is_raised_here_as_itself(fork):
    with SharedJobs(fails_there, ["sixty-four"], (os.getpid(),), workers=1, fork=fork) as jobs:
        with pytest.raises(TypeError, match="sixty-four: not supported between a worker and this test") as raised:
            jobs.results()
    assert "fails_there" in str(raised.value.__cause__)      # where it was raised, in the worker


@pytest.mark.parametrize("fork", [True, False])
def test_a_worker_that_dies_is_warned_of_and_its_jobs_run_here(fork):
    with SharedJobs(answer_or_die, [1, 2, 3], (os.getpid(),), workers=2, fork=fork) as jobs:
        with pytest.warns(RuntimeWarning, match=rf"ended without its answers \({LAST_WORDS}\)"):
            assert jobs.results() == [2, 4, 6]


def test_no_workers_answers_everything_here():
    with SharedJobs(answer_or_die, [1, 2], (os.getpid(),), workers=0) as jobs:
        assert jobs.results() == [2, 4]
