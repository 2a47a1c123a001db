"""The declared GPU and network: what an emulated device runs at, and what the simulator will count with.

- :mod:`~poplar.emulate.model`: the roofline time of every operator on a declared GPU;
- :mod:`~poplar.emulate.network`: ring collectives over the declared links;
- :mod:`~poplar.emulate.dilation`: how much slower than the declared GPUs this host runs them.

The emulated device that keeps this pace at run time is
:class:`poplar.devices.emulated.EmulatedDevice`.
"""

from poplar.emulate.model import GpuModel, WorkCounter
from poplar.emulate.network import NetworkModel

__all__ = ["GpuModel", "NetworkModel", "WorkCounter"]
