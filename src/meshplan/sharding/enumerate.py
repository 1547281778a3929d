"""Enumerate every node's strategies through the rule registry (Graph -> node strategies)."""

from __future__ import annotations

import warnings
from collections import deque

from meshplan.cluster.mesh import LogicalMesh
from meshplan.cost.model import CostModel
from meshplan.ir.graph import Graph
from meshplan.ir.node import Node, OpKind
from meshplan.sharding.context import RuleConfig, RuleContext
from meshplan.sharding.rules import dot, fallback, follow, leaves  # noqa: F401  (register rules)
from meshplan.sharding.rules.dot import DotDims
from meshplan.sharding.rules.registry import rule_for
from meshplan.sharding.spec import reshape_groups
from meshplan.sharding.strategy import NodeStrategies


class UnsupportedOpWarning(UserWarning):
    """Some ops have no sharding rule and were planned replicated."""


def enumerate_strategies(graph: Graph, mesh: LogicalMesh, model: CostModel,
                         config: RuleConfig | None = None) -> tuple[NodeStrategies, ...]:
    """The strategies of every node, in graph order; ops without a rule get replicated."""
    config = config or RuleConfig()
    batch_dims = {}
    if config.force_batch_dim_to_mesh_dim is not None and graph.parameters():
        batch_dims = trace_batch_dims(graph, graph.parameters()[0].id, 0)
    ctx = RuleContext(graph, mesh, model, config, node_depths(graph), batch_dims, constant_nodes(graph))
    unknown: set[str] = set()
    for node in graph.nodes:
        rule = rule_for(node.kind)
        result = rule(node, ctx) if rule else fallback.replicated_strategies(node, ctx)
        if result.fallback:
            unknown.add(node.op)
        ctx.done[node.id] = result
    if unknown:
        warnings.warn(
            f"no sharding rule for {', '.join(sorted(unknown))}: planned replicated "
            "(correct, but may cost memory and communication)", UnsupportedOpWarning, stacklevel=2)
    return tuple(ctx.done[n.id] for n in graph.nodes)


def constant_nodes(graph: Graph) -> frozenset[int]:
    """Nodes whose value depends on no parameter (constants, iotas and ops on them only)."""
    found: set[int] = set()
    for node in graph.nodes:
        if node.kind in (OpKind.CONSTANT, OpKind.IOTA) or (
                node.kind is not OpKind.PARAMETER and node.operands and all(o in found for o in node.operands)):
            found.add(node.id)
    return frozenset(found)


def node_depths(graph: Graph) -> tuple[int, ...]:
    """Longest path length from any source to each node."""
    depth: list[int] = []
    for node in graph.nodes:
        depth.append(1 + max((depth[o] for o in node.operands), default=-1))
    return tuple(depth)


def trace_batch_dims(graph: Graph, source: int, dim: int) -> dict[int, int]:
    """Follow dim `dim` of node `source` forward: node id -> the dim that carries the batch."""
    found = {source: dim}
    queue = deque([source])
    while queue:
        producer = queue.popleft()
        for user in graph.users(producer):
            if user in found:
                continue
            mapped = _carry_batch_dim(graph, graph[user], producer, found[producer])
            if mapped is not None:
                found[user] = mapped
                queue.append(user)
    return found


def _carry_batch_dim(graph: Graph, node: Node, producer: int, dim: int) -> int | None:
    kind = node.kind
    if kind is OpKind.ELEMENTWISE:
        return dim
    if kind is OpKind.TRANSPOSE:
        return node.attr("perm").index(dim)
    if kind is OpKind.BROADCAST:
        return node.attr("dims")[dim]
    if kind is OpKind.REDUCE:
        dims = node.attr("dims")
        return None if dim in dims else dim - sum(d < dim for d in dims)
    if kind is OpKind.RESHAPE:
        for in_dims, out_dims in reshape_groups(graph[producer].shape, node.shape):
            if in_dims and in_dims[0] == dim and out_dims:
                return out_dims[0]
        return None
    if kind is OpKind.DOT:
        dims = DotDims(node, graph[node.operands[0]], graph[node.operands[1]])
        nb, nl = len(dims.lb), len(dims.lf)
        if node.operands[0] == producer:
            if dim in dims.lb:
                return dims.lb.index(dim)
            return nb + dims.lf.index(dim) if dim in dims.lf else None
        if dim in dims.rb:
            return dims.rb.index(dim)
        return nb + nl + dims.rf.index(dim) if dim in dims.rf else None
    return None
