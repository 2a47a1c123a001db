"""The emulated heterogeneous cluster: CPU ranks slowed down and memory-capped for real."""

from poplar.emulate.cluster import ClusterSpec, DeviceGroup, load_cluster, parse_cluster, presets
from poplar.emulate.device import EmulatedDevice

__all__ = ["ClusterSpec", "DeviceGroup", "EmulatedDevice", "load_cluster", "parse_cluster", "presets"]
