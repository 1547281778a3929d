"""Devices and logical meshes."""

from meshplan.cluster.cluster import Cluster, parse_cluster
from meshplan.cluster.devices import DEVICES, DeviceSpec, device_from_overrides, get_device
from meshplan.cluster.mesh import LogicalMesh, parse_bytes, parse_floats, parse_mesh_shape

__all__ = [
    "DEVICES",
    "Cluster",
    "DeviceSpec",
    "LogicalMesh",
    "device_from_overrides",
    "get_device",
    "parse_bytes",
    "parse_cluster",
    "parse_floats",
    "parse_mesh_shape",
]
