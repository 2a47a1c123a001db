"""The device a rank computes on, as the loops that time it see it: the host (``base``), a real GPU
(``cuda``), an emulated GPU (``emulated``: the pace of :mod:`poplar.emulate`'s declared model)."""

from __future__ import annotations

import torch

from poplar.devices.base import Device


def rank_device(cluster, rank: int, workload=None, precision: str = "fp32", most: int | None = None) -> Device:
    """Rank ``rank``'s device in ``cluster`` (a :class:`~poplar.cluster.spec.ClusterSpec`): its GPU, or an emulated one.

    ``workload`` (a :class:`~poplar.models.workload.ModelSource`: a preset, or an integration's
    :class:`~poplar.integrations.module_source.ModuleSource`, the user's own module and data),
    ``precision`` and ``most``: what the rank will train, in which dtype it computes and its
    largest micro-batch (None: what the card's memory holds), so an emulated cluster's time
    dilation fits it (:mod:`poplar.emulate.dilation`).

    Enter it on every rank (``with rank_device(spec, rank) as device:``): an emulated
    device agrees its clock with the others there. It sees the collectives issued through
    ``device.comm`` (give it to the engine: ``poplar.initialize(..., comm=device.comm)``).
    """
    if cluster.is_real:
        from poplar.devices.cuda import CudaDevice

        return CudaDevice()
    from poplar.devices.emulated import EmulatedDevice

    return EmulatedDevice(cluster, rank, probe=None if workload is None else _WorkloadProbe(workload, precision, most))


def rank_device_of(cluster, rank: int, workload=None, cuda: bool | None = None, precision: str = "fp32",
                   most: int | None = None) -> Device:
    """The device rank ``rank`` computes on, for every loop that runs one (``poplar train``'s ranks, the
    integrations'): ``cluster``'s (:func:`rank_device`) where one is given; else its own GPU where ``cuda``
    (None: where the process group runs over NCCL), else this host's CPU."""
    if cluster is not None:
        return rank_device(cluster, rank, workload, precision, most)
    if cuda is None:
        import torch.distributed as dist

        cuda = dist.is_initialized() and dist.get_backend() == "nccl"
    if cuda:
        from poplar.devices.cuda import CudaDevice

        return CudaDevice()
    return Device()


class _WorkloadProbe:
    """A step of ``workload``'s own model at ``m`` samples in ``precision``'s dtype, for the dilation's probes
    (on a host without half-precision units a half step is slower against its declared time than fp32's): its
    floating-point inputs cast to that dtype as the engine casts them. ``model``: whose parameters the probe's
    memory leaves out (the device holds them as model states); ``most``: the largest micro-batch the rank runs
    (None: what its memory holds)."""

    def __init__(self, workload, precision: str, most: int | None = None):
        from torch.utils._pytree import tree_map

        from poplar.precision import torch_dtype

        dtype = torch_dtype(precision)
        self.workload, self.most = workload, most
        self.model = workload.build().to(dtype)
        cast = lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
        self.model.register_forward_pre_hook(lambda _, args, kwargs: (tree_map(cast, args), tree_map(cast, kwargs)),
                                             with_kwargs=True)

    def __call__(self, m: int) -> None:
        self.workload.loss(self.model, self.workload.random_batch(m)).backward()
        self.model.zero_grad(set_to_none=True)


__all__ = ["Device", "rank_device", "rank_device_of"]
