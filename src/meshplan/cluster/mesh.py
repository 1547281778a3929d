"""LogicalMesh: a view of devices as an N-D grid with a latency/bandwidth per axis."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from meshplan.errors import MeshError

# Sharding specs are written with one digit per mesh axis ("S012"): ten axes at most.
MAX_MESH_AXES = 10


@dataclass(frozen=True, slots=True)
class MeshTopology:
    """Where a mesh's devices sit: nodes of `devices_per_node` consecutive device ids, NVLink-class
    links inside a node and each device's share of the node's NICs between nodes (nominal
    figures of the device; the cost model applies the sustained fraction).

    Attributes:
        devices_per_node: devices per node; device id i sits on node i // devices_per_node.
        intra_bandwidth, intra_latency: bytes/s per device per direction and seconds per step
            inside a node.
        inter_bandwidth, inter_latency: bytes/s of one device's NIC share and seconds per step
            between nodes.
    """

    devices_per_node: int
    intra_bandwidth: float
    intra_latency: float
    inter_bandwidth: float
    inter_latency: float


@dataclass(frozen=True, slots=True)
class LogicalMesh:
    """Devices arranged as a grid; collectives along axis d cost alpha[d] + beta[d] * bytes.

    Attributes:
        shape: devices along each axis, e.g. (50, 4).
        alpha: latency per collective along each axis (seconds, or cost units).
        beta: time per byte along each axis (seconds/byte, or cost units).
        memory_per_device: bytes each device holds; None means unlimited.
        device_ids: flat device ids in row-major grid order.
        topology: the nodes the devices sit on and their links (None: the alpha-beta of each
            axis is all there is, as in Alpa's unit setting and the runtime's measured costs).
    """

    shape: tuple[int, ...]
    alpha: tuple[float, ...]
    beta: tuple[float, ...]
    memory_per_device: float | None = None
    device_ids: tuple[int, ...] = ()
    topology: MeshTopology | None = None
    _locality: dict[tuple[int, ...], int] = field(init=False, repr=False, compare=False, hash=False)
    _priced: dict = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_locality", {})
        object.__setattr__(self, "_priced", {})
        shape = tuple(int(s) for s in self.shape)
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "alpha", tuple(float(a) for a in self.alpha))
        object.__setattr__(self, "beta", tuple(float(b) for b in self.beta))
        if not shape or any(s < 1 for s in shape):
            raise MeshError(f"mesh shape {shape} is invalid; every axis needs at least one device")
        if len(shape) > MAX_MESH_AXES:
            raise MeshError(f"mesh shape {shape} has {len(shape)} axes; sharding specs name axes 0-9, so at most "
                            f"{MAX_MESH_AXES}: merge axes into fewer")
        for what, values in (("alpha", self.alpha), ("beta", self.beta)):
            if len(values) != len(shape):
                raise MeshError(
                    f"mesh {self.name}: {len(values)} {what} values for {len(shape)} axes; "
                    f"give one per axis, e.g. --mesh-{what} {','.join(['1'] * len(shape))}"
                )
            if any(v < 0 or not math.isfinite(v) for v in values):
                raise MeshError(f"mesh {self.name}: {what} values {values} must be finite and >= 0")
        if not self.device_ids:
            object.__setattr__(self, "device_ids", tuple(range(math.prod(shape))))
        elif len(self.device_ids) != math.prod(shape):
            raise MeshError(f"mesh {self.name} needs {math.prod(shape)} device ids, got {len(self.device_ids)}")
        if self.memory_per_device is not None and self.memory_per_device <= 0:
            raise MeshError(f"mesh {self.name}: memory per device must be positive, got {self.memory_per_device}")

    @property
    def name(self) -> str:
        return "x".join(map(str, self.shape))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def num_devices(self) -> int:
        return math.prod(self.shape)

    def axis_size(self, axes: Sequence[int]) -> int:
        """Devices in the group spanned by `axes`."""
        if len(axes) == 1:  # the common case, on the planner's hottest path
            return self.shape[axes[0]]
        return math.prod(self.shape[a] for a in axes)

    def with_memory(self, memory_per_device: float | None) -> LogicalMesh:
        return LogicalMesh(self.shape, self.alpha, self.beta, memory_per_device, self.device_ids, self.topology)

    def __reduce__(self):  # pickled without the caches (a plan's mesh travels between processes)
        return LogicalMesh, (self.shape, self.alpha, self.beta, self.memory_per_device, self.device_ids, self.topology)

    @property
    def priced(self) -> dict:
        """Costs computed on this mesh, for the cost model to remember (a pure function of the
        mesh and the key it files them under; planning one graph asks for the same collective
        thousands of times)."""
        return self._priced

    def group_locality(self, axes: Sequence[int]) -> tuple[int, int]:
        """(ranks, ranks sharing a node) of the groups a collective over `axes` runs in: the
        group of the first device (the views here are regular, every group alike). Without a
        topology every group counts as one node."""
        size = self.axis_size(tuple(axes)) if axes else 1
        if self.topology is None or size <= 1:
            return size, size
        key = tuple(sorted(axes))
        local = self._locality.get(key)
        if local is None:  # collectives over the same axes are priced many times per plan
            local = self._locality[key] = _local_ranks(self.shape, self.device_ids, key,
                                                       self.topology.devices_per_node)
        return size, local


def _local_ranks(shape: tuple[int, ...], ids: tuple[int, ...], axes: tuple[int, ...], per_node: int) -> int:
    """The most ranks of the first device's group over `axes` that share one node."""
    strides = [math.prod(shape[a + 1:]) for a in range(len(shape))]
    offsets = [0]
    for a in axes:
        offsets = [o + i * strides[a] for o in offsets for i in range(shape[a])]
    nodes = [ids[o] // per_node for o in offsets]
    return max(nodes.count(n) for n in set(nodes))


def parse_mesh_shape(text: str) -> tuple[int, ...]:
    """Parse "50x4" (or "50,4", "8", "2x2x2") into a shape tuple of 1 to MAX_MESH_AXES axes."""
    parts = re.split(r"[x,×*]", text.strip().lower())
    try:
        shape = tuple(int(p) for p in parts)
    except ValueError:
        raise MeshError(f"mesh {text!r} is not a shape; write axis sizes like 50x4, 2x2x2 or 8") from None
    if any(s < 1 for s in shape):
        raise MeshError(f"mesh {text!r}: every axis needs at least one device")
    if len(shape) > MAX_MESH_AXES:
        raise MeshError(f"mesh {text!r} has {len(shape)} axes; plans name mesh axes 0-9 (S01 splits a dim over "
                        f"axes 0 and 1), so at most {MAX_MESH_AXES}: merge axes, e.g. 4x2x2 for 2x2x2x2")
    return shape


def parse_floats(text: str, what: str) -> tuple[float, ...]:
    """Parse "1,0.01" into floats."""
    try:
        return tuple(float(p) for p in text.split(","))
    except ValueError:
        raise MeshError(f"{what} {text!r} is not a list of numbers; write e.g. 1,0.01") from None


_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> float:
    """Parse a size like "32GB", "16 GiB", "1e9" into bytes (GB = 1e9, GiB = 2**30)."""
    match = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([a-zA-Z]*)\s*", text)
    if match is None or match.group(2).lower() not in _UNITS:
        raise MeshError(f"memory size {text!r} is not understood; write e.g. 32GB, 16GiB or 4e9")
    try:
        value = float(match.group(1)) * _UNITS[match.group(2).lower()]
    except ValueError:
        raise MeshError(f"memory size {text!r} is not understood; write e.g. 32GB, 16GiB or 4e9") from None
    if value <= 0:
        raise MeshError(f"memory size {text!r} must be positive")
    return value
