"""Run a function on N local processes joined in a gloo process group.

This is how tests, the demo and benchmarks start an (emulated) cluster on one machine
without torchrun. Every wait is bounded: a rank that fails or hangs stops all of them.

>>> def hello(rank, world_size):
...     return rank * 10
>>> spawn(hello, 2)   # doctest: +SKIP
[0, 10]
"""

from __future__ import annotations

import os
import pickle
import time
import traceback
from typing import Any, Callable

import torch
import torch.multiprocessing as mp

from poplar.engine.dist import free_port, init_distributed, shutdown


class RankFailed(RuntimeError):
    """A spawned rank raised; the message carries that rank's traceback."""


def _entry(rank: int, fn, world_size: int, port: int, timeout_s: float, threads: int, results, args, kwargs):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(threads)
    try:
        init_distributed(timeout_s=timeout_s, backend="gloo")
        out = fn(rank, world_size, *args, **kwargs)
    except BaseException as e:  # report, then let the parent stop the others
        results.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        raise
    # Plain pickle copies tensors: shared-memory handles would die with this process.
    results.put((rank, "ok", pickle.dumps(out)))
    try:
        shutdown()
    except Exception:   # the result is in; a group broken by the function's own test of failures may not close
        pass


def spawn(fn: Callable[..., Any], world_size: int, *args, timeout_s: float = 120.0, threads: int = 1,
          collective_timeout_s: float | None = None, on_poll: Callable[[], None] | None = None,
          **kwargs) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` processes; return their results.

    ``fn`` must be importable (a module-level function). Raises :class:`RankFailed` with
    the first failing rank's traceback, or :class:`TimeoutError` after ``timeout_s``.
    ``on_poll`` is called while waiting (e.g. to show progress the ranks report).
    """
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    port = free_port()
    coll_timeout = collective_timeout_s or max(10.0, timeout_s / 2)
    pc = mp.start_processes(_entry, args=(fn, world_size, port, coll_timeout, threads, results, args, kwargs),
                            nprocs=world_size, join=False, start_method="spawn")
    outputs: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s

    def drain():
        while not results.empty():
            rank, status, payload = results.get()
            if status == "ok":
                outputs[rank] = pickle.loads(payload)
            else:
                errors[rank] = payload

    procs = pc.processes
    try:
        while len(outputs) < world_size:
            drain()
            if errors:
                break
            # A rank that died before handing in its result failed. One that dies after
            # (gloo can abort in its own teardown at exit) has done its work.
            dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in outputs]
            if dead:
                drain()
                dead = [r for r in dead if r not in outputs]
                if dead and not errors:
                    errors[dead[0]] = f"rank {dead[0]} exited with code {procs[dead[0]].exitcode} before returning"
                if errors:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"{world_size} ranks did not finish within {timeout_s:.0f} s")
            if on_poll is not None:
                on_poll()
            time.sleep(0.02)
    finally:
        # With every result in, the ranks only leave the group: give them a moment.
        grace = time.monotonic() + (10.0 if len(outputs) == world_size else 0.0)
        for p in procs:
            p.join(timeout=max(0.0, grace - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    if errors:
        rank = next(iter(errors))   # the first to fail: the others may only have lost it
        raise RankFailed(f"rank {rank} failed:\n{errors[rank]}")
    missing = [r for r in range(world_size) if r not in outputs]
    if missing:
        raise RankFailed(f"ranks {missing} returned no result")
    return [outputs[r] for r in range(world_size)]
