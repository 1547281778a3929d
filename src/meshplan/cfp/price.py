"""Analytic price of a laid-out graph with meshplan's cost model (Graph + node strategies -> Price).

What `--analytic` profiles record, how the search prices resharding between segments, and the
"predicted" column of the comparison: compute and collectives of every node's strategy, plus
the resharding of every edge whose producer's layout differs from what its reader needs.
Memory is the largest sum of local bytes over the live sets; inputs live throughout.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from meshplan.cluster.mesh import LogicalMesh
from meshplan.cost.collectives import Collective, CollectiveKind
from meshplan.cost.model import CostModel
from meshplan.intra.strategy_graph import live_sets
from meshplan.ir.graph import Graph
from meshplan.sharding.resharding import resharding_collectives
from meshplan.sharding.spec import ShardingSpec
from meshplan.sharding.strategy import Strategy


@dataclass(frozen=True, slots=True)
class Price:
    """Predicted cost of a laid-out graph, per device.

    Attributes:
        compute, communication, resharding: seconds (or cost units) by term.
        volume: bytes each device sends in collectives (strategies' and resharding's).
        peak_memory: bytes held at the fullest point of the program.
        collectives: every collective, for reports.
    """

    compute: float
    communication: float
    resharding: float
    volume: float
    peak_memory: float
    collectives: tuple[Collective, ...] = ()

    @property
    def time(self) -> float:
        return self.compute + self.communication + self.resharding


def price(graph: Graph, layouts: Sequence[Strategy], mesh: LogicalMesh, model: CostModel) -> Price:
    """The cost model's price of running `graph` with node v laid out as `layouts[v]`."""
    compute = communication = resharding = 0.0
    collectives: list[Collective] = []
    for node in graph.nodes:
        s = layouts[node.id]
        compute += s.compute
        communication += s.communication
        collectives += s.collectives
        for operand, required in zip(node.operands, s.operands, strict=True):
            moved = reshard(graph, operand, layouts[operand].output, required, mesh, model)
            resharding += sum(c.cost for c in moved)
            collectives += moved
    memory = [s.memory for s in layouts]
    peak = max((sum(memory[v] for v in live) for live in live_sets(graph)), default=0.0)
    volume = sum(sent_bytes(c, mesh) for c in collectives)
    return Price(compute, communication, resharding, volume, peak, tuple(collectives))


def reshard(graph: Graph, producer: int, src: ShardingSpec, dst: ShardingSpec, mesh: LogicalMesh,
            model: CostModel) -> tuple[Collective, ...]:
    node = graph[producer]
    return resharding_collectives(node.shape, node.dtype.itemsize, src, dst, mesh, model)


# Bytes each device sends per byte of a collective's buffer, for a group of n devices (ring
# algorithms; the cost model's bandwidth terms, without the hierarchical split over axes).
_SENT = {
    CollectiveKind.ALL_REDUCE: lambda n: 2 * (n - 1) / n,
    CollectiveKind.ALL_GATHER: lambda n: (n - 1) / n,
    CollectiveKind.REDUCE_SCATTER: lambda n: (n - 1) / n,
    CollectiveKind.ALL_TO_ALL: lambda n: (n - 1) / n,
    CollectiveKind.COLLECTIVE_PERMUTE: lambda n: 1.0,
}


def sent_bytes(collective: Collective, mesh: LogicalMesh) -> float:
    """Bytes one device sends in `collective`."""
    n = mesh.axis_size(collective.axes)
    return _SENT[collective.kind](n) * collective.nbytes if n > 1 else 0.0
