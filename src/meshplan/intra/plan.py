"""IntraPlan: the chosen strategy of every node of one stage on one logical mesh."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from meshplan.cluster.mesh import LogicalMesh
from meshplan.cost.collectives import Collective
from meshplan.intra.solvers import SolveResult
from meshplan.intra.strategy_graph import Breakdown
from meshplan.sharding.spec import ShardingSpec


@dataclass(frozen=True, slots=True)
class ChosenStrategy:
    """One node's decision: strategy name, output spec, required operand specs, collectives."""

    node: int
    name: str
    op: str
    layer: int | None
    strategy: str
    output: ShardingSpec
    operands: tuple[ShardingSpec, ...]
    collectives: tuple[Collective, ...]
    memory: float
    compute: float = 0.0
    communication: float = 0.0


@dataclass(frozen=True, slots=True)
class Resharding:
    """A producer's value converted for a consumer, and the collectives that costs."""

    producer: str
    consumer: str
    consumer_id: int
    src: ShardingSpec
    dst: ShardingSpec
    collectives: tuple[Collective, ...]


@dataclass(frozen=True, slots=True)
class IntraPlan:
    """Result of the intra-op pass.

    Attributes:
        graph_name, mesh: what was planned on what.
        nodes: per node, the chosen strategy.
        objective: total cost; `breakdown` splits it into compute, communication, resharding.
        peak_memory: the largest sum of local bytes over the live sets, per device.
        memory_budget: the budget the plan was held to (None: unlimited).
        solve: the solver's result (status, objective, bound, gap, wall time).
        reshardings: conversions between producers and consumers that cost something.
        shared_layers: repeated layers were forced to share choices.
        num_groups, num_variables, num_constraints: size of the problem solved.
        build_s: seconds spent enumerating strategies and building the program.
        unsupported_ops: ops planned replicated for lack of a rule.
    """

    graph_name: str
    mesh: LogicalMesh
    nodes: tuple[ChosenStrategy, ...]
    objective: float
    breakdown: Breakdown
    peak_memory: float
    memory_budget: float | None
    solve: SolveResult
    reshardings: tuple[Resharding, ...]
    shared_layers: bool
    num_groups: int
    num_variables: int
    num_constraints: int
    build_s: float
    unsupported_ops: tuple[str, ...] = ()

    def strategy(self, node: int | str) -> ChosenStrategy:
        """The decision of a node, by id or by name."""
        for chosen in self.nodes:
            if chosen.node == node or chosen.name == node:
                return chosen
        raise KeyError(f"no node {node!r} in plan of {self.graph_name!r}")

    def collectives(self) -> tuple[Collective, ...]:
        """Every collective the plan implies: strategies' own, then reshardings'."""
        own = tuple(c for n in self.nodes for c in n.collectives)
        return own + tuple(c for r in self.reshardings for c in r.collectives)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready summary."""
        return {
            "graph": self.graph_name,
            "mesh": {"shape": list(self.mesh.shape), "alpha": list(self.mesh.alpha), "beta": list(self.mesh.beta)},
            "objective": self.objective,
            "breakdown": {"compute": self.breakdown.compute, "communication": self.breakdown.communication,
                          "resharding": self.breakdown.resharding},
            "peak_memory_bytes": self.peak_memory,
            "memory_budget_bytes": self.memory_budget,
            "solver": {"backend": self.solve.backend, "status": self.solve.status.value,
                       "objective": self.solve.objective, "bound": self.solve.bound, "gap": self.solve.gap,
                       "wall_s": self.solve.wall_s},
            "problem": {"groups": self.num_groups, "variables": self.num_variables,
                        "constraints": self.num_constraints, "shared_layers": self.shared_layers,
                        "build_s": self.build_s},
            "unsupported_ops": list(self.unsupported_ops),
            "nodes": [{"id": n.node, "name": n.name, "op": n.op, "layer": n.layer, "strategy": n.strategy,
                       "output": str(n.output), "collectives": [str(c) for c in n.collectives]}
                      for n in self.nodes],
            "reshardings": [{"producer": r.producer, "consumer": r.consumer, "src": str(r.src), "dst": str(r.dst),
                             "collectives": [str(c) for c in r.collectives]} for r in self.reshardings],
        }
