"""Worker processes: forked where that is safe, else fresh; an error in one raised here as itself."""

import subprocess
import sys

import pytest

from poplar.compare.alone import plan_alone
from poplar.processes.pool import Worker
from tests.compare.test_alone import ARGS, SPEC

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
def test_an_error_in_a_worker_is_raised_here_as_itself(fork):
    worker = Worker({0: ["a100-80gb"]}, plan_alone, (ARGS[0], SPEC, "sixty-four", ARGS[4]), fork)   # a batch, no number
    try:
        with pytest.raises(TypeError, match="not supported between"):
            while True:
                worker.receive()
    finally:
        worker.close()
