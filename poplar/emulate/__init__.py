"""The emulated heterogeneous cluster: CPU ranks that keep the pace of declared GPUs and links."""

from poplar.emulate.device import EmulatedDevice
from poplar.emulate.model import GpuModel, WorkCounter
from poplar.emulate.network import NetworkModel

__all__ = ["EmulatedDevice", "GpuModel", "NetworkModel", "WorkCounter"]
