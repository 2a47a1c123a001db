"""The collectives the engine uses, in one place: all-reduce, reduce-scatter, all-gather, broadcast.

All take flat, contiguous tensors whose length is a multiple of the world size (units
are padded for that), so they map onto the even-sized collectives every backend has.

This module is also the one seam where anything that wants to observe or pace the
communication plugs in (a GPU timer separating compute from waiting, a modelled
cluster's network): :func:`observe` installs an observer for this process. Every
collective then tells it ``launch(op, nbytes)`` before it is issued, and its wait goes
through ``wait(token, real_wait)``. With no observer, a collective is the plain
``torch.distributed`` call. The engine never sees the difference.

>>> class Counter:
...     def __init__(self): self.ops = []
...     def launch(self, op, nbytes): self.ops.append((op, nbytes))
...     def wait(self, token, real_wait): real_wait()
>>> counter = Counter()
>>> with observe(counter):        # doctest: +SKIP  (needs a process group)
...     all_reduce(torch.ones(4))
>>> counter.ops                   # doctest: +SKIP
[('all_reduce', 16)]
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Protocol

import torch
import torch.distributed as dist

# torch 2.13 renamed the *_tensor collectives; keep working on older releases too.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Observer(Protocol):
    """What observes or paces the collectives (see the module's docstring)."""

    def launch(self, op: str, nbytes: int) -> Any:
        """Called before a collective moving ``nbytes`` (the full buffer's size) is issued; returns a token."""

    def wait(self, token: Any, real_wait: Callable[[], Any]) -> None:
        """Called to wait for that collective; must call ``real_wait()``."""


_observer: Observer | None = None


@contextlib.contextmanager
def observe(observer: Observer | None) -> Iterator[None]:
    """Route every collective of this process through ``observer`` until the block ends."""
    global _observer
    before, _observer = _observer, observer
    try:
        yield
    finally:
        _observer = before


def observer() -> Observer | None:
    return _observer


class Work:
    """An issued collective; :meth:`wait` blocks until it is done (through the observer, if any)."""

    __slots__ = ("_work", "_observer", "_token")

    def __init__(self, work, obs: Observer, token: Any):
        self._work, self._observer, self._token = work, obs, token

    def wait(self, *args, **kwargs) -> bool:
        if self._work is not None:
            work, self._work = self._work, None   # a second wait is a no-op, as torch's is
            self._observer.wait(self._token, lambda: work.wait(*args, **kwargs))
        return True

    def is_completed(self) -> bool:
        return self._work is None or self._work.is_completed()


def run(op: str, nbytes: int, issue: Callable[[bool], Any], async_op: bool):
    """Issue one collective (``issue(async_op)`` calls torch.distributed) through the observer, if any."""
    obs = _observer
    if obs is None:
        return issue(async_op)
    token = obs.launch(op, nbytes)
    work = Work(issue(True), obs, token)
    if async_op:
        return work
    work.wait()
    return None


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def all_reduce(tensor: torch.Tensor, op=dist.ReduceOp.SUM, async_op: bool = False):
    return run("all_reduce", _bytes(tensor), lambda a: dist.all_reduce(tensor, op=op, async_op=a), async_op)


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, async_op: bool = False):
    """Sum ``input`` (full, padded) over ranks; this rank receives its ``output`` shard."""
    return run("reduce_scatter", _bytes(input),
               lambda a: _reduce_scatter(output, input, op=dist.ReduceOp.SUM, async_op=a), async_op)


def all_gather(output: torch.Tensor, input: torch.Tensor, async_op: bool = False):
    """Concatenate every rank's ``input`` shard into ``output`` (full, padded)."""
    return run("all_gather", _bytes(output), lambda a: _all_gather(output, input, async_op=a), async_op)


def broadcast(tensor: torch.Tensor, src: int = 0, async_op: bool = False):
    return run("broadcast", _bytes(tensor), lambda a: dist.broadcast(tensor, src=src, async_op=a), async_op)


def barrier() -> None:
    run("barrier", 0, lambda a: dist.barrier(async_op=a), False)


def agree(values: list[int], device: torch.device) -> tuple[list[int], list[int]]:
    """Element-wise (min, max) of integer ``values`` across ranks: one small all-reduce."""
    t = torch.tensor(values + [-v for v in values], dtype=torch.int64, device=device)
    all_reduce(t, op=dist.ReduceOp.MAX)
    n = len(values)
    return [-int(v) for v in t[n:].tolist()], [int(v) for v in t[:n].tolist()]
