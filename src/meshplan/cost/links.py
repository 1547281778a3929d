"""Link model: seconds of collectives, hand-offs and overlapped communication on a cluster's links.

One model for both pricers: the closed-form layout pricer (meshplan.simulator.analytic) and the
op-level cost model the intra-op ILP and the stage DP use (meshplan.cost.collectives,
meshplan.inter.stages). A group of ranks is described by how many ranks it has and how many of
them share a node; the formulas follow NCCL's algorithms (docs/simulator.md gives the sources):

- inside one node, a ring over NVLink: 2(n-1) steps for an all-reduce, n-1 for an all-gather or
  reduce-scatter, each rank moving 2(n-1)/n resp. (n-1)/n of the buffer (nccl-tests' "bus
  bandwidth" factors);
- one rank per node, a ring across nodes at that rank's NIC share;
- several ranks per node and several nodes, hierarchical: reduce-scatter inside the node, the
  cross-node step on 1/local of the buffer with every local rank on its own NIC at once (NCCL
  builds one ring, a channel, per NIC and splits the buffer over them through NVLink), then
  all-gather inside the node;
- all-to-all: each rank keeps 1/n of its bytes and sends the rest, the part for ranks of its own
  node over NVLink and the part for other nodes over its NIC share, both links at once.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from meshplan.cluster.devices import DeviceSpec
from meshplan.cluster.mesh import MeshTopology


class CollectiveKind(enum.Enum):
    ALL_REDUCE = "all-reduce"
    ALL_GATHER = "all-gather"
    REDUCE_SCATTER = "reduce-scatter"
    ALL_TO_ALL = "all-to-all"
    COLLECTIVE_PERMUTE = "collective-permute"


@dataclass(frozen=True, slots=True)
class Links:
    """Sustained link figures per device: NVLink-class inside a node, its NIC share across nodes.

    Attributes:
        intra_bandwidth, intra_latency: bytes/s per direction and seconds per step inside a node.
        inter_bandwidth, inter_latency: bytes/s of one device's NIC share and seconds per step
            between nodes.
    """

    intra_bandwidth: float
    intra_latency: float
    inter_bandwidth: float
    inter_latency: float

    @staticmethod
    def of(topology: MeshTopology | DeviceSpec, link_efficiency: float) -> Links:
        """The links of a topology or device at `link_efficiency` of their nominal bandwidth."""
        return Links(topology.intra_bandwidth * link_efficiency, topology.intra_latency,
                     topology.inter_bandwidth * link_efficiency, topology.inter_latency)

    def point_to_point(self, crosses_node: bool) -> tuple[float, float]:
        """(bandwidth, latency) of a send from one device to another."""
        return (self.inter_bandwidth, self.inter_latency) if crosses_node else (self.intra_bandwidth,
                                                                                 self.intra_latency)


@dataclass(frozen=True, slots=True)
class Group:
    """The ranks of one collective: `size` of them, `local` of which share each node."""

    size: int
    local: int

    @property
    def nodes(self) -> int:
        return math.ceil(self.size / self.local)

    @staticmethod
    def strided(size: int, stride: int, devices_per_node: int) -> Group:
        """`size` ranks `stride` apart (Megatron's rank order: the tensor-parallel group has
        stride 1, the data-parallel group stride tp x cp, ...), nodes of `devices_per_node`."""
        if size <= 1:
            return Group(max(size, 1), max(size, 1))
        local = min(size, math.ceil(devices_per_node / stride)) if stride < devices_per_node else 1
        return Group(size, local)


def bus_factor(kind: CollectiveKind, ranks: int) -> float:
    """Bytes each rank moves per byte of its buffer in a ring of `ranks` (nccl-tests' bus
    bandwidth factors): 2(n-1)/n for an all-reduce, (n-1)/n for the others. The buffer is the
    reduced one (all-reduce), the gathered output (all-gather), the input (reduce-scatter), the
    bytes each rank holds (all-to-all)."""
    factor = (ranks - 1) / ranks
    return 2 * factor if kind is CollectiveKind.ALL_REDUCE else factor


def ring_seconds(kind: CollectiveKind, nbytes: float, ranks: int, bandwidth: float, latency: float) -> float:
    """One ring of `ranks` over one kind of link: a latency per step, the bus bytes at `bandwidth`."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    steps = 2 * (ranks - 1) if kind is CollectiveKind.ALL_REDUCE else ranks - 1
    return steps * latency + bus_factor(kind, ranks) * nbytes / bandwidth


def collective_seconds(kind: CollectiveKind, nbytes: float, group: Group, links: Links) -> float:
    """Seconds of one collective over `group` with `nbytes` per rank (see `bus_factor`)."""
    if group.size <= 1 or nbytes <= 0:
        return 0.0
    if kind is CollectiveKind.COLLECTIVE_PERMUTE:  # each rank sends its buffer to one peer at once
        if group.nodes == 1:
            return links.intra_latency + nbytes / links.intra_bandwidth
        return links.inter_latency + nbytes / links.inter_bandwidth
    if group.nodes == 1:
        return ring_seconds(kind, nbytes, group.size, links.intra_bandwidth, links.intra_latency)
    if group.local == 1:
        return ring_seconds(kind, nbytes, group.size, links.inter_bandwidth, links.inter_latency)
    if kind is CollectiveKind.ALL_TO_ALL:
        return _all_to_all(nbytes, group, links)
    return _hierarchical(kind, nbytes, group, links)


def _hierarchical(kind: CollectiveKind, nbytes: float, group: Group, links: Links) -> float:
    """Reduce-scatter inside the node, the cross-node phase on 1/local of the buffer (each of the
    local ranks on its own NIC), all-gather inside the node; an all-gather or a reduce-scatter
    runs only its half of the phases."""
    local, nodes = group.local, group.nodes
    inside = lambda k: ring_seconds(k, nbytes, local, links.intra_bandwidth, links.intra_latency)  # noqa: E731
    across = ring_seconds(kind, nbytes / local, nodes, links.inter_bandwidth, links.inter_latency)
    if kind is CollectiveKind.ALL_REDUCE:
        return inside(CollectiveKind.REDUCE_SCATTER) + across + inside(CollectiveKind.ALL_GATHER)
    return across + inside(kind)


def _all_to_all(nbytes: float, group: Group, links: Links) -> float:
    """Each rank sends (local-1)/n of its bytes over NVLink and (n-local)/n over its NIC share,
    at once; a latency per peer."""
    n = group.size
    inside = (group.local - 1) / n * nbytes / links.intra_bandwidth
    across = (n - group.local) / n * nbytes / links.inter_bandwidth
    return (n - 1) * links.inter_latency + max(inside, across)


def bucketed_seconds(collectives, links: Links) -> float:
    """Collectives given as (kind value, ranks, ranks sharing a node, bytes) run in buckets: one
    collective per kind and group with all their bytes (as Megatron-LM and PyTorch DDP bucket
    gradient reductions), each paying its latency once."""
    buckets: dict[tuple[str, int, int], float] = {}
    for kind, size, local, nbytes in collectives:
        buckets[(kind, size, local)] = buckets.get((kind, size, local), 0.0) + nbytes
    return sum(collective_seconds(CollectiveKind(kind), nbytes, Group(size, local), links)
               for (kind, size, local), nbytes in buckets.items())


def send_seconds(nbytes: float, crosses_node: bool, links: Links) -> float:
    """One point-to-point send of `nbytes` (a pipeline hand-off), on the link it crosses."""
    bandwidth, latency = links.point_to_point(crosses_node)
    return latency + nbytes / bandwidth


def exposed_seconds(communication: float, window: float, tail: float) -> float:
    """Communication overlapped with `window` seconds of compute: what the window does not hide,
    and at least the `tail` share (the last bucket waits for the last gradient)."""
    return max(communication - window, communication * tail)
