"""What arithmetic tells before anything is measured: a precision a device has no hardware for, a model whose
states no cluster of these devices can hold.

In ZeRO-3 the model states are one copy over the whole cluster, each rank holding its share
(any share: :attr:`poplar.plan.Plan.shard_shares`), so whatever the stage, shape and
shares, the devices together hold at least the stage's sharded bytes a parameter
(:meth:`poplar.stages.ZeroStage.sharded_bytes_per_param`) times the parameters. A cluster
whose memory is less than that is refused at once, before minutes of profiling or
simulating find the same.
"""

from __future__ import annotations

from poplar.cluster.spec import ClusterSpec
from poplar.stages import stage as zero_stage
from poplar.workload import Workload


def check_states_fit(wl: Workload, spec: ClusterSpec, precision: str) -> None:
    """Raise a one-line ``ValueError`` where a device has no hardware for ``precision`` (bf16 on a V100), or the
    cluster's devices together cannot hold the model's states."""
    spec.check_precision(precision)
    per_param = zero_stage(3).sharded_bytes_per_param(precision)
    need = per_param * wl.n_params()
    held = sum(spec.memory_bytes(d) for d in spec.rank_devices())
    if need > held:
        raise ValueError(f"{wl.name} has {_count(wl.n_params())} parameters: its model states take at least "
                         f"{_size(need)} in ZeRO-3 ({per_param} bytes a parameter in {precision}), more than the "
                         f"{spec.world_size} device{'s' * (spec.world_size > 1)} of this cluster hold together "
                         f"({_size(held)}): add devices or larger ones, or choose a smaller model")


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n:,}"


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.2f} MiB"
