"""Place stage sub-meshes on the cluster: whole-node meshes on free nodes, partial-node meshes
packed into the remaining nodes (first fit, largest first)."""

from __future__ import annotations

from collections.abc import Sequence


def place_submeshes(shapes: Sequence[tuple[int, int]], nodes: int, per_node: int,
                    keep_neighbours: bool = False) -> list[tuple[int, int]] | None:
    """Origins (node, first device) for each sub-mesh in order, or None when they do not tile.

    Alpa's sub-mesh shapes, (1, 2^i) and (k, M), always tile a cluster when their device
    counts add up and M is a power of two; other M can fail, which the planner checks here.
    With `keep_neighbours`, partial-node meshes are first packed in pipeline order, so that
    consecutive stages share a node where they fit (their hand-offs then stay on the node's
    link); if that does not tile, largest first.
    """
    if keep_neighbours:
        found = _place(shapes, nodes, per_node, in_order=True)
        if found is not None:
            return found
    return _place(shapes, nodes, per_node, in_order=False)


def _place(shapes: Sequence[tuple[int, int]], nodes: int, per_node: int,
           in_order: bool) -> list[tuple[int, int]] | None:
    origins: list[tuple[int, int] | None] = [None] * len(shapes)
    next_node = 0
    for j, (n, m) in enumerate(shapes):
        if m == per_node:
            origins[j] = (next_node, 0)
            next_node += n
    used = [0] * nodes
    partial = [j for j, (_, m) in enumerate(shapes) if m != per_node]
    if not in_order:
        partial.sort(key=lambda j: -shapes[j][1])
    current = next_node
    for j in partial:
        width = shapes[j][1]
        start = current if in_order else next_node  # in order: never go back to an earlier node
        node = next((k for k in range(start, nodes) if per_node - used[k] >= width), None)
        if node is None:
            return None
        origins[j] = (node, used[node])
        used[node] += width
        current = node
    if next_node > nodes:
        return None
    return origins  # type: ignore[return-value]
