"""Graph: a DAG of Nodes in topological order with outputs, aliases and forced shardings."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from meshplan.errors import GraphError
from meshplan.ir.node import Node, OpKind


@dataclass(frozen=True, slots=True)
class Graph:
    """An operator graph.

    Attributes:
        nodes: all nodes; `nodes[i].id == i` and operands precede their users.
        outputs: ids of the graph's results.
        aliases: (parameter id, updated value id) pairs: the update overwrites the parameter
            in place, so both must be laid out the same way.
        force_replicated: ids of nodes whose value must be replicated on every device.
        name: the graph's name for reports.
    """

    nodes: tuple[Node, ...]
    outputs: tuple[int, ...] = ()
    aliases: tuple[tuple[int, int], ...] = ()
    force_replicated: tuple[int, ...] = ()
    name: str = "graph"
    _users: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        users: list[list[int]] = [[] for _ in self.nodes]
        for node in self.nodes:
            for operand in node.operands:
                if 0 <= operand < len(users) and node.id not in users[operand]:
                    users[operand].append(node.id)
        object.__setattr__(self, "_users", tuple(tuple(u) for u in users))

    def __len__(self) -> int:
        return len(self.nodes)

    def __iter__(self) -> Iterator[Node]:
        return iter(self.nodes)

    def __getitem__(self, node_id: int) -> Node:
        return self.nodes[node_id]

    def users(self, node_id: int) -> tuple[int, ...]:
        """Ids of the nodes that read `node_id`, in order."""
        return self._users[node_id]

    def operand_nodes(self, node: Node) -> tuple[Node, ...]:
        return tuple(self.nodes[i] for i in node.operands)

    def parameters(self) -> tuple[Node, ...]:
        return tuple(n for n in self.nodes if n.kind is OpKind.PARAMETER)

    def layers(self) -> tuple[int, ...]:
        """The distinct layer indices tagged on nodes, ascending."""
        return tuple(sorted({n.layer for n in self.nodes if n.layer is not None}))


def check_graph(graph: Graph) -> None:
    """Raise GraphError unless ids, topological order, outputs and aliases are consistent."""
    if not graph.nodes:
        raise GraphError(f"graph {graph.name!r} has no nodes; build at least one operator")
    names: dict[str, int] = {}
    for position, node in enumerate(graph.nodes):
        if node.id != position:
            raise GraphError(f"node {node.label} has id {node.id} at position {position}")
        for operand in node.operands:
            if not 0 <= operand < position:
                raise GraphError(
                    f"node {node.label} reads %{operand}, which is not an earlier node; "
                    "nodes must be in topological order"
                )
        if any(d < 0 for d in node.shape):
            raise GraphError(f"node {node.label} has a negative dimension in {node.shape}")
        if node.name:
            if node.name in names:
                raise GraphError(f"two nodes are named {node.name!r} (%{names[node.name]}, %{position})")
            names[node.name] = position
    _check_ids(graph, graph.outputs, "output")
    _check_ids(graph, graph.force_replicated, "force_replicated entry")
    for param, updated in graph.aliases:
        _check_ids(graph, (param, updated), "alias")
        p, u = graph.nodes[param], graph.nodes[updated]
        if p.kind is not OpKind.PARAMETER:
            raise GraphError(f"alias source {p.label} is a {p.kind.value}, not a parameter")
        if p.shape != u.shape:
            raise GraphError(
                f"alias {p.label} -> {u.label}: shapes differ ({p.shape} vs {u.shape}); "
                "an updated parameter must keep its shape"
            )


def _check_ids(graph: Graph, ids: tuple[int, ...], what: str) -> None:
    for node_id in ids:
        if not 0 <= node_id < len(graph.nodes):
            raise GraphError(f"{what} %{node_id} is not a node of graph {graph.name!r}")
