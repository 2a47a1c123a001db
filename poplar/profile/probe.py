"""The memory probe: the largest micro-batch that fits a device beside a stage's model states.

It grows the micro-batch, then bisects, running forward and backward on a local copy of
the model (in the compute precision, as the engine holds it). How a device decides
whether a run fits is its own (:meth:`poplar.devices.Device.memory_probe`): an emulated
device counts the bytes autograd saves against its declared capacity, a real GPU runs
out of memory for real with the other model states reserved beside the model. An
out-of-memory is caught and cleaned up after, and never strands the other ranks: the
probe has no collectives.

>>> grow_then_bisect(lambda m: m <= 37, limit=100), grow_then_bisect(lambda m: False, limit=100)
(37, 0)
"""

from __future__ import annotations

from collections.abc import Callable

from poplar.devices.base import Device
from poplar.engine.batch import split_batch
from poplar.precision import cast_model, torch_dtype
from poplar.models.workload import Workload, as_workload


def largest_micro_batch(device: Device, workload: str | Workload, state_bytes: int, limit: int = 4096,
                        precision: str = "fp32") -> int:
    """Grow the micro-batch until the device runs out of memory, then bisect. 0: not even 1 fits.

    ``state_bytes``: the model states held meanwhile (those the probe's model does not
    hold itself, the device holds beside it). ``precision``: the compute precision
    (``bf16``: the model's parameters and activations in bf16, as the engine's mixed
    precision computes).
    """
    found = _search(device, as_workload(workload), state_bytes, limit, torch_dtype(precision))
    device.free_memory()   # the probe's model died with the search's frame
    return found


def _search(device: Device, wl: Workload, state_bytes: int, limit: int, dtype) -> int:
    model = cast_model(wl.build(), device.torch_device, dtype)   # buffers too, as the engine holds them
    with device.memory_probe(model, state_bytes) as fits:
        return grow_then_bisect(lambda m: fits(lambda: forward_backward(device, model, wl, m)), limit)


def forward_backward(device: Device, model, wl: Workload, micro_batch: int) -> None:
    """One forward and backward of ``micro_batch`` samples on ``device``."""
    # in a frame of its own, so the batch and the graph die with it
    (batch,) = split_batch(wl.random_batch(micro_batch, seed=micro_batch), micro_batch, device.torch_device)
    wl.loss(model, batch).backward()
    device.synchronize()   # an asynchronous failure surfaces here, not in the next probe


def grow_then_bisect(fits: Callable[[int], bool], limit: int) -> int:
    """The largest ``m <= limit`` with ``fits(m)``, found by doubling then bisecting; 0 if not even 1 fits."""
    if not fits(1):
        return 0
    good, bad = 1, None
    while bad is None:
        nxt = good * 2
        if nxt > limit:
            return good
        if fits(nxt):
            good = nxt
        else:
            bad = nxt
    while bad - good > 1:
        mid = (good + bad) // 2
        if fits(mid):
            good = mid
        else:
            bad = mid
    return good
