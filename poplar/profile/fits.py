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

from typing import TYPE_CHECKING

from poplar.cluster.spec import ClusterSpec

if TYPE_CHECKING:
    from poplar.models.workload import Workload


def check_states_fit(wl: Workload, spec: ClusterSpec, precision: str) -> None:
    """Raise a one-line ``ValueError`` where a device has no hardware for ``precision`` (bf16 on a V100), or the
    cluster's devices together cannot hold the model's states (:meth:`ClusterSpec.check_holds_states`: its frozen
    weights, LoRA's base, whole on every device)."""
    spec.check_precision(precision)
    check_holds_states(wl, spec, precision)


def check_holds_states(wl: Workload, spec: ClusterSpec, precision: str) -> None:
    """:meth:`ClusterSpec.check_holds_states` for ``wl``'s trained and frozen parameters."""
    from poplar.models.source import trained_and_frozen

    trained, frozen = trained_and_frozen(wl)
    spec.check_holds_states(wl.name, trained, precision, frozen=frozen)
