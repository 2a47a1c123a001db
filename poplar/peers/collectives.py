"""Another system's collectives, seen by an emulated device: wrapped for as long as the system computes.

Poplar's engine tells its device when it launches a collective and when it waits for one
(``boundary()``, ``waiting()``). A peer such as DeepSpeed launches its own, so while it
runs, :func:`device_collectives` replaces the ``torch.distributed`` collectives (and
any references the peer cached to them) with wrappers that do the same:
``boundary()`` before the launch, ``waiting()`` around a blocking call, and an
asynchronous call's work handed back wrapped so that its ``wait()`` is a wait too.

>>> with device_collectives(device):              # doctest: +SKIP
...     deepspeed_engine.backward(loss)            # its all-reduce now pays the device's compute debt first
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Iterator

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from poplar.engine.device import Device

# Everything in torch.distributed that moves data between ranks or waits for them.
COLLECTIVES = ("all_reduce", "all_reduce_coalesced", "reduce", "reduce_scatter", "reduce_scatter_tensor",
               "reduce_scatter_single", "_reduce_scatter_base", "all_gather", "all_gather_into_tensor",
               "all_gather_single", "_all_gather_base", "all_gather_object", "broadcast", "broadcast_object_list",
               "barrier", "all_to_all", "all_to_all_single", "gather", "scatter", "gather_object",
               "scatter_object_list")


class DeviceWork:
    """An asynchronous collective's work: ``wait()`` counts as a wait on the device."""

    def __init__(self, work, device: Device):
        self._work, self._device = work, device

    def wait(self, *args, **kwargs):
        with self._device.waiting():
            return self._work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._work, name)


@contextlib.contextmanager
def device_collectives(device: Device, cached: tuple[tuple[object, str], ...] = ()) -> Iterator[None]:
    """Route every collective through ``device`` until the block ends; the originals come back after.

    ``cached``: ``(object, attribute)`` pairs where the peer keeps its own reference to
    a collective (DeepSpeed's backend does, for all-gather and reduce-scatter).
    Collectives that call collectives (``all_gather_object`` gathers sizes, then
    bytes) are one launch and one wait: only the outermost call is counted.
    """
    depth = [0]

    def wrap(fn):
        sig = inspect.signature(fn)

        def collective(*args, **kwargs):
            if depth[0]:
                return fn(*args, **kwargs)
            try:
                is_async = bool(sig.bind(*args, **kwargs).arguments.get("async_op", False))
            except TypeError:   # let the function itself report the bad call
                is_async = False
            depth[0] += 1
            try:
                if is_async:
                    device.boundary()
                    work = fn(*args, **kwargs)
                    return None if work is None else DeviceWork(work, device)
                with device.waiting():   # waiting() pays the compute debt (boundary) first
                    return fn(*args, **kwargs)
            finally:
                depth[0] -= 1

        collective.__wrapped__ = fn
        return collective

    targets = [(module, name) for module in (dist, c10d) for name in COLLECTIVES if hasattr(module, name)]
    targets += [pair for pair in cached if getattr(*pair, None) is not None]
    originals = [(obj, name, getattr(obj, name)) for obj, name in targets]
    wrapped: dict[int, object] = {}    # one wrapper per function, whichever names it goes by
    try:
        for obj, name, fn in originals:
            if id(fn) not in wrapped:
                wrapped[id(fn)] = wrap(fn)
            setattr(obj, name, wrapped[id(fn)])
        yield
    finally:
        for obj, name, fn in reversed(originals):
            setattr(obj, name, fn)
