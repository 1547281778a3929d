"""A readable text form of a graph, one line per node."""

from __future__ import annotations

from meshplan.ir.graph import Graph
from meshplan.ir.node import Node

_HIDDEN_ATTRS = {"op"}


def format_node(graph: Graph, node: Node) -> str:
    shape = "x".join(map(str, node.shape)) or "scalar"
    args = ", ".join(graph[i].label for i in node.operands)
    attrs = ", ".join(f"{k}={v}" for k, v in node.attrs if k not in _HIDDEN_ATTRS and v is not None)
    text = f"{node.label} = {node.op}({args}) : {node.dtype}[{shape}]"
    if attrs:
        text += f"  {{{attrs}}}"
    if node.layer is not None:
        text += f"  @layer{node.layer}"
    return text


def format_graph(graph: Graph) -> str:
    """The graph as text: nodes, then outputs, aliases and forced-replicated values."""
    lines = [f"graph {graph.name} ({len(graph)} nodes)"]
    lines += ["  " + format_node(graph, n) for n in graph.nodes]
    if graph.outputs:
        lines.append("  outputs: " + ", ".join(graph[i].label for i in graph.outputs))
    if graph.aliases:
        lines.append("  aliases: " + ", ".join(f"{graph[p].label} <- {graph[u].label}" for p, u in graph.aliases))
    if graph.force_replicated:
        lines.append("  replicated: " + ", ".join(graph[i].label for i in graph.force_replicated))
    return "\n".join(lines)
