import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow

# The main thread waits 2 s inside one C call (a store wait that never returns to Python) while a shell
# sends two SIGTERMs 50 ms apart: Python's handler runs once for both, yet both must be counted.
BLOCKED = textwrap.dedent("""
    import os, subprocess, sys
    from datetime import timedelta
    import torch.distributed as dist
    from poplar.runtime.preemption import Preemption

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    with Preemption(comm=None, tensor_device=None) as preemption:
        pid = os.getpid()
        subprocess.Popen(["sh", "-c", f"sleep 0.5; kill -TERM {pid}; sleep 0.05; kill -TERM {pid}"])
        try:
            store.wait(["never"], timedelta(seconds=SECONDS))
        except Exception:
            pass
        print("requested", preemption.requested, flush=True)
""")


def _run(seconds: float):
    return subprocess.run([sys.executable, "-c", BLOCKED.replace("SECONDS", str(seconds))],
                          capture_output=True, text=True, timeout=60)


def test_two_sigterms_during_one_collective_are_two_and_the_second_stops_at_once():
    run = _run(2.0)
    assert run.returncode == 128 + 15, run.stdout + run.stderr[-2000:]
    assert "a second SIGTERM: stopping now" in run.stderr
    assert "requested" not in run.stdout   # stopped inside the wait, not after it


def test_without_sigterms_the_handler_is_given_back():
    code = "import signal\nfrom poplar.runtime.preemption import Preemption\n" \
           "before = signal.getsignal(signal.SIGTERM)\n" \
           "with Preemption(comm=None, tensor_device=None):\n    pass\n" \
           "assert signal.getsignal(signal.SIGTERM) is before and signal.set_wakeup_fd(-1) == -1\nprint('ok')"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and "ok" in run.stdout, run.stderr[-2000:]
