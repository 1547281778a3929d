"""Graph IR: nodes, graphs, dtypes, a builder, FLOPs/bytes counting and a printer."""

from meshplan.ir.builder import GraphBuilder
from meshplan.ir.counting import graph_flops, node_bytes_accessed, node_flops
from meshplan.ir.dtypes import DType, as_dtype
from meshplan.ir.graph import Graph, check_graph
from meshplan.ir.node import Node, OpKind
from meshplan.ir.printer import format_graph, format_node

__all__ = [
    "DType", "Graph", "GraphBuilder", "Node", "OpKind", "as_dtype", "check_graph", "format_graph",
    "format_node", "graph_flops", "node_bytes_accessed", "node_flops",
]
