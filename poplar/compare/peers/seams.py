"""Another system's collectives, through a Poplar :class:`~poplar.engine.collectives.Comm` while it computes.

Poplar's engine issues its collectives through the ``Comm`` it is given, which a device
observes (``device.comm``: a GPU timer, an emulated network). A peer such as DeepSpeed
calls ``torch.distributed`` itself, so while it runs, :func:`seam_collectives` replaces
those functions (and any references the peer cached to them) with wrappers that issue
the same call through ``comm``: the device sees the launch, the bytes and the wait, and
an asynchronous call's work comes back wrapped so that its ``wait()`` goes through it too.

>>> with seam_collectives(device.comm):    # doctest: +SKIP
...     deepspeed_engine.backward(loss)     # its all-reduce is timed as Poplar's would be
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Iterator

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from poplar.engine.collectives import Comm

# Everything in torch.distributed that moves data between ranks or waits for them, and the
# collective whose network time it takes.
COLLECTIVES = {
    "all_reduce": "all_reduce", "all_reduce_coalesced": "all_reduce", "reduce": "all_reduce",
    "reduce_scatter": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_single": "reduce_scatter", "_reduce_scatter_base": "reduce_scatter",
    "all_gather": "all_gather", "all_gather_into_tensor": "all_gather", "all_gather_single": "all_gather",
    "_all_gather_base": "all_gather", "all_gather_object": "all_gather", "broadcast": "broadcast",
    "broadcast_object_list": "broadcast", "barrier": "barrier", "all_to_all": "all_gather",
    "all_to_all_single": "all_gather", "gather": "all_gather", "scatter": "broadcast",
    "gather_object": "all_gather", "scatter_object_list": "broadcast",
}


def _nbytes(op: str, args, kwargs) -> int:
    """The full buffer's bytes: the largest tensor (or list of tensors) among the arguments."""
    sizes = [0]
    for value in [*args, *kwargs.values()]:
        if isinstance(value, torch.Tensor):
            sizes.append(value.numel() * value.element_size())
        elif isinstance(value, (list, tuple)) and value and all(isinstance(t, torch.Tensor) for t in value):
            sizes.append(sum(t.numel() * t.element_size() for t in value))
    return max(sizes)


@contextlib.contextmanager
def seam_collectives(comm: Comm, cached: tuple[tuple[object, str], ...] = ()) -> Iterator[None]:
    """Route every ``torch.distributed`` collective through ``comm`` until the block ends.

    ``cached``: ``(object, attribute)`` pairs where the peer keeps its own reference to
    a collective (DeepSpeed's backend does, for all-gather and reduce-scatter).
    Collectives that call collectives (``all_gather_object`` gathers sizes, then
    bytes) are one launch and one wait: only the outermost call is seen.
    """
    depth = [0]

    def wrap(fn, op: str):
        sig = inspect.signature(fn)

        def collective(*args, **kwargs):
            if depth[0]:
                return fn(*args, **kwargs)
            try:
                bound = sig.bind(*args, **kwargs).arguments
            except TypeError:   # let the function itself report the bad call
                return fn(*args, **kwargs)
            is_async = bool(bound.get("async_op", False))
            takes_async = "async_op" in sig.parameters

            def issue(async_op: bool):
                depth[0] += 1
                try:
                    if takes_async:
                        return fn(*args, **{**kwargs, "async_op": async_op})
                    return fn(*args, **kwargs)
                finally:
                    depth[0] -= 1

            if not takes_async:   # object collectives: blocking, seen as one launch and wait (they return None)
                comm.run(op, _nbytes(op, args, kwargs), lambda _a: _Done(issue(False)), False)
                return None
            return comm.run(op, _nbytes(op, args, kwargs), issue, is_async)

        collective.__wrapped__ = fn
        return collective

    targets = [(module, name, op) for module in (dist, c10d) for name, op in COLLECTIVES.items() if hasattr(module, name)]
    targets += [(obj, name, _op_of(getattr(obj, name))) for obj, name in cached if getattr(obj, name, None) is not None]
    originals = [(obj, name, getattr(obj, name), op) for obj, name, op in targets]
    wrapped: dict[int, object] = {}    # one wrapper per function, whichever names it goes by
    try:
        for obj, name, fn, op in originals:
            if id(fn) not in wrapped:
                wrapped[id(fn)] = wrap(fn, op)
            setattr(obj, name, wrapped[id(fn)])
        yield
    finally:
        for obj, name, fn, _ in reversed(originals):
            setattr(obj, name, fn)


def _op_of(fn) -> str:
    """The network collective of a function a peer cached (by its torch.distributed name)."""
    name = getattr(fn, "__name__", "")
    return COLLECTIVES.get(name) or ("reduce_scatter" if "reduce_scatter" in name else
                                     "all_gather" if "gather" in name else "all_reduce")


class _Done:
    """A blocking call's result, handed through the seam as already-finished work."""

    def __init__(self, result):
        self.result = result

    def wait(self, *args, **kwargs):
        return True

    def is_completed(self) -> bool:
        return True
