"""Cluster: nodes x devices per node of one DeviceSpec -> sub-mesh shapes and their LogicalMesh views.

Device ids are global and row-major over the physical grid: device j of node i has id
i * devices_per_node + j, so ids within a node are consecutive.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

import numpy as np

from meshplan.cluster.devices import DeviceSpec
from meshplan.cluster.mesh import LogicalMesh, MeshTopology
from meshplan.errors import MeshError


@dataclass(frozen=True, slots=True)
class Cluster:
    """A homogeneous cluster: `nodes` hosts, each with `devices_per_node` devices of kind `device`.

    Compute efficiency is not part of the cluster; the cost model applies it.
    """

    nodes: int
    devices_per_node: int
    device: DeviceSpec

    def __post_init__(self) -> None:
        for field in ("nodes", "devices_per_node"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise MeshError(f"cluster {field} = {value!r} must be a positive integer, e.g. Cluster(50, 4, device)")
        if not isinstance(self.device, DeviceSpec):
            raise MeshError(f"cluster device must be a DeviceSpec, got {self.device!r}; use get_device('a100-80gb')")

    @property
    def num_devices(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def name(self) -> str:
        """E.g. "50x4 v100-32gb"."""
        return f"{self.nodes}x{self.devices_per_node} {self.device.name}"

    def submesh_shapes(self) -> tuple[tuple[int, int], ...]:
        """Alpa's sub-mesh choices (§5.2), as (nodes, devices per node).

        (1, 1), (1, 2), (1, 4), ... powers of two below M, then (1, M) even if M is not a power
        of two, then whole nodes (k, M) for k = 2..N. These shapes can always tile the cluster.
        """
        m = self.devices_per_node
        partial = [(1, 2**i) for i in range(m.bit_length()) if 2**i < m]
        return (*partial, *((k, m) for k in range(1, self.nodes + 1)))

    def logical_views(self, shape: tuple[int, int], origin: tuple[int, int] = (0, 0),
                      max_axes: int = 2) -> tuple[LogicalMesh, ...]:
        """The logical meshes of the physical sub-mesh `shape` = (n nodes, m devices each).

        With D = n * m, the 2-D views are (D // b, b) for each divisor b > 1 of m, largest b
        first (so (n, m) comes first, then (2n, m/2), ...), then (1, D) if not already listed.
        Each view's axis 1 stays inside a node when b divides m. Transposes are left out: (m, 1)
        would repeat (1, m) with the axes swapped. With `max_axes` = 3 and D >= 8, the 3-D
        views (`three_axis_shapes`) follow. An axis whose every group lies in one node gets the
        intra-node alpha/beta, otherwise the inter-node ones (the slowest link of its ring); a
        size-1 axis counts as intra. All views of a sub-mesh share its device ids, row-major with
        the within-node index fastest, so the last axis's groups are consecutive.

        Args:
            shape: (nodes, devices per node) of the sub-mesh.
            origin: (first node, first device within the node) of the sub-mesh.
            max_axes: 2 (Alpa's views) or 3 (also the 3-D views).

        Raises:
            MeshError: the sub-mesh does not fit, or `max_axes` is not 2 or 3.
        """
        if max_axes not in (2, 3):
            raise MeshError(f"logical views of {max_axes} axes are not planned; use 2 (Alpa's 2-D views) or 3 "
                            "(also data x tensor x sequence views of stages of 8 or more devices)")
        ids = self.submesh_ids(shape, origin)
        n, m = shape
        widths = [b for b in range(m, 1, -1) if m % b == 0]
        views: list[tuple[int, ...]] = [(n * m // b, b) for b in widths]
        if (1, n * m) not in views:
            views.append((1, n * m))
        if max_axes == 3:
            views += three_axis_shapes(n, m)
        return tuple(self._view(view, ids) for view in views)

    def full_mesh_views(self, max_axes: int = 2) -> tuple[LogicalMesh, ...]:
        """`logical_views` of the whole cluster."""
        return self.logical_views((self.nodes, self.devices_per_node), max_axes=max_axes)

    def submesh_ids(self, shape: tuple[int, int], origin: tuple[int, int]) -> tuple[int, ...]:
        """Global ids of the sub-mesh, row-major; raises MeshError if it does not fit."""
        (n, m), (i0, j0) = shape, origin
        fits = n >= 1 and m >= 1 and i0 >= 0 and j0 >= 0
        if not fits or i0 + n > self.nodes or j0 + m > self.devices_per_node:
            raise MeshError(
                f"sub-mesh {n}x{m} at node {i0}, device {j0} does not fit cluster {self.name}; "
                f"pick one of {self.submesh_shapes()} inside {self.nodes} nodes x {self.devices_per_node} devices"
            )
        return tuple((i0 + i) * self.devices_per_node + j0 + j for i in range(n) for j in range(m))

    def _view(self, view: tuple[int, ...], ids: tuple[int, ...]) -> LogicalMesh:
        """One logical view of `ids`, with per-axis alpha/beta from the links its groups use."""
        nodes = np.asarray(ids).reshape(view) // self.devices_per_node
        # An axis stays in one node when every group along it (a fibre of the view) does.
        intra = tuple(bool((nodes == nodes.take([0], axis=k)).all()) for k in range(len(view)))
        d = self.device
        alpha = tuple(d.intra_latency if x else d.inter_latency for x in intra)
        beta = tuple(d.intra_beta if x else d.inter_beta for x in intra)
        memory = None if d.memory_bytes == math.inf else d.memory_bytes
        return LogicalMesh(view, alpha, beta, memory_per_device=memory, device_ids=ids, topology=self.topology)

    @property
    def topology(self) -> MeshTopology:
        """The nodes and links every view of this cluster sits on (node-aware collective costs)."""
        d = self.device
        return MeshTopology(self.devices_per_node, d.intra_bandwidth, d.intra_latency, d.inter_bandwidth,
                            d.inter_latency)


def three_axis_shapes(nodes: int, per_node: int) -> list[tuple[int, int, int]]:
    """The 3-D views (a, b, c) of `nodes` x `per_node` devices, a * b * c of them, every axis of
    at least 2 (a size-1 axis would repeat a 2-D view), and none with fewer than 8 devices.

    The last axis stays inside a node (c divides `per_node`: the axis that talks most, e.g.
    tensor parallelism, gets NVLink) and no axis straddles a node boundary unevenly (b * c
    divides `per_node` or is a multiple of it), so every axis is wholly intra- or inter-node.
    Ordered by c, then b, largest first. For D = 2^k devices there are at most (k-1)(k-2)/2 of
    them (3 of 2 x 8, 15 of 32 x 8, where c <= 8 leaves out 6 of the 21): the stage search
    prices each, so the count is what 3-D views add to its time.
    """
    total = nodes * per_node
    if total < 8:
        return []
    shapes = []
    for c in (c for c in range(per_node, 1, -1) if per_node % c == 0):
        for b in (b for b in range(total // c, 1, -1) if (total // c) % b == 0):
            a = total // (b * c)
            aligned = per_node % (b * c) == 0 or (b * c) % per_node == 0
            if a > 1 and aligned:
                shapes.append((a, b, c))
    return shapes


def axis_groups(view: tuple[int, ...], ids: tuple[int, ...], axis: int) -> list[tuple[int, ...]]:
    """The device groups along `axis` of a row-major view of `ids` (a collective over that axis
    runs in each group)."""
    stride, size = math.prod(view[axis + 1:]), view[axis]
    starts = [f for f in range(len(ids)) if (f // stride) % size == 0]
    return [tuple(ids[f + i * stride] for i in range(size)) for f in starts]


_CLUSTER_RE = re.compile(r"\s*(\d+)\s*[x×*,]\s*(\d+)\s*")


def parse_cluster(text: str) -> tuple[int, int]:
    """Parse "50x4" into (nodes, devices per node).

    Raises:
        MeshError: the text is not NODESxDEVICES or a count is zero.
    """
    match = _CLUSTER_RE.fullmatch(text.lower())
    if match is None:
        raise MeshError(f"cluster {text!r} is not NODESxDEVICES_PER_NODE; write e.g. 50x4 (50 nodes of 4 devices)")
    nodes, per_node = int(match.group(1)), int(match.group(2))
    if nodes < 1 or per_node < 1:
        raise MeshError(f"cluster {text!r} needs at least 1 node and 1 device per node; write e.g. 50x4")
    return nodes, per_node


def load_cluster_file(path: str) -> Cluster:
    """A Cluster from a file written by `meshplan profile-cluster`."""
    try:
        with open(path) as handle:
            data = json.load(handle)
        device = DeviceSpec(**data["device"])
        return Cluster(int(data["nodes"]), int(data["devices_per_node"]), device)
    except FileNotFoundError:
        raise MeshError(f"cluster file {path!r} does not exist; write one with `meshplan profile-cluster`") from None
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise MeshError(f"cluster file {path!r} is not a meshplan cluster file ({exc}); "
                        "write one with `meshplan profile-cluster`") from None
