"""Follow tensor dims through a graph: which dim of each node carries a given dim of a source.

The data-parallel methods force the batch dim of every value it reaches to be split, and the
capture stage finds the batch inputs by where their dims meet; both follow dims this way.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence

from meshplan.ir.graph import Graph
from meshplan.ir.node import Node, OpKind
from meshplan.ir.windows import conv_output_dim, windowed_dims

# Ops whose output dim d holds operand 0's dim d (their other operands index or fill it).
_SAME_DIMS = frozenset({OpKind.ELEMENTWISE, OpKind.SLICE, OpKind.DYNAMIC_SLICE, OpKind.CONCATENATE,
                        OpKind.DYNAMIC_UPDATE_SLICE, OpKind.CUMULATIVE, OpKind.SORT})


def trace_dims(graph: Graph, sources: Mapping[int, int]) -> dict[int, int]:
    """Follow dim `sources[n]` of each source node n forward: node id -> the dim that carries it.

    A node reached along several paths keeps the dim of the first (sources in the given order).
    """
    found = {n: d for n, d in sources.items() if 0 <= d < graph[n].rank}
    queue = deque(found)
    while queue:
        producer = queue.popleft()
        for user in graph.users(producer):
            if user in found:
                continue
            node = graph[user]
            dims = [carry_dim(graph, node, k, found[producer]) for k, o in enumerate(node.operands) if o == producer]
            mapped = next((d for d in dims if d is not None), None)
            if mapped is not None:
                found[user] = mapped
                queue.append(user)
    return found


def carry_dim(graph: Graph, node: Node, position: int, dim: int) -> int | None:
    """The dim of `node`'s output that holds dim `dim` of its operand at `position`, or None when
    the op contracts, reduces or indexes it away."""
    kind = node.kind
    if kind in _SAME_DIMS:
        return dim if graph[node.operands[position]].rank == node.rank else None
    if kind is OpKind.TRANSPOSE:
        return node.attr("perm").index(dim)
    if kind is OpKind.BROADCAST:
        return node.attr("dims")[dim]
    if kind in (OpKind.REDUCE, OpKind.ARG_REDUCE):
        dims = node.attr("dims") if kind is OpKind.REDUCE else (node.attr("dim"),)
        return None if dim in dims else dim - sum(d < dim for d in dims)
    if kind is OpKind.TOP_K:
        return None if dim == node.attr("dim") else dim
    if kind is OpKind.RESHAPE:
        return _reshaped_dim(graph[node.operands[0]].shape, node.shape, dim)
    if kind is OpKind.DOT:
        return _dot_dim(graph, node, position, dim)
    if kind is OpKind.CONV:
        out = conv_output_dim(node, position, dim, graph[node.operands[1]].shape)
        return out if isinstance(out, int) else None
    if kind in (OpKind.REDUCE_WINDOW, OpKind.SELECT_AND_SCATTER_ADD):
        return None if dim in windowed_dims(node) else dim
    if kind is OpKind.REVERSE:
        return None if dim in node.attr("dims") else dim
    if kind is OpKind.GATHER:
        return _gather_dim(graph, node, position, dim)
    if kind is OpKind.SCATTER_ADD:
        return _scatter_dim(graph, node, position, dim)
    return None


def reshape_groups(in_shape: Sequence[int], out_shape: Sequence[int]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Split a reshape into (input dims, output dims) groups whose sizes have equal products."""
    n, m = len(in_shape), len(out_shape)
    if 0 in in_shape or 0 in out_shape:
        return [(tuple(range(n)), tuple(range(m)))]
    groups: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    i = j = 0
    while i < n and j < m:
        gi, gj = [i], [j]
        pi, pj = in_shape[i], out_shape[j]
        i, j = i + 1, j + 1
        while pi != pj:
            if pi < pj:
                gi.append(i)
                pi *= in_shape[i]
                i += 1
            else:
                gj.append(j)
                pj *= out_shape[j]
                j += 1
        groups.append((tuple(gi), tuple(gj)))
    if i < n or j < m:  # trailing size-1 dims
        groups.append((tuple(range(i, n)), tuple(range(j, m))))
    return groups


def _reshaped_dim(in_shape: Sequence[int], out_shape: Sequence[int], dim: int) -> int | None:
    """The major output dim of the group whose major input dim is `dim` (size-1 dims are skipped:
    a squeezed dim carries nothing)."""
    for in_dims, out_dims in reshape_groups(in_shape, out_shape):
        major_in = next((d for d in in_dims if in_shape[d] > 1), None)
        major_out = next((d for d in out_dims if out_shape[d] > 1), None)
        if major_in == dim and major_out is not None:
            return major_out
    return None


def _dot_dim(graph: Graph, node: Node, position: int, dim: int) -> int | None:
    """Output dims of a dot: batch dims, then lhs free dims, then rhs free dims."""
    side = "lhs" if position == 0 else "rhs"
    batch, contracting = node.attr(f"{side}_batch"), node.attr(f"{side}_contracting")
    if dim in batch:
        return batch.index(dim)
    if dim in contracting:
        return None
    free = [d for d in range(graph[node.operands[position]].rank) if d not in batch + contracting]
    offset = len(batch)
    if position == 1:
        lhs = graph[node.operands[0]]
        offset += lhs.rank - len(node.attr("lhs_batch")) - len(node.attr("lhs_contracting"))
    return offset + free.index(dim)


def _gather_dim(graph: Graph, node: Node, position: int, dim: int) -> int | None:
    """gather's output is operand[:axis] + indices[batch_dims:] + operand[axis + 1:]."""
    axis, batch_dims = node.attr("axis"), node.attr("batch_dims")
    picked = graph[node.operands[1]].rank - batch_dims
    if position == 1:
        return dim if dim < batch_dims else axis + dim - batch_dims
    if dim == axis:
        return None
    return dim if dim < axis else dim + picked - 1


def _scatter_dim(graph: Graph, node: Node, position: int, dim: int) -> int | None:
    """scatter_add(indices, updates): updates are shaped like gather's output, the result like its operand."""
    axis, batch_dims = node.attr("axis"), node.attr("batch_dims")
    picked = graph[node.operands[0]].rank - batch_dims
    if position == 0:
        return dim if dim < batch_dims else None
    if dim < axis:
        return dim
    return None if dim < axis + picked else dim - picked + 1
