"""Ranks watch each other: a dead, frozen or failed rank stops the rest within the bound, with one line."""

import signal
import time
from datetime import timedelta

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from poplar.runtime.watchdog import EXIT_PEER_DIED, EXIT_PEER_FAILED
from tests.train.watch_workers import watched

pytestmark = [pytest.mark.slow, pytest.mark.paced]


def _run(tmp_path, fate: str, world_size: int = 3):
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    ctx = mp.get_context("spawn")
    log = str(tmp_path / "err")
    procs = [ctx.Process(target=watched, args=(r, world_size, store.port, fate, log)) for r in range(world_size)]
    start = time.monotonic()
    for p in procs:
        p.start()
    for p in procs[:-1]:
        p.join(timeout=60)
    took = time.monotonic() - start
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    lines = {r: open(f"{log}.{r}").read().strip().splitlines() for r in range(world_size)}
    return [p.exitcode for p in procs], lines, took


@pytest.mark.parametrize("fate, why", [("kill", "its process"), ("freeze", "no heartbeat for 2 s")])
def test_a_dead_or_frozen_rank_stops_the_others_with_one_line(tmp_path, fate, why):
    codes, lines, took = _run(tmp_path, fate)
    assert codes[:2] == [EXIT_PEER_DIED, EXIT_PEER_DIED]
    assert codes[2] == -signal.SIGKILL      # a frozen one is killed by the test at the end
    assert took < 20, took      # the survivors slept 30 s: the watch ended them
    assert len(lines[0]) == 1 and lines[0][0].startswith("poplar: rank 2 died (") and why in lines[0][0]
    assert lines[0][0].endswith("during step 7")
    assert lines[1] == []       # one rank speaks for all


def test_a_failing_rank_stops_the_others_at_once(tmp_path):
    codes, lines, took = _run(tmp_path, "fail")
    assert codes == [EXIT_PEER_FAILED, EXIT_PEER_FAILED, 1] and took < 20
    assert lines[0] == ["poplar: rank 2 failed: ValueError: a bad batch; during step 7"]


def test_a_rank_that_finished_is_not_mourned(tmp_path):
    codes, lines, _ = _run(tmp_path, "finish", world_size=2)
    assert codes == [0, 0] and lines == {0: [], 1: []}
