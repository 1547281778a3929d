"""IntraPlan: the chosen strategy of every node of one stage on one logical mesh."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import asdict, dataclass
from typing import Any

from meshplan.cluster.mesh import LogicalMesh, MeshTopology
from meshplan.cost.collectives import Collective
from meshplan.errors import PlanValidationError
from meshplan.intra.solvers import SolveResult, SolveStatus
from meshplan.intra.strategy_graph import Breakdown
from meshplan.ir.node import Node
from meshplan.sharding.spec import ShardingSpec
from meshplan.sharding.strategy import Strategy


@dataclass(frozen=True, slots=True)
class ChosenStrategy:
    """One node's decision: strategy name, output spec, required operand specs, collectives.

    `shape`, `operand_ids` and `tags` (a subset of NODE_TAGS) repeat the node's graph facts so a
    plan can be read alone (empty in plans written before they were recorded).
    """

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
    shape: tuple[int, ...] = ()
    operand_ids: tuple[int, ...] = ()
    tags: tuple[str, ...] = ()


# Graph facts a report needs to read a plan without its graph (ChosenStrategy.tags).
NODE_TAGS = ("batch_input", "aliased", "accumulated", "per_iteration")


def chosen_strategy(node: Node, strategy: Strategy, aliased: Collection[int] = ()) -> ChosenStrategy:
    """The record of `strategy` chosen for `node`; `aliased`: the graph's aliased parameter ids."""
    facts = {"batch_input": bool(node.attr("batch_input")) or node.attr("batch_dim") is not None,
             "aliased": node.id in aliased, "accumulated": bool(node.attr("accumulated")),
             "per_iteration": bool(node.attr("per_iteration"))}
    s = strategy
    return ChosenStrategy(node.id, node.label, node.op, node.layer, s.name, s.output, s.operands, s.collectives,
                          s.memory, s.compute, s.communication, node.shape, node.operands,
                          tuple(tag for tag in NODE_TAGS if facts[tag]))


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
        """A JSON-ready dict that `IntraPlan.from_dict` reads back exactly (the solver's raw
        solution vector is left out)."""
        return {
            "graph": self.graph_name,
            "mesh": mesh_to_dict(self.mesh),
            "objective": self.objective,
            "breakdown": {"compute": self.breakdown.compute, "communication": self.breakdown.communication,
                          "resharding": self.breakdown.resharding, "penalty": self.breakdown.penalty},
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
                       "output": str(n.output), "operands": [str(o) for o in n.operands],
                       "collectives": [c.to_dict() for c in n.collectives], "memory_bytes": n.memory,
                       "compute": n.compute, "communication": n.communication, "shape": list(n.shape),
                       "operand_ids": list(n.operand_ids), "tags": list(n.tags)}
                      for n in self.nodes],
            "reshardings": [{"producer": r.producer, "consumer": r.consumer, "consumer_id": r.consumer_id,
                             "src": str(r.src), "dst": str(r.dst),
                             "collectives": [c.to_dict() for c in r.collectives]} for r in self.reshardings],
        }

    @staticmethod
    def from_dict(data: dict[str, Any]) -> IntraPlan:
        """The plan `to_dict` wrote.

        Raises:
            PlanValidationError: a field is missing or has the wrong type.
        """
        try:
            solver, problem, b = data["solver"], data["problem"], data["breakdown"]
            solve = SolveResult(SolveStatus(solver["status"]), solver["objective"], solver["bound"], solver["gap"],
                                solver["wall_s"], solver["backend"])
            return IntraPlan(
                data["graph"], mesh_from_dict(data["mesh"]), tuple(_chosen(n) for n in data["nodes"]),
                data["objective"], Breakdown(b["compute"], b["communication"], b["resharding"], b["penalty"]),
                data["peak_memory_bytes"], data["memory_budget_bytes"], solve,
                tuple(_resharding(r) for r in data["reshardings"]), problem["shared_layers"], problem["groups"],
                problem["variables"], problem["constraints"], problem["build_s"], tuple(data["unsupported_ops"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise PlanValidationError(f"intra-op plan data is malformed ({type(exc).__name__}: {exc}); "
                                      "write it again with this meshplan") from None


def mesh_to_dict(mesh: LogicalMesh) -> dict[str, Any]:
    data = {"shape": list(mesh.shape), "alpha": list(mesh.alpha), "beta": list(mesh.beta),
            "memory_per_device": mesh.memory_per_device, "device_ids": list(mesh.device_ids)}
    if mesh.topology is not None:
        data["topology"] = asdict(mesh.topology)
    return data


def mesh_from_dict(data: dict[str, Any]) -> LogicalMesh:
    topology = MeshTopology(**data["topology"]) if data.get("topology") else None
    return LogicalMesh(tuple(data["shape"]), tuple(data["alpha"]), tuple(data["beta"]), data["memory_per_device"],
                       tuple(data["device_ids"]), topology)


def _chosen(data: dict[str, Any]) -> ChosenStrategy:
    return ChosenStrategy(data["id"], data["name"], data["op"], data["layer"], data["strategy"],
                          ShardingSpec.parse(data["output"]), tuple(ShardingSpec.parse(o) for o in data["operands"]),
                          tuple(Collective.from_dict(c) for c in data["collectives"]), data["memory_bytes"],
                          data["compute"], data["communication"], tuple(data.get("shape", ())),
                          tuple(data.get("operand_ids", ())), tuple(data.get("tags", ())))


def _resharding(data: dict[str, Any]) -> Resharding:
    return Resharding(data["producer"], data["consumer"], data["consumer_id"], ShardingSpec.parse(data["src"]),
                      ShardingSpec.parse(data["dst"]), tuple(Collective.from_dict(c) for c in data["collectives"]))
