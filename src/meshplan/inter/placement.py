"""Place stage sub-meshes on the cluster: whole-node meshes on free nodes, partial-node meshes
packed into the remaining nodes (first fit, largest first)."""

from __future__ import annotations

from collections.abc import Sequence


def place_submeshes(shapes: Sequence[tuple[int, int]], nodes: int, per_node: int) -> list[tuple[int, int]] | None:
    """Origins (node, first device) for each sub-mesh in order, or None when they do not tile.

    Alpa's sub-mesh shapes, (1, 2^i) and (k, M), always tile a cluster when their device
    counts add up and M is a power of two; other M can fail, which the planner checks here.
    """
    origins: list[tuple[int, int] | None] = [None] * len(shapes)
    next_node = 0
    for j, (n, m) in enumerate(shapes):
        if m == per_node:
            origins[j] = (next_node, 0)
            next_node += n
    used = [0] * nodes
    partial = sorted((j for j, (_, m) in enumerate(shapes) if m != per_node), key=lambda j: -shapes[j][1])
    for j in partial:
        width = shapes[j][1]
        node = next((k for k in range(next_node, nodes) if per_node - used[k] >= width), None)
        if node is None:
            return None
        origins[j] = (node, used[node])
        used[node] += width
    if next_node > nodes:
        return None
    return origins  # type: ignore[return-value]
