"""Find repeated identical layers so their nodes can share one choice."""

from __future__ import annotations

from meshplan.intra.strategy_graph import StrategyGraph
from meshplan.ir.graph import Graph


def layer_signatures(graph: Graph) -> dict[int, tuple]:
    """Per layer index, a structural hash: two layers with equal signatures are identical."""
    by_layer: dict[int, list[int]] = {}
    for node in graph.nodes:
        if node.layer is not None:
            by_layer.setdefault(node.layer, []).append(node.id)
    signatures = {}
    for layer, ids in by_layer.items():
        local = {v: k for k, v in enumerate(ids)}
        entries = []
        for v in ids:
            node = graph[v]
            refs = tuple(("in", local[o]) if o in local else ("out", graph[o].shape, graph[o].dtype)
                         for o in node.operands)
            entries.append((node.kind, node.attrs, node.shape, node.dtype, refs))
        signatures[layer] = tuple(entries)
    return signatures


def canonical_nodes(graph: Graph) -> dict[int, int]:
    """Node id -> the matching node in the first layer with the same structure."""
    by_layer: dict[int, list[int]] = {}
    for node in graph.nodes:
        if node.layer is not None:
            by_layer.setdefault(node.layer, []).append(node.id)
    first_of: dict[tuple, int] = {}
    mapping = {}
    for layer, signature in layer_signatures(graph).items():
        first = first_of.setdefault(signature, layer)
        for k, v in enumerate(by_layer[layer]):
            mapping[v] = by_layer[first][k]
    return mapping


def shared_groups(sg: StrategyGraph) -> dict[int, int]:
    """Group -> the group whose variables it uses (itself unless a layer repeats it)."""
    nodes = canonical_nodes(sg.graph)
    canon = {}
    for g in sg.groups:
        c = nodes.get(g, g)
        same = (c != g and sg.leader[c] == c and
                [s.name for s in sg.nodes[c].strategies] == [s.name for s in sg.nodes[g].strategies])
        canon[g] = c if same else g
    return canon
