"""FLOPs and memory traffic of one node (forward only, no fusion assumed)."""

from __future__ import annotations

import math

from meshplan.ir.graph import Graph
from meshplan.ir.node import Node, OpKind
from meshplan.ir.windows import conv_tap_pairs

# Ops that produce no arithmetic: they only move or name data.
_DATA_MOVEMENT = {
    OpKind.PARAMETER, OpKind.CONSTANT, OpKind.IOTA, OpKind.BROADCAST, OpKind.RESHAPE,
    OpKind.TRANSPOSE, OpKind.SLICE, OpKind.CONCATENATE, OpKind.GATHER, OpKind.DYNAMIC_SLICE,
    OpKind.DYNAMIC_UPDATE_SLICE, OpKind.REVERSE,
}
# Elementwise ops that cost several FLOPs per element (rough libm figures).
_TRANSCENDENTAL_FLOPS = {"exp": 4, "log": 4, "tanh": 6, "logistic": 6, "rsqrt": 2, "sqrt": 2,
                         "pow": 8, "erf": 8, "sin": 6, "cos": 6}


def node_flops(graph: Graph, node: Node) -> float:
    """Floating-point operations of `node` (a multiply-add counts as 2)."""
    if node.kind is OpKind.DOT:
        lhs = graph[node.operands[0]]
        contracted = math.prod(lhs.shape[d] for d in node.attr("lhs_contracting"))
        return 2.0 * node.size * contracted
    if node.kind is OpKind.CONV:  # each output entry: a multiply-add per kernel input feature and real tap
        lhs, kernel = (graph[i] for i in node.operands)
        spec = node.attr("rhs_spec")
        features = kernel.shape[spec[1]]
        return 2.0 * node.size * features * conv_tap_pairs(node, lhs.shape, kernel.shape)
    if node.kind is OpKind.REDUCE_WINDOW:  # one op per window entry of each output entry
        return float(node.size * math.prod(node.attr("window_dimensions")))
    if node.kind is OpKind.SELECT_AND_SCATTER_ADD:  # a comparison per window entry, an add per source entry
        source = graph[node.operands[0]]
        return float(source.size * (math.prod(node.attr("window_dimensions")) + 1))
    if node.kind is OpKind.REDUCE:
        return float(graph[node.operands[0]].size)
    if node.kind is OpKind.SCATTER_ADD:
        return float(graph[node.operands[1]].size)  # one add per update element
    if node.kind in (OpKind.TOP_K, OpKind.ARG_REDUCE):
        return float(graph[node.operands[0]].size)  # one comparison per entry read
    if node.kind is OpKind.SORT:  # n log n comparisons, counted once (on the first result)
        n = node.shape[node.attr("dim")]
        return float(node.size * max(math.log2(n), 1.0)) if node.attr("output") == 0 else 0.0
    if node.kind is OpKind.ELEMENTWISE:
        if node.op in ("convert", "select", "copy", "bitcast"):
            return 0.0
        return float(node.size * _TRANSCENDENTAL_FLOPS.get(node.op, 1))
    if node.kind in _DATA_MOVEMENT:
        return 0.0
    return float(node.size)


def node_bytes_accessed(graph: Graph, node: Node) -> int:
    """Bytes read and written by `node` when run unfused."""
    if node.kind in (OpKind.PARAMETER, OpKind.CONSTANT, OpKind.IOTA):
        return 0
    if node.kind is OpKind.GATHER:  # reads the picked entries and the indices, not the whole operand
        return 2 * node.nbytes + graph[node.operands[1]].nbytes
    return node.nbytes + sum(graph[i].nbytes for i in node.operands)


def graph_flops(graph: Graph) -> float:
    return sum(node_flops(graph, n) for n in graph.nodes)
