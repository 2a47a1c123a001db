"""What the engine's model state holds in memory: bytes by kind, the steady level of a step, peaks.

Functions of the engine; :class:`~poplar.engine.engine.Engine` exposes them as its
methods of the same names (:func:`sample_peak` as the private ``_sample_peak``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

import torch

if TYPE_CHECKING:
    from poplar.engine.engine import Engine


def memory_report(engine: Engine) -> dict[str, int]:
    """Bytes this rank holds now, by kind, measured from the tensors themselves.

    ``parameters``: the model's parameter storage (full or shard); ``master``: fp32
    master weights not shared with it; ``gradients``: gradient accumulators;
    ``optimizer``: optimizer states. Storages shared by views are counted once.
    """
    seen: set[int] = set()

    def nbytes(tensors: Iterable[torch.Tensor | None]) -> int:
        total = 0
        for t in tensors:
            if t is None:
                continue
            st = t.untyped_storage()
            if st.nbytes() == 0 or st.data_ptr() in seen:
                continue
            seen.add(st.data_ptr())
            total += st.nbytes()
        return total

    units = engine.units
    report = {
        "parameters": nbytes([u.full_param for u in units] + [u.param_shard for u in units]),
        "master": nbytes(u.master.data for u in units),
        "gradients": nbytes([u.grad_full for u in units] + [u.grad_shard for u in units]),
        "optimizer": nbytes(t for st in engine.optimizer.state.values() for t in st.values()
                            if isinstance(t, torch.Tensor) and t.dim() > 0),
    }
    report["total"] = sum(report.values())
    return report


def model_state_bytes(engine: Engine) -> int:
    """Bytes of model state this rank holds through a micro-step, at their steady level.

    What the tensors hold now (:meth:`memory_report`), plus what a step allocates on
    the way: the full gradient accumulators of stages 0-1 before their first use, the
    full-size gradient buckets in flight in stages 2-3, and in ZeRO-3 the units
    gathered at once (the root, the current one and the prefetched one).
    """
    units, stage = engine.units, engine.stage
    total = memory_report(engine)["total"]
    largest = max(u.padded_numel for u in units)
    if not stage.shards_gradients:
        total += sum(4 * u.padded_numel for u in units if u.grad_full is None)
    else:
        total += 4 * largest * (engine.config.max_inflight_reduces + 1)
    if stage.shards_parameters:   # the allowance, not whatever happens to be gathered right now
        total -= sum(u.full_param.untyped_storage().nbytes() for u in units)
        itemsize = torch.finfo(engine.compute_dtype).bits // 8
        total += itemsize * (units[0].padded_numel + 2 * largest)
    return total


def held_state(engine: Engine) -> tuple[int, set[int]]:
    """What a device's memory accounting needs: :meth:`model_state_bytes` and the storages it counts.

    The storages are the engine's own buffers that autograd saves by reference
    (``untyped_storage()._cdata``), so an accounting of saved activations skips them.
    """
    tensors = [u.full_param for u in engine.units] + [u.master.data for u in engine.units]
    return model_state_bytes(engine), {t.untyped_storage()._cdata for t in tensors}


def sample_peak(engine: Engine) -> None:
    """Raise ``engine.peak_memory`` to what :func:`memory_report` measures now, kind by kind."""
    now = memory_report(engine)
    engine.peak_memory = {k: max(v, engine.peak_memory.get(k, 0)) for k, v in now.items()}
