"""The emulated heterogeneous cluster: CPU ranks slowed down and memory-capped for real."""

from poplar.emulate.cluster import ClusterSpec, DeviceGroup, load_cluster, parse_cluster, presets

__all__ = ["ClusterSpec", "DeviceGroup", "load_cluster", "parse_cluster", "presets"]
