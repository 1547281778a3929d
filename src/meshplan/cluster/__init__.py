"""Devices and logical meshes."""

from meshplan.cluster.cluster import Cluster, load_cluster_file, parse_cluster
from meshplan.cluster.devices import DEVICES, DeviceSpec, device_from_overrides, get_device
from meshplan.cluster.mesh import LogicalMesh, MeshTopology, parse_bytes, parse_floats, parse_mesh_shape

__all__ = [
    "DEVICES",
    "Cluster",
    "DeviceSpec",
    "LogicalMesh",
    "MeshTopology",
    "device_from_overrides",
    "get_device",
    "load_cluster_file",
    "parse_bytes",
    "parse_cluster",
    "parse_floats",
    "parse_mesh_shape",
]
