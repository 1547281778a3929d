"""DeviceCosts: what the runtime plans with: collective costs, FLOP/s and memory of the devices at hand.

Without a cluster file the alpha/beta and FLOP/s are placeholders for local (CPU) devices,
not measurements: they only need to rank plans sensibly. `meshplan profile-cluster` measures
real ones; `parallelize(..., cluster=...)` plans with them (`DeviceCosts.from_cluster`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from meshplan.cluster.cluster import Cluster, load_cluster_file
from meshplan.cluster.devices import DeviceSpec
from meshplan.cluster.mesh import LogicalMesh
from meshplan.errors import MeshError

ALPHA_S = 1e-5  # placeholder latency of one collective, seconds
BETA_S_PER_BYTE = 1e-9  # placeholder time per byte moved, seconds
FLOPS_PER_SECOND = 1e11  # placeholder, per device


def default_mesh_shape(num_devices: int) -> tuple[int, ...]:
    """(2, n/2) when n is even and > 2, else (n,)."""
    if num_devices > 2 and num_devices % 2 == 0:
        return (2, num_devices // 2)
    return (num_devices,)


@dataclass(frozen=True, slots=True)
class DeviceCosts:
    """Collective latency (s) and time per byte (s/byte) inside and between nodes, FLOP/s per
    device, how many consecutive devices share a node (None: all of them), bytes per device
    plans must fit in (None: unlimited) and, when the costs were measured, on how many devices
    (plans for another count are refused)."""

    intra_alpha: float = ALPHA_S
    intra_beta: float = BETA_S_PER_BYTE
    inter_alpha: float = ALPHA_S
    inter_beta: float = BETA_S_PER_BYTE
    flops_per_second: float = FLOPS_PER_SECOND
    devices_per_node: int | None = None
    num_devices: int | None = None
    memory_bytes: float | None = None

    @classmethod
    def from_cluster(cls, cluster: Cluster | str) -> DeviceCosts:
        """The costs a cluster, or a cluster file written by `meshplan profile-cluster`,
        describes, at its peak FLOP/s.

        Raises:
            MeshError: the file is missing or not a cluster file.
        """
        cluster = load_cluster_file(cluster) if isinstance(cluster, str) else cluster
        d = cluster.device
        return cls(d.intra_latency, 1 / d.intra_bandwidth, d.inter_latency, 1 / d.inter_bandwidth, d.peak_flops,
                   cluster.devices_per_node, cluster.num_devices, d.memory_bytes)

    def cluster(self, num_devices: int) -> Cluster:
        """`num_devices` devices as a cluster of nodes of `devices_per_node` (default: one node),
        with these link costs, FLOP/s and memory (unlimited when None).

        Raises:
            MeshError: `devices_per_node` does not divide `num_devices`.
        """
        per_node = self.devices_per_node or num_devices
        if num_devices % per_node:
            raise MeshError(f"{num_devices} devices do not fill nodes of {per_node}; use a multiple of "
                            f"{per_node} devices or a cluster file measured on these devices")
        memory = math.inf if self.memory_bytes is None else self.memory_bytes
        device = DeviceSpec("local", self.flops_per_second, memory, 1 / self.intra_beta, self.intra_alpha,
                            1 / self.inter_beta, self.inter_alpha, "devices at hand")
        return Cluster(num_devices // per_node, per_node, device)

    def check_devices(self, count: int, where: str) -> None:
        """Raise MeshError when the costs were measured on another number of devices."""
        if self.num_devices is not None and self.num_devices != count:
            raise MeshError(f"{where}: the cluster describes {self.num_devices} devices but {count} are used; "
                            f"measure these devices with `meshplan profile-cluster`, or pass that many devices")

    @property
    def beta(self) -> float:
        """The larger time per byte: the unit memory prices are expressed in."""
        return max(self.intra_beta, self.inter_beta)

    def mesh(self, shape: tuple[int, ...], devices: Sequence[int] | None = None) -> LogicalMesh:
        """The logical mesh of `shape` over `devices` (indices into the device list, row-major;
        default 0, 1, ...): an axis whose steps stay inside one node gets the intra-node costs,
        any other the inter-node costs. Its memory per device is `memory_bytes`."""
        ids = np.arange(math.prod(shape)) if devices is None else np.asarray(devices)
        ids = ids.reshape(shape)
        nodes = ids // (self.devices_per_node or int(ids.max()) + 1)
        inside = [bool(np.all(nodes == nodes.take([0], axis=k))) for k in range(len(shape))]
        return LogicalMesh(shape, tuple(self.intra_alpha if i else self.inter_alpha for i in inside),
                           tuple(self.intra_beta if i else self.inter_beta for i in inside), self.memory_bytes)
