"""The device a rank computes on, as the loops that time it see it: the host (``base``), a real GPU
(``cuda``), an emulated GPU (``emulated``: the pace of :mod:`poplar.emulate`'s declared model)."""

from __future__ import annotations

from poplar.devices.base import Device


def rank_device(cluster, rank: int, workload=None, precision: str = "fp32") -> Device:
    """Rank ``rank``'s device in ``cluster`` (a :class:`~poplar.cluster.spec.ClusterSpec`): its GPU, or an emulated one.

    ``workload`` (a :class:`~poplar.workload.Workload`) and ``precision``: what the rank will
    train and in which dtype it computes, so an emulated cluster's time dilation fits it.

    Enter it on every rank (``with rank_device(spec, rank) as device:``): an emulated
    device agrees its clock with the others there. It sees the collectives issued through
    ``device.comm`` (give it to the engine: ``poplar.initialize(..., comm=device.comm)``).
    """
    if cluster.is_real:
        from poplar.devices.cuda import CudaDevice

        return CudaDevice()
    from poplar.devices.emulated import EmulatedDevice

    return EmulatedDevice(cluster, rank, probe=None if workload is None else _WorkloadProbe(workload, precision))


def rank_device_of(cluster, rank: int, workload=None, cuda: bool | None = None, precision: str = "fp32") -> Device:
    """The device rank ``rank`` computes on, for every loop that runs one (``poplar train``'s ranks, the
    integrations'): ``cluster``'s (:func:`rank_device`) where one is given; else its own GPU where ``cuda``
    (None: where the process group runs over NCCL), else this host's CPU."""
    if cluster is not None:
        return rank_device(cluster, rank, workload, precision)
    if cuda is None:
        import torch.distributed as dist

        cuda = dist.is_initialized() and dist.get_backend() == "nccl"
    if cuda:
        from poplar.devices.cuda import CudaDevice

        return CudaDevice()
    return Device()


class _WorkloadProbe:
    """A step of ``workload``'s own model at ``m`` samples in ``precision``'s dtype, for the dilation's probes
    (on a host without half-precision units a half step is slower against its declared time than fp32's).
    ``model``: whose parameters the probe's memory leaves out (the device holds them as model states)."""

    def __init__(self, workload, precision: str):
        from poplar.precision import torch_dtype

        self.workload, self.model = workload, workload.build().to(torch_dtype(precision))

    def __call__(self, m: int) -> None:
        self.workload.loss(self.model, self.workload.random_batch(m)).backward()
        self.model.zero_grad(set_to_none=True)


__all__ = ["Device", "rank_device", "rank_device_of"]
