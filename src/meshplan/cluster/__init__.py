"""Devices and logical meshes."""

from meshplan.cluster.mesh import LogicalMesh, parse_bytes, parse_floats, parse_mesh_shape

__all__ = ["LogicalMesh", "parse_bytes", "parse_floats", "parse_mesh_shape"]
