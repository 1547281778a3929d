"""Cost constants and mesh shapes the runtime plans with when no cluster file is given.

The alpha/beta and FLOP/s below are placeholders for local (CPU) devices, not measurements:
they only need to rank plans sensibly. `meshplan profile-cluster` measures real ones.
"""

from __future__ import annotations

from meshplan.cluster.mesh import LogicalMesh

ALPHA_S = 1e-5  # latency of one collective, seconds
BETA_S_PER_BYTE = 1e-9  # time per byte moved, seconds
FLOPS_PER_SECOND = 1e11  # per device


def default_mesh_shape(num_devices: int) -> tuple[int, ...]:
    """(2, n/2) when n is even and > 2, else (n,)."""
    if num_devices > 2 and num_devices % 2 == 0:
        return (2, num_devices // 2)
    return (num_devices,)


def local_mesh(shape: tuple[int, ...]) -> LogicalMesh:
    """A logical mesh of `shape` with the placeholder alpha/beta on every axis."""
    return LogicalMesh(shape, (ALPHA_S,) * len(shape), (BETA_S_PER_BYTE,) * len(shape))
