"""Named dims: the names some nodes give their dims (attribute "dims", e.g. a weight's
("hidden", "ffn")), followed through the whole graph.

Every op ties dims of its operands to dims of its output (an element-wise op dim by dim, a
transpose by its permutation, a contraction its batch and free dims, and the contracting dims
of its two operands to each other), and an alias ties a parameter's dims to its update's; dims
tied together form one family, and a family takes the
name of the first named dim in it. A dim no named dim reaches stays unnamed (None). A layout
can then be said by name ("split ffn over the tensor-parallel axis"), as Haliax and GSPMD's
logical axes do.
"""

from __future__ import annotations

from meshplan.ir.dimflow import carry_dim
from meshplan.ir.graph import Graph
from meshplan.ir.node import OpKind

DimNames = tuple[tuple[str | None, ...], ...]


def dim_names(graph: Graph) -> DimNames:
    """Per node, a name (or None) for each of its dims."""
    offsets, total = [], 0
    for node in graph.nodes:
        offsets.append(total)
        total += node.rank
    parent = list(range(total))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    def tie(a: int, b: int) -> None:
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)  # the earlier slot stays the root: names come first-found

    for node in graph.nodes:
        for position, operand in enumerate(node.operands):
            for dim in range(graph[operand].rank):
                out = carry_dim(graph, node, position, dim)
                if out is not None:
                    tie(offsets[operand] + dim, offsets[node.id] + out)
        if node.kind is OpKind.DOT:
            lhs, rhs = node.operands
            for a, b in zip(node.attr("lhs_contracting"), node.attr("rhs_contracting"), strict=True):
                tie(offsets[lhs] + a, offsets[rhs] + b)
    for param, updated in graph.aliases:  # an update overwrites its parameter: the same dims
        for dim in range(graph[param].rank):
            tie(offsets[param] + dim, offsets[updated] + dim)
    named: dict[int, str] = {}
    for node in graph.nodes:
        for dim, name in enumerate(node.attr("dims") or ()):
            named.setdefault(find(offsets[node.id] + dim), name)
    return tuple(tuple(named.get(find(offsets[n.id] + d)) for d in range(n.rank)) for n in graph.nodes)
